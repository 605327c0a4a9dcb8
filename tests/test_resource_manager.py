"""Tests for runtime.framework.resource_management.resource_manager."""

from __future__ import annotations

import os
import shutil
import threading

import pytest

from conftest import MODEL_FILES, adapter_path, make_resource_manager
import numpy as np

from runtime.components.residency import KeepAll, OnlyActive
from runtime.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from runtime.framework.lora_source import LoraSource
from runtime.framework.resource_management.resource_manager import ResourceManager
from runtime.util.signature_names import LoraSlot


@pytest.fixture
def manager():
    resources = make_resource_manager(MODEL_FILES["default"])
    yield resources
    resources.close()


def sessions_using(manager, lora_id):
    return next(a.sessions for a in manager.registry.report().adapters if a.lora_id == lora_id)


def test_same_file_same_id_through_any_path(manager, tmp_path):
    original = tmp_path / "a.tflite"
    shutil.copy(adapter_path("torch_r4"), original)
    link = tmp_path / "link.tflite"
    link.symlink_to(original)
    hard = tmp_path / "hard.tflite"
    os.link(original, hard)
    first = manager.registry.register(LoraSource(path=original))
    assert manager.registry.register(LoraSource(path=str(original))) == first
    assert manager.registry.register(LoraSource(path=link)) == first
    assert manager.registry.register(LoraSource(path=hard)) == first
    assert manager.registry.register(LoraSource(path=tmp_path / "." / "a.tflite")) == first
    copy = tmp_path / "copy.tflite"
    shutil.copy(original, copy)  # same bytes, another file: another adapter
    assert manager.registry.register(LoraSource(path=copy)) != first
    assert manager.registry.ids() == [first, first + 1]


def test_rewritten_file_is_a_new_adapter(manager, tmp_path):
    path = tmp_path / "a.tflite"
    shutil.copy(adapter_path("torch_r4"), path)
    first = manager.registry.register(LoraSource(path=path))
    path.unlink()
    shutil.copy(adapter_path("litertlm_r4"), path)
    assert manager.registry.register(LoraSource(path=path)) != first


def test_same_bytes_same_id_different_bytes_new_id(manager):
    blob = adapter_path("torch_r4").read_bytes()
    first = manager.registry.register(LoraSource(buffer=blob))
    assert manager.registry.register(LoraSource(buffer=bytearray(blob))) == first
    assert manager.registry.register(LoraSource(buffer=memoryview(blob))) == first
    other = manager.registry.register(LoraSource(buffer=adapter_path("litertlm_r4").read_bytes()))
    assert other != first


def test_failed_load_leaves_no_id(manager):
    bad = adapter_path("wrong_hidden_r4")
    with pytest.raises(InvalidArgumentError, match="input size 48"):
        manager.registry.register(LoraSource(path=bad))
    assert manager.registry.ids() == []
    with pytest.raises(InvalidArgumentError, match="file identifier"):
        manager.registry.register(LoraSource(buffer=b"garbage, but long enough to have an identifier"))
    with pytest.raises(NotFoundError):
        manager.registry.register(LoraSource(path="/nonexistent/adapter.tflite"))
    good = manager.registry.register(LoraSource(path=adapter_path("torch_r4")))
    assert manager.registry.ids() == [good] == [1]  # the refused ones used up no id


