"""Tests for runtime.util.tensor_spec."""

from __future__ import annotations


import ml_dtypes
import numpy as np
import pytest

from runtime.util.tensor_spec import TensorSpec

SHAPES = [(), (0,), (1,), (7,), (1, 64, 2, 16), (16, 0, 3), (3, 5, 1, 2, 1, 4)]
DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.int32, np.int64, np.int8, np.bool_, np.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_nbytes_is_what_a_buffer_of_that_shape_holds(shape, dtype):
    spec = TensorSpec("t", shape, np.dtype(dtype))
    assert spec.nbytes == np.zeros(shape, dtype).nbytes
    assert isinstance(spec.nbytes, int)


def test_nbytes_examples():
    assert TensorSpec("kv_cache_k_0", (1, 64, 2, 16), np.dtype(np.float32)).nbytes == 8192
    assert TensorSpec("lora", (16, 32), np.dtype(ml_dtypes.bfloat16)).nbytes == 1024
    assert TensorSpec("input_pos", (), np.dtype(np.int32)).nbytes == 4
    assert TensorSpec("empty", (4, 0), np.dtype(np.float32)).nbytes == 0


def test_nbytes_does_not_overflow():
    # Far beyond what numpy's int64 product of dims could hold.
    spec = TensorSpec("huge", (1 << 31, 1 << 31, 1 << 31), np.dtype(np.float64))
    assert spec.nbytes == (1 << 93) * 8


@pytest.mark.parametrize(
    "spec,text",
    [
        (TensorSpec("tokens", (1, 8), np.dtype(np.int32)), "tokens [1, 8] int32"),
        (TensorSpec("logits", (1, 1, 256), np.dtype(np.float32)), "logits [1, 1, 256] float32"),
        (TensorSpec("lora_atten_q_a_prime_weight_0", (64, 4), np.dtype(ml_dtypes.bfloat16)),
         "lora_atten_q_a_prime_weight_0 [64, 4] bfloat16"),
        (TensorSpec("query_w_prime_left_0", (4, 64), np.dtype(np.float16)), "query_w_prime_left_0 [4, 64] float16"),
        (TensorSpec("input_pos", (), np.dtype(np.int32)), "input_pos [] int32"),
        (TensorSpec("kv_cache_v_1", (1, 0, 2, 16), np.dtype(np.float32)), "kv_cache_v_1 [1, 0, 2, 16] float32"),
    ],
)
def test_describe(spec, text):
    assert spec.describe() == text


def test_equality_and_hash_follow_all_fields():
    spec = TensorSpec("t", (2, 3), np.dtype(np.float32))
    same = TensorSpec("t", (2, 3), np.dtype("float32"))
    assert spec == same and hash(spec) == hash(same)
    assert len({spec, same}) == 1
    for other in (
        TensorSpec("u", (2, 3), np.dtype(np.float32)),
        TensorSpec("t", (3, 2), np.dtype(np.float32)),
        TensorSpec("t", (2, 3), np.dtype(np.float16)),
    ):
        assert spec != other
    # Same size, different layout: a slot built for one does not fit the other.
    assert TensorSpec("t", (6,), np.dtype(np.float32)).nbytes == spec.nbytes
    assert TensorSpec("t", (6,), np.dtype(np.float32)) != spec
