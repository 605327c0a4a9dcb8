"""Tests for runtime.executor.fast_path: the direct calls are in use, and the public-API
fallback gives the same results."""

from __future__ import annotations

from functools import partial

import numpy as np

from conftest import MODEL_FILES
from runtime.executor import litert_executor
from runtime.executor.fast_path import FastPath
from runtime.executor.litert_executor import LlmExecutor


def test_direct_calls_and_fallback_agree(monkeypatch):
    executor = LlmExecutor(MODEL_FILES["default"])
    assert executor._fast.direct  # ai-edge-litert 2.3's private names are where we expect
    prompt = [5, 17, 42, 200, 3]
    kv = executor.create_kv_cache()
    binding = executor.bind(kv)
    fast = [executor.prefill(binding, prompt, 0)] + [executor.decode(binding, t, 5 + i) for i, t in enumerate((9, 250))]
    executor.close()

    monkeypatch.setattr(litert_executor, "FastPath", partial(FastPath, direct=False))  # as on another version
    executor = LlmExecutor(MODEL_FILES["default"])
    assert not executor._fast.direct
    binding = executor.bind(executor.create_kv_cache())
    slow = [executor.prefill(binding, prompt, 0)] + [executor.decode(binding, t, 5 + i) for i, t in enumerate((9, 250))]
    executor.close()
    for a, b in zip(fast, slow, strict=True):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype == np.float32 and a.shape == b.shape == (256,)


def test_reader_returns_a_fresh_array_each_time():
    executor = LlmExecutor(MODEL_FILES["transposed"])
    binding = executor.bind(executor.create_kv_cache())
    first = executor.decode(binding, 7, 0)
    kept = first.copy()
    second = executor.decode(binding, 8, 1)
    assert first is not second and not np.shares_memory(first, second)
    np.testing.assert_array_equal(first, kept)  # the later step did not overwrite it
    assert not np.array_equal(first, second)
    executor.close()
