"""Tests for runtime.components.lora_manager (the LiteRT-LM manager cases and more)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from conftest import adapter_path
from retained import retained_per_adapter
from runtime.components.lora_manager import LoraManager, normalize_blend
from runtime.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from runtime.adapters.lora_data import LoraData
from runtime.adapters.lora_util import Convention, lora_input_name
from runtime.adapters.lora_writer import serialize_lora_tensors
from runtime.util.signature_names import ALL_LINEAR, ATTENTION, LoraSlot
from slots import allocator, slot_inputs

R4, R16 = LoraSlot(4), LoraSlot(16)
SLOTS = {R4: slot_inputs(4), R16: slot_inputs(16)}


@pytest.fixture
def manager():
    allocate = allocator(SLOTS)
    m = LoraManager(SLOTS, allocate)
    m.allocations = allocate.calls
    return m


def data(name):
    return LoraData.create_from_file_path(adapter_path(name))


def use(manager, *entries):
    """Builds (or finds) a blend's buffers as one run would, and ends the run."""
    blend = normalize_blend(entries)
    lora = manager.acquire(blend)
    manager.release(blend)
    return lora


def resident(manager, blend):
    return any(b == blend for b, _ in manager.resident())


def test_load_parses_and_first_use_builds_buffers(manager):
    plan = manager.load_lora(1, data("torch_r4"))
    assert plan.rank == 4
    assert manager.allocations == []  # load parses only
    lora = use(manager, (1, 1.0))
    assert lora.slot == R4
    assert len(manager.allocations) == len(SLOTS[R4])
    assert set(lora.buffers) == set(SLOTS[R4])


def test_a_blend_also_runs_zero_padded_in_a_larger_slot(manager):
    manager.load_lora(1, data("torch_r4"))
    blend = normalize_blend([(1, 1.0)])
    own = use(manager, (1, 1.0))
    padded = manager.acquire(blend, R16)
    assert padded is not own and (own.slot, padded.slot) == (R4, R16)
    assert manager.acquire(blend, R4) is own and manager.acquire(blend, R16) is padded  # each found again
    assert sorted(slot.rank for b, slot in manager.resident()) == [4, 16]
    for slot in (R4, R16, R16):
        manager.release(blend, slot)
    manager.load_lora(2, data("torch_r16"))
    with pytest.raises(InvalidArgumentError, match="adapters \\[2\\] cannot run in LoRA slot r4: they need slot r16"):
        manager.acquire(normalize_blend([(2, 1.0)]), R4)
    with pytest.raises(InvalidArgumentError, match="cannot run in LoRA slot r8"):
        manager.acquire(blend, LoraSlot(8))
    manager.unload_lora(1)  # drops the blend in every slot
    assert not resident(manager, blend)


def test_taken_id_and_unknown_id(manager):
    manager.load_lora(1, data("torch_r4"))
    with pytest.raises(AlreadyExistsError):
        manager.load_lora(1, data("litertlm_r4"))
    with pytest.raises(NotFoundError):
        manager.acquire(((2, 1.0),))
    with pytest.raises(NotFoundError):
        manager.unload_lora(2)


def test_an_empty_blend_has_no_buffers(manager):
    with pytest.raises(InvalidArgumentError, match="use the base model"):
        manager.acquire(())


def test_switch_ones_twos_ones_reuses_buffers(manager):
    manager.load_lora(1, data("torch_r4"))
    manager.load_lora(2, data("litertlm_r8_layer0"))
    ones = use(manager, (1, 1.0))
    twos = use(manager, (2, 1.0))
    assert twos.slot == R16  # rank 8 goes into the r16 slot
    allocated = len(manager.allocations)
    assert use(manager, (1, 1.0)) is ones  # resident: no new buffers
    assert len(manager.allocations) == allocated
    stats = manager.residency_stats()
    assert (stats.hits, stats.misses) == (1, 2)


def test_blend_and_scales(manager):
    manager.load_lora(1, data("torch_r4"))
    manager.load_lora(2, data("litertlm_r4"))
    blend = use(manager, (1, 0.7), (2, 0.3))
    assert blend.slot == R16  # ranks add up: 8 goes into the r16 slot
    assert use(manager, (1, 0.5)) is not use(manager, (1, 1.0))  # scale is part of the key
    assert manager.slot_for(normalize_blend([(1, 1.0), (2, 1.0)])) == R16
    manager.load_lora(3, data("torch_r16"))
    with pytest.raises(InvalidArgumentError, match="need rank 20 together"):
        manager.acquire(normalize_blend([(1, 1.0), (3, 1.0)]))


def test_a_blend_lays_its_adapters_out_by_their_sources_not_by_registration():
    """Which of a blend's adapters an engine registered first does not change its buffers:
    the adapters lie side by side along the rank in their sources' order, so the delta's
    sums run in one order (the other had logits 3e-6 apart)."""
    built = []
    for order in (("torch_r4", "litertlm_r4"), ("litertlm_r4", "torch_r4")):
        manager = LoraManager(SLOTS, allocator(SLOTS))
        for lora_id, name in enumerate(order, start=1):
            manager.load_lora(lora_id, data(name))
        lora = use(manager, (order.index("torch_r4") + 1, 0.7), (order.index("litertlm_r4") + 1, 0.3))
        built.append({name: buffer.array for name, buffer in lora.buffers.items()})
    assert built[0].keys() == built[1].keys()
    for name in built[0]:
        assert np.array_equal(built[0][name], built[1][name]), name


