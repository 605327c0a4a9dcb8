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
with read-only file THP): :func:`read_again_in_huge_pages` reads such a file again at open,
before its views map it.

XNNPACK's packed weights (an int8 model's whole step) are read from its weight-cache file, and
how the page cache holds that file moves the step as much: SmolLM2-135M int8's took 8.8 ms a
step with the file in 4 KB pages against 6.6 ms with the same bytes in 2 MB ones (two copies of
the file in one process, alternating; AMD EPYC Zen 4, 1 thread). The file is written in one
piece when the model is first opened, and what the writes leave (here 26 of 134 MB in 2 MB
pages) stays until the system drops the pages: :func:`read_again_in_huge_pages` reads it
again before XNNPACK maps it, and after a build (docs/weight-cache.md).

Where the file system holds no file in 2 MB folios (ext4 before Linux 6.16, tmpfs without
``huge=``, ext4 with ``data=journal``...), reading again brings none: the first time that
happens on a device to a file of 16 MB or more while free memory holds 2 MB blocks for all of
it, the device is remembered until the machine restarts (a marker in the runtime's cache
directory), and its files are not read again: each open would otherwise read its files from
the disk anew, for nothing.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import StatusError
from runtime.util.cache_dir import foreign_writer, runtime_cache_dir

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
# Linux's madvise(2) advice; Python's mmap module names only some, and only on some builds.
_MADV_DONTNEED, _MADV_HUGEPAGE, _MADV_PAGEOUT, _MADV_POPULATE_READ = 4, 14, 21, 22
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
    """A file read again in 2 MB pages (:func:`read_again_in_huge_pages`): its bytes, those
    mapped 2 MB at a time before and after, and the seconds the reading took."""

    file_bytes: int
    huge_before: int
    huge_after: int
    seconds: float

    def summary(self) -> str:
        """What was done, in words, for a log line."""
        return (f"{(self.file_bytes - self.huge_before) / 2**20:,.0f} of its {self.file_bytes / 2**20:,.0f} MiB "
                f"were in small pages; read again, {self.huge_after / 2**20:,.0f} MiB now in 2 MB pages "
                f"({self.seconds:.2f} s)")


