"""Tests for runtime.executor.weight_cache: packed weights kept in a file between opens."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

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


def published(cache) -> list:
    """The packed-weight files in ``cache`` (beside them: each one's .source, and the directory's .lock)."""
    return sorted(cache.glob("*" + SUFFIX))


def written(cache) -> list[str]:
    """Every name in ``cache`` but the directory's lock file."""
    return sorted(name for name in os.listdir(cache) if name != ".lock")


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
    files = published(cache)
    assert len(files) == 1 and files[0].stat().st_size > 0
    assert written(cache) == [files[0].name, files[0].name + ".source"]
    mtime = files[0].stat().st_mtime_ns
    assert (logits(model, cache) == expected).all()
    assert published(cache) == files and files[0].stat().st_mtime_ns == mtime  # read, not written again


def test_a_published_file_cut_short_is_replaced_not_written_in_place(model, tmp_path):
    """A published file shorter than it was written (a copy or restore of the directory cut
    short) is not given to XNNPACK, which rewrote it in place under every process mapping it
    (and aborts the process where that write fails: a read-only or full directory): it goes,
    and a new whole file is published under its name."""
    cache = tmp_path / "cache"
    expected = logits(model, cache)
    (file,) = published(cache)
    whole, inode = file.stat().st_size, file.stat().st_ino
    os.truncate(file, whole // 2)
    with open(file, "rb") as cut_short:  # its inode stays while held, so a new file gets another
        assert (logits(model, cache) == expected).all()
        assert os.fstat(cut_short.fileno()).st_size == whole // 2  # not written again
    assert published(cache) == [file] and file.stat().st_size == whole and file.stat().st_ino != inode


def test_a_directory_every_user_can_write_is_not_used(model, tmp_path, monkeypatch):
    """XNNPACK trusts the packed weights it reads: a directory another user could write into
    (a cache under /tmp) is refused when named, and packs in memory by default."""
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    with pytest.raises(PermissionDeniedError, match=rf"{cache} is writable by every user \(mode 777\): the weight "):
        logits(model, cache)
    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path))
    (tmp_path / "xnnpack").mkdir(mode=0o777)
    (tmp_path / "xnnpack").chmod(0o777)
    assert (logits(model, WeightCacheDir.USER) == logits(model, None)).all()
    assert os.listdir(cache) == os.listdir(tmp_path / "xnnpack") == []


def test_a_directory_made_under_umask_0_is_still_used(model, tmp_path):
    old = os.umask(0)
    try:
        expected = logits(model, tmp_path / "cache")
    finally:
        os.umask(old)
    (file,) = published(tmp_path / "cache")
    inode = file.stat().st_ino
    assert (logits(model, tmp_path / "cache") == expected).all()
    assert published(tmp_path / "cache") == [file] and file.stat().st_ino == inode  # read, not built again


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a file to another user: root only")
def test_a_published_file_another_user_owns_is_replaced_not_read(model, tmp_path):
    cache = tmp_path / "cache"
    expected = logits(model, cache)
    (file,) = published(cache)
    os.chown(file, 4242, 4242)
    assert (logits(model, cache) == expected).all()
    assert published(cache) == [file] and file.stat().st_uid == os.geteuid()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="no /proc/self/maps here")
def test_every_open_asks_for_the_file_in_huge_pages(model, tmp_path, monkeypatch):
    """The open that writes the file asks once XNNPACK has written it; a later open, before
    XNNPACK maps it (tests/test_page_advice.py: what asking does); a model packed in memory
    has no file to ask for."""
    asked = []

    def read_again(path):
        stat = os.stat(path)
        with open("/proc/self/maps") as maps:  # (start-end perms offset device inode path)
            mapped = any(int(line.split()[4]) == stat.st_ino for line in maps)
        asked.append((stat.st_ino, mapped))

    monkeypatch.setattr(weight_cache, "read_again_in_huge_pages", read_again)
    cache = tmp_path / "cache"
    logits(model, cache)
    logits(model, cache)
    inode = published(cache)[0].stat().st_ino
    assert asked == [(inode, True), (inode, False)]
    logits(model)
    assert len(asked) == 2


def test_executors_of_one_engine_share_the_file(model, tmp_path):
    cache = tmp_path / "cache"
    with Engine(model, EngineSettings(weight_cache_dir=cache, executors=2)) as engine:
        with engine.create_session() as session:
            session.run_prefill(PROMPT)
    assert len(published(cache)) == 1