ALL_LINEAR_SLOTS = {R4: slot_inputs(4), LoraSlot(4, ALL_LINEAR): slot_inputs(4, mlp=True),
                    LoraSlot(16, ALL_LINEAR): slot_inputs(16, mlp=True)}


def mlp_adapter(rank: int = 4):
    """An adapter with LoRA on layer 0's q and gate (graph layout, litert-torch names)."""
    rng = np.random.default_rng(rank)
    tensors = {}
    for projection, (fan_in, fan_out) in (("q", (64, 64)), ("gate", (64, 128))):
        tensors[lora_input_name(Convention.LITERT_TORCH, 0, projection, "a")] = rng.standard_normal((fan_in, rank))
        tensors[lora_input_name(Convention.LITERT_TORCH, 0, projection, "b")] = rng.standard_normal((rank, fan_out))
    return LoraData.create_from_buffer(serialize_lora_tensors(
        {name: array.astype(np.float32) for name, array in tensors.items()}, external_data=False))


def test_adapters_run_in_the_cheapest_slot_of_their_projections():
    manager = LoraManager(ALL_LINEAR_SLOTS, allocator(ALL_LINEAR_SLOTS))
    manager.load_lora(1, data("torch_r4"))  # attention only
    manager.load_lora(2, mlp_adapter())
    assert manager.plan(1).targets == ATTENTION and manager.plan(2).targets == ALL_LINEAR
    assert manager.slot_for(((1, 1.0),)) == R4  # no MLP inputs to pay for
    assert manager.slot_for(((2, 1.0),)) == LoraSlot(4, ALL_LINEAR)
    assert manager.slot_for(((1, 1.0), (2, 1.0))) == LoraSlot(16, ALL_LINEAR)  # a blend: summed rank 8
    everywhere = manager.acquire(((2, 1.0),))
    gate_a = everywhere.buffers["lora_ff_gate_a_prime_weight_0"].array
    np.testing.assert_array_equal(gate_a, mlp_adapter().read_tensor("lora_ff_gate_a_prime_weight_0"))
    assert not everywhere.buffers["lora_ff_down_b_prime_weight_1"].array.any()  # uncovered: zero
    padded = manager.acquire(((1, 1.0),), LoraSlot(4, ALL_LINEAR))  # an attention row in an all-linear batch
    assert not padded.buffers["lora_ff_up_a_prime_weight_0"].array.any()
    with pytest.raises(InvalidArgumentError, match=r"adapters \[2\] cannot run in LoRA slot r4"):
        manager.acquire(((2, 1.0),), R4)  # its MLP tensors would be dropped


def test_an_mlp_adapter_on_an_attention_only_model_names_every_mlp_tensor_and_the_flag(manager):
    with pytest.raises(InvalidArgumentError) as info:
        manager.load_lora(1, mlp_adapter())
    message = str(info.value)
    assert "2 tensor(s) are on MLP projections" in message and "--lora-targets all-linear" in message
    assert "lora_ff_gate_a_prime_weight_0, lora_ff_gate_b_prime_weight_0" in message
    assert manager.loaded_ids() == []


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
    manager.load_lora(2, data("litertlm_r4"))
    use(manager, (1, 1.0))
    use(manager, (1, 0.5), (2, 0.5))
    use(manager, (2, 1.0))
    manager.pin(1)
    with pytest.raises(FailedPreconditionError, match="live session"):
        manager.unload_lora(1)
    manager.unpin(1)
    manager.unload_lora(1)
    assert manager.loaded_ids() == [2]
    assert [b for b, _ in manager.resident()] == [((2, 1.0),)]  # every blend holding 1 went with it
    assert manager.residency_stats().evictions == 0  # unloaded, not evicted: KeepAll evicts nothing
    with pytest.raises(NotFoundError):
        manager.acquire(((1, 1.0),))



def test_unload_refuses_an_adapter_a_run_is_using(manager):
    """An adapter of a blend being run (acquired, not yet released) is not unloaded: its
    buffers would go while the run reads them, and the run's release could no longer find
    the blend (NotFoundError), leaving it counted active for ever."""
    from runtime.components.residency import OnlyActive

    manager.load_lora(1, data("torch_r4"))
    manager.load_lora(2, data("litertlm_r4"))
    blend = normalize_blend([(1, 0.5), (2, 0.5)])
    running = manager.acquire(blend)  # no session pins it: LiteRT-LM's UseLoRA callers hold none
    for lora_id in (1, 2):
        with pytest.raises(FailedPreconditionError, match=r"torch_r4|litertlm_r4") as refused:
            manager.unload_lora(lora_id)
        assert "being run" in str(refused.value)
    assert manager.loaded_ids() == [1, 2] and manager.resident()[(blend, R16)] is running
    manager.release(blend)
    manager.unload_lora(1)
    manager.set_residency(OnlyActive())  # nothing runs: nothing stays resident
    assert manager.loaded_ids() == [2] and manager.resident() == {}


