"""Tests for runtime.executor.weight_cache: packed weights kept in a file between opens."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from conftest import MODEL_FILES
from runtime import Engine, EngineSettings
from runtime.errors import InvalidArgumentError, NotFoundError, PermissionDeniedError, ResourceExhaustedError
from runtime.executor import weight_cache
from runtime.executor.litert_executor import LlmExecutor
from runtime.executor.model_spec import ModelSpec
from runtime.executor.weight_cache import SUFFIX, WeightCacheDir, WeightCacheFile

PROMPT = [1, 2, 3, 4, 5]


def logits(model, cache_dir=None) -> np.ndarray:
    with Engine(model, EngineSettings(weight_cache_dir=cache_dir)) as engine, engine.create_session() as session:
        session.run_prefill(PROMPT)
        return session.run_decode(6)


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "models" / "model.tflite"
    path.parent.mkdir()
    shutil.copy(MODEL_FILES["default"], path)
    return path


def test_the_first_open_writes_the_file_and_later_opens_read_it(model, tmp_path):
    cache = tmp_path / "cache"
    expected = logits(model)
    assert (logits(model, cache) == expected).all()
    files = sorted(cache.iterdir())
    assert [f.suffix for f in files] == [SUFFIX] and files[0].stat().st_size > 0
    written = files[0].stat().st_mtime_ns
    assert (logits(model, cache) == expected).all()
    assert sorted(cache.iterdir()) == files and files[0].stat().st_mtime_ns == written  # read, not written again


def test_executors_of_one_engine_share_the_file(model, tmp_path):
    cache = tmp_path / "cache"
    with Engine(model, EngineSettings(weight_cache_dir=cache, executors=2)) as engine:
        with engine.create_session() as session:
            session.run_prefill(PROMPT)
    assert len(list(cache.iterdir())) == 1


def test_a_changed_model_gets_a_new_file_and_its_old_file_goes(model, tmp_path):
    cache = tmp_path / "cache"
    other_model = tmp_path / "other" / "model.tflite"  # same name, another path: its own file, kept
    other_model.parent.mkdir()
    shutil.copy(model, other_model)
    logits(other_model, cache)
    expected = logits(model, cache)
    old = set(cache.iterdir())
    stat = model.stat()
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten in place, same bytes
    assert (logits(model, cache) == expected).all()
    new = set(cache.iterdir())
    assert len(old) == len(new) == 2
    assert len(old - new) == 1 and WeightCacheFile.for_model(cache, other_model).path in new


def test_a_model_replaced_by_another_file_gets_a_new_name(model, tmp_path):
    before = WeightCacheFile.for_model(tmp_path, model)
    replacement = model.with_name("new.tflite")
    shutil.copy2(model, replacement)  # same size and time, another inode
    os.replace(replacement, model)
    assert WeightCacheFile.for_model(tmp_path, model) != before
    assert WeightCacheFile.for_model(tmp_path, model, part="section 2") != WeightCacheFile.for_model(tmp_path, model)


def test_a_directory_that_cannot_be_made_is_refused_naming_it(model, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(PermissionDeniedError, match="a-file/cache: cannot write the weight cache"):
        logits(model, blocker / "cache")


def test_a_full_disk_is_refused_before_xnnpack_writes(model, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setattr(weight_cache.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    with pytest.raises(ResourceExhaustedError, match=r"cache: 0 MiB free, the weight cache model\..*needs about"):
        logits(model, cache)
    assert list(cache.iterdir()) == []


def test_an_open_that_fails_leaves_no_file(model, tmp_path, monkeypatch):
    cache = tmp_path / "cache"

    def refuse(details, source):
        raise InvalidArgumentError(f"{source}: refused")

    monkeypatch.setattr(ModelSpec, "from_details", refuse)
    with pytest.raises(InvalidArgumentError, match="refused"):
        LlmExecutor(model, weight_cache=WeightCacheFile.for_model(cache, model))
    assert list(cache.iterdir()) == []


def test_files_left_by_builders_that_died_are_removed(model, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    name = WeightCacheFile.for_model(cache, model).path.name
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = cache / f"{name}.{int(gone.stdout)}.0badf00d.building"
    living = cache / f"{name}.{os.getpid()}.0badf00d.building"
    unrelated = cache / "another-model.12345678.0123456789abcdef.xnnpack"
    for path in (dead, living, unrelated):
        path.write_bytes(b"partial")
    logits(model, cache)
    assert not dead.exists() and living.exists() and unrelated.exists()


def test_by_default_the_file_goes_to_the_user_cache_directory(model, tmp_path, monkeypatch):
    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path / "user"))
    expected = logits(model, None)
    with Engine(model) as engine, engine.create_session() as session:
        session.run_prefill(PROMPT)
        assert (session.run_decode(6) == expected).all()
    assert [f.suffix for f in (tmp_path / "user" / "xnnpack").iterdir()] == [SUFFIX]


def test_by_default_a_directory_that_cannot_be_made_packs_in_memory(model, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("RUNTIME_CACHE", str(blocker))
    assert (logits(model, WeightCacheDir.USER) == logits(model, None)).all()
    assert blocker.read_text() == "not a directory"


def test_by_default_a_full_disk_packs_in_memory_and_leaves_no_file(model, tmp_path, monkeypatch):
    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path / "user"))
    monkeypatch.setattr(weight_cache.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    assert (logits(model, WeightCacheDir.USER) == logits(model, None)).all()
    assert list((tmp_path / "user" / "xnnpack").iterdir()) == []


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or subprocess.run(["stat", "-f", "-c", "%T", "/dev/shm"],
                    capture_output=True, text=True).stdout.strip() != "tmpfs", reason="needs /dev/shm on tmpfs")
def test_by_default_no_file_is_written_in_memory_but_a_named_directory_there_gets_one(model, monkeypatch):
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        monkeypatch.setenv("RUNTIME_CACHE", shm)
        expected = logits(model, WeightCacheDir.USER)
        assert os.listdir(shm) == []
        assert (logits(model, os.path.join(shm, "named")) == expected).all()
        assert [f.endswith(SUFFIX) for f in os.listdir(os.path.join(shm, "named"))] == [True]


def test_a_missing_model_is_named_as_such_by_default_and_without_a_cache(tmp_path):
    for cache_dir in (WeightCacheDir.USER, None):
        with pytest.raises(NotFoundError, match=r"missing\.tflite: no such model file$"):
            Engine(tmp_path / "missing.tflite", EngineSettings(weight_cache_dir=cache_dir))


def test_settings_refuse_what_is_not_a_path():
    with pytest.raises(InvalidArgumentError, match="weight_cache_dir=3, expected a directory path"):
        EngineSettings(weight_cache_dir=3)
