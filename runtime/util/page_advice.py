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
with read-only file THP).
"""

from __future__ import annotations

import mmap


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
