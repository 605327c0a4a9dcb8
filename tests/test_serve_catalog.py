"""Tests for runtime.serve.catalog: names, the path checks of loading, leases against unloading."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading

import pytest

from runtime import Engine
from runtime.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
)
from runtime.serve.catalog import AdapterCatalog

from conftest import MODEL_FILES, MODELS, adapter_path

PEFT_DIR = MODELS / "peft" / "qkvo_r4"


@pytest.fixture(scope="module")
def engine():
    with Engine(MODEL_FILES["default"]) as engine:
        yield engine


@pytest.fixture
def folder(tmp_path):
    shutil.copy(adapter_path("torch_r4"), tmp_path / "alpha.tflite")
    shutil.copy(MODELS / "peft" / "qkvo_r4.gguf", tmp_path / "beta.gguf")
    shutil.copytree(PEFT_DIR, tmp_path / "gamma")
    (tmp_path / ".hidden.tflite").write_bytes(b"half a download")
    (tmp_path / "notes.txt").write_text("not an adapter")
    (tmp_path / "empty_dir").mkdir()
    return tmp_path


def test_scan_names_files_and_peft_directories(engine, folder):
    catalog = AdapterCatalog(engine, folder)
    names = [entry.name for entry in catalog.scan()]
    assert names == ["alpha", "beta", "gamma"]
    assert [e.name for e in catalog.entries()] == names
    assert len({e.lora_id for e in catalog.entries()}) == 3
    for entry in catalog.entries():
        catalog.unload(entry.name)
    assert engine.adapter_ids() == []


def test_scan_skips_two_adapters_with_one_name_unless_strict(engine, folder):
    shutil.copy(adapter_path("litertlm_r4"), folder / "alpha.gguf")
    with pytest.raises(AlreadyExistsError, match="'alpha'"):
        AdapterCatalog(engine, folder).scan(strict=True)
    assert engine.adapter_ids() == []  # strict: nothing stays registered
    catalog = AdapterCatalog(engine, folder)
    assert [entry.name for entry in catalog.scan()] == ["alpha", "beta", "gamma"]
    assert [(s.file, "'alpha'" in s.reason) for s in catalog.skipped] == [("alpha.tflite", True)]
    for entry in catalog.entries():
        catalog.unload(entry.name)


def test_loading_by_path_stays_inside_the_folder(engine, folder, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    shutil.copy(adapter_path("torch_r4"), outside / "out.tflite")
    (folder / "link.tflite").symlink_to(outside / "out.tflite")
    os.mkfifo(folder / "fifo.tflite")
    peft_escape = folder / "delta"
    peft_escape.mkdir()
    shutil.copy(PEFT_DIR / "adapter_config.json", peft_escape)
    (peft_escape / "adapter_model.safetensors").symlink_to(PEFT_DIR / "adapter_model.safetensors")
    catalog = AdapterCatalog(engine, folder)
    for lora_path, error in [("../out.tflite", PermissionDeniedError), (str(outside / "out.tflite"), PermissionDeniedError),
                             ("link.tflite", PermissionDeniedError), ("fifo.tflite", PermissionDeniedError),
                             ("delta", PermissionDeniedError), ("missing.tflite", NotFoundError),
                             ("empty_dir", InvalidArgumentError), ("notes.txt", InvalidArgumentError),
                             ("", InvalidArgumentError)]:
        with pytest.raises(error):
            catalog.load_path("probe", lora_path)
    assert catalog.entries() == [] and engine.adapter_ids() == []
    entry = catalog.load_path("probe", str(folder / "gamma"))  # absolute, inside
    assert entry.path == (folder / "gamma").resolve()
    catalog.unload("probe")


def test_names_are_checked_and_unique(engine, folder):
    catalog = AdapterCatalog(engine, folder, reserved_names=["base"])
    catalog.load_path("a", "alpha.tflite")
    for name, error in [("a", AlreadyExistsError), ("base", AlreadyExistsError), ("../a", InvalidArgumentError),
                        ("a::b", InvalidArgumentError), ("", InvalidArgumentError), ("x" * 129, InvalidArgumentError)]:
        with pytest.raises(error):
            catalog.load_path(name, "beta.gguf")
    with pytest.raises(AlreadyExistsError, match="already loaded as adapter 'a'"):
        catalog.load_path("a2", "alpha.tflite")  # one file, one name
    with pytest.raises(InvalidArgumentError, match="64 hex"):
        catalog.load_path("b", "beta.gguf", sha256="abc")
    catalog.unload("a")


def test_a_leased_adapter_cannot_be_unloaded(engine, folder):
    catalog = AdapterCatalog(engine, folder)
    catalog.scan()
    lease = catalog.lease(["alpha", "gamma"])
    with pytest.raises(FailedPreconditionError, match="1 running"):
        catalog.unload("alpha")
    with pytest.raises(NotFoundError):
        catalog.lease(["alpha", "nope"])
    lease.release()
    lease.release()  # twice is harmless
    for name in ("alpha", "beta", "gamma"):
        catalog.unload(name)
    with pytest.raises(NotFoundError):
        catalog.unload("alpha")


def test_without_a_folder_nothing_loads_by_path(engine, tmp_path):
    catalog = AdapterCatalog(engine, None)
    assert catalog.scan() == []
    with pytest.raises(FailedPreconditionError, match="--adapters"):
        catalog.load_path("a", str(adapter_path("torch_r4")))
    with pytest.raises(NotFoundError):
        AdapterCatalog(engine, tmp_path / "missing")


def test_scan_skips_what_it_cannot_register_and_says_why(engine, folder, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    shutil.copy(adapter_path("torch_r4"), outside / "out.tflite")
    (folder / "link.tflite").symlink_to(outside / "out.tflite")
    os.mkfifo(folder / "fifo.tflite")
    (folder / "garbage.gguf").write_bytes(b"GGUF but nothing after")
    (folder / "bad name!.tflite").write_bytes(b"x")
    catalog = AdapterCatalog(engine, folder)
    assert [entry.name for entry in catalog.scan()] == ["alpha", "beta", "gamma"]
    reasons = {skipped.file: skipped.reason for skipped in catalog.skipped}
    assert sorted(reasons) == ["bad name!.tflite", "fifo.tflite", "garbage.gguf", "link.tflite"]
    assert "outside the adapters directory" in reasons["link.tflite"]
    assert "not a regular file" in reasons["fifo.tflite"]
    for entry in catalog.entries():
        catalog.unload(entry.name)
    with pytest.raises(InvalidArgumentError, match="bad name!"):  # the first in order
        AdapterCatalog(engine, folder).scan(strict=True)
    assert engine.adapter_ids() == []


def test_a_request_uses_the_registered_adapter_and_a_changed_file_is_refused(engine, folder):
    catalog = AdapterCatalog(engine, folder)
    entry = catalog.load_path("a", "alpha.tflite")
    lease = catalog.lease(["a"])
    assert lease.adapters([("a", 0.5)]) == {entry.lora_id: 0.5}
    lease.release()
    shutil.copy(adapter_path("litertlm_r4"), folder / "alpha.tflite")  # rewritten after it was loaded
    with pytest.raises(FailedPreconditionError, match="changed .* since it was loaded"):
        catalog.lease(["a"])
    assert engine.adapter_ids() == [entry.lora_id]  # nothing registered behind the catalog's back
    catalog.unload("a")
    again = catalog.load_path("a", "alpha.tflite")
    catalog.lease(["a"]).release()
    assert again.lora_id != entry.lora_id and engine.adapter_ids() == [again.lora_id]
    catalog.unload("a")


def test_one_file_loaded_under_two_names_at_once_is_one_adapter(engine, folder, monkeypatch):
    # Each load waits (up to 0.5 s) inside its registration for the other to get there too:
    # the two would otherwise both be registered, sharing the engine's id of the file.
    catalog = AdapterCatalog(engine, folder)
    meeting = threading.Barrier(2, timeout=0.5)
    registered = engine.adapter

    def adapter(lora_id):
        with contextlib.suppress(threading.BrokenBarrierError):
            meeting.wait()
        return registered(lora_id)

    monkeypatch.setattr(engine, "adapter", adapter)
    outcomes = {}

    def load(name):
        try:
            outcomes[name] = catalog.load_path(name, "alpha.tflite")
        except AlreadyExistsError as exc:
            outcomes[name] = exc

    loads = [threading.Thread(target=load, args=(name,)) for name in ("a", "b")]
    for thread in loads:
        thread.start()
    for thread in loads:
        thread.join()
    refused = [name for name, outcome in outcomes.items() if isinstance(outcome, AlreadyExistsError)]
    assert len(refused) == 1 and "already loaded" in str(outcomes[refused[0]])
    (kept,) = catalog.entries()
    catalog.unload(kept.name)
    assert catalog.entries() == [] and engine.adapter_ids() == []
