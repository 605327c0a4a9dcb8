"""Tests for runtime.util.signature_names: the exporter's names read back as written."""

from __future__ import annotations

import pytest

from runtime.util.signature_names import (
    ALL_LINEAR,
    DORA,
    LoraSlot,
    SignatureName,
    cheapest_slot,
    parse_row_tensor_name,
    row_tensor_name,
)


@pytest.mark.parametrize("name, parts", [
    ("prefill_128", SignatureName("prefill", 128)),
    ("prefill", SignatureName("prefill")),
    ("prefill_32_lora_r8", SignatureName("prefill", 32, lora_slot=LoraSlot(8))),
    ("prefill_32_lora_all_r8", SignatureName("prefill", 32, lora_slot=LoraSlot(8, ALL_LINEAR))),
    ("decode", SignatureName("decode")),
    ("decode_lora_r16", SignatureName("decode", lora_slot=LoraSlot(16))),
    ("decode_attend128", SignatureName("decode", window=128)),
    ("decode_batch8", SignatureName("decode", rows=8)),
    ("decode_batch8_attend512_lora_r8", SignatureName("decode", rows=8, window=512, lora_slot=LoraSlot(8))),
    ("decode_batch4_lora_all_r16", SignatureName("decode", rows=4, lora_slot=LoraSlot(16, ALL_LINEAR))),
    ("verify4", SignatureName("verify", 4)),
    ("verify8_lora_r16", SignatureName("verify", 8, lora_slot=LoraSlot(16))),
    ("verify4_lora_all_r8", SignatureName("verify", 4, lora_slot=LoraSlot(8, ALL_LINEAR))),
    ("verify4_attend128_lora_r8", SignatureName("verify", 4, window=128, lora_slot=LoraSlot(8))),
    ("prefill_32_attend128_lora_all_r8", SignatureName("prefill", 32, window=128, lora_slot=LoraSlot(8, ALL_LINEAR))),
    ("score_512", SignatureName("score", 512)),
    ("score_128_lora_dora_r8", SignatureName("score", 128, lora_slot=LoraSlot(8, DORA))),
])
def test_names_round_trip(name, parts):
    assert SignatureName.parse(name) == parts
    assert str(parts) == name


@pytest.mark.parametrize("name", [
    "serving_default", "decode_lora_r0", "decode_batch0", "decode_lora_r8_batch2", "prefill_08", "decode ",
    "decode_lora_mlp_r8", "decode_all_r8",
    "verify0", "verify_4", "verify4_batch2", "verify4_lora_r8_attend128",
])
def test_other_names_are_not_of_the_contract(name):
    assert SignatureName.parse(name) is None


def test_row_tensor_names():
    name = row_tensor_name("kv_cache_k_12", 3)
    assert name == "kv_cache_k_12_3"
    assert parse_row_tensor_name(name) == ("kv_cache_k_12", 3)
    assert parse_row_tensor_name("tokens") is None
    assert parse_row_tensor_name("kv_cache_k_1_03") is None


def test_the_cheapest_slot_that_holds_an_adapter():
    slots = [LoraSlot(8), LoraSlot(16), LoraSlot(8, ALL_LINEAR), LoraSlot(64, ALL_LINEAR)]
    assert cheapest_slot(slots, LoraSlot(4)) == LoraSlot(8)  # attention-only: no MLP inputs to pay for
    assert cheapest_slot(slots, LoraSlot(12)) == LoraSlot(16)
    assert cheapest_slot(slots, LoraSlot(32)) == LoraSlot(64, ALL_LINEAR)  # zero MLP inputs: exact
    assert cheapest_slot(slots, LoraSlot(4, ALL_LINEAR)) == LoraSlot(8, ALL_LINEAR)
    assert cheapest_slot(slots, LoraSlot(128)) is None
    assert cheapest_slot(slots[:2], LoraSlot(4, ALL_LINEAR)) is None  # MLP tensors need MLP inputs
    assert str(LoraSlot(8, ALL_LINEAR)) == "all-linear r8" and str(LoraSlot(8)) == "r8"


def test_dora_slots_hold_every_adapter_and_only_they_hold_dora_ones():
    slots = [LoraSlot(8), LoraSlot(8, ALL_LINEAR), LoraSlot(8, DORA)]
    assert cheapest_slot(slots, LoraSlot(4, DORA)) == LoraSlot(8, DORA)
    assert cheapest_slot(slots, LoraSlot(4, ALL_LINEAR)) == LoraSlot(8, ALL_LINEAR)  # not the costlier DoRA slot
    assert cheapest_slot(slots[:2], LoraSlot(4, DORA)) is None  # a DoRA adapter needs the scale inputs
    assert cheapest_slot(slots[2:], LoraSlot(4)) == LoraSlot(8, DORA)  # zero scales and MLP inputs: exact
    name = SignatureName.parse("decode_attend128_lora_dora_r8")
    assert name == SignatureName("decode", window=128, lora_slot=LoraSlot(8, DORA))
    assert str(name) == "decode_attend128_lora_dora_r8" and str(LoraSlot(8, DORA)) == "dora r8"
