"""Tests for runtime.util.page_advice.refill_in_huge_pages: a file this process maps, read
again 2 MB at a time where the page cache holds it in small pages."""

from __future__ import annotations

import hashlib
import mmap
import os
import random
import sys

import pytest

from runtime.util import page_advice
from runtime.util.page_advice import HUGE_PAGE, refill_in_huge_pages

SIZE = 8 * HUGE_PAGE


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


def test_a_mapped_file_in_small_pages_is_read_again_in_huge_ones_with_the_same_bytes(small_pages_file):
    path, fd, data = small_pages_file
    with mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ) as mapping:
        assert hashlib.sha256(mapping).digest() == hashlib.sha256(data).digest()  # every page mapped, small
        assert _huge_bytes(fd) == 0
        refill = refill_in_huge_pages(fd)
        assert refill is not None
        assert (refill.mapped_bytes, refill.huge_before) == (SIZE, 0)
        assert refill.huge_after > 0
        assert _huge_bytes(fd) == refill.huge_after
        assert mapping[:] == data
        assert refill_in_huge_pages(fd) is None  # in huge pages now: nothing to do


def test_nothing_is_done_for_a_file_this_process_does_not_map(small_pages_file):
    _, fd, _ = small_pages_file
    assert refill_in_huge_pages(fd) is None


def test_a_private_mapping_keeps_what_was_written_to_it(small_pages_file):
    """Private mappings are left alone (dropping their entries would lose the pages written);
    the shared ones are read again."""
    path, fd, data = small_pages_file
    with open(path, "r+b") as writable:
        private = mmap.mmap(writable.fileno(), SIZE, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    shared = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ)
    try:
        private[:4] = b"mine"
        _ = shared[:]  # every page mapped
        refill = refill_in_huge_pages(fd)
        assert refill is not None and refill.mapped_bytes == SIZE  # the shared mapping only
        assert private[:4] == b"mine" and private[4:] == data[4:]
        assert shared[:] == data
    finally:
        private.close()
        shared.close()
