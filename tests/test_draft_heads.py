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


# Two Medusa-1 heads of width 3, computed with torch 2.13 by Medusa's own ResBlock
# (medusa/model/medusa_model.py: ``x + nn.SiLU()(nn.Linear(hidden, hidden)(x))``, here with
# torch.manual_seed(0) parameters times 4, rounded to 6 digits), on the hidden state H_REF:
# each head's output, and its draft through LM_HEAD_REF (argmax of LM_HEAD_REF @ out).
W_REF = [[[-0.0172901, 1.23886, -1.90074], [-1.69958, -0.889476, 0.619283], [-0.0457566, 1.8311, -0.204946]],
         [[-2.20628, -1.52947, -0.951988], [0.0855485, 0.912988, 1.38569], [-1.56564, -1.00566, 0.838814]]]
B_REF = [[0.611097, -0.697931, -0.453948], [1.9177, -0.475275, 1.72815]]
H_REF = [0.5, -1.25, 2.0]
LM_HEAD_REF = [[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 1], [-1, 2, 0]]
OUT_REF = [[0.4591806, -0.6957028, 1.872676], [1.071378, -0.3300831, 5.801531]]
DRAFT_REF = [2, 3]


def medusa_state(weights, biases) -> dict[str, np.ndarray]:
    """Heads as a Medusa checkpoint names them."""
    state = {}
    for k, (w, b) in enumerate(zip(weights, biases)):
        state[f"base_model.model.medusa_head.{k}.linear.weight"] = np.asarray(w, np.float32)
        state[f"base_model.model.medusa_head.{k}.linear.bias"] = np.asarray(b, np.float32)
    return state


def test_medusa_heads_give_what_medusas_torch_resblocks_gave():
    heads = _heads(medusa_state(W_REF, B_REF))
    hidden = np.asarray(H_REF, np.float32)
    np.testing.assert_allclose(heads.hidden_states(hidden), OUT_REF, rtol=1e-6, atol=1e-6)
    lm_head = np.asarray(LM_HEAD_REF, np.float32)
    assert heads.draft(hidden, lambda rows: rows @ lm_head.T) == DRAFT_REF
    assert heads.count == 2 and heads.width == 3 and heads.nbytes == 2 * (9 + 3) * 4


def reference_heads(weights: np.ndarray, biases: np.ndarray, hidden: np.ndarray) -> np.ndarray:
    """Medusa's head k, ``h + SiLU(W_k h + b_k)``, for all K heads at once in float64: the
    hidden state as a row times each W_k transposed, and SiLU(z) = z * sigmoid(z) with the
    sigmoid as exp(-log(1 + exp(-z))) (``logaddexp``: no overflow in either tail)."""
    row = hidden.astype(np.float64)[None, None, :]  # [1, 1, H]
    z = (row @ weights.astype(np.float64).transpose(0, 2, 1))[:, 0, :] + biases  # [K, H]
    return row[0] + z * np.exp(-np.logaddexp(0.0, -z))


def test_medusa_heads_match_an_independent_reference():
    rng = np.random.default_rng(0)
    count, width, vocab = 3, 16, 40
    weights = rng.standard_normal((count, width, width)).astype(np.float32)  # not symmetric: W, not W^T
    biases = rng.standard_normal((count, width)).astype(np.float32)
    heads = _heads(medusa_state(weights, biases))
    hidden = (3 * rng.standard_normal(width)).astype(np.float32)  # pre-activations far into both tails
    expected = reference_heads(weights, biases, hidden)
    np.testing.assert_allclose(heads.hidden_states(hidden), expected, rtol=1e-5, atol=1e-4)
    lm_head = rng.standard_normal((vocab, width)).astype(np.float32)
    assert heads.draft(hidden, lambda rows: rows @ lm_head.T) == list(np.argmax(expected @ lm_head.T, axis=-1))


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
    # Heads of another width than head 0's passed (check_heads compares head 0's with the
    # model's), and the first draft raised numpy's ValueError inside every generation.
    ({"medusa_head.0.linear.weight": np.zeros((4, 4)), "medusa_head.0.linear.bias": np.zeros(4),
      "medusa_head.1.linear.weight": np.zeros((3, 3)), "medusa_head.1.linear.bias": np.zeros(3)},
     "draft head 1 block 0: 'medusa_head.1.linear.weight' is [3, 3] and 'medusa_head.1.linear.bias' [3], expected "
     "[hidden, hidden] and [hidden] (hidden = 4, head 0's)"),
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


@pytest.mark.parametrize("vocab", [np.array([5, 2**64 - 1], np.uint64), np.array([2**63], np.uint64),
                                   np.array([[1, 2]]), np.array([1.0, 2.0]), np.array([3, -1])],
                         ids=["uint64 max", "2**63", "2-d", "float", "negative"])
def test_a_draft_vocabulary_that_is_not_token_ids_is_refused(vocab):
    """uint64 ids past int64's range became negative ids on the cast after the check, which
    check_heads' bound let through: the heads drafted token -1 and every verify run failed
    with LiteRT's 'Embedding Lookup: index out of bounds'."""
    state = {**medusa_state(W_REF, B_REF), "medusa_head.vocab": vocab}
    with pytest.raises(InvalidArgumentError, match="'medusa_head.vocab' is .* expected \\[V\\] non-negative integer"):
        _heads(state)
