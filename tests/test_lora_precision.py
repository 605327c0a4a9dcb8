"""LoRA factors in float16 (``--lora-dtype float16``, runtime.util.lora_precision): the
committed fixtures' factor inputs converted at test time, run against the float32 originals
given the same factors rounded to float16, in the standard form and in the LoRA-delta op's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ai_edge_litert import schema_py_generated as schema

from batching import assert_rows_equal_alone, four_adapter_rows, greedy_alone
from conftest import MODELS, adapter_path, run_signature, step_inputs
from graph_passes import converted, needs_kernel, through
from runtime import Engine, SessionConfig
from runtime.errors import InvalidArgumentError
from runtime.executor.native import NativeModel
from runtime.export.settings import ExportSettings
from runtime.util import flatbuffer_model
from runtime.util.attention_rewrite import LORA_DELTA, attention_forms, rewrite_decode_attention
from runtime.util.graph_edit import op_name
from runtime.util.lora_precision import is_lora_factor, lora_factors_to_float16
from runtime.util.model_view import signature_details

# Llama-like GQA in the transposed layout (what the kernels read) and Gemma 3 (its own
# steps, an all-linear slot), both with batched rows.
FIXTURES = {"gqa": MODELS / "gqa_transposed.tflite", "gemma3": MODELS / "gemma3" / "model.tflite"}
TOOL = Path(__file__).resolve().parent.parent / "tools" / "attention_kernel.py"


def to_float16(source: Path, out: Path, attention: str | None = None) -> dict[str, int]:
    return through(lora_factors_to_float16, source, out, attention)


@pytest.fixture(scope="module")
def half(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return converted(lora_factors_to_float16, FIXTURES, tmp_path_factory.mktemp("lora_float16"))


@pytest.mark.parametrize("fixture", sorted(FIXTURES))
def test_every_signatures_factors_become_float16_and_nothing_else(fixture, half):
    before, after = signature_details(FIXTURES[fixture].read_bytes()), signature_details(half[fixture].read_bytes())
    assert before.keys() == after.keys()
    factors = 0
    for key in before:
        for side in (0, 1):  # inputs, outputs
            assert before[key][side].keys() == after[key][side].keys()
            for name, detail in before[key][side].items():
                changed = after[key][side][name]
                assert list(changed["shape"]) == list(detail["shape"])
                if side == 0 and is_lora_factor(name.encode()):
                    assert np.dtype(detail["dtype"]) == np.float32 and np.dtype(changed["dtype"]) == np.float16
                    factors += 1
                else:
                    assert np.dtype(changed["dtype"]) == np.dtype(detail["dtype"]), f"{key}: {name}"
    assert factors > 0


def factor_inputs(model: NativeModel, key: str, seed: int) -> dict[str, np.ndarray]:
    """One step's inputs of ``key`` (conftest.step_inputs) with LoRA factors of the size of a
    trained adapter's, rounded to float16 (kept as float32 arrays)."""
    inputs = step_inputs(model, key, position=5, seed=seed)
    rng = np.random.default_rng(seed + 1)
    for name, value in inputs.items():
        if is_lora_factor(name.encode()):
            inputs[name] = (0.05 * rng.standard_normal(value.shape)).astype(np.float16).astype(np.float32)
    return inputs


