"""LatencyRecorder: counts and percentiles of how long something took, thread-safe."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LatencySummary:
    """How many times something happened and how long it took (over the recent window)."""

    count: int
    p50_ms: float
    p99_ms: float


class LatencyRecorder:
    """Keeps the total count and the most recent ``window`` durations.

    The window is allocated up front, so recording never grows memory.
    """

    def __init__(self, window: int = 4096) -> None:
        self._samples = np.zeros(window, np.float64)
        self._count = 0
        self._lock = threading.Lock()

    def record(self, seconds: float) -> None:
        """Adds one duration."""
        with self._lock:
            self._samples[self._count % len(self._samples)] = seconds
            self._count += 1

    @contextmanager
    def time(self) -> Iterator[None]:
        """Records how long the ``with`` block took (also when it raises)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(time.perf_counter() - start)

    def summary(self) -> LatencySummary:
        """Count, median and 99th percentile in milliseconds (0 when nothing was recorded)."""
        with self._lock:
            count = self._count
            samples = self._samples[: min(count, len(self._samples))].copy()
        if samples.size == 0:
            return LatencySummary(count, 0.0, 0.0)
        p50, p99 = np.percentile(samples, [50, 99]) * 1e3
        return LatencySummary(count, float(p50), float(p99))