def test_a_changed_model_gets_a_new_file_and_its_old_file_goes(model, tmp_path):
    cache = tmp_path / "cache"
    other_model = tmp_path / "other" / "model.tflite"  # same name, another path: its own file, kept
    other_model.parent.mkdir()
    shutil.copy(model, other_model)
    logits(other_model, cache)
    expected = logits(model, cache)
    old = set(published(cache))
    stat = model.stat()
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten in place, same bytes
    assert (logits(model, cache) == expected).all()
    new = set(published(cache))
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


def test_a_file_given_as_the_directory_is_refused_saying_so(model, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(InvalidArgumentError, match="a-file: is a file, not a directory: expected a directory"):
        logits(model, blocker)
    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path))
    (tmp_path / "xnnpack").write_text("not a directory")  # the user's: packed in memory instead
    assert (logits(model, WeightCacheDir.USER) == logits(model, None)).all()
    assert blocker.read_text() == (tmp_path / "xnnpack").read_text() == "not a directory"


def test_a_full_disk_is_refused_before_xnnpack_writes(model, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setattr(weight_cache.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    with pytest.raises(ResourceExhaustedError, match=r"cache: 0 MiB free, the weight cache model\..*needs about"):
        logits(model, cache)
    assert written(cache) == []


def test_an_open_that_fails_leaves_no_file(model, tmp_path, monkeypatch):
    cache = tmp_path / "cache"

    def refuse(details, source, kv_layout=None):
        raise InvalidArgumentError(f"{source}: refused")

    monkeypatch.setattr(ModelSpec, "from_details", refuse)
    with pytest.raises(InvalidArgumentError, match="refused"):
        LlmExecutor(model, weight_cache=WeightCacheFile.for_model(cache, model))
    assert written(cache) == []


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
    with open(living, "rb") as held:  # a build going on holds its file
        fcntl.flock(held.fileno(), fcntl.LOCK_SH)
        logits(model, cache)
    assert not dead.exists() and living.exists() and unrelated.exists()


def test_files_left_by_killed_builds_go_though_their_pid_runs_again(model, tmp_path):
    """A build killed midway leaves its file unheld; its pid may name a process that runs now
    (reused, e.g. after a reboot): the file goes all the same, and with it its size beyond
    the cap, which counts published files only. (It stayed as long as that pid ran.)"""
    cache = tmp_path / "cache"
    cache.mkdir()
    name = WeightCacheFile.for_model(cache, model).path.name
    left = [cache / f"{name}.1.0badf00d.building", cache / f"another-model.12345678.0123456789abcdef.xnnpack.1.0badf00d"
            ".building", cache / f"another-model.12345678.0123456789abcdef.xnnpack.source.1.0badf00d.building"]
    for path in left:
        path.write_bytes(b"partial")
    logits(model, cache)
    assert not any(path.exists() for path in left)
    assert written(cache) == [name, name + ".source"]


def test_a_file_being_written_under_a_pid_not_seen_here_stays_while_its_builder_holds_it(model, tmp_path):
    """A builder in another pid namespace (a container sharing the directory) looks dead by
    its pid; the shared lock it holds while XNNPACK writes keeps its file."""
    cache = tmp_path / "cache"
    cache.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    other = cache / f"other-model.12345678.0123456789abcdef.xnnpack.{int(gone.stdout)}.0badf00d.building"
    other.write_bytes(b"partial")
    with open(other, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_SH)
        logits(model, cache)
        assert other.exists()
    logits(model, cache)
    assert not other.exists()


def test_by_default_the_file_goes_to_the_user_cache_directory(model, tmp_path, monkeypatch):
    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path / "user"))
    expected = logits(model, None)
    with Engine(model) as engine, engine.create_session() as session:
        session.run_prefill(PROMPT)
        assert (session.run_decode(6) == expected).all()
    assert len(published(tmp_path / "user" / "xnnpack")) == 1


def test_by_default_a_directory_that_cannot_be_made_packs_in_memory(model, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("RUNTIME_CACHE", str(blocker))
    assert (logits(model, WeightCacheDir.USER) == logits(model, None)).all()
    assert blocker.read_text() == "not a directory"


def test_by_default_a_user_without_a_home_directory_packs_in_memory(model, request):
    """No $RUNTIME_CACHE, $XDG_CACHE_HOME nor home directory (a container's arbitrary uid):
    the model opens with its weights packed in memory (the open raised RuntimeError)."""
    expected = logits(model, None)
    request.getfixturevalue("without_home")
    assert (logits(model, WeightCacheDir.USER) == expected).all()


def test_by_default_a_full_disk_packs_in_memory_and_leaves_no_file(model, tmp_path, monkeypatch):
    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path / "user"))
    monkeypatch.setattr(weight_cache.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    assert (logits(model, WeightCacheDir.USER) == logits(model, None)).all()
    assert written(tmp_path / "user" / "xnnpack") == []


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or subprocess.run(["stat", "-f", "-c", "%T", "/dev/shm"],
                    capture_output=True, text=True).stdout.strip() != "tmpfs", reason="needs /dev/shm on tmpfs")