def read_again_in_huge_pages(path: str | os.PathLike[str]) -> HugePageRefill | None:
    """Reads the file ``path`` again 2 MB at a time where the page cache holds most of
    it in small pages. The file is mapped whole for the while, asked for 2 MB pages and filled
    (pages not in memory come so); where most of it is still mapped in small ones, that
    mapping's pages are dropped, the pages this process's other shared mappings of the file
    hold are reclaimed (``MADV_PAGEOUT``: non-destructive, whatever those addresses hold by
    then), the file's cached pages given back (``POSIX_FADV_DONTNEED``: those no mapping holds)
    and the mapping filled again from disk. No byte changes. Mappings made afterwards map the
    2 MB pages whole; the other mappings fault them back mapped by 4 KB entries (fewer misses
    all the same: int8 6.5 ms a step against 5.9 mapped whole, 9.0 in small pages). Pages
    another process maps stay as they are. Logged (INFO) when done; ``None`` where nothing was
    done: not Linux, a file that cannot be read or is shorter than 2 MB, most of it in 2 MB
    pages already, the system refused (a kernel without transparent huge pages, or before
    5.14), or a file on a device whose files came back without a single 2 MB page since the
    machine started (see the module)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        stat = os.fstat(fd)
        if _without_huge_pages(stat.st_dev):
            return None
        refill = _read_again(fd, stat)
    except OSError:
        return None
    finally:
        os.close(fd)
    if refill is None:
        return None
    if _file_system_without_huge_pages(refill):
        _remember_without_huge_pages(stat.st_dev)
        log.info("%s: %s; none came: its file system is not read again until the machine restarts", path,
                 refill.summary())
    else:
        log.info("%s: %s", path, refill.summary())
    return refill


def _read_again(fd: int, stat: os.stat_result) -> HugePageRefill | None:
    """:func:`read_again_in_huge_pages` of the file open as ``fd`` (``stat``: its status)."""
    libc = _libc()
    size = stat.st_size
    stretches = size // HUGE_PAGE * HUGE_PAGE
    if not stretches:
        return None
    address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        if libc.madvise(address, size, _MADV_HUGEPAGE) or libc.madvise(address, size, _MADV_POPULATE_READ):
            return None
        ours = [(address, address + size)]
        huge_before = _huge_bytes(ours)
        if huge_before >= (1 - _SMALL_PAGES_TOLERATED) * stretches:
            return None
        begun = time.perf_counter()
        libc.madvise(address, size, _MADV_DONTNEED)  # this function's own mapping
        # The others' pages are reclaimed, not dropped: their ranges are read from /proc, and
        # one another thread unmapped meanwhile and whose addresses were mapped again would
        # lose its contents to a drop; reclaimed pages keep theirs (written back or swapped).
        for start, end in _shared_mappings(stat):
            if start != address:
                libc.madvise(start, end - start, _MADV_PAGEOUT)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        libc.madvise(address, size, _MADV_POPULATE_READ)
        huge_after = _huge_bytes(ours)
    except (OSError, AttributeError, ValueError):  # no /proc/self/smaps, no posix_fadvise, or a line not as read
        return None
    finally:
        libc.munmap(address, size)
    return HugePageRefill(size, huge_before, huge_after, time.perf_counter() - begun)


# A file of fewer 2 MB stretches says nothing of its file system when none comes back in 2 MB
# pages (a mapping not aligned to 2 MB, the pages of a file just written not yet given back).
_STRETCHES_TO_JUDGE = 8


def _file_system_without_huge_pages(refill: HugePageRefill) -> bool:
    """Whether a file read again came back without a single 2 MB page for its file system's
    sake, not the memory's: a file of at least ``_STRETCHES_TO_JUDGE`` stretches, and memory
    free in 2 MB blocks for all of it (``/proc/buddyinfo``; fragmented memory also brings
    small pages, for a while)."""
    stretches = refill.file_bytes // HUGE_PAGE
    return refill.huge_after == 0 and stretches >= _STRETCHES_TO_JUDGE and _free_huge_blocks() >= stretches


def _free_huge_blocks() -> int:
    """How many 2 MB blocks the kernel's free memory holds (``/proc/buddyinfo``: per zone, the
    free blocks of each order, 4 KB pages times 2 to the order); 0 where it cannot be read."""
    order = (HUGE_PAGE // mmap.PAGESIZE).bit_length() - 1  # 9 with 4 KB pages
    total = 0
    try:
        with open("/proc/buddyinfo") as buddy:
            for line in buddy:  # Node 0, zone Normal c0 c1 ... c10
                counts = line.split()[4:]
                total += sum(int(count) << (k - order) for k, count in enumerate(counts) if k >= order)
    except (OSError, ValueError):
        return 0
    return total


# Devices whose files came back without a 2 MB page (this process's memory of the markers).
_devices_without_huge_pages: set[int] = set()
_MARKERS = "page-advice"  # the cache directory's folder of markers: "{boot id}.{major}-{minor}"


def _without_huge_pages(device: int) -> bool:
    """Whether files on ``device`` were read again since the machine started and came back
    without a single 2 MB page (in this process, or as a marker says)."""
    if device in _devices_without_huge_pages:
        return True
    marker = _marker(device)
    if marker is not None and marker.exists():
        _devices_without_huge_pages.add(device)
        return True
    return False


def _remember_without_huge_pages(device: int) -> None:
    """Remembers ``device`` as :func:`_without_huge_pages` until the machine restarts: in this
    process, and as a marker for the next ones (markers of earlier boots removed); a cache
    directory that cannot be written leaves this process's memory alone."""
    _devices_without_huge_pages.add(device)
    marker = _marker(device)
    if marker is None:
        return
    try:
        marker.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        for old in marker.parent.iterdir():
            if not old.name.startswith(marker.name.partition(".")[0] + "."):
                old.unlink(missing_ok=True)
        marker.touch()
    except OSError:
        pass


def _marker(device: int) -> Path | None:
    """The marker of ``device`` for this boot; ``None`` without a boot id or a cache directory,
    or where another user could write there (a marker planted or a symbolic link put in its
    place: :func:`runtime.util.cache_dir.foreign_writer`)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
        folder = runtime_cache_dir() / _MARKERS
    except (OSError, StatusError):
        return None
    if foreign_writer(folder.parent) or foreign_writer(folder):
        return None
    return folder / f"{boot_id}.{os.major(device)}-{os.minor(device)}"


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


def _libc() -> ctypes.CDLL:
    """libc with ``mmap``, ``munmap`` and ``madvise`` declared (for mappings at addresses this
    module knows: Python's mmap objects do not give theirs)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mmap.restype = ctypes.c_void_p
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc
