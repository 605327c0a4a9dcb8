"""The pages a KV cache's buffers take: small while the context fills little of them,
huge once it fills half (runtime.executor.litert_executor.KvCache, native.PageBlock)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.executor.litert_executor import KvCache
from runtime.executor.native import PageBlock, TensorInfo

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")

LENGTH = 8192  # positions; a V cache as exports lay it out: [1, heads, head_dim, positions]
SHAPE = (1, 3, 64, LENGTH)


def _mapping_kb(address: int) -> dict[str, int]:
    """The ``Rss`` and ``AnonHugePages`` (kB) of the mapping holding ``address``."""
    fields: dict[str, int] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            begin, end = (int(part, 16) for part in head.split("-"))
            inside = begin <= address < end
        elif inside and head in ("Rss:", "AnonHugePages:"):
            fields[head[:-1]] = int(line.split()[1])
    return fields


def _huge_pages_offered() -> bool:
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return setting.exists() and "[never]" not in setting.read_text()


@pytest.fixture
def cache() -> tuple[KvCache, np.ndarray]:
    block = PageBlock([TensorInfo("kv_cache_v_0", SHAPE, np.dtype(np.float32), b"")])
    array = block.buffers["kv_cache_v_0"].array
    return KvCache({LENGTH: block}, {"kv_cache_v_0": 3}, array.nbytes), array


def test_a_short_context_in_a_long_cache_takes_the_pages_it_writes(cache):
    """36 positions of 8,192, written in every row of the cache: one small page per row
    (192 rows, 768 kB), not the whole 6 MB buffer."""
    kv, array = cache
    kv.reach(36)
    array[..., :36] = 1.0
    taken = _mapping_kb(array.ctypes.data)
    assert taken["Rss"] <= 1024, taken
    assert taken.get("AnonHugePages", 0) == 0, taken


@pytest.mark.skipif(not _huge_pages_offered(), reason="the system offers no transparent huge pages")
def test_a_context_filling_half_its_cache_moves_to_huge_pages_and_keeps_its_values(cache):
    kv, array = cache
    kv.reach(1000)
    values = np.random.default_rng(0).standard_normal(array[..., :1000].shape, np.float32)
    array[..., :1000] = values
    kv.reach(LENGTH // 2)
    np.testing.assert_array_equal(array[..., :1000], values)
    assert not array[..., 1000:].any()
    array[..., 1000 : LENGTH // 2] = 2.0
    assert _mapping_kb(array.ctypes.data).get("AnonHugePages", 0) > 0


def test_released_buffers_read_as_zeros_and_take_small_pages_again(cache):
    """A cache left (its context moved to another length) gives its pages back; a short
    context written into it later takes small pages again."""
    kv, array = cache
    kv.reach(LENGTH)
    array[...] = 3.0
    kv.release(LENGTH)
    assert not array.any()
    kv.reach(36)
    array[..., :36] = 1.0
    taken = _mapping_kb(array.ctypes.data)
    assert taken["Rss"] <= 1024, taken
    kv.clear(LENGTH)
    assert not array.any()
