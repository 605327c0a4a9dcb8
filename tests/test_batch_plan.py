"""Tests for runtime.executor.batch_plan: which signature runs which rows, in which slot.

The test model (tests/models/gqa_default.tflite) has LoRA slots r4 and r16 (attention only), batched decode
of 2 and 4 rows for both slots (none without LoRA), windows 16 and 32, a KV cache of 64.
"""

from __future__ import annotations

import pytest

from conftest import MODEL_FILES
from runtime.executor.batch_plan import DecodeRow, plan_decode
from runtime.executor.litert_executor import LlmExecutor
from runtime.executor.model_spec import ModelSpec, SignatureSpec
from runtime.util.signature_names import ALL_LINEAR, DORA, LoraSlot, SignatureName


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


class AllLinearSpec:
    """What the planner asks of a model, for one with attention-only and all-linear r8
    slots, batches of 2 and 4 rows in both, and no windows (KV 64)."""

    kv_length = 64
    slots = (LoraSlot(8), LoraSlot(8, ALL_LINEAR))

    def batch_sizes(self, slot):
        return (2, 4) if slot is not None else ()

    def window_for(self, position, slot, rows=1):
        return None

    def decode(self, slot=None, window=None):
        return SignatureSpec(str(SignatureName("decode", lora_slot=slot)), "decode", 1, slot, {}, {})

    def decode_batch(self, rows, slot, window=None):
        return SignatureSpec(str(SignatureName("decode", rows=rows, lora_slot=slot)), "decode", 1, slot, {}, {}, rows)


def test_attention_rows_are_padded_into_an_all_linear_host():
    attention, everything = LoraSlot(8), LoraSlot(8, ALL_LINEAR)
    plan = plan_decode(AllLinearSpec(), [DecodeRow(attention, 1), DecodeRow(everything, 2), DecodeRow(None, 3)])
    assert runs(plan) == [("decode_batch4_lora_all_r8", (0, 1, 2))]
    assert plan.slots == (everything, everything, None)  # zero MLP inputs for the attention row: exact
    alone = plan_decode(AllLinearSpec(), [DecodeRow(attention, 1), DecodeRow(attention, 2)])
    assert runs(alone) == [("decode_batch2_lora_r8", (0, 1))]  # without an MLP row, the cheaper slot


class DoraSpec(AllLinearSpec):
    """:class:`AllLinearSpec` with a DoRA r8 slot beside, whose signatures are single-session only."""

    slots = (*AllLinearSpec.slots, LoraSlot(8, DORA))

    def batch_sizes(self, slot):
        return () if slot is None or slot.targets == DORA else (2, 4)


def test_a_dora_row_steps_alone_and_the_others_batch_without_it():
    everything, dora = LoraSlot(8, ALL_LINEAR), LoraSlot(8, DORA)
    plan = plan_decode(DoraSpec(), [DecodeRow(everything, 1), DecodeRow(dora, 2), DecodeRow(everything, 3)])
    assert runs(plan) == [("decode_batch2_lora_all_r8", (0, 2)), ("decode_lora_dora_r8", (1,))]
    assert plan.slots == (everything, dora, everything)
