"""What objects keep in memory while they are held, for the tests of registered adapters."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any


def retained_per_adapter(open_adapter: Callable[[Any], object], sources: Sequence[Any]) -> float:
    """Python bytes (tracemalloc) that each adapter opened by ``open_adapter`` keeps while it
    is held, over ``sources[1:]`` (the first one warms imports and shared caches)."""
    open_adapter(sources[0])
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        held = [open_adapter(source) for source in sources[1:]]
        gc.collect()
        return (tracemalloc.get_traced_memory()[0] - before) / len(held)
    finally:
        tracemalloc.stop()
