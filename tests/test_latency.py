"""Tests for runtime.util.latency."""

from __future__ import annotations

import pytest

from runtime.util.latency import LatencyRecorder


def test_percentiles_and_window():
    recorder = LatencyRecorder(window=100)
    assert recorder.summary().count == 0
    for ms in range(1, 201):
        recorder.record(ms / 1e3)
    summary = recorder.summary()
    assert summary.count == 200  # total, though only the last 100 are kept
    assert summary.p50_ms == pytest.approx(150.5)
    assert 199 <= summary.p99_ms <= 200


def test_time_records_even_on_error():
    recorder = LatencyRecorder()
    with pytest.raises(ValueError):
        with recorder.time():
            raise ValueError
    assert recorder.summary().count == 1
