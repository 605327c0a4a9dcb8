"""Adapters made by the real PEFT library and llama.cpp's GGUF layout, run on the test model
and compared with transformers + peft logits (fixtures: tools/build_peft_fixtures.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import MODEL_FILES, MODELS
from runtime import Engine, LoraSource, SessionConfig
from runtime.errors import InvalidArgumentError

PEFT = MODELS / "peft"
TOL = 1e-4


@pytest.fixture(scope="module")
def reference():
    with np.load(PEFT / "reference.npz") as data:
        return {key: data[key] for key in data.files}


@pytest.fixture(scope="module", params=["default", "transposed", "grouped"])
def engine(request):
    with Engine(MODEL_FILES[request.param]) as engine:
        yield engine


def logits_and_greedy(session, reference):
    tokens = reference["tokens"].tolist()
    rows = [session.run_prefill(tokens[:1])] + [session.run_decode(t) for t in tokens[1:]]
    session.reset()
    greedy = session.generate(reference["prefix"].tolist(), max_new_tokens=8).tokens
    return np.stack(rows), greedy


def check(session, reference, case):
    logits, greedy = logits_and_greedy(session, reference)
    diff = np.abs(logits - reference[f"{case}/logits"]).max()
    assert diff <= TOL, f"{case}: max |diff| {diff:.2e}"
    assert greedy == reference[f"{case}/greedy"].tolist()
    return diff


@pytest.mark.parametrize(
    "case,sources",
    [
        ("base", []),
        ("qkvo_r4", [LoraSource(path=PEFT / "qkvo_r4")]),
        ("qv_r8_rslora", [LoraSource(path=PEFT / "qv_r8_rslora")]),
        ("rank_pattern", [LoraSource(path=PEFT / "rank_pattern")]),
        ("layers_1_only", [LoraSource(path=PEFT / "layers_1_only")]),
        ("qkvo_r4_scale_0.5", [LoraSource(path=PEFT / "qkvo_r4", scale=0.5)]),
        ("blend_cat_qkvo_r4_0.7_qkvo_r4_b_0.3",
         [LoraSource(path=PEFT / "qkvo_r4", scale=0.7), LoraSource(path=PEFT / "qkvo_r4_b", scale=0.3)]),
        ("blend_cat", [LoraSource(path=PEFT / "blend_cat")]),
        ("qkvo_r4", [LoraSource(path=PEFT / "qkvo_r4.gguf")]),  # llama.cpp layout, q/k rows permuted
        ("qkvo_r4_f16_gguf", [LoraSource(path=PEFT / "qkvo_r4_f16.gguf")]),
    ],
)
def test_matches_transformers_and_peft(engine, reference, case, sources):
    with engine.create_session(SessionConfig(loras=sources)) as session:
        check(session, reference, case)


def test_blend_costs_one_slot_of_the_summed_rank(engine):
    sources = [LoraSource(path=PEFT / "qkvo_r4", scale=0.7), LoraSource(path=PEFT / "qkvo_r4_b", scale=0.3)]
    with engine.create_session(SessionConfig(loras=sources)) as session:
        session.run_decode(1)
        (resident,) = [r for r in engine.stats().resident if r.blend == session.blend]
        assert resident.slot_rank == 16  # 4 + 4 -> smallest slot that fits
    too_wide = [LoraSource(path=PEFT / "qv_r8_rslora"), LoraSource(path=PEFT / "rank_pattern"),
                LoraSource(path=PEFT / "qkvo_r4")]  # 8 + 8 + 4 = 20
    with pytest.raises(InvalidArgumentError, match=r"need rank 20 together.*slots: r4, r16"):
        engine.create_session(SessionConfig(loras=too_wide))


def test_state_dict_in_memory(engine, reference):
    state = load_file(str(PEFT / "qv_r8_rslora" / "adapter_model.safetensors"))
    config = json.loads((PEFT / "qv_r8_rslora" / "adapter_config.json").read_text())
    with engine.create_session(SessionConfig(lora_buffer=state, lora_peft_config=config)) as session:
        check(session, reference, "qv_r8_rslora")


def test_mlp_only_adapter_is_refused_with_the_list(engine):
    before = engine.adapter_ids()
    with pytest.raises(InvalidArgumentError) as info:
        engine.create_session(SessionConfig(lora_path=PEFT / "mlp_only"))
    message = str(info.value)
    assert "12 tensor(s) are on MLP projections" in message and "--lora-targets all-linear" in message
    for layer in (0, 1):
        for module in ("gate", "up", "down"):
            assert f"lora_ff_{module}_a_prime_weight_{layer}" in message
    assert engine.adapter_ids() == before  # nothing half-registered


def test_gguf_of_the_wrong_type_is_refused(engine):
    with pytest.raises(InvalidArgumentError, match="general.type is 'model', expected 'adapter'"):
        engine.create_session(SessionConfig(lora_path=PEFT / "not_an_adapter.gguf"))


@pytest.mark.parametrize("convention,dtype,tol", [("litert-lm", "f32", TOL), ("litert-torch", "f32", TOL),
                                                  ("litert-lm", "f16", 5e-3)])
def test_convert_round_trip(tmp_path, reference, convention, dtype, tol):
    out = tmp_path / "converted.tflite"
    done = subprocess.run(
        [sys.executable, "-m", "runtime", "convert", str(PEFT / "rank_pattern"), "--model",
         str(MODEL_FILES["default"]), "--out", str(out), "--convention", convention, "--dtype", dtype],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    with Engine(MODEL_FILES["default"]) as engine, engine.create_session(SessionConfig(lora_path=out)) as session:
        logits, _ = logits_and_greedy(session, reference)
    assert np.abs(logits - reference["rank_pattern/logits"]).max() <= tol


def test_convert_refuses_what_does_not_fit(tmp_path):
    out = tmp_path / "x.tflite"
    done = subprocess.run(
        [sys.executable, "-m", "runtime", "convert", str(PEFT / "mlp_only"), "--model",
         str(MODEL_FILES["default"]), "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2 and "--lora-targets all-linear" in done.stderr
    assert not out.exists() and not (tmp_path / "x.tflite.partial").exists()
