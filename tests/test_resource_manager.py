"""Tests for runtime.framework.resource_management.resource_manager."""

from __future__ import annotations

import os
import shutil
import threading

import pytest

from conftest import MODEL_FILES, adapter_path
from runtime.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from runtime.executor.litert_executor import LlmExecutor
from runtime.framework.lora_source import LoraSource
from runtime.framework.resource_management.resource_manager import ResourceManager


@pytest.fixture
def manager():
    resources = ResourceManager(LlmExecutor(MODEL_FILES["default"]))
    yield resources
    resources.close()


def test_same_file_same_id_through_any_path(manager, tmp_path):
    original = tmp_path / "a.tflite"
    shutil.copy(adapter_path("torch_r4"), original)
    link = tmp_path / "link.tflite"
    link.symlink_to(original)
    hard = tmp_path / "hard.tflite"
    os.link(original, hard)
    first = manager.register(LoraSource(path=original))
    assert manager.register(LoraSource(path=str(original))) == first
    assert manager.register(LoraSource(path=link)) == first
    assert manager.register(LoraSource(path=hard)) == first
    assert manager.register(LoraSource(path=tmp_path / "." / "a.tflite")) == first
    assert manager.assign_lora_id(path=link) == first
    copy = tmp_path / "copy.tflite"
    shutil.copy(original, copy)  # same bytes, another file: another adapter
    assert manager.register(LoraSource(path=copy)) != first
    assert manager.lora_manager.loaded_ids() == [first, first + 1]


def test_rewritten_file_is_a_new_adapter(manager, tmp_path):
    path = tmp_path / "a.tflite"
    shutil.copy(adapter_path("torch_r4"), path)
    first = manager.register(LoraSource(path=path))
    path.unlink()
    shutil.copy(adapter_path("litertlm_r4"), path)
    assert manager.register(LoraSource(path=path)) != first


def test_same_bytes_same_id_different_bytes_new_id(manager):
    blob = adapter_path("torch_r4").read_bytes()
    first = manager.register(LoraSource(buffer=blob))
    assert manager.register(LoraSource(buffer=bytearray(blob))) == first
    assert manager.register(LoraSource(buffer=memoryview(blob))) == first
    assert manager.assign_lora_id(buffer=blob) == first
    other = manager.register(LoraSource(buffer=adapter_path("litertlm_r4").read_bytes()))
    assert other != first
    assert manager.assign_lora_id(buffer=b"fresh bytes") not in (first, other)


def test_failed_load_leaves_no_id(manager):
    bad = adapter_path("wrong_hidden_r4")
    with pytest.raises(InvalidArgumentError, match="input size 48"):
        manager.register(LoraSource(path=bad))
    assert manager.lora_manager.loaded_ids() == []
    with pytest.raises(InvalidArgumentError, match="file identifier"):
        manager.register(LoraSource(buffer=b"garbage, but long enough to have an identifier"))
    with pytest.raises(NotFoundError):
        manager.register(LoraSource(path="/nonexistent/adapter.tflite"))
    good = manager.register(LoraSource(path=adapter_path("torch_r4")))
    assert manager.lora_manager.loaded_ids() == [good]


def test_concurrent_registration_loads_once(manager):
    blob = adapter_path("torch_r16").read_bytes()
    ids = []
    threads = [threading.Thread(target=lambda: ids.append(manager.register(LoraSource(buffer=blob)))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 1 and manager.lora_manager.loaded_ids() == ids[:1]


def test_contexts_pin_their_adapters(manager):
    lora_id = manager.register(LoraSource(path=adapter_path("torch_r4")))
    context = manager.new_context([(lora_id, 1.0)])
    clone = manager.clone_context(context)
    assert manager.lora_manager.pin_count(lora_id) == 2
    with pytest.raises(FailedPreconditionError):
        manager.unload(lora_id)
    manager.release_context(context)
    manager.release_context(clone)
    manager.unload(lora_id)
    assert manager.lora_manager.loaded_ids() == []
    with pytest.raises(NotFoundError):
        manager.new_context([(lora_id, 1.0)])


@pytest.mark.parametrize("switch", [False, True])
def test_unload_cannot_slip_between_register_and_pin(manager, switch, monkeypatch):
    """Another thread unloads the adapter just as it is registered for a context: the
    context must still get it (and the unload be refused), never a NotFoundError."""
    source = LoraSource(path=adapter_path("torch_r4"))
    lora_id = manager.register(source)
    context = manager.new_context([]) if switch else None
    outcome: list[BaseException | None] = []
    racers: list[threading.Thread] = []

    def unload() -> None:
        try:
            manager.unload(lora_id)
            outcome.append(None)
        except (FailedPreconditionError, NotFoundError) as exc:
            outcome.append(exc)

    original_register = manager.register

    def register_then_let_an_unload_try(registered: LoraSource) -> int:
        registered_id = original_register(registered)
        racer = threading.Thread(target=unload)
        racers.append(racer)
        racer.start()
        racer.join(0.3)  # long enough for an unload that is not kept out to finish
        return registered_id

    monkeypatch.setattr(manager, "register", register_then_let_an_unload_try)
    if switch:
        manager.set_sources(context, [source])
    else:
        context = manager.new_context_for_sources([source])
    monkeypatch.undo()
    for racer in racers:
        racer.join(10)
    assert context.lora_ids == [lora_id]
    assert len(outcome) == 1 and isinstance(outcome[0], FailedPreconditionError)
    manager.release_context(context)


def test_bind_is_cached_until_the_adapter_changes(manager):
    one = manager.register(LoraSource(path=adapter_path("torch_r4")))
    two = manager.register(LoraSource(path=adapter_path("litertlm_r8_layer0")))
    context = manager.new_context([(one, 1.0)])
    first = manager.bind(context)
    assert manager.bind(context) is first
    assert first.lora_rank == 4
    manager.set_blend(context, [(two, 1.0)])
    assert manager.lora_manager.pin_count(one) == 0
    second = manager.bind(context)
    assert second is not first and second.lora_rank == 16
    manager.set_blend(context, [])
    assert manager.bind(context).lora_rank is None


def test_mutable_buffer_is_snapshotted_at_registration(manager):
    blob = bytearray(adapter_path("torch_r4").read_bytes())
    lora_id = manager.register(LoraSource(buffer=blob))
    data = manager.lora_manager.plan(lora_id).data
    before = data.read_tensor("lora_atten_q_a_prime_weight_0").copy()
    blob[:] = bytes(len(blob))  # the caller scribbles over its buffer
    assert (data.read_tensor("lora_atten_q_a_prime_weight_0") == before).all()


def test_wrong_buffer_type(manager):
    with pytest.raises(InvalidArgumentError, match="got str"):
        manager.register(LoraSource(buffer="not bytes"))