def test_by_default_no_file_is_written_in_memory_but_a_named_directory_there_gets_one(model, monkeypatch):
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        monkeypatch.setenv("RUNTIME_CACHE", shm)
        expected = logits(model, WeightCacheDir.USER)
        assert os.listdir(shm) == []
        assert (logits(model, os.path.join(shm, "named")) == expected).all()
        assert len(published(Path(shm) / "named")) == 1


def test_a_missing_model_is_named_as_such_by_default_and_without_a_cache(tmp_path):
    for cache_dir in (WeightCacheDir.USER, None):
        with pytest.raises(NotFoundError, match=r"missing\.tflite: no such model file$"):
            Engine(tmp_path / "missing.tflite", EngineSettings(weight_cache_dir=cache_dir))


def test_settings_refuse_what_is_not_a_path():
    with pytest.raises(InvalidArgumentError, match="weight_cache_dir=3, expected a directory path"):
        EngineSettings(weight_cache_dir=3)


# -- the cap, files of gone models, files in use ----------------------------------------------

HOLDER = """
import sys
import numpy as np
from runtime import Engine, EngineSettings
engine = Engine(sys.argv[1], EngineSettings(weight_cache_dir=sys.argv[2], weight_cache_max_bytes=int(sys.argv[3])))
print("open", flush=True)
sys.stdin.readline()  # the test removes what it may meanwhile
with engine.create_session() as session:
    session.run_prefill([1, 2, 3, 4, 5])
    print(session.run_decode(6).tobytes().hex(), flush=True)
engine.close()
"""


def copies(tmp_path, count: int) -> list:
    """The test model at ``count`` paths of its own (each gets a file of its own)."""
    paths = []
    for index in range(count):
        path = tmp_path / f"model-{index}" / "model.tflite"
        path.parent.mkdir()
        shutil.copy(MODEL_FILES["default"], path)
        paths.append(path)
    return paths


def open_once(model, cache, max_bytes) -> None:
    with Engine(model, EngineSettings(weight_cache_dir=cache, weight_cache_max_bytes=max_bytes)):
        pass


def file_of(model, cache):
    return WeightCacheFile.for_model(cache, model).path


def packed_bytes(tmp_path) -> int:
    """The size of the test model's packed-weight file (larger than the model: 3.3 MB for 2.2 MB)."""
    probe = tmp_path / "probe"
    probe.mkdir()
    model, = copies(probe, 1)
    logits(model, probe / "cache")
    return published(probe / "cache")[0].stat().st_size


def test_past_the_cap_the_least_recently_used_file_goes(tmp_path):
    a, b, c = copies(tmp_path, 3)
    cache = tmp_path / "cache"
    cap = int(2.5 * packed_bytes(tmp_path))  # two files fit (of the test model: 0.4 MB, a sixth of the model)
    open_once(a, cache, cap)
    open_once(b, cache, cap)
    open_once(a, cache, cap)  # a used again: b is now the least recently used, though written later
    assert published(cache) == sorted([file_of(a, cache), file_of(b, cache)])
    open_once(c, cache, cap)
    assert published(cache) == sorted([file_of(a, cache), file_of(c, cache)])
    assert not file_of(b, cache).with_name(file_of(b, cache).name + ".source").exists()
    assert sum(f.stat().st_size for f in published(cache)) <= cap


