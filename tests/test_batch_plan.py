"""Tests for runtime.executor.batch_plan: which signature runs which rows, in which slot.

The test model (tests/models/gqa_default.tflite) has LoRA slots r4 and r16 (attention only), batched decode
of 2 and 4 rows for both slots (none without LoRA), windows 16 and 32, a KV cache of 64.
"""

from __future__ import annotations

import pytest

from conftest import MODEL_FILES
from runtime.executor.batch_plan import DecodeRow, plan_decode
from runtime.executor.litert_executor import LlmExecutor
from runtime.executor.model_spec import ModelSpec
from runtime.util.signature_names import LoraSlot


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    executor = LlmExecutor(MODEL_FILES["default"])
    executor.close()
    return executor.spec


def runs(plan):
    return [(run.signature.key, run.rows) for run in plan.runs]


def test_a_row_alone_runs_as_one_session_in_its_window(spec):
    plan = plan_decode(spec, [DecodeRow(LoraSlot(4), 20)])
    assert runs(plan) == [("decode_attend32_lora_r4", (0,))]
    assert runs(plan_decode(spec, [DecodeRow(None, 40)])) == [("decode", (0,))]


def test_smaller_slots_are_padded_into_the_largest_and_share_its_runs(spec):
    plan = plan_decode(spec, [DecodeRow(LoraSlot(4), 3), DecodeRow(LoraSlot(16), 5), DecodeRow(LoraSlot(4), 20)])
    assert runs(plan) == [("decode_batch4_attend32_lora_r16", (0, 1, 2))]
    assert plan.slots == (LoraSlot(16),) * 3


def test_rows_without_an_adapter_join_the_host_slot_with_zero_inputs(spec):
    plan = plan_decode(spec, [DecodeRow(None, 1), DecodeRow(LoraSlot(4), 2)])
    assert runs(plan) == [("decode_batch2_attend16_lora_r4", (1, 0))]  # the slot's rows first
    assert plan.slots == (None, LoraSlot(4))  # the plain row binds no adapter buffers
    plain_only = plan_decode(spec, [DecodeRow(None, 1), DecodeRow(None, 2), DecodeRow(None, 3)])
    assert runs(plain_only) == [("decode_batch4_attend16_lora_r4", (0, 1, 2))]  # the first batched slot


def test_more_rows_than_the_largest_batch_take_several_runs(spec):
    rows = [DecodeRow(LoraSlot(4), p) for p in (1, 2, 3, 4, 50)]
    assert runs(plan_decode(spec, rows)) == [("decode_batch4_attend16_lora_r4", (0, 1, 2, 3)),
                                             ("decode_lora_r4", (4,))]
    rows = [DecodeRow(LoraSlot(4), p) for p in (1, 2, 3, 4, 5, 6)]
    assert runs(plan_decode(spec, rows)) == [("decode_batch4_attend16_lora_r4", (0, 1, 2, 3)),
                                             ("decode_batch2_attend16_lora_r4", (4, 5))]


def test_rows_past_the_cache_are_not_planned(spec):
    plan = plan_decode(spec, [DecodeRow(LoraSlot(4), 63), DecodeRow(LoraSlot(4), 64), DecodeRow(None, 70)])
    assert plan.overflow == (1, 2)
    assert runs(plan) == [("decode_lora_r4", (0,))]


def test_the_window_is_the_furthest_rows(spec):
    rows = [DecodeRow(LoraSlot(16), 0), DecodeRow(LoraSlot(16), 31)]
    assert runs(plan_decode(spec, rows)) == [("decode_batch2_attend32_lora_r16", (0, 1))]
    rows = [DecodeRow(LoraSlot(16), 0), DecodeRow(LoraSlot(16), 32)]
    assert runs(plan_decode(spec, rows)) == [("decode_batch2_lora_r16", (0, 1))]
