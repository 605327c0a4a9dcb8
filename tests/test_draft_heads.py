"""Tests for runtime.adapters.draft_heads: reading Turbo LoRA / Medusa draft heads."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.errors import FailedPreconditionError, InvalidArgumentError
from runtime.adapters.draft_heads import check_heads, read_adapter_heads, read_draft_heads
from conftest import MODELS

TURBO = MODELS / "turbo"


def _heads(state: dict[str, np.ndarray], config: dict | None = None):
    return read_draft_heads({k: v.shape for k, v in state.items()}, state.__getitem__, config or {}, "test")


def test_medusa_layout_is_read_and_applied_as_a_residual_silu_block():
    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((4, 4)).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    heads = _heads({"base_model.model.medusa_head.0.linear.weight": w, "base_model.model.medusa_head.0.linear.bias": b})
    h = rng.standard_normal(4).astype(np.float32)
    z = w @ h + b
    np.testing.assert_allclose(heads.hidden_states(h)[0], h + z / (1 + np.exp(-z)), rtol=1e-6)
    assert heads.count == 1 and heads.width == 4 and heads.nbytes == w.nbytes + b.nbytes


def test_draft_is_each_heads_argmax_through_the_shared_lm_head():
    zero = {f"medusa_head.{k}.linear.{p}": np.zeros((3, 3) if p == "weight" else 3, np.float32)
            for k in range(2) for p in ("weight", "bias")}
    heads = _heads(zero)
    lm_head = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1], [0, 0, 2]], np.float32)
    assert heads.draft(np.array([0.0, 1.0, 0.0], np.float32), lambda rows: rows @ lm_head.T) == [1, 1]
    assert heads.draft(np.array([0.0, 0.0, 1.0], np.float32), lambda rows: rows @ lm_head.T) == [3, 3]


def test_lorax_layout_with_blocks_and_output_projection():
    heads = read_adapter_heads("lorax", peft_directory=str(TURBO / "lorax_heads"))
    assert heads.count == 3 and heads.width == 64
    assert all(len(head.blocks) == 2 and head.out.shape == (256, 64) for head in heads.heads)


def test_adapter_without_heads_has_none():
    assert read_adapter_heads("plain", peft_directory=str(MODELS / "peft" / "qkvo_r4")) is None


@pytest.mark.parametrize("state, needle", [
    ({"medusa_head.0.linear.weight": np.zeros((4, 4))}, "expected weight and bias"),
    ({"medusa_head.0.linear.weight": np.zeros((4, 3)), "medusa_head.0.linear.bias": np.zeros(4)}, "[hidden, hidden]"),
    ({"medusa_head.1.linear.weight": np.zeros((4, 4)), "medusa_head.1.linear.bias": np.zeros(4)}, "numbered 0"),
    ({"medusa_head.0.foo": np.zeros(4)}, "medusa_head.0.foo"),
    ({"medusa_head.0.linear.weight": np.full((2, 2), np.nan), "medusa_head.0.linear.bias": np.zeros(2)}, "NaN"),
    ({"medusa_head.0.linear.weight": np.zeros((2, 2), np.int32), "medusa_head.0.linear.bias": np.zeros(2)}, "dtype"),
])
def test_malformed_heads_are_refused_naming_the_tensor(state, needle):
    with pytest.raises(InvalidArgumentError) as caught:
        _heads(state)
    assert needle in str(caught.value)


def test_declared_layer_count_must_match_the_tensors():
    state = {"medusa_head.0.linear.weight": np.zeros((2, 2)), "medusa_head.0.linear.bias": np.zeros(2)}
    with pytest.raises(InvalidArgumentError, match="medusa_num_layers"):
        _heads(state, {"medusa_num_layers": 2})


def test_heads_the_model_cannot_run_are_refused_with_the_way_out():
    heads = read_adapter_heads("t", peft_directory=str(TURBO / "random_heads"))
    check_heads(heads, 64, 256, "t")
    for width in (None, 32):
        with pytest.raises(FailedPreconditionError, match="--verify-lengths.*heads=False"):
            check_heads(heads, width, 256, "t")