@pytest.mark.parametrize("fixture", sorted(FIXTURES))
def test_the_standard_form_computes_what_float32_factors_of_the_same_values_do(fixture, half):
    """Every signature with factors (prefill, decode, windows, batched rows), the float16
    model given the factors as float16 and the original given the same values as float32:
    the same outputs (the DEQUANTIZE is exact; float32 sums in the same order)."""
    original = NativeModel(FIXTURES[fixture], num_threads=1, weight_cache=":memory:", name="original")
    converted = NativeModel(half[fixture], num_threads=1, weight_cache=":memory:", name="float16")
    try:
        keys = [key for key, sig in converted.signatures.items() if any(is_lora_factor(n.encode()) for n in sig.inputs)]
        assert any(key.startswith("decode_batch") for key in keys) and any(key.startswith("prefill") for key in keys)
        for seed, key in enumerate(keys):
            inputs = factor_inputs(original, key, seed)
            want = run_signature(original, key, inputs)
            got = run_signature(converted, key, {name: value.astype(np.float16) if is_lora_factor(name.encode())
                                                 else value for name, value in inputs.items()})
            for name in want:
                assert np.allclose(got[name], want[name], rtol=0, atol=1e-6), f"{key}: {name}"
    finally:
        original.close()
        converted.close()


@needs_kernel
@pytest.mark.parametrize("fixture", sorted(FIXTURES))
def test_the_op_reads_float16_factors_as_the_standard_form_does(fixture, half, tmp_path, kernel_cache):
    """The op form over float16 factors (the kernel converting as it reads, the DEQUANTIZEs
    dropped) against the standard form over the same factors: every decode signature with
    factors, single-row and batched, within 1e-4 of the logits' range (the ops sum in
    another order, as with float32 factors)."""
    native_path = tmp_path / "native.tflite"
    to_float16(FIXTURES[fixture], native_path, attention="native")
    standard = NativeModel(half[fixture], num_threads=1, weight_cache=":memory:", name="standard")
    native = NativeModel(native_path, num_threads=1, weight_cache=":memory:", name="native")
    try:
        keys = [key for key, sig in native.signatures.items()
                if key.startswith("decode") and any(is_lora_factor(n.encode()) for n in sig.inputs)]
        assert keys
        for seed, key in enumerate(keys):
            inputs = {name: value.astype(np.float16) if is_lora_factor(name.encode()) else value
                      for name, value in factor_inputs(standard, key, seed).items()}
            want, got = run_signature(standard, key, inputs), run_signature(native, key, inputs)
            scale = max(1.0, float(np.abs(want["logits"]).max()))
            assert float(np.abs(got["logits"] - want["logits"]).max()) <= 1e-4 * scale, key
    finally:
        standard.close()
        native.close()


@needs_kernel
def test_a_file_of_both_forms_reads_the_float16_factors_in_its_op_form(tmp_path, kernel_cache):
    """What ``runtime export --lora-dtype float16`` writes (both forms): each op-form LoRA
    delta reads the float16 factor inputs themselves (no DEQUANTIZE left for them), the
    standard form converts them; run, the op form gives the standard form's tokens."""
    both = tmp_path / "both.tflite"
    to_float16(FIXTURES["gqa"], both, attention="both")
    model = flatbuffer_model.unpack(both.read_bytes())
    delta_code = next(i for i, code in enumerate(model.operatorCodes)
                      if code.customCode in (LORA_DELTA, LORA_DELTA.encode()))
    factors_of = {sig.subgraphIndex: {int(entry.tensorIndex) for entry in sig.inputs if is_lora_factor(entry.name)}
                  for sig in model.signatureDefs}
    checked = 0
    for standard_index, op_index in attention_forms(both.read_bytes()).items():
        standard, op_form = model.subgraphs[standard_index], model.subgraphs[op_index]
        factors = factors_of[standard_index]
        if not factors:
            continue
        converted = lambda sub: {int(op.inputs[0]) for op in sub.operators  # noqa: E731
                                 if op_name(model, op) == "DEQUANTIZE" and int(op.inputs[0]) in factors}
        deltas = [op for op in op_form.operators if op.opcodeIndex == delta_code]
        assert converted(standard) == factors and not converted(op_form)
        assert {int(i) for op in deltas for i in op.inputs[1:]} == factors
        assert all(op_form.tensors[i].type == schema.TensorType.FLOAT16 for i in factors)
        checked += 1
    assert checked
    config = SessionConfig(lora_path=adapter_path("torch_r4"))
    tokens = []
    for path in (both, tmp_path / "standard.tflite"):
        if not path.exists():
            to_float16(FIXTURES["gqa"], path)
        with Engine(path) as engine, engine.create_session(config) as session:
            tokens.append(session.generate([5, 17, 42, 99, 3], 24).tokens)
    assert tokens[0] == tokens[1]