def test_a_file_in_use_by_another_process_is_never_removed(tmp_path):
    a, b = copies(tmp_path, 2)
    cache = tmp_path / "cache"
    expected = logits(a)
    cap = int(1.5 * packed_bytes(tmp_path))  # one file fits
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(a), str(cache), str(cap)], cwd=os.getcwd(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "open\n"
        open_once(b, cache, cap)  # over the cap, but a's file is open in the holder
        assert published(cache) == sorted([file_of(a, cache), file_of(b, cache)])
        holder.stdin.write("\n")
        holder.stdin.flush()
        decoded = np.frombuffer(bytes.fromhex(holder.stdout.readline()), dtype=expected.dtype)
        assert (decoded == expected.ravel()).all()
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0
    open_once(b, cache, cap)  # a's file is free now: b's, just used, stays
    assert published(cache) == [file_of(b, cache)]


def test_files_of_models_that_are_gone_are_dropped_once_unused(tmp_path):
    a, b, c = copies(tmp_path, 3)
    cache = tmp_path / "cache"
    logits(a, cache)
    logits(b, cache)
    a_file, b_file = file_of(a, cache), file_of(b, cache)
    with Engine(b, EngineSettings(weight_cache_dir=cache)) as held:
        os.unlink(a)
        os.unlink(b)  # b's model goes while b's engine maps its file
        open_once(c, cache, None)  # even with no cap
        assert published(cache) == sorted([b_file, file_of(c, cache)])
        assert not a_file.with_name(a_file.name + ".source").exists()
        held_entry, = [e for e in held.stats().weight_cache.entries if e.name == b_file.name]
        assert held_entry.in_use and held_entry.model_gone and held_entry.model == os.path.realpath(b)
    open_once(c, cache, None)
    assert published(cache) == [file_of(c, cache)]
    assert written(cache) == [file_of(c, cache).name, file_of(c, cache).name + ".source"]


def test_processes_building_one_file_at_once_publish_one_whole_file(model, tmp_path):
    cache, go = tmp_path / "cache", tmp_path / "go"
    racer = ("import os, sys, time\nfrom runtime import Engine, EngineSettings\n"
             "while not os.path.exists(sys.argv[2]): time.sleep(0.001)\n"
             "with Engine(sys.argv[1], EngineSettings(weight_cache_dir=sys.argv[3])) as engine, "
             "engine.create_session() as session:\n"
             "    session.run_prefill([1, 2, 3, 4, 5]); print(session.run_decode(6).tobytes().hex())\n")
    racers = [subprocess.Popen([sys.executable, "-c", racer, str(model), str(go), str(cache)], cwd=os.getcwd(),
                               stdout=subprocess.PIPE, text=True) for _ in range(2)]
    go.touch()
    outputs = [r.communicate(timeout=120)[0] for r in racers]
    assert [r.returncode for r in racers] == [0, 0]
    expected = logits(model, cache)  # from the published file
    for output in outputs:
        assert (np.frombuffer(bytes.fromhex(output), dtype=expected.dtype) == expected.ravel()).all()
    name = file_of(model, cache).name
    assert written(cache) == [name, name + ".source"]


def test_a_disk_without_room_takes_the_least_recently_used_unused_files_first(tmp_path, monkeypatch):
    a, b, c = copies(tmp_path, 3)
    cache = tmp_path / "cache"
    logits(a, cache)
    logits(b, cache)
    packed = published(cache)[0].stat().st_size
    needed = int(a.stat().st_size * 1.25)  # what a build asks the disk for
    disk = {"room": needed + 3 * packed // 2}  # with two files, room for a build only once one is gone

    def disk_usage(path):
        return shutil._ntuple_diskusage(10**9, 10**9, disk["room"] - sum(f.stat().st_size for f in published(cache)))

    monkeypatch.setattr(weight_cache.shutil, "disk_usage", disk_usage)
    open_once(a, cache, None)  # found: no room needed; a is now the most recently used
    open_once(c, cache, None)
    assert published(cache) == sorted([file_of(a, cache), file_of(c, cache)])  # b made room
    disk["room"] = needed + packed // 2  # now both would have to go
    with Engine(c, EngineSettings(weight_cache_dir=cache)):
        with pytest.raises(ResourceExhaustedError, match="MiB free, the weight cache model.* needs about"):
            open_once(b, cache, None)  # c is in use: removing a alone would not make the room
    assert published(cache) == sorted([file_of(a, cache), file_of(c, cache)])  # so a was not removed for nothing


def test_a_file_larger_than_the_cap_serves_its_model_until_another_model_opens(tmp_path):
    a, b = copies(tmp_path, 2)
    cache = tmp_path / "cache"
    expected = logits(a)
    for _ in range(2):  # written, then read: it stays while its model is the only one used
        with Engine(a, EngineSettings(weight_cache_dir=cache, weight_cache_max_bytes=1)) as engine, \
                engine.create_session() as session:
            session.run_prefill(PROMPT)
            assert (session.run_decode(6) == expected).all()
            assert engine.stats().weight_cache.file == str(file_of(a, cache))
        assert published(cache) == [file_of(a, cache)]
    open_once(b, cache, 1)
    assert published(cache) == [file_of(b, cache)]


def test_stats_say_what_the_cache_holds(model, tmp_path):
    cache = tmp_path / "cache"
    other, = copies(tmp_path, 1)
    logits(other, cache)
    with Engine(model, EngineSettings(weight_cache_dir=cache, weight_cache_max_bytes=3 * 2**30)) as engine:
        stats = engine.stats().weight_cache
    assert stats.directory == str(cache) and stats.max_bytes == 3 * 2**30
    assert stats.file == str(file_of(model, cache))
    assert [e.name for e in stats.entries] == [file_of(other, cache).name, file_of(model, cache).name]  # LRU first
    assert [e.model for e in stats.entries] == [os.path.realpath(other), os.path.realpath(model)]
    assert [e.in_use for e in stats.entries] == [False, True] and not any(e.model_gone for e in stats.entries)
    assert stats.nbytes == sum(f.stat().st_size for f in published(cache)) > 0
    with Engine(model, EngineSettings(weight_cache_dir=None)) as engine:
        assert engine.stats().weight_cache is None


def test_inspect_lists_the_cache(model, tmp_path):
    cache = tmp_path / "cache"
    logits(model, cache)
    done = subprocess.run([sys.executable, "-m", "runtime", "inspect", "--weight-cache", str(cache)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RUNTIME_WEIGHT_CACHE_MAX_SIZE": "2G"})
    assert done.returncode == 0, done.stderr
    head, line = done.stdout.strip().splitlines()
    assert head == f"weight cache {cache}: 1 file(s), 0 MiB (cap 2,048 MiB)"
    assert line.split()[0] == file_of(model, cache).name and line.endswith(os.path.realpath(model))


@pytest.mark.parametrize("name, error", [
    ("a-file", "INVALID_ARGUMENT: --weight-cache {path}: is a file, not a directory: expected a weight cache directory"),
    ("missing", "NOT_FOUND: --weight-cache {path}: no such directory"),
])
def test_inspect_refuses_a_cache_directory_that_is_a_file_or_missing(tmp_path, name, error):
    path = tmp_path / name
    if name == "a-file":
        path.write_text("not a directory")
    done = subprocess.run([sys.executable, "-m", "runtime", "inspect", "--weight-cache", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"error: {error.format(path=path)}\n"


def test_the_cap_comes_from_the_setting_the_flag_or_the_environment(monkeypatch):
    from runtime.cli.main import build_parser
    from runtime.cli.options import weight_cache_settings

    monkeypatch.delenv("RUNTIME_WEIGHT_CACHE_MAX_SIZE", raising=False)
    assert EngineSettings().weight_cache_max_bytes == weight_cache.DEFAULT_MAX_BYTES == 5 * 2**30
    for text, expected in (("1G", 2**30), ("500M", 500 * 2**20), ("1.5GiB", 3 * 2**29), ("4096", 4096),
                           ("2 kb", 2048), ("unlimited", None), ("None", None)):
        monkeypatch.setenv("RUNTIME_WEIGHT_CACHE_MAX_SIZE", text)
        assert EngineSettings().weight_cache_max_bytes == expected, text
    monkeypatch.setenv("RUNTIME_WEIGHT_CACHE_MAX_SIZE", "lots")
    with pytest.raises(InvalidArgumentError, match=r"\$RUNTIME_WEIGHT_CACHE_MAX_SIZE='lots': expected a size"):
        EngineSettings()
    assert EngineSettings(weight_cache_max_bytes=7).weight_cache_max_bytes == 7  # the setting wins
    with pytest.raises(InvalidArgumentError, match="weight_cache_max_bytes=0, expected bytes >= 1 or None"):
        EngineSettings(weight_cache_max_bytes=0)
    for command in (["generate", "--prompt-ids", "1"], ["serve"]):
        args = build_parser().parse_args([*command, "--model", "m.tflite", "--weight-cache-max-size", "200M"])
        assert weight_cache_settings(args) == {"weight_cache_dir": WeightCacheDir.USER,
                                               "weight_cache_max_bytes": 200 * 2**20}
        assert "weight_cache_max_bytes" not in weight_cache_settings(build_parser().parse_args(
            [*command, "--model", "m.tflite"]))  # the environment's, through EngineSettings
    done = subprocess.run([sys.executable, "-m", "runtime", "generate", "--model", "m.tflite", "--prompt-ids", "1",
                           "--weight-cache-max-size", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--weight-cache-max-size='0': expected a size such as 500M" in done.stderr
