"""Tests for runtime.executor.model_spec: discovering what an export offers."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest

from conftest import MODEL_FILES
from runtime.errors import InvalidArgumentError, NotFoundError, UnimplementedError
from runtime.executor.litert_executor import LlmExecutor
from runtime.executor.native import NativeModel
from runtime.util import flatbuffer_model
from runtime.util.kv_layout import KV_LAYOUT_METADATA, named_kv_layout
from runtime.util.model_view import ModelFile, signature_details
from runtime.executor.model_spec import ModelSpec, signature_group
from runtime.util.signature_names import ALL_LINEAR, LoraSlot


@pytest.fixture(scope="module")
def details():
    model = NativeModel(MODEL_FILES["default"], num_threads=1, weight_cache=":memory:", name="default")
    found = model.signature_details()
    model.close()
    return found


@pytest.mark.parametrize("layout", ["default", "transposed", "grouped"])
def test_discovers_the_test_models(layout):
    executor = LlmExecutor(MODEL_FILES[layout])
    spec = executor.spec
    assert spec.kv_layout == layout
    assert spec.kv_length == 64
    assert spec.vocab_size == 256
    assert spec.num_layers == 2
    assert spec.prefill_lengths == (8, 32)
    assert spec.slots == (LoraSlot(4), LoraSlot(16))
    assert spec.prefill_has_logits == (layout != "default")
    assert spec.kv_cache_bytes == 4 * 64 * 2 * 16 * 4
    assert len(spec.slot_inputs(LoraSlot(4))) == 16
    assert spec.slot_inputs(LoraSlot(16))["lora_atten_k_b_prime_weight_1"].shape == (16, 32)
    assert spec.slot_for(LoraSlot(5)) == LoraSlot(16) and spec.slot_for(LoraSlot(17)) is None
    assert spec.slot_for(LoraSlot(4, ALL_LINEAR)) is None  # attention-only slots: no MLP inputs
    assert spec.prefill(8, LoraSlot(4)).key == "prefill_8_lora_r4"
    with pytest.raises(NotFoundError):
        spec.prefill(9)
    assert spec.batch_sizes(LoraSlot(4)) == spec.batch_sizes(LoraSlot(16)) == (2, 4) and spec.batch_sizes(None) == ()
    batch = spec.decode_batch(4, LoraSlot(16))
    assert (batch.key, batch.rows, batch.lora_slot) == ("decode_batch4_lora_r16", 4, LoraSlot(16))
    assert batch.lora_inputs == spec.slot_inputs(LoraSlot(16))  # each row takes what decode_lora_r16 takes
    assert batch.row_input("kv_cache_v_1_3") == (3, "kv_cache_v_1") and batch.row_input("tokens") is None
    assert spec.decode(LoraSlot(16)).key == "decode_lora_r16"
    assert spec.windows(None) == spec.windows(LoraSlot(16)) == spec.windows(LoraSlot(4), rows=2) == (16, 32)
    assert [spec.window_for(p, LoraSlot(16)) for p in (0, 15, 16, 31, 32, 63)] == [16, 16, 32, 32, None, None]
    assert spec.decode(LoraSlot(4), window=16).key == "decode_attend16_lora_r4"
    assert spec.decode_batch(4, LoraSlot(16), window=32).key == "decode_batch4_attend32_lora_r16"
    with pytest.raises(NotFoundError, match="attending over 8 positions"):
        spec.decode(None, window=8)
    # Prefill chunks of 8 attend over 16 or 32 positions, of 32 over 32; a chunk's last position picks.
    assert spec.windows(LoraSlot(4), kind="prefill", seq_len=8) == (16, 32)
    assert spec.windows(None, kind="prefill", seq_len=32) == (32,)
    assert [spec.window_for(p, None, kind="prefill", seq_len=8) for p in (7, 15, 16, 31, 32)] == [16, 16, 32, 32, None]
    assert spec.prefill(8, LoraSlot(16), window=32).key == "prefill_8_attend32_lora_r16"
    assert spec.prefill_lengths == (8, 32)
    executor.close()



def test_the_layout_a_model_names_is_read_and_checked_against_its_caches():
    """The grouped layout's K and V have one shape, as litert-torch's default layout's do:
    the model names its layout (an export of before that names none and is told by its
    shapes), and caches shaped otherwise than the layout named are refused, naming both."""
    headers = {layout: ModelFile(path).header() for layout, path in MODEL_FILES.items()}
    assert named_kv_layout(headers["grouped"]) == "grouped"
    assert named_kv_layout(headers["default"]) is None and named_kv_layout(headers["transposed"]) is None
    assert named_kv_layout(b"not a model at all") is None
    grouped = signature_details(headers["grouped"])
    assert ModelSpec.from_details(grouped, "g.tflite", "grouped").kv_position_axis("kv_cache_v_0") == 2
    with pytest.raises(InvalidArgumentError, match=r"g\.tflite: signature 'decode': K \[1, 2, 64, 16\] float32 and "
                       r"V \[1, 2, 64, 16\] float32 are not the transposed KV layout's"):
        ModelSpec.from_details(grouped, "g.tflite")  # told by the shapes: V is not K transposed
    transposed = signature_details(headers["transposed"])
    with pytest.raises(InvalidArgumentError, match=r"not the grouped KV layout's \(K and V \[1, groups, positions"):
        ModelSpec.from_details(transposed, "t.tflite", "grouped")
    with pytest.raises(InvalidArgumentError, match="not the default KV layout's"):
        ModelSpec.from_details(transposed, "t.tflite", "default")


def test_a_model_naming_an_unknown_layout_is_refused(tmp_path):
    model = flatbuffer_model.unpack(MODEL_FILES["grouped"].read_bytes())
    entry = next(entry for entry in model.metadata if entry.name == KV_LAYOUT_METADATA.encode())
    model.buffers[entry.buffer].data = np.frombuffer(b"sideways", dtype=np.uint8)
    path = tmp_path / "sideways.tflite"
    flatbuffer_model.write(model, path)
    with pytest.raises(InvalidArgumentError, match=f"sideways.tflite: its {KV_LAYOUT_METADATA} metadata names the "
                       "KV layout 'sideways', expected one of default, transposed, grouped"):
        LlmExecutor(path)

def test_refuses_attention_windows_it_cannot_honour(details):
    short = {**details, "prefill_32_attend16": details["prefill_32"]}
    with pytest.raises(InvalidArgumentError, match=r"'prefill_32_attend16' attends over 16 positions, expected 32 "):
        ModelSpec.from_details(short, "m")
    with_logits = copy.deepcopy(details)
    inputs, outputs = with_logits["prefill_8_attend16"]
    outputs.setdefault("logits", {"shape": [1, 8, 256], "dtype": np.float32})
    with_logits["prefill_8"][1].pop("logits", None)
    with pytest.raises(InvalidArgumentError, match="'prefill_8_attend16' takes or returns other tensors than its "
                                                   "whole-cache counterpart 'prefill_8'"):
        ModelSpec.from_details(with_logits, "m")
    too_long = {**details, "decode_attend64": details["decode_attend16"]}
    with pytest.raises(InvalidArgumentError, match=r"'decode_attend64' attends over 64 positions, expected 1 ... 63"):
        ModelSpec.from_details(too_long, "m")
    whole = {**details, "decode_attend16": details["decode"]}  # an export older than window-sized caches
    with pytest.raises(InvalidArgumentError, match=r"'decode_attend16' input 'kv_cache_k_0' is kv_cache_k_0 "
                                                   r"\[1, 64, 2, 16\] float32, expected kv_cache_k_0 "
                                                   r"\[1, 16, 2, 16\] .*export the model again"):
        ModelSpec.from_details(whole, "m")
    orphan = {k: v for k, v in details.items() if not k.startswith("decode_batch4_lora")}
    with pytest.raises(InvalidArgumentError, match="'decode_batch4_attend16_lora_r4' has no whole-cache counterpart"):
        ModelSpec.from_details(orphan, "m")


def test_refuses_batched_signatures_whose_rows_differ_from_decode(details):
    missing = copy.deepcopy(details)
    del missing["decode_batch2_lora_r4"][0]["lora_atten_v_b_prime_weight_1"]
    with pytest.raises(InvalidArgumentError, match=r"'decode_batch2_lora_r4' LoRA inputs differ from "
                                                   r"'decode_lora_r4''s stacked over 2 rows, "
                                                   r"e.g. \['lora_atten_v_b_prime_weight_1'\]"):
        ModelSpec.from_details(missing, "m")
    unstacked = copy.deepcopy(details)
    unstacked["decode_batch2_lora_r4"][0]["lora_atten_q_a_prime_weight_0"]["shape"] = [4, 32, 4]
    with pytest.raises(InvalidArgumentError, match=r"input 'lora_atten_q_a_prime_weight_0' is \[4, 32, 4\] float32, "
                                                   r"expected \[2, ...\] float32 or float16: the rows' LoRA weights "
                                                   r"stacked"):
        ModelSpec.from_details(unstacked, "m")
    per_row = copy.deepcopy(details)  # an export from before the rows' LoRA inputs were stacked
    inputs = per_row["decode_batch2_lora_r4"][0]
    for name in [name for name in inputs if name.startswith("lora_")]:
        stacked = inputs.pop(name)
        for row in range(2):
            inputs[f"{name}_{row}"] = {**stacked, "shape": stacked["shape"][1:]}
    with pytest.raises(UnimplementedError, match=r"LoRA inputs per row: an export older than stacked batch LoRA "
                                                 r"inputs; export the model again"):
        ModelSpec.from_details(per_row, "m")
    shape = copy.deepcopy(details)
    shape["decode_batch4_lora_r16"][0]["kv_cache_k_0_2"]["shape"] = [1, 32, 2, 16]
    with pytest.raises(InvalidArgumentError, match=r"input kv_cache_k_0_2 is \[1, 32, 2, 16\] float32, expected"):
        ModelSpec.from_details(shape, "m")
    stray = copy.deepcopy(details)
    stray["decode_batch2_lora_r4"][0]["kv_cache_k_0_7"] = stray["decode_batch2_lora_r4"][0]["kv_cache_k_0_0"]
    with pytest.raises(UnimplementedError, match="cannot feed: 'kv_cache_k_0_7'"):
        ModelSpec.from_details(stray, "m")
    tokens = copy.deepcopy(details)
    tokens["decode_batch2_lora_r4"][0]["tokens"]["shape"] = [1, 1]
    with pytest.raises(InvalidArgumentError, match=r"input 'tokens' is \[1, 1\] int32, expected \[2, 1\] int32"):
        ModelSpec.from_details(tokens, "m")


def test_refuses_exports_it_cannot_drive(details):
    no_decode = {k: v for k, v in details.items() if not k.startswith("decode")}
    with pytest.raises(InvalidArgumentError, match="no plain 'decode'"):
        ModelSpec.from_details(no_decode, "m")
    with pytest.raises(UnimplementedError, match="neither prefill nor decode"):
        ModelSpec.from_details({**details, "embed": details["decode"]}, "m")
    extra = copy.deepcopy(details)
    extra["decode"][0]["mask"] = {"shape": [1, 1, 1, 64], "dtype": "float32"}
    with pytest.raises(UnimplementedError, match=r"cannot feed: \['mask'\]"):
        ModelSpec.from_details(extra, "m")
    mixed = copy.deepcopy(details)
    mixed["decode_lora_r4"][0]["lora_atten_q_a_prime_weight_0"]["shape"] = [64, 8]
    with pytest.raises(InvalidArgumentError, match="mixes LoRA ranks"):
        ModelSpec.from_details(mixed, "m")
    kv = copy.deepcopy(details)
    kv["prefill_8"][0]["kv_cache_k_1"]["shape"] = [1, 32, 2, 16]
    with pytest.raises(InvalidArgumentError, match="'prefill_8' input 'kv_cache_k_1'"):
        ModelSpec.from_details(kv, "m")
    # found by fuzzing model files: a signature's logits of no shape escaped as numpy's ValueError at its first run
    for shape in ([], [1, 1, 255]):
        logits = copy.deepcopy(details)
        logits["decode_lora_r4"][1]["logits"]["shape"] = shape
        expected = f"signature 'decode_lora_r4' output logits {shape} float32: expected [1, 1, 256] float32, logits " \
                   "of the vocabulary 'decode' returns (256) for each of its tokens"
        with pytest.raises(InvalidArgumentError, match=re.escape(expected)):
            ModelSpec.from_details(logits, "m")


def test_dora_scale_inputs_are_checked_against_their_projection(details):
    fan_out = details["decode_lora_r4"][0]["lora_atten_q_b_prime_weight_0"]["shape"][1]
    wrong = copy.deepcopy(details)
    wrong["decode_lora_r4"][0]["lora_atten_q_m_prime_weight_0"] = {"shape": [fan_out + 1], "dtype": "float32"}
    with pytest.raises(InvalidArgumentError, match=rf"DoRA scale input .*lora_atten_q_m_prime_weight_0.*"
                                                   rf"expected \[{fan_out}\] float32"):
        ModelSpec.from_details(wrong, "m")
    partial = copy.deepcopy(details)
    partial["decode_lora_r4"][0]["lora_atten_q_m_prime_weight_0"] = {"shape": [fan_out], "dtype": "float32"}
    with pytest.raises(InvalidArgumentError, match="a DoRA slot is an all-linear slot with a scale per projection"):
        ModelSpec.from_details(partial, "m")


def test_signatures_are_grouped_by_what_a_session_needs_together(details):
    spec = ModelSpec.from_details(details, "m.tflite")
    groups = spec.groups
    assert list(groups)[0] == "plain"
    assert sorted(key for keys in groups.values() for key in keys) == sorted(spec.signatures)  # a partition
    # A short prompt's group: decode and the shortest prefill, their windows; a longer prefill apart.
    assert set(groups["plain"]) == {"prefill_8", "decode", "decode_attend16", "decode_attend32",
                                    "prefill_8_attend16", "prefill_8_attend32"}
    assert set(groups["plain_prefill32"]) == {"prefill_32", "prefill_32_attend32"}
    assert all(key.endswith("_lora_r4") and "batch" not in key and "prefill_32" not in key
               for key in groups["lora_r4"])
    assert all(key.startswith("prefill_32") for key in groups["lora_r4_prefill32"])
    assert "decode_lora_r4" in groups["lora_r4"] and "decode_batch2_lora_r4" in groups["batch2_lora_r4"]
    assert set(groups) == {"plain", "plain_prefill32", "lora_r4", "lora_r4_prefill32", "lora_r16",
                           "lora_r16_prefill32", "batch2_lora_r4", "batch4_lora_r4", "batch2_lora_r16",
                           "batch4_lora_r16"}
    assert spec.group_of(spec.signatures["decode_batch4_attend16_lora_r16"]) == "batch4_lora_r16"
    assert spec.session_groups(None) == ("plain", "plain_prefill32")
    assert spec.session_groups(LoraSlot(16)) == ("lora_r16", "lora_r16_prefill32")


@pytest.mark.parametrize(("kind", "rows", "slot", "group"), [
    ("prefill", 1, None, "plain"), ("decode", 1, LoraSlot(8), "lora_r8"),
    ("decode", 1, LoraSlot(16, ALL_LINEAR), "lora_all_r16"), ("verify", 1, None, "verify"),
    ("verify", 1, LoraSlot(8), "verify_lora_r8"), ("score", 1, LoraSlot(4), "score_lora_r4"),
    ("decode", 8, None, "batch8"), ("decode", 2, LoraSlot(8, ALL_LINEAR), "batch2_lora_all_r8"),
])
def test_group_names(kind, rows, slot, group):
    assert signature_group(kind, rows, slot) == group


def _with(details, key: str, side: int, name: str, shape, dtype=np.float32):
    """``details`` with tensor ``name`` of signature ``key`` (``side`` 0: inputs, 1: outputs)
    set to ``shape`` and ``dtype`` (``shape`` None: removed), in every signature when
    ``key`` is None."""
    changed = copy.deepcopy(details)
    for signature in ([key] if key else list(changed)):
        tensors = changed[signature][side]
        if shape is None:
            tensors.pop(name, None)
        else:
            tensors[name] = {"shape": shape, "dtype": dtype}
    return changed


@pytest.mark.parametrize("key, side, name, shape, dtype, error, message", [
    # A run fills a position per token: a shorter input_pos made the first prefill fail on a
    # numpy broadcast, a longer one ran positions nobody wrote.
    ("prefill_8", 0, "input_pos", (1,), np.int32, InvalidArgumentError,
     "signature 'prefill_8' input 'input_pos' is [1] int32, expected [8] int32"),
    ("decode", 0, "input_pos", (2,), np.int32, InvalidArgumentError,
     "signature 'decode' input 'input_pos' is [2] int32, expected [1] int32"),
    ("decode", 0, "input_pos", (1,), np.float32, InvalidArgumentError,
     "signature 'decode' input 'input_pos' is [1] float32, expected [1] int32"),
    # An output the executor binds no buffer to: binding the signature failed on a KeyError.
    ("prefill_8", 1, "attention_probs", (1, 8), np.float32, UnimplementedError,
     "signature 'prefill_8' has outputs this runtime cannot bind: ['attention_probs']"),
    # A final hidden state of the last token only: the executor's open failed on a numpy reshape.
    ("prefill_8", 1, "hidden", (1, 1, 32), np.float32, InvalidArgumentError,
     "signature 'prefill_8' output 'hidden' is [1, 1, 32] float32, expected [1, 8, width] float32"),
    # Logits of the last token only: a prefill chunk's logits were read past them (IndexError).
    ("prefill_8", 1, "logits", (1, 1, 256), np.float32, InvalidArgumentError,
     "signature 'prefill_8' output logits [1, 1, 256] float32: expected [1, 8, 256] float32"),
    ("decode", 1, "logits", (1, 2, 256), np.float32, InvalidArgumentError,
     "signature 'decode' output logits [1, 2, 256] float32: expected [1, 1, 256] float32"),
    # Layer 0's caches missing, or a cache not 4-D: named with the signature, not a bare "expected 4-D".
    (None, 0, "kv_cache_v_0", None, None, InvalidArgumentError,
     "m.tflite: signature 'decode' has no 'kv_cache_v_0' input"),
    ("decode", 0, "kv_cache_k_1", (1, 64, 32), np.float32, InvalidArgumentError,
     "m.tflite: signature 'decode' input 'kv_cache_k_1' is [1, 64, 32] float32, expected 4-D"),
])
def test_malformed_signatures_are_refused_naming_the_signature_and_tensor(details, key, side, name, shape, dtype,
                                                                         error, message):
    windowless = {key: tensors for key, tensors in details.items() if "attend" not in key}
    with pytest.raises(error, match=re.escape(message)):
        ModelSpec.from_details(_with(windowless, key, side, name, shape, dtype), "m.tflite")


def test_a_kv_cache_of_another_dtype_in_a_whole_cache_signature_gets_no_window_hint(details):
    """The hint about windows' caches (an older export) is for windowed signatures only."""
    changed = _with(details, "prefill_8", 0, "kv_cache_k_0", (1, 64, 2, 16), np.float16)
    with pytest.raises(InvalidArgumentError, match="'prefill_8' input 'kv_cache_k_0'") as refused:
        ModelSpec.from_details(changed, "m.tflite")
    assert "attention window" not in str(refused.value)


