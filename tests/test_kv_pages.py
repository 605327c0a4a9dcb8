"""The pages a KV cache's buffers take: small while the context fills little of them,
huge once it fills half, except buffers whose every page one position writes, huge from the
start (runtime.executor.litert_executor.KvCache, native.PageBlock)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.executor.litert_executor import KvCache, _one_position_touches_every_page
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


def _rss_kb(begin: int, end: int) -> int:
    """The ``Rss`` (kB) of the mappings overlapping addresses ``begin`` to ``end``."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low < end and high > begin
        elif inside and head == "Rss:":
            total += int(line.split()[1])
    return total


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


def test_a_closed_cache_gives_its_pages_back_while_a_binding_still_holds_its_buffers(cache):
    """A closed session's cache may stay referenced (the executor keeps its last batch's
    run): its memory goes back at close all the same."""
    kv, array = cache
    kv.reach(LENGTH)
    array[...] = 3.0
    assert _mapping_kb(array.ctypes.data)["Rss"] >= array.nbytes // 1024
    kv.close()
    assert _mapping_kb(array.ctypes.data)["Rss"] <= 64
    assert not array.any()


def test_which_buffers_one_position_writes_whole():
    """Positions innermost in rows of at most a page (a transposed V of 1,024 float32 or 2,048
    float16 positions); not a longer V, nor a K cache (positions outermost in its rows)."""
    def info(shape, dtype=np.float32):
        return TensorInfo("kv_cache_v_0", shape, np.dtype(dtype), b"")
    assert _one_position_touches_every_page(info((1, 3, 64, 1024)), 3)
    assert _one_position_touches_every_page(info((1, 3, 64, 2048), np.float16), 3)
    assert not _one_position_touches_every_page(info((1, 3, 64, 4096)), 3)
    assert not _one_position_touches_every_page(info((1, 3, 1024, 64)), 2)


@pytest.mark.skipif(not _huge_pages_offered(), reason="the system offers no transparent huge pages")
def test_buffers_one_position_writes_whole_start_in_huge_pages_at_no_cost_in_memory():
    """Three V caches of 1,024 positions (2.3 MB) and a K cache: one position written in each
    puts the V caches' first 2 MB in a huge page, no more memory than small pages would take
    (every small page of theirs was written), and the K cache in small pages; released, they
    read as zeros and come back the same way."""
    v_names = [f"kv_cache_v_{layer}" for layer in range(3)]
    infos = [TensorInfo(name, (1, 3, 64, 1024), np.dtype(np.float32), b"") for name in v_names]
    infos.append(TensorInfo("kv_cache_k_0", (1, 3, 1024, 64), np.dtype(np.float32), b""))
    block = PageBlock(infos, v_names)
    values, k = [block.buffers[name].array for name in v_names], block.buffers["kv_cache_k_0"].array
    for _ in range(2):
        for v in values:
            v[..., 0] = 1.0
        k[:, :, 0, :] = 1.0
        taken = _mapping_kb(values[0].ctypes.data)
        assert taken.get("AnonHugePages", 0) == 2048, taken
        small = _mapping_kb(k.ctypes.data)
        assert small.get("AnonHugePages", 0) == 0, small
        # The whole block: the V caches' bytes (each of their small pages was written) and
        # K's three pages, within a page of rounding each.
        whole = _rss_kb(min(v.ctypes.data for v in values), k.ctypes.data + k.nbytes)
        assert whole <= sum(v.nbytes for v in values) // 1024 + 3 * 4 + 4 * 4, whole
        block.release()
        assert not any(v.any() for v in values) and not k.any()
