"""Tests for runtime.executor.fast_path: the direct calls are in use, and the public-API
fallback gives the same results."""

from __future__ import annotations

import numpy as np

from conftest import MODEL_FILES
from runtime.executor.litert_executor import LlmExecutor


def test_direct_calls_and_fallback_agree():
    executor = LlmExecutor(MODEL_FILES["default"])
    assert executor._fast.direct  # ai-edge-litert 2.3's private names are where we expect
    prompt = [5, 17, 42, 200, 3]
    fast = executor.prefill(executor.bind(executor.create_kv_cache()), prompt, 0)
    slow_path = executor._fast
    slow_path._run_by_index = slow_path._write = slow_path._read = None  # as on another version
    assert not slow_path.direct
    slow = executor.prefill(executor.bind(executor.create_kv_cache()), prompt, 0)
    np.testing.assert_array_equal(fast, slow)
    executor.close()