def test_signatures_of_a_lora_slot_that_disagree_are_refused_naming_the_tensor(details):
    """A slot's prefill without its decode signature was accepted (an adapter's buffers are
    made for the decode signature: NotFoundError at the slot's first use); LoRA inputs or
    outputs that differ named the signatures but not the tensor."""
    windowless = {key: tensors for key, tensors in details.items() if "attend" not in key}
    reshaped = _with(windowless, "prefill_8_lora_r4", 0, "lora_atten_k_b_prime_weight_1", (4, 31))
    with pytest.raises(InvalidArgumentError, match=re.escape(
            "signature 'prefill_8_lora_r4' LoRA inputs differ from 'decode_lora_r4''s, e.g. "
            "['lora_atten_k_b_prime_weight_1']")):
        ModelSpec.from_details(reshaped, "m.tflite")
    no_decode = {key: tensors for key, tensors in windowless.items()
                 if not (key.startswith("decode") and key.endswith("_lora_r4"))}
    with pytest.raises(InvalidArgumentError, match=re.escape(
            "has no decode signature of its LoRA slot beside it (expected 'decode_lora_r4')")):
        ModelSpec.from_details(no_decode, "m.tflite")
    no_logits = _with(details, "decode_attend16", 1, "logits", None)
    with pytest.raises(InvalidArgumentError, match=re.escape(
            "signature 'decode_attend16' takes or returns other tensors than its whole-cache counterpart 'decode', "
            "e.g. ['logits']")):
        ModelSpec.from_details(no_logits, "m.tflite")