def test_concurrent_registration_loads_once(manager):
    blob = adapter_path("torch_r16").read_bytes()
    ids = []
    threads = [threading.Thread(target=lambda: ids.append(manager.registry.register(LoraSource(buffer=blob)))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 1 and manager.registry.ids() == ids[:1]


def test_contexts_pin_their_adapters(manager):
    source = LoraSource(path=adapter_path("torch_r4"))
    context = manager.create_context_handler([source])
    (lora_id,) = context.lora_ids
    clone = manager.clone_context_handler(context)
    assert sessions_using(manager, lora_id) == 2
    with pytest.raises(FailedPreconditionError):
        manager.registry.unload(lora_id)
    manager.release_context(context)
    manager.release_context(clone)
    manager.registry.unload(lora_id)
    assert manager.registry.ids() == []
    again = manager.create_context_handler([source])  # registered anew, under a new id
    assert again.lora_ids != [lora_id] and manager.registry.ids() == again.lora_ids


@pytest.mark.parametrize("switch", [False, True])
def test_unload_cannot_slip_between_register_and_pin(manager, switch, monkeypatch):
    """Another thread unloads the adapter just as it is registered for a context: the
    context must still get it (and the unload be refused), never a NotFoundError."""
    source = LoraSource(path=adapter_path("torch_r4"))
    lora_id = manager.registry.register(source)
    context = manager.create_context_handler([]) if switch else None
    outcome: list[BaseException | None] = []
    racers: list[threading.Thread] = []

    def unload() -> None:
        try:
            manager.registry.unload(lora_id)
            outcome.append(None)
        except (FailedPreconditionError, NotFoundError) as exc:
            outcome.append(exc)

    original_register = manager.registry.register

    def register_then_let_an_unload_try(registered: LoraSource) -> int:
        registered_id = original_register(registered)
        racer = threading.Thread(target=unload)
        racers.append(racer)
        racer.start()
        racer.join(0.3)  # long enough for an unload that is not kept out to finish
        return registered_id

    monkeypatch.setattr(manager.registry, "register", register_then_let_an_unload_try)
    if switch:
        manager.set_adapters(context, [source])
    else:
        context = manager.create_context_handler([source])
    monkeypatch.undo()
    for racer in racers:
        racer.join(10)
    assert context.lora_ids == [lora_id]
    assert len(outcome) == 1 and isinstance(outcome[0], FailedPreconditionError)
    manager.release_context(context)


def bound(manager, context):
    with manager.acquire_executor_with_context_handler(context) as binding:
        return binding


def test_binding_is_reused_until_the_adapter_changes(manager):
    one = LoraSource(path=adapter_path("torch_r4"))
    context = manager.create_context_handler([one])
    first = bound(manager, context)
    assert bound(manager, context) is first
    assert first.lora_slot == LoraSlot(4)
    manager.set_adapters(context, [LoraSource(path=adapter_path("litertlm_r8_layer0"))])
    assert sessions_using(manager, manager.registry.register(one)) == 0
    second = bound(manager, context)
    assert second is not first and second.lora_slot == LoraSlot(16)
    manager.set_adapters(context, [])
    assert bound(manager, context).lora_slot is None
    manager.set_adapters(context, [one])
    assert bound(manager, context) is first  # a recent binding, not rebuilt


def test_a_run_protects_its_adapter_and_always_ends(manager):
    manager.registry.set_residency(OnlyActive())
    context = manager.create_context_handler([LoraSource(path=adapter_path("torch_r4"))])
    with manager.acquire_executor_with_context_handler(context):
        assert len(manager.registry.report().resident) == 1  # running: kept
    assert manager.registry.report().resident == ()  # ended: OnlyActive drops it
    with pytest.raises(RuntimeError, match="inside the run"):
        with manager.acquire_executor_with_context_handler(context):
            raise RuntimeError("inside the run")
    assert manager.registry.report().resident == ()  # ended by the exception too
    manager.release_context(context)


def test_idle_contexts_let_go_of_evicted_buffers(manager):
    """Else an eviction would free nothing: the idle context's binding would keep them."""
    a = manager.create_context_handler([LoraSource(path=adapter_path("torch_r4"))])
    b = manager.create_context_handler([LoraSource(path=adapter_path("litertlm_r4"))])
    bound(manager, a)
    assert a.bound_lora is not None
    manager.registry.set_residency(OnlyActive())  # a is idle: its blend goes
    assert a.bound_lora is None and a.binding is None and a.recent == {}
    with manager.acquire_executor_with_context_handler(b):
        assert b.bound_lora is not None  # active: kept while it runs
    assert b.bound_lora is None  # idle again: evicted, let go
    manager.release_context(a)
    manager.release_context(b)


def test_switches_are_counted_when_context_or_adapter_changes(manager):
    a = manager.create_context_handler([LoraSource(path=adapter_path("torch_r4"))])
    b = manager.create_context_handler([])
    for context in (a, a, b, b, a):
        bound(manager, context)
    assert manager.switch_latency.summary().count == 2  # a->b and b->a; the first run is no switch


def test_mutable_buffer_is_snapshotted_at_registration(manager):
    blob = bytearray(adapter_path("torch_r4").read_bytes())
    lora_id = manager.registry.register(LoraSource(buffer=blob))
    context = manager.create_context_handler([LoraSource(buffer=bytes(blob))])
    assert context.lora_ids == [lora_id]  # same content, same adapter
    before = bound(manager, context).executor.decode(bound(manager, context), 1, 0)
    blob[:] = bytes(len(blob))  # the caller scribbles over its buffer
    manager.registry.set_residency(OnlyActive())  # buffers rebuilt from the registered bytes
    manager.registry.set_residency(KeepAll())
    after = bound(manager, context).executor.decode(bound(manager, context), 1, 0)
    np.testing.assert_array_equal(after, before)
    manager.release_context(context)


def test_wrong_buffer_type(manager):
    with pytest.raises(InvalidArgumentError, match="buffer='not bytes', expected the bytes of an adapter"):
        manager.registry.register(LoraSource(buffer="not bytes"))
    assert manager.registry.ids() == []


def test_a_context_whose_kv_cache_cannot_be_made_leaves_nothing_registered_or_pinned(manager, monkeypatch):
    """Under memory pressure the KV cache's allocation fails after the adapters were
    registered and pinned: the adapters the call brought go again, the others keep their
    pins as they were."""
    kept = manager.registry.register(LoraSource(path=adapter_path("litertlm_r4")))
    holder = manager.create_context_handler([], [(kept, 1.0)])

    def out_of_memory():
        raise MemoryError("no room for a KV cache")

    monkeypatch.setattr(manager.pool.primary, "create_kv_cache", out_of_memory)
    with pytest.raises(MemoryError):
        manager.create_context_handler([LoraSource(path=adapter_path("torch_r4"))], [(kept, 0.5)])
    assert manager.registry.ids() == [kept] and sessions_using(manager, kept) == 1
    monkeypatch.undo()
    manager.release_context(holder)
    assert sessions_using(manager, kept) == 0


def test_an_eviction_while_a_base_model_run_starts_never_lends_it_the_evicted_binding(manager):
    """A context switched to the base model still holds its binding to the adapter it ran
    before; an eviction of that adapter's buffers on another thread, landing just after the
    run read the binding and before it read what the binding was for, made the run take the
    old binding as the base model's: the adapter's delta in a base-model run."""
    from runtime.framework.resource_management.context_handler import ContextHandler

    class EvictionAfterTheBindingIsRead(ContextHandler):
        evict = None  # called once, right after the binding is next read

        @property
        def binding(self):
            value = self.__dict__["_binding"]
            evict, self.evict = self.evict, None
            if evict is not None:
                evict()
            return value

        @binding.setter
        def binding(self, value):
            self.__dict__["_binding"] = value

    context = manager.create_context_handler([LoraSource(path=adapter_path("torch_r4"))])
    assert bound(manager, context).lora_slot == LoraSlot(4)
    manager.set_adapters(context, [])
    context.__dict__["_binding"] = context.__dict__.pop("binding")
    context.__class__ = EvictionAfterTheBindingIsRead
    context.evict = lambda: manager.registry.set_residency(OnlyActive())  # the adapter is idle: it goes
    with manager.acquire_executor_with_context_handler(context) as binding:
        assert binding.lora_slot is None
    assert manager.registry.report().resident == ()
    manager.release_context(context)


def test_a_run_interrupted_waiting_for_an_executor_leaves_its_adapter_idle(manager, monkeypatch):
    """Ctrl-C lands where a run waits, for an executor of a busy pool: the blend the run had
    acquired must be released, else it stays active for ever (never evicted, never unloaded)."""
    context = manager.create_context_handler([LoraSource(path=adapter_path("torch_r4"))])
    (lora_id,) = context.lora_ids

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(manager.pool, "take", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with manager.acquire_executor_with_context_handler(context):
            pass
    monkeypatch.undo()
    manager.registry.set_residency(OnlyActive())
    assert manager.registry.report().resident == ()
    manager.release_context(context)
    manager.registry.unload(lora_id)
    assert manager.registry.ids() == []


def test_an_adapter_without_draft_heads_has_one_id_whatever_its_heads_flag(manager):
    """``heads`` picks whether a Turbo LoRA's draft heads come with it; an adapter that
    carries none is the same adapter either way, not a second registration (and a second
    set of buffers) under another id."""
    from conftest import MODELS

    peft = MODELS / "peft"
    for path in (adapter_path("torch_r4"), peft / "qkvo_r4"):  # with heads (the default) first
        first = manager.registry.register(LoraSource(path=path))
        assert manager.registry.register(LoraSource(path=path, heads=False)) == first
    for path in (adapter_path("litertlm_r4"), peft / "qkvo_r4_b"):  # without first
        first = manager.registry.register(LoraSource(path=path, heads=False))
        assert manager.registry.register(LoraSource(path=path)) == first
    turbo = manager.registry.register(LoraSource(path=MODELS / "turbo" / "trained_heads", heads=False))
    with pytest.raises(FailedPreconditionError, match="heads=False"):  # it has heads: not its heads=False twin
        manager.registry.register(LoraSource(path=MODELS / "turbo" / "trained_heads"))
    ids = manager.registry.ids()
    assert ids == [1, 2, 3, 4, turbo]
    for lora_id in ids:
        manager.registry.unload(lora_id)  # every name of it goes
    again = manager.registry.register(LoraSource(path=peft / "qkvo_r4", heads=False))
    assert manager.registry.register(LoraSource(path=peft / "qkvo_r4")) == again == turbo + 1


def test_a_blend_of_in_memory_adapters_of_one_size_lies_in_one_order_whatever_was_registered_first():
    """A blend's adapters lie along the rank in their sources' order, so its sums do not
    depend on registration order; in-memory adapters are named by their size, and two of
    one size (same architecture and format: the common case) tied and fell back to id order."""
    from runtime.adapters.lora_data import LoraData
    from runtime.adapters.lora_writer import serialize_lora_tensors

    with LoraData.create_from_file_path(adapter_path("torch_r4")) as data:
        tensors = {name: data.read_tensor(name).astype(np.float32) for name in data.get_all_tensor_names()}
    blobs = [serialize_lora_tensors({name: array * factor for name, array in tensors.items()}, external_data=False)
             for factor in (1.0, -0.5)]
    assert len(blobs[0]) == len(blobs[1]) and blobs[0] != blobs[1]
    built = []
    for order in (blobs, blobs[::-1]):
        resources = make_resource_manager(MODEL_FILES["default"])
        try:
            ids = {blob: resources.registry.register(LoraSource(buffer=blob)) for blob in order}
            blend = tuple(sorted([(ids[blobs[0]], 0.7), (ids[blobs[1]], 0.3)]))
            lora = resources.registry.acquire(blend)
            built.append({name: buffer.array.copy() for name, buffer in lora.buffers.items()})
            resources.registry.release(blend)
        finally:
            resources.close()
    for name in built[0]:
        assert np.array_equal(built[0][name], built[1][name]), name


@pytest.mark.parametrize("given", [str(adapter_path("torch_r4")), adapter_path("torch_r4"), b"bytes"],
                         ids=["a path string", "a Path", "bytes"])
def test_an_adapter_that_is_not_a_lora_source_is_refused_by_name(manager, given):
    """LiteRT-LM's AssignLoraId takes a path: passed here, it failed as an AttributeError
    ('str' object has no attribute 'origin') instead of the runtime's error naming it."""
    with pytest.raises(InvalidArgumentError, match=r"expected a LoraSource \(LoraSource\(path=\.\.\.\)"):
        manager.assign_lora_id(given)
    with pytest.raises(InvalidArgumentError, match="expected a LoraSource"):
        manager.create_context_handler([LoraSource(path=adapter_path("litertlm_r4")), given])
    assert manager.registry.ids() == []
