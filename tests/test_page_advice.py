"""Tests for runtime.util.page_advice.read_again_in_huge_pages: a file read again 2 MB at a
time where the page cache holds it in small pages."""

from __future__ import annotations

import mmap
import os
import random
import shutil
import sys
import tempfile

import pytest

from runtime.util import page_advice
from runtime.util.page_advice import HUGE_PAGE, read_again_in_huge_pages

SIZE = 8 * HUGE_PAGE


@pytest.fixture(autouse=True)
def own_markers(tmp_path, monkeypatch):
    """Each test with a cache directory and a memory of its own: a device another test's
    files marked (the whole suite's runtime cache) would leave these files alone."""
    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(page_advice, "_devices_without_huge_pages", set())


def _write(path, size: int = SIZE) -> bytes:
    data = random.Random(7).randbytes(size)
    with open(path, "wb") as file:
        file.write(data)
        os.fsync(file.fileno())
    return data


def _in_small_pages(fd: int, size: int) -> None:
    """The file's cached pages dropped and read back one 4 KB page at a time, out of order."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    offsets = list(range(0, size, mmap.PAGESIZE))
    random.Random(3).shuffle(offsets)
    for offset in offsets:
        os.pread(fd, 1, offset)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_NORMAL)


def _huge_bytes(fd: int) -> int:
    return page_advice._huge_bytes(page_advice._shared_mappings(os.fstat(fd)))


def _file_huge_pages_here(directory) -> bool:
    """Whether this system reads a file in this directory into 2 MB pages and maps them so."""
    if not sys.platform.startswith("linux") or not os.path.exists("/proc/self/smaps"):
        return False
    path = directory / "probe"
    _write(path, 2 * HUGE_PAGE)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        with mmap.mmap(fd, 2 * HUGE_PAGE, mmap.MAP_SHARED, mmap.PROT_READ) as mapping:
            try:
                mapping.madvise(page_advice._MADV_HUGEPAGE)
                mapping.madvise(page_advice._MADV_POPULATE_READ)
            except OSError:
                return False
            return _huge_bytes(fd) > 0
    finally:
        os.close(fd)
        path.unlink()


@pytest.fixture
def small_pages_file(tmp_path):
    if not _file_huge_pages_here(tmp_path):
        pytest.skip("this kernel does not map this file system's pages 2 MB at a time")
    path = tmp_path / "weights.bin"
    data = _write(path)
    fd = os.open(path, os.O_RDONLY)
    _in_small_pages(fd, SIZE)
    yield path, fd, data
    os.close(fd)


def _mapped_huge(fd: int, size: int = SIZE) -> int:
    """The bytes a new shared mapping of the file, filled, maps 2 MB at a time."""
    with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as mapping:
        _ = mapping[:]
        return _huge_bytes(fd)


def test_a_file_in_small_pages_is_read_again_in_huge_ones_with_the_same_bytes(small_pages_file):
    _, fd, data = small_pages_file
    assert _mapped_huge(fd) == 0
    refill = read_again_in_huge_pages(small_pages_file[0])
    assert refill is not None
    assert (refill.file_bytes, refill.huge_before) == (SIZE, 0) and refill.huge_after > 0
    assert _mapped_huge(fd) > 0  # a mapping made afterwards maps them 2 MB at a time
    with open(small_pages_file[0], "rb") as file:
        assert file.read() == data
    assert read_again_in_huge_pages(small_pages_file[0]) is None  # in 2 MB pages now: nothing to do


def test_a_mapping_held_meanwhile_reads_the_same_bytes_and_the_pages_come_back_large(small_pages_file):
    """A shared mapping that exists already (XNNPACK's, after it built the file) keeps its
    address and bytes; its pages are reclaimed, so the page cache holds the file in 2 MB pages."""
    _, fd, data = small_pages_file
    with mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ) as held:
        assert held[:] == data
        refill = read_again_in_huge_pages(small_pages_file[0])
        assert refill is not None and refill.huge_after > 0
        assert held[:] == data
    assert _mapped_huge(fd) > 0


def test_a_private_mapping_keeps_what_was_written_to_it(small_pages_file):
    path, fd, data = small_pages_file
    with open(path, "r+b") as writable:
        private = mmap.mmap(writable.fileno(), SIZE, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        private[:4] = b"mine"
        assert read_again_in_huge_pages(path) is not None
        assert private[:4] == b"mine" and private[4:] == data[4:]
    finally:
        private.close()


def test_a_file_shorter_than_a_huge_page_is_left_alone(tmp_path):
    path = tmp_path / "small.bin"
    _write(path, HUGE_PAGE - 1)
    assert read_again_in_huge_pages(path) is None


def test_a_missing_file_is_left_alone(tmp_path):
    assert read_again_in_huge_pages(tmp_path / "missing.bin") is None


def test_a_device_whose_files_come_back_without_huge_pages_is_not_read_again_until_a_restart(tmp_path, monkeypatch):
    """ext4 before Linux 6.16 (most systems' today) holds no file in 2 MB folios: every open
    read its weight files from the disk anew, for nothing. Judged on a file of 16 MB or more
    while free memory holds 2 MB blocks for all of it: a small file (its mapping not aligned)
    or fragmented memory brings small pages on any file system, for a while."""
    first, second, small = tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "small.bin"
    _write(first), _write(second), _write(small, 4 * HUGE_PAGE)
    brought, free = [0], [1000]
    reads = []

    def read_again(fd, stat):
        reads.append(stat.st_ino)
        return page_advice.HugePageRefill(stat.st_size, 0, brought[0], 0.1)

    monkeypatch.setattr(page_advice, "_read_again", read_again)
    monkeypatch.setattr(page_advice, "_free_huge_blocks", lambda: free[0])
    earlier_boot = tmp_path / "cache" / "page-advice" / "an-earlier-boot.8-1"
    earlier_boot.parent.mkdir(parents=True)
    earlier_boot.touch()
    brought[0] = 2 * HUGE_PAGE  # some came: read again whenever its pages are small
    read_again_in_huge_pages(first), read_again_in_huge_pages(first)
    brought[0] = 0
    read_again_in_huge_pages(small), read_again_in_huge_pages(small)  # too small to tell
    free[0] = 7  # fewer free 2 MB blocks than the file's 8: the memory's sake
    read_again_in_huge_pages(first), read_again_in_huge_pages(first)
    assert len(reads) == 6
    free[0] = 1000
    assert read_again_in_huge_pages(first).huge_after == 0
    assert read_again_in_huge_pages(first) is None and read_again_in_huge_pages(second) is None
    assert len(reads) == 7
    monkeypatch.setattr(page_advice, "_devices_without_huge_pages", set())  # the next process: the marker
    assert read_again_in_huge_pages(second) is None and len(reads) == 7
    assert [marker.name.rpartition(".")[2] for marker in earlier_boot.parent.iterdir()] == [
        f"{os.major(first.stat().st_dev)}-{os.minor(first.stat().st_dev)}"]


def test_a_cache_directory_another_user_can_write_holds_no_marker(tmp_path, monkeypatch):
    """A marker planted there would turn the reading off (or a symbolic link in its place
    would have an empty file made wherever it points): this process remembers alone."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("RUNTIME_CACHE", str(shared))
    path = tmp_path / "a.bin"
    _write(path)
    reads = []
    monkeypatch.setattr(page_advice, "_read_again", lambda fd, stat: reads.append(1) or page_advice.HugePageRefill(
        stat.st_size, 0, 0, 0.1))
    monkeypatch.setattr(page_advice, "_free_huge_blocks", lambda: 1000)
    read_again_in_huge_pages(path)
    assert read_again_in_huge_pages(path) is None and len(reads) == 1  # remembered in this process
    assert not (shared / "page-advice").exists()
    monkeypatch.setattr(page_advice, "_devices_without_huge_pages", set())
    with open("/proc/sys/kernel/random/boot_id") as boot:
        planted = shared / "page-advice" / f"{boot.read().strip()}.{os.major(path.stat().st_dev)}-" \
                                           f"{os.minor(path.stat().st_dev)}"
    planted.parent.mkdir()
    planted.touch()
    read_again_in_huge_pages(path)
    assert len(reads) == 2  # a marker there is not believed


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no tmpfs at /dev/shm")
def test_a_file_on_a_file_system_without_huge_file_pages_is_read_once(tmp_path, monkeypatch):
    """tmpfs without huge= maps no file 2 MB at a time: one read, then none."""
    monkeypatch.setattr(page_advice, "_free_huge_blocks", lambda: 1000)  # not for the memory's sake
    folder = tempfile.mkdtemp(dir="/dev/shm")
    try:
        path = os.path.join(folder, "weights.bin")
        data = _write(path)
        refill = read_again_in_huge_pages(path)
        if refill is None or refill.huge_after:
            pytest.skip("this tmpfs maps files 2 MB at a time")
        assert read_again_in_huge_pages(path) is None
        with open(path, "rb") as file:
            assert file.read() == data
    finally:
        shutil.rmtree(folder)