def test_an_id_loaded_again_after_unloading_gets_its_new_adapters_slot(manager):
    manager.load_lora(1, data("torch_r4"))
    assert manager.slot_for(((1, 1.0),)) == R4
    manager.unload_lora(1)
    with pytest.raises(NotFoundError):
        manager.slot_for(((1, 1.0),))
    manager.load_lora(1, data("torch_r16"))
    assert manager.slot_for(((1, 1.0),)) == R16
    assert use(manager, (1, 1.0)).slot == R16

def test_concurrent_use_materializes_once():
    """Eight threads ask for one blend at the same moment (a barrier) while building its
    buffers is slow (each allocation sleeps, letting the other threads run): one build."""
    allocate = allocator(SLOTS)

    def slow_allocate(slot, name):
        time.sleep(0.002)
        return allocate(slot, name)

    manager = LoraManager(SLOTS, slow_allocate)
    manager.load_lora(1, data("torch_r4"))
    start = threading.Barrier(8)
    results, errors = [], []

    def run():
        start.wait(timeout=30)
        try:
            results.append(use(manager, (1, 1.0)))
        except BaseException as exc:  # noqa: BLE001 - reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == [] and len(results) == 8
    assert len({id(r) for r in results}) == 1
    assert len(allocate.calls) == len(SLOTS[R4])  # one set of buffers, not one per thread
    stats = manager.residency_stats()
    assert (stats.misses, stats.hits) == (1, 7)


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
    use(manager, (2, 1.0))
    use(manager, (3, 1.0))  # over budget: two is the idle LRU one
    assert evicted == [two]
    assert resident(manager, one) and resident(manager, three)
    manager.release(one)
    use(manager, (2, 1.0))  # miss, rebuilt; now one is LRU and idle
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
    assert resident(manager, blend)
    manager.release(blend)
    assert not resident(manager, blend)


def test_switching_policy_applies_at_once(manager):
    from runtime.components.residency import Lru

    for lora_id, name in ((1, "torch_r4"), (2, "litertlm_r4")):
        manager.load_lora(lora_id, data(name))
        use(manager, (lora_id, 1.0))
    manager.set_residency(Lru(max_resident=1))
    assert len(manager.resident()) == 1


def test_set_residency_refuses_what_is_not_a_policy_and_keeps_the_old_one(manager):
    lora_id = 1
    manager.load_lora(lora_id, LoraData.create_from_file_path(adapter_path("torch_r4")))
    use(manager, (lora_id, 1.0))
    with pytest.raises(InvalidArgumentError, match="residency policy 'only-active'"):
        manager.set_residency("only-active")
    assert len(manager.resident()) == 1  # KeepAll still holds it


def test_adapters_of_one_layout_share_their_pairs_and_keep_their_own_weights(manager):
    first, second = manager.load_lora(1, data("torch_r4")), manager.load_lora(2, data("torch_r4"))
    other = manager.load_lora(3, data("torch_r16"))
    assert first.pairs is second.pairs and other.pairs is not first.pairs
    assert manager.plan(2).pairs is first.pairs and manager.plan(2).data is not first.data
    np.testing.assert_array_equal(use(manager, (2, 1.0)).buffers[lora_input_name(Convention.LITERT_TORCH, 0, "q", "a")].array,
                                  use(manager, (1, 1.0)).buffers[lora_input_name(Convention.LITERT_TORCH, 0, "q", "a")].array)
    manager.unload_lora(1)
    assert manager.load_lora(4, data("torch_r4")).pairs is first.pairs  # still shared with adapter 2
    for lora_id in (2, 3, 4):
        manager.unload_lora(lora_id)
    assert manager.load_lora(5, data("torch_r4")).pairs is not first.pairs  # nobody held it any more


def test_a_registered_adapter_keeps_no_pair_objects_of_its_own(tmp_path):
    # Each plan used to keep a ProjectionPair per projection and its own dict of them (1.2 KiB
    # per adapter of 8 pairs here, 24 KiB at SmolLM2 all-linear); adapters of one layout share them
    # and each keeps its plan (0.3 KiB).
    rng = np.random.default_rng(0)
    opened = []
    for index in range(11):
        tensors = {name: rng.standard_normal(spec.shape).astype(np.float32) for name, spec in SLOTS[R4].items()}
        (tmp_path / f"adapter{index}.tflite").write_bytes(serialize_lora_tensors(tensors, external_data=True))
        opened.append(LoraData.create_from_file_path(tmp_path / f"adapter{index}.tflite"))
    manager = LoraManager(SLOTS, allocator(SLOTS))
    assert retained_per_adapter(lambda index: manager.load_lora(index, opened[index]), range(11)) < 768