def test_an_adapter_takes_half_the_bytes_and_a_batchs_rows_equal_their_sessions_alone(half):
    """A resident adapter's buffers are half those of the float32 model; 4 sessions with
    rank-4 adapters (one scaled) step together as they step alone, bit for bit, and greedy
    tokens are those of the float32 model (the adapters' weights rounded once, at load)."""
    configs, prompt = four_adapter_rows()
    tokens = assert_rows_equal_alone(half["gqa"], configs, prompt, 5)
    assert tokens == [t for t, _ in greedy_alone(FIXTURES["gqa"], configs, prompt, 5)]
    held = []
    for model in (FIXTURES["gqa"], half["gqa"]):
        with Engine(model) as engine:
            for row, config in enumerate(configs):
                engine.create_session(config).run_prefill(prompt(row))
            held.append(engine.stats().resident_bytes)
    assert held[0] == 2 * held[1] > 0


def test_bad_models_and_settings_are_refused_naming_why(half):
    with pytest.raises(InvalidArgumentError, match=r"signature '\w+', input 'lora_atten_\w+_prime_weight_\d': a "
                                                   "FLOAT16 LoRA factor"):
        lora_factors_to_float16(flatbuffer_model.unpack(half["gqa"].read_bytes()))
    rewritten, _ = rewrite_decode_attention(FIXTURES["gqa"].read_bytes())
    with pytest.raises(InvalidArgumentError, match="already runs the runtime.s custom ops"):
        lora_factors_to_float16(flatbuffer_model.unpack(rewritten))
    with pytest.raises(InvalidArgumentError, match="no LoRA factor input"):
        lora_factors_to_float16(flatbuffer_model.unpack((MODELS / "adapters" / "torch_r4.tflite").read_bytes()))
    with pytest.raises(InvalidArgumentError, match="lora_dtype float16 with no LoRA slot"):
        ExportSettings(kv_length=64, lora_dtype="float16")
    with pytest.raises(InvalidArgumentError, match=r"lora_dtype='bfloat16': expected one of float32, float16"):
        ExportSettings(kv_length=64, lora_ranks=(4,), lora_dtype="bfloat16")


def test_the_tool_stores_an_exports_factors_in_float16_and_makes_its_op_form_again(half, tmp_path, kernel_cache):
    """``tools/attention_kernel.py --lora-dtype float16`` on a file of both forms (what the
    export writes by default): float16 factors, both forms again, and the same logits as
    the standard float16 model."""
    both_f32 = tmp_path / "both.tflite"
    both_f32.write_bytes(rewrite_decode_attention(FIXTURES["gqa"].read_bytes(), keep_standard=True)[0])
    out = tmp_path / "both16.tflite"
    done = subprocess.run([sys.executable, str(TOOL), str(both_f32), "--out", str(out), "--lora-dtype", "float16"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "carried both forms: its op form was made again" in done.stdout
    assert "LoRA factors stored in float16: " in done.stdout
    details = signature_details(out.read_bytes())
    assert {str(np.dtype(detail["dtype"])) for inputs, _ in details.values() for name, detail in inputs.items()
            if is_lora_factor(name.encode())} == {"float16"}
    assert attention_forms(out.read_bytes())
    config = SessionConfig(lora_path=adapter_path("torch_r16"))
    results = []
    for path in (out, half["gqa"]):
        with Engine(path) as engine, engine.create_session(config) as session:
            results.append(session.generate([5, 17, 42, 99, 3], 24).tokens)
    assert results[0] == results[1]
