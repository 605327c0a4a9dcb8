"""Tests for runtime.components.lora_manager (the LiteRT-LM manager cases and more)."""

from __future__ import annotations

import threading

import pytest

from conftest import adapter_path
from runtime.components.lora_manager import LoraManager, normalize_blend
from runtime.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from runtime.util.lora_data import LoraData
from slots import allocator, slot_inputs

SLOTS = {4: slot_inputs(4), 16: slot_inputs(16)}


@pytest.fixture
def manager():
    allocate = allocator(SLOTS)
    m = LoraManager(SLOTS, allocate)
    m.allocations = allocate.calls
    return m


def data(name):
    return LoraData.create_from_file_path(adapter_path(name))


def test_load_then_use(manager):
    plan = manager.load_lora(1, data("torch_r4"))
    assert plan.rank == 4
    assert manager.allocations == []  # load parses only
    assert manager.get_current_lora_id() is None
    lora = manager.use_lora(1)
    assert manager.get_current_lora_id() == 1
    assert lora.slot_rank == 4
    assert len(manager.allocations) == len(SLOTS[4])
    assert manager.get_lora_buffers() is lora.buffers


def test_taken_id_and_unknown_id(manager):
    manager.load_lora(1, data("torch_r4"))
    with pytest.raises(AlreadyExistsError):
        manager.load_lora(1, data("litertlm_r4"))
    with pytest.raises(NotFoundError):
        manager.use_lora(2)
    with pytest.raises(NotFoundError):
        manager.unload_lora(2)


def test_buffers_before_use_fail(manager):
    manager.load_lora(1, data("torch_r4"))
    with pytest.raises(FailedPreconditionError):
        manager.get_lora_buffers()
    manager.use_lora(None)
    with pytest.raises(FailedPreconditionError):
        manager.get_lora_buffers()


def test_switch_ones_twos_ones_reuses_buffers(manager):
    manager.load_lora(1, data("torch_r4"))
    manager.load_lora(2, data("litertlm_r8_layer0"))
    ones = manager.use_lora(1)
    twos = manager.use_lora(2)
    assert manager.get_current_lora_id() == 2
    assert twos.slot_rank == 16  # rank 8 goes into the r16 slot
    allocated = len(manager.allocations)
    assert manager.use_lora(1) is ones  # resident: no new buffers
    assert len(manager.allocations) == allocated
    assert manager.get_current_lora_id() == 1


def test_blend_and_scales(manager):
    manager.load_lora(1, data("torch_r4"))
    manager.load_lora(2, data("litertlm_r4"))
    blend = manager.use_blend([(1, 0.7), (2, 0.3)])
    assert blend.slot_rank == 16
    assert manager.get_current_lora_id() is None
    assert manager.get_current_blend() == ((1, 0.7), (2, 0.3))
    assert manager.use_lora(1, 0.5) is not manager.use_lora(1, 1.0)  # scale is part of the key
    assert manager.use_blend([(1, 0.0)]) is None  # zero scale: the base model
    manager.load_lora(3, data("torch_r16"))
    with pytest.raises(InvalidArgumentError, match="need rank 20 together"):
        manager.use_blend([(1, 1.0), (3, 1.0)])


def test_normalize_blend():
    assert normalize_blend([(2, 0.5), (1, 1.0), (2, 0.25), (3, 0.0)]) == ((1, 1.0), (2, 0.75))
    with pytest.raises(InvalidArgumentError):
        normalize_blend([(1, float("nan"))])


def test_bad_adapter_registers_nothing(manager):
    with pytest.raises(InvalidArgumentError):
        manager.load_lora(1, data("wrong_hidden_r4"))
    assert manager.loaded_ids() == []
    manager.load_lora(1, data("torch_r4"))  # the id is still free


def test_unload_frees_and_refuses_pinned(manager):
    manager.load_lora(1, data("torch_r4"))
    manager.use_lora(1)
    manager.pin(1)
    with pytest.raises(FailedPreconditionError, match="live session"):
        manager.unload_lora(1)
    manager.unpin(1)
    manager.unload_lora(1)
    assert manager.loaded_ids() == [] and manager.resident() == {}
    assert manager.get_current_blend() is None
    with pytest.raises(NotFoundError):
        manager.use_lora(1)


def test_concurrent_use_materializes_once(manager):
    manager.load_lora(1, data("torch_r4"))
    results = []
    threads = [threading.Thread(target=lambda: results.append(manager.materialize(((1, 1.0),)))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(r) for r in results}) == 1
    assert len(manager.allocations) == len(SLOTS[4])


def test_lru_evicts_least_recently_used_idle_blend():
    from runtime.components.residency import Lru

    allocate = allocator(SLOTS)
    manager = LoraManager(SLOTS, allocate, residency=Lru(max_resident=2))
    evicted = []
    manager.add_evict_listener(lambda blend, lora: evicted.append(blend))
    for lora_id, name in ((1, "torch_r4"), (2, "litertlm_r4"), (3, "mediapipe_r4")):
        manager.load_lora(lora_id, data(name))
    one, two, three = ((1, 1.0),), ((2, 1.0),), ((3, 1.0),)
    manager.acquire(one)  # running: protected
    manager.materialize(two)
    manager.materialize(three)  # over budget: two is the idle LRU one
    assert evicted == [two]
    assert manager.is_resident(one) and manager.is_resident(three)
    manager.release(one)
    manager.materialize(two)  # miss, rebuilt; now one is LRU and idle
    assert evicted == [two, one]
    stats = manager.residency_stats()
    assert (stats.hits, stats.misses, stats.evictions) == (0, 4, 2)
    assert stats.materialize.count == 4


def test_only_active_keeps_buffers_only_while_running():
    from runtime.components.residency import OnlyActive

    manager = LoraManager(SLOTS, allocator(SLOTS), residency=OnlyActive())
    manager.load_lora(1, data("torch_r4"))
    blend = ((1, 1.0),)
    lora = manager.acquire(blend)
    assert manager.acquire(blend) is lora  # a second runner shares it (hit)
    manager.release(blend)
    assert manager.is_resident(blend)
    manager.release(blend)
    assert not manager.is_resident(blend)
    assert not manager.evict(blend)


def test_switching_policy_applies_at_once(manager):
    from runtime.components.residency import Lru

    for lora_id, name in ((1, "torch_r4"), (2, "litertlm_r4")):
        manager.load_lora(lora_id, data(name))
        manager.materialize(((lora_id, 1.0),))
    manager.set_residency(Lru(max_resident=1))
    assert len(manager.resident()) == 1


def test_set_residency_refuses_what_is_not_a_policy_and_keeps_the_old_one(manager):
    lora_id = 1
    manager.load_lora(lora_id, LoraData.create_from_file_path(adapter_path("torch_r4")))
    manager.use_lora(lora_id)
    manager.use_lora(None)
    with pytest.raises(InvalidArgumentError, match="residency policy 'only-active'"):
        manager.set_residency("only-active")
    assert len(manager.resident()) == 1  # KeepAll still holds it
