"""Tests for runtime.adapters.lora_util: which names are LoRA inputs and what they mean."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.errors import InvalidArgumentError
from runtime.adapters.lora_util import (
    ATTENTION_PROJECTIONS,
    PROJECTIONS,
    SIDES,
    Convention,
    is_lora_input_name,
    lora_input_name,
    parse_lora_input_name,
    rank_axis,
    to_graph_layout,
)

VALID = [
    ("lora_atten_q_a_prime_weight_0", (0, "q", "a", Convention.LITERT_TORCH)),
    ("lora_atten_o_b_prime_weight_17", (17, "o", "b", Convention.LITERT_TORCH)),
    ("query_w_prime_left_0", (0, "q", "a", Convention.LITERT_LM)),
    ("key_w_prime_right_3", (3, "k", "b", Convention.LITERT_LM)),
    ("value_w_prime_left_12", (12, "v", "a", Convention.LITERT_LM)),
    ("post_w_prime_right_1", (1, "o", "b", Convention.LITERT_LM)),
    ("transformer.layer_2.attn.q.w_prime_left", (2, "q", "a", Convention.MEDIAPIPE)),
    ("transformer.layer_0.attn.attn_vec_einsum.w_prime_right", (0, "o", "b", Convention.MEDIAPIPE)),
]

INVALID = [
    "",
    "lora_atten_q_a_prime_weight",  # no layer
    "lora_atten_q_a_prime_weight_",  # empty layer
    "lora_atten_q_a_prime_weight_x",  # non-numeric layer
    "lora_atten_q_a_prime_weight_01",  # leading zero: not a canonical layer number
    "lora_atten_q_a_prime_weight_-1",
    "lora_atten_x_a_prime_weight_0",  # bad projection
    "lora_atten_q_c_prime_weight_0",  # bad side
    "lora_atten_q_a_weight_0",  # wrong component count
    "lora_atten_q_a_prime_weight_0_1",
    "xlora_atten_q_a_prime_weight_0",  # bad prefix
    "prefix/lora_atten_q_a_prime_weight_0",  # partial match
    "lora_atten_q_a_prime_weight_0 ",
    "query_w_prime_left",
    "query_w_prime_middle_0",
    "queries_w_prime_left_0",
    "query_w_prime_left_0x",
    "transformer.layer_.attn.q.w_prime_left",
    "transformer.layer_0.attn.o.w_prime_left",  # MediaPipe spells o as attn_vec_einsum
    "transformer.layer_0.attn.q.w_prime_left.extra",
    "kv_cache_k_0",
    "tokens",
]


@pytest.mark.parametrize("name,expected", VALID)
def test_valid_names_parse(name, expected):
    assert is_lora_input_name(name)
    parsed = parse_lora_input_name(name)
    assert (parsed.layer, parsed.projection, parsed.side, parsed.convention) == expected


@pytest.mark.parametrize("name", INVALID)
def test_invalid_names_are_refused(name):
    assert not is_lora_input_name(name)
    with pytest.raises(InvalidArgumentError, match="not a LoRA input name"):
        parse_lora_input_name(name)


def spells(convention: Convention, projection: str) -> bool:
    return projection in ATTENTION_PROJECTIONS or convention is not Convention.MEDIAPIPE


@pytest.mark.parametrize("convention", list(Convention))
def test_spelling_round_trips(convention):
    for layer in (0, 5, 31):
        for projection in filter(lambda p: spells(convention, p), PROJECTIONS):
            for side in SIDES:
                name = lora_input_name(convention, layer, projection, side)
                parsed = parse_lora_input_name(name)
                assert parsed.key == (layer, projection, side)
                assert parsed.convention is convention
                for other in filter(lambda c: spells(c, projection), Convention):
                    assert parse_lora_input_name(lora_input_name(other, *parsed.key)).key == parsed.key


def test_mlp_inputs_are_named_like_the_attention_ones():
    assert lora_input_name(Convention.LITERT_TORCH, 2, "gate", "a") == "lora_ff_gate_a_prime_weight_2"
    assert lora_input_name(Convention.LITERT_LM, 0, "down", "b") == "down_w_prime_right_0"
    assert not is_lora_input_name("lora_atten_gate_a_prime_weight_0")
    assert not is_lora_input_name("lora_ff_q_a_prime_weight_0")


def test_lora_input_name_refuses_unknown_parts():
    with pytest.raises(InvalidArgumentError, match="mediapipe convention"):
        lora_input_name(Convention.MEDIAPIPE, 0, "gate", "a")
    with pytest.raises(InvalidArgumentError):
        lora_input_name(Convention.LITERT_TORCH, 0, "ffn", "a")
    with pytest.raises(InvalidArgumentError):
        lora_input_name(Convention.LITERT_LM, -1, "q", "a")


def test_layouts_and_rank_axis():
    stored_torch_a = np.zeros((64, 4))  # [in, r]
    stored_lm_a = np.zeros((4, 64))  # [r, in]
    assert rank_axis(Convention.LITERT_TORCH, "a") == 1
    assert rank_axis(Convention.LITERT_LM, "a") == 0
    assert rank_axis(Convention.LITERT_TORCH, "b") == rank_axis(Convention.LITERT_LM, "b") == 0
    assert to_graph_layout(Convention.LITERT_TORCH, "a", stored_torch_a).shape == (64, 4)
    assert to_graph_layout(Convention.LITERT_LM, "a", stored_lm_a).shape == (64, 4)
    assert to_graph_layout(Convention.LITERT_LM, "b", np.zeros((4, 32))).shape == (4, 32)
