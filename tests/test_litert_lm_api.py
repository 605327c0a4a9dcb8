"""The LiteRT-LM mapping (docs/litert-lm.md): every name in its table exists and does what
its row says. A name removed from the code, or a row added without a check here, fails."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import MODEL_FILES, adapter_path, make_resource_manager
from runtime.adapters.lora_data import LoraData
from runtime.adapters.lora_util import is_lora_input_name
from runtime.components.lora_manager import LoraManager
from runtime.executor.litert_executor import LlmExecutor
from runtime.framework.lora_source import LoraSource
from runtime.framework.resource_management.resource_manager import ResourceManager
from runtime.util.scoped_file import ScopedFile

TABLE = Path(__file__).resolve().parents[1] / "docs" / "litert-lm.md"
ROW = re.compile(r"^\| `(?P<theirs>[^`]+)`[^|]* \| `(?P<ours>runtime\.[\w.]+)` \|", re.M)
ADAPTER = adapter_path("torch_r4")


def mapped_names() -> list[str]:
    return [match["ours"] for match in ROW.finditer(TABLE.read_text())]


def resolve(dotted: str) -> object:
    """The object a dotted name in the table names: a module's attribute, or a class's."""
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[split:]:
            target = getattr(target, attribute)
        return target
    raise AssertionError(f"{dotted}: no module to import")


@pytest.fixture
def resources():
    manager = make_resource_manager(MODEL_FILES["default"])
    yield manager
    manager.close()


def check_lora_data():
    by_path = LoraData.create_from_file_path(ADAPTER)
    by_buffer = LoraData.create_from_buffer(ADAPTER.read_bytes())
    scoped = ScopedFile(ADAPTER)
    by_scoped = LoraData.create_from_scoped_file(scoped)
    names = by_path.get_all_tensor_names()
    assert names and names == by_buffer.get_all_tensor_names() == by_scoped.get_all_tensor_names()
    assert all(by_path.has_tensor(name) for name in names) and not by_path.has_tensor("no_such_tensor")
    np.testing.assert_array_equal(by_path.read_tensor(names[0]), by_buffer.read_tensor(names[0]))
    assert by_path.get_lora_rank() == by_buffer.get_lora_rank() == 4
    assert sum(map(is_lora_input_name, names)) == len(names) and not is_lora_input_name("logits")
    for data in (by_path, by_buffer, by_scoped):
        data.close()
    scoped.close()


def check_lora_manager():
    executor = LlmExecutor(MODEL_FILES["default"])
    try:
        manager = LoraManager(executor.spec.lora_slots, executor.create_lora_buffer)
        data = LoraData.create_from_file_path(ADAPTER)
        plan = manager.load_lora(7, data)
        assert plan.rank == 4 and manager.has_lora(7) and not manager.resident()
        lora = manager.use_lora(7)
        assert manager.resident() and lora.slot.rank == 4
        buffers = manager.get_lora_buffers(7)
        assert set(buffers) == set(executor.spec.lora_slots[lora.slot]) and all(is_lora_input_name(n) for n in buffers)
    finally:
        executor.close()


def check_resource_manager(resources: ResourceManager):
    first = resources.assign_lora_id(LoraSource(path=ADAPTER))
    assert resources.assign_lora_id(LoraSource(buffer=adapter_path("torch_r16").read_bytes())) != first
    assert resources.assign_lora_id(LoraSource(path=str(ADAPTER))) == first
    context = resources.create_context_handler([LoraSource(path=ADAPTER)])
    assert context.lora_ids == [first]
    with resources.acquire_executor_with_context_handler(context) as binding:
        logits = binding.executor.prefill(binding, [5, 17, 42], 0)
    context.position = 3
    clone = resources.clone_context_handler(context)
    assert (clone.lora_ids, clone.position) == ([first], 3)
    with resources.acquire_executor() as executor:
        assert executor.spec is resources.spec
    with resources.acquire_executor_with_context_handler(clone) as binding:
        again = binding.executor.decode(binding, 9, clone.position)
    with resources.acquire_executor_with_context_handler(context) as binding:
        assert np.array_equal(binding.executor.decode(binding, 9, context.position), again)  # the clone's own copy
    assert logits.shape == again.shape
    resources.release_context(clone)
    resources.release_context(context)


CHECKS = {
    "LoraData": check_lora_data,
    "lora_util": check_lora_data,
    "ScopedFile": check_lora_data,
    "LoraManager": check_lora_manager,
    "ResourceManager": check_resource_manager,
    "ContextHandler": check_resource_manager,
}


def owner(dotted: str) -> str:
    return next(key for key in CHECKS if f".{key}" in dotted or dotted.endswith(f".{key}"))


def test_the_table_maps_every_litert_lm_lora_api():
    theirs = [match["theirs"] for match in ROW.finditer(TABLE.read_text())]
    for name in ("LoraData::HasTensor", "LoraData::GetLoRARank", "LoraManager::LoadLoRA", "LoraManager::UseLoRA",
                 "LoraManager::GetLoRABuffers", "ResourceManager::AssignLoraId",
                 "ResourceManager::CreateContextHandler", "ResourceManager::AcquireExecutorWithContextHandler"):
        assert name in theirs, name


@pytest.mark.parametrize("dotted", mapped_names())
def test_every_mapped_name_exists_and_has_a_check(dotted):
    assert callable(resolve(dotted)) or isinstance(resolve(dotted), property), dotted
    assert owner(dotted) in CHECKS


def test_lora_data_behaves_as_mapped():
    check_lora_data()


def test_lora_manager_behaves_as_mapped():
    check_lora_manager()


def test_resource_manager_and_context_handler_behave_as_mapped(resources):
    check_resource_manager(resources)
