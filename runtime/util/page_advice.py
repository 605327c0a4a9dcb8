"""Advice to the kernel about a mapping's pages (``madvise``), taken where the system knows it
and skipped where it does not.

The float32 linear layers' op reads a model's weights from its file's mapping on every decode
step (XNNPACK reads its packed copy from a file of its own). Linux 6.18 on ext4 can hold a
file's pages in 2 MB folios and map them 2 MB at a time, and with ``MADV_HUGEPAGE`` on the
mapping it reads the pages not yet in memory so: SmolLM2-135M f32's file, read fresh through the
engine, came back with 494 MB of 515 in 2 MB pages, 78 MB without the advice (the first reads
land scattered). The float32 step took 33.9 ms from a file the page cache held in 4 KB pages
against 28.6 ms from the same file read again in 2 MB ones (AMD EPYC Zen 4, 1 thread,
docs/kernels.md). Pages already in memory stay as they are (``MADV_COLLAPSE`` needs a kernel
with read-only file THP): :func:`read_again_in_huge_pages` reads such a file again at open.

XNNPACK's packed weights (an int8 model's whole step) are read from its weight-cache file, and
how the page cache holds that file moves the step as much: SmolLM2-135M int8's took 8.8 ms a
step with the file in 4 KB pages against 6.6 ms with the same bytes in 2 MB ones (two copies of
the file in one process, alternating; AMD EPYC Zen 4, 1 thread). The file is written in one
piece when the model is first opened, and what the writes leave (here 26 of 134 MB in 2 MB
pages) stays until the system drops the pages: :func:`refill_in_huge_pages` reads it again
once XNNPACK maps it (docs/weight-cache.md).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import sys
import time
from dataclasses import dataclass

HUGE_PAGE = 2 << 20
# Linux's madvise(2) advice; Python's mmap module names only some, and only on some builds.
_MADV_DONTNEED, _MADV_HUGEPAGE, _MADV_POPULATE_READ = 4, 14, 22
# The line of /proc/self/smaps that begins a mapping's entry: start-end perms offset device inode [path]
_SMAPS_HEADER = re.compile(rb"^([0-9a-f]+)-[0-9a-f]+ ")
# The share of a file's mapped 2 MB stretches that may be in small pages before it is read again.
_SMALL_PAGES_TOLERATED = 0.1


def advise(mapping: mmap.mmap, advice: int | None, start: int = 0, length: int | None = None) -> bool:
    """Advises ``mapping`` (or ``length`` bytes of it from ``start``); whether the system took
    the advice (``None``: one this platform does not name; a kernel without transparent huge
    pages refuses theirs, and small pages serve)."""
    if advice is None:
        return False
    try:
        if length is None:
            mapping.madvise(advice)
        else:
            mapping.madvise(advice, start, length)
    except OSError:
        return False
    return True


def advise_huge_pages(mapping: mmap.mmap) -> bool:
    """Asks for ``mapping``'s pages not yet in memory to be read and mapped 2 MB at a time (see
    the module); whether the system took the advice."""
    return advise(mapping, getattr(mmap, "MADV_HUGEPAGE", None))


@dataclass(frozen=True)
class HugePageRefill:
    """A file this process maps, read again in 2 MB pages (:func:`refill_in_huge_pages`):
    the bytes of its shared mappings, those mapped 2 MB at a time before and after, and the
    seconds it took (the file read from disk once more)."""

    mapped_bytes: int
    huge_before: int
    huge_after: int
    seconds: float


def refill_in_huge_pages(fd: int) -> HugePageRefill | None:
    """Where this process maps the file open as ``fd`` shared (as XNNPACK maps its weight
    cache): its mappings asked for 2 MB pages and filled (the pages not in memory read so);
    then, where the page cache holds most of the file in small pages, read again 2 MB at a
    time: the mappings' page-table entries dropped, the file's cached pages given back
    (``POSIX_FADV_DONTNEED``: those no other process maps) and the mappings filled again
    from disk. Nothing else changes: the mappings keep their addresses and read the same
    bytes (a shared mapping's pages are the file's; private mappings, whose written pages
    dropping would lose, are left as they are). What was read again, or ``None``: not Linux,
    no shared mapping of the file, most of it in 2 MB pages already, or the system refused (a
    kernel without transparent huge pages, or before 5.14)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        stat = os.fstat(fd)
        mappings = _shared_mappings(stat)
        madvise = _libc_madvise()
        for start, end in mappings:  # (what a mapping has not touched yet is not counted below)
            if madvise(start, end - start, _MADV_HUGEPAGE) != 0 or madvise(start, end - start, _MADV_POPULATE_READ):
                return None
        huge_before = _huge_bytes(mappings)
        stretches = sum((end - start) // HUGE_PAGE * HUGE_PAGE for start, end in mappings)
        if not stretches or huge_before >= (1 - _SMALL_PAGES_TOLERATED) * stretches:
            return None
        begun = time.perf_counter()
        for start, end in mappings:
            madvise(start, end - start, _MADV_DONTNEED)  # their pages stay the file's, cached or on disk
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        for start, end in mappings:
            madvise(start, end - start, _MADV_POPULATE_READ)
        huge_after = _huge_bytes(mappings)
    except (OSError, AttributeError, ValueError):  # no /proc/self/smaps, no posix_fadvise, or a line not as read
        return None
    return HugePageRefill(sum(end - start for start, end in mappings), huge_before, huge_after,
                          time.perf_counter() - begun)


def read_again_in_huge_pages(path: str | os.PathLike[str]) -> HugePageRefill | None:
    """:func:`refill_in_huge_pages` for a file this process does not map yet (a model whose
    steps read its weights from its own mapping, before that mapping is made): the file mapped
    whole, shared and read-only, for the while, every page brought in 2 MB at a time where
    it was not in memory, and read again where the page cache held most of it in small pages.
    Mappings made afterwards map the 2 MB pages. ``None`` as there, or where the file cannot
    be mapped."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ):
            return refill_in_huge_pages(file.fileno())
    except (OSError, ValueError):  # unreadable or empty
        return None


def _shared_mappings(stat: os.stat_result) -> list[tuple[int, int]]:
    """This process's shared mappings of the file ``stat`` describes (start, end), from
    ``/proc/self/maps``."""
    mappings = []
    device = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}"
    with open("/proc/self/maps") as maps:  # start-end perms offset major:minor inode [path]
        for line in maps:
            fields = line.split(maxsplit=5)
            if fields[4] == str(stat.st_ino) and fields[3] == device and fields[1][3] == "s":
                start, end = fields[0].split("-")
                mappings.append((int(start, 16), int(end, 16)))
    return mappings


def _huge_bytes(mappings: list[tuple[int, int]]) -> int:
    """The bytes of these mappings mapped 2 MB at a time (``FilePmdMapped`` in ``/proc/self/smaps``)."""
    starts, huge, current = {start for start, _ in mappings}, 0, False
    with open("/proc/self/smaps", "rb") as smaps:
        for line in smaps:
            header = _SMAPS_HEADER.match(line)
            if header:
                current = int(header.group(1), 16) in starts
            elif current and line.startswith(b"FilePmdMapped:"):
                huge += int(line.split()[1]) * 1024
    return huge


def _libc_madvise():
    """libc's ``madvise(addr, length, advice)``, for mappings this module did not make."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
