"""Each supported family, exported by ``runtime.export`` (tools/build_family_fixtures.py), gives
float64 transformers' logits and greedy tokens through this runtime: plain, and with PEFT
adapters against transformers + peft (on q/k/v/o, and on every linear projection where the
family's export has all-linear slots, and a DoRA one where it has DoRA slots). The tiny exports and the references are committed,
so this runs without torch."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import MODELS
from runtime import Engine, SessionConfig

FAMILIES = MODELS / "families"
MANIFEST = json.loads((FAMILIES / "MANIFEST.json").read_text())
TOLERANCE = 1e-4


CASES = [(family, adapter) for family, entry in sorted(MANIFEST["families"].items())
         for adapter in (None, *sorted(entry["adapters"]))]


@pytest.mark.parametrize("family, adapter", CASES, ids=[f"{f}-{a or 'plain'}" for f, a in CASES])
def test_logits_match_float64_transformers(family: str, adapter: str | None) -> None:
    with np.load(FAMILIES / family / "reference.npz") as data:
        reference = {key: data[key] for key in data.files}
    tokens = [int(t) for t in reference["tokens"]]
    prompt_len = int(reference["prompt_len"])
    expected = reference[f"logits_{adapter}" if adapter else "logits"]
    config = SessionConfig(lora_path=FAMILIES / family / adapter if adapter else None)
    with Engine(FAMILIES / family / "model.tflite") as engine, engine.create_session(config) as session:
        rows = [session.run_prefill(tokens[:prompt_len])]
        rows += [session.run_decode(token) for token in tokens[prompt_len:]]
    got = np.stack(rows)
    assert got.shape == expected.shape and got.shape[0] >= 16
    assert np.max(np.abs(got - expected)) <= TOLERANCE
    assert np.std(expected) > 1.0  # logits spread over units, so the tolerance means something
    if adapter:
        assert np.max(np.abs(expected - reference["logits"])) > 0.5  # the adapter matters
    if adapter == "adapter_all_linear":  # its MLP part matters too
        assert np.max(np.abs(expected - reference["logits_adapter"])) > 0.5


@pytest.mark.parametrize("family, adapter", CASES, ids=[f"{f}-{a or 'plain'}" for f, a in CASES])
def test_greedy_tokens_match(family: str, adapter: str | None) -> None:
    with np.load(FAMILIES / family / "reference.npz") as data:
        prompt = [int(t) for t in data["tokens"][: int(data["prompt_len"])]]
        expected = data[f"greedy_{adapter}" if adapter else "greedy"].tolist()
    config = SessionConfig(lora_path=FAMILIES / family / adapter if adapter else None)
    with Engine(FAMILIES / family / "model.tflite") as engine, engine.create_session(config) as session:
        result = session.generate(prompt, max_new_tokens=len(expected), stop_tokens=[])
    assert result.tokens == expected


def test_every_family_has_a_small_fixture() -> None:
    assert set(MANIFEST["families"]) == {"llama", "llama3", "qwen2", "qwen3", "gemma3"}
    assert {family for family, entry in MANIFEST["families"].items() if "adapter_all_linear" in entry["adapters"]} \
        == {"llama", "llama3", "qwen2", "qwen3"}
    assert {family for family, entry in MANIFEST["families"].items() if "adapter_dora" in entry["adapters"]} \
        == {"llama", "qwen2", "qwen3"}  # DoRA slots: interleaved q/k/v, q/k/v biases, q/k/v split per head
    for family, entry in MANIFEST["families"].items():
        assert entry["files"]["model.tflite"]["size_bytes"] < 2_000_000, family
