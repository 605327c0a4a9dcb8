"""Tests for runtime.components.lora: fitting adapters to slots and filling buffers."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import adapter_path
from runtime.components.lora import LoRA, plan_adapter
from runtime.errors import InvalidArgumentError
from runtime.adapters.lora_data import LoraData
from runtime.adapters.lora_util import Convention, lora_input_name
from runtime.adapters.lora_writer import LoraWeights, serialize_lora_tensors, name_adapter_tensors
from runtime.util.signature_names import LoraSlot
from slots import ArrayBuffer, slot_inputs

SLOTS = {LoraSlot(4): slot_inputs(4), LoraSlot(16): slot_inputs(16)}


def data(name: str) -> LoraData:
    return LoraData.create_from_file_path(adapter_path(name))


def build(blend, rank, inputs=None):
    inputs = inputs or SLOTS[LoraSlot(rank)]
    return LoRA(blend, LoraSlot(rank), inputs, lambda name: ArrayBuffer(inputs[name]))


def graph_pair(d: LoraData, layer: int, proj: str) -> tuple[np.ndarray, np.ndarray]:
    """The adapter's (a [in, r], b [r, out]) for one projection, read the slow obvious way."""
    torch_a = f"lora_atten_{proj}_a_prime_weight_{layer}"
    if torch_a in d.get_all_tensor_names():
        return d.read_tensor(torch_a).astype(np.float32), d.read_tensor(f"lora_atten_{proj}_b_prime_weight_{layer}").astype(np.float32)
    a = d.read_tensor(lora_input_name(Convention.LITERT_LM, layer, proj, "a")).astype(np.float32).T
    b = d.read_tensor(lora_input_name(Convention.LITERT_LM, layer, proj, "b")).astype(np.float32)
    return a, b


@pytest.mark.parametrize("name", ["torch_r4", "litertlm_r4", "torch_r4_bf16"])
def test_fill_is_exact_in_own_slot_and_padded_slot(name):
    d = data(name)
    plan = plan_adapter(d, SLOTS)
    assert plan.rank == 4
    for rank in (4, 16):
        lora = build([(plan, 0.5)], rank)
        assert lora.nbytes == sum(s.nbytes for s in SLOTS[LoraSlot(rank)].values())
        for layer in range(2):
            for proj in "qkvo":
                a, b = graph_pair(d, layer, proj)
                got_a = lora.buffers[f"lora_atten_{proj}_a_prime_weight_{layer}"].array
                got_b = lora.buffers[f"lora_atten_{proj}_b_prime_weight_{layer}"].array
                np.testing.assert_array_equal(got_a[:, :4], a * np.float32(0.5))
                np.testing.assert_array_equal(got_b[:4], b)
                assert not got_a[:, 4:].any() and not got_b[4:].any()


def test_partial_adapter_zero_fills_the_rest():
    plan = plan_adapter(data("torch_r4_layer1_qv"), SLOTS)
    assert sorted(plan.pairs) == [(1, "q"), (1, "v")]
    lora = build([(plan, 1.0)], 4)
    assert len(lora.buffers) == len(SLOTS[LoraSlot(4)])
    assert lora.buffers["lora_atten_q_a_prime_weight_1"].array.any()
    for name in ("lora_atten_q_a_prime_weight_0", "lora_atten_k_b_prime_weight_1", "lora_atten_o_a_prime_weight_0"):
        assert not lora.buffers[name].array.any()


def test_blend_concatenates_ranks():
    p1, p2 = plan_adapter(data("torch_r4"), SLOTS), plan_adapter(data("litertlm_r4"), SLOTS)
    lora = build([(p1, 0.7), (p2, 0.3)], 16)
    a = lora.buffers["lora_atten_k_a_prime_weight_0"].array
    b = lora.buffers["lora_atten_k_b_prime_weight_0"].array
    a1, b1 = graph_pair(p1.data, 0, "k")
    a2, b2 = graph_pair(p2.data, 0, "k")
    np.testing.assert_allclose(a @ b, 0.7 * a1 @ b1 + 0.3 * a2 @ b2, rtol=1e-5, atol=1e-6)
    with pytest.raises(InvalidArgumentError, match="summed rank 8"):
        build([(p1, 1.0), (p2, 1.0)], 4)


def test_writes_into_a_model_of_the_other_convention():
    lm_slots = {LoraSlot(8): slot_inputs(8, Convention.LITERT_LM)}
    d = data("torch_r4")
    plan = plan_adapter(d, lm_slots)
    lora = build([(plan, 1.0)], 8, lm_slots[LoraSlot(8)])
    left = lora.buffers["query_w_prime_left_1"].array  # [r, in]
    a, _ = graph_pair(d, 1, "q")
    np.testing.assert_array_equal(left[:4], a.T)


@pytest.mark.parametrize(
    "name,match",
    [
        ("wrong_hidden_r4", r"input size 48, expected 64"),
        ("torch_r32", r"rank 32 exceeds every LoRA slot of the model \(slots: r4, r16\)"),
    ],
)
def test_misfits_are_refused_with_the_reason(name, match):
    with pytest.raises(InvalidArgumentError, match=match):
        plan_adapter(data(name), SLOTS)


def _blob(tensors):
    return LoraData.create_from_buffer(serialize_lora_tensors(tensors, external_data=False), name="x.tflite")


def test_unknown_tensor_missing_half_and_layer_out_of_range():
    a = np.zeros((64, 4), np.float32)
    b = np.zeros((4, 64), np.float32)
    with pytest.raises(InvalidArgumentError, match=r"x.tflite: tensor 'mlp_up' is not a LoRA input name"):
        plan_adapter(_blob({"mlp_up": a}), SLOTS)
    with pytest.raises(InvalidArgumentError, match=r"'lora_atten_q_b_prime_weight_0' is missing"):
        plan_adapter(_blob({"lora_atten_q_a_prime_weight_0": a}), SLOTS)
    with pytest.raises(InvalidArgumentError, match=r"layer 7 projection 'q'"):
        plan_adapter(_blob({"lora_atten_q_a_prime_weight_7": a, "lora_atten_q_b_prime_weight_7": b}), SLOTS)
    with pytest.raises(InvalidArgumentError, match=r"disagree on the rank \(4 vs 2\)"):
        plan_adapter(_blob({"lora_atten_q_a_prime_weight_0": a, "lora_atten_q_b_prime_weight_0": b[:2]}), SLOTS)
    with pytest.raises(InvalidArgumentError, match=r"output size 32, expected 64"):
        plan_adapter(_blob({"lora_atten_q_a_prime_weight_0": a, "lora_atten_q_b_prime_weight_0": b[:, :32]}), SLOTS)
    with pytest.raises(InvalidArgumentError, match="no LoRA inputs"):
        plan_adapter(data("torch_r4"), {})


def test_non_finite_weights_refused_unless_allowed():
    weights = {(0, "q"): LoraWeights(np.full((64, 4), np.nan, np.float32), np.zeros((4, 64), np.float32))}
    d = _blob(name_adapter_tensors(weights, Convention.LITERT_TORCH))
    plan = plan_adapter(d, SLOTS)
    with pytest.raises(InvalidArgumentError, match="NaN or Inf"):
        build([(plan, 1.0)], 4)
    lora = LoRA([(plan, 1.0)], LoraSlot(4), SLOTS[LoraSlot(4)], lambda n: ArrayBuffer(SLOTS[LoraSlot(4)][n]), allow_non_finite=True)
    assert np.isnan(lora.buffers["lora_atten_q_a_prime_weight_0"].array).all()
