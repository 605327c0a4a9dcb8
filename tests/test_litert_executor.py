"""Tests for runtime.executor.litert_executor against the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import MODEL_FILES, adapter_deltas, adapter_path
from reference_model import reference_logits
from runtime.components.lora import LoRA, plan_adapter
from runtime.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from runtime.executor.litert_executor import ExecutorSettings, LlmExecutor
from runtime.util.lora_data import LoraData
from runtime.util.signature_names import LoraSlot

TOL = 1e-4


@pytest.fixture(scope="module", params=["default", "transposed"])
def executor(request):
    executor = LlmExecutor(MODEL_FILES[request.param])
    yield executor
    executor.close()


def tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


@pytest.mark.parametrize("length", [1, 2, 7, 8, 9, 20, 32, 33, 45, 63])
def test_prefill_chunking_matches_reference(executor, weights, length):
    prompt = tokens(length, seed=length)
    binding = executor.bind(executor.create_kv_cache())
    logits = executor.prefill(binding, prompt, 0)
    expected = reference_logits(weights, prompt)
    assert logits.shape == (256,) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, expected[-1], atol=TOL)


def test_prefill_then_decode_and_continue(executor, weights):
    seq = tokens(30, seed=3)
    binding = executor.bind(executor.create_kv_cache())
    executor.prefill(binding, seq[:10], 0)
    logits = executor.prefill(binding, seq[10:21], 10)  # appending to existing context
    expected = reference_logits(weights, seq)
    np.testing.assert_allclose(logits, expected[20], atol=TOL)
    for pos in range(21, 30):
        logits = executor.decode(binding, seq[pos], pos)
        np.testing.assert_allclose(logits, expected[pos], atol=TOL)


def test_rank_4_adapter_in_rank_16_slot(executor, weights):
    plan = plan_adapter(LoraData.create_from_file_path(adapter_path("torch_r4")), {LoraSlot(16): executor.spec.slot_inputs(LoraSlot(16))})
    lora = LoRA([(plan, 1.0)], LoraSlot(16), executor.spec.slot_inputs(LoraSlot(16)), lambda n: executor.create_lora_buffer(LoraSlot(16), n))
    binding = executor.bind(executor.create_kv_cache(), lora.buffers, LoraSlot(16))
    seq = tokens(14, seed=4)
    expected = reference_logits(weights, seq, lora=adapter_deltas("torch_r4"))
    np.testing.assert_allclose(executor.prefill(binding, seq[:6], 0), expected[5], atol=TOL)
    for pos in range(6, 14):
        np.testing.assert_allclose(executor.decode(binding, seq[pos], pos), expected[pos], atol=TOL)


@pytest.mark.parametrize("adapter", [None, "torch_r4"])
def test_decode_across_its_attention_windows_matches_reference(executor, weights, adapter):
    """Positions 0-15 run decode_attend16, 16-31 decode_attend32, the rest the whole
    cache: every step's logits are the reference's, at each window's edges too."""
    assert executor.spec.windows(None) == executor.spec.windows(LoraSlot(16)) == (16, 32)
    if adapter is None:
        binding, deltas = executor.bind(executor.create_kv_cache()), None
    else:
        plan = plan_adapter(LoraData.create_from_file_path(adapter_path(adapter)), {LoraSlot(16): executor.spec.slot_inputs(LoraSlot(16))})
        lora = LoRA([(plan, 1.0)], LoraSlot(16), executor.spec.slot_inputs(LoraSlot(16)), lambda n: executor.create_lora_buffer(LoraSlot(16), n))
        binding, deltas = executor.bind(executor.create_kv_cache(), lora.buffers, LoraSlot(16)), adapter_deltas(adapter)
    seq = tokens(64, seed=9)
    expected = reference_logits(weights, seq, lora=deltas)
    for pos in range(64):
        np.testing.assert_allclose(executor.decode(binding, seq[pos], pos), expected[pos], atol=TOL,
                                   err_msg=f"position {pos}")


def test_kv_copy_is_independent(executor, weights):
    seq = tokens(12, seed=5)
    original = executor.bind(executor.create_kv_cache())
    executor.prefill(original, seq[:8], 0)
    copy = executor.bind(executor.copy_kv_cache(original.kv))
    executor.decode(original, 1, 8)  # diverge the original
    expected = reference_logits(weights, seq)
    np.testing.assert_allclose(executor.decode(copy, seq[8], 8), expected[8], atol=TOL)


def test_context_overflow_leaves_the_cache_usable(executor, weights):
    seq = tokens(64, seed=6)
    binding = executor.bind(executor.create_kv_cache())
    executor.prefill(binding, seq[:60], 0)
    with pytest.raises(ResourceExhaustedError, match="exceed the KV cache of 64"):
        executor.prefill(binding, seq[60:64] + [1], 60)
    with pytest.raises(ResourceExhaustedError):
        executor.decode(binding, 1, 64)
    expected = reference_logits(weights, seq)
    np.testing.assert_allclose(executor.prefill(binding, seq[60:64], 60), expected[63], atol=TOL)


def test_bad_arguments(executor):
    binding = executor.bind(executor.create_kv_cache())
    with pytest.raises(InvalidArgumentError):
        executor.prefill(binding, [], 0)
    with pytest.raises(InvalidArgumentError):
        executor.decode(binding, 1, -1)
    with pytest.raises(NotFoundError):
        executor.create_lora_buffer(LoraSlot(4), "kv_cache_k_0")
    with pytest.raises(InvalidArgumentError):
        executor.bind(binding.kv, lora_slot=LoraSlot(4))


def test_missing_and_invalid_model_files(tmp_path):
    with pytest.raises(NotFoundError):
        LlmExecutor(tmp_path / "missing.tflite")
    bogus = tmp_path / "bogus.tflite"
    bogus.write_bytes(b"not a model at all")
    with pytest.raises(InvalidArgumentError, match="cannot load"):
        LlmExecutor(bogus)
    with pytest.raises(InvalidArgumentError):
        ExecutorSettings(num_threads=-1)


def test_closed_executor_refuses_work():
    executor = LlmExecutor(MODEL_FILES["default"])
    binding = executor.bind(executor.create_kv_cache())
    executor.close()
    executor.close()
    with pytest.raises(FailedPreconditionError):
        executor.decode(binding, 1, 0)
    with pytest.raises(FailedPreconditionError):
        executor.create_kv_cache()
