"""Gemma 3's batched, windowed and all-linear signatures (tools/build_gemma3_fixtures.py):
every adapter through the runtime equals float64 transformers + peft, and every row of a
batch equals its session run alone, across the attention window and the sliding window.
The tiny export and its references are committed, so this runs without torch."""

from __future__ import annotations

import json

import numpy as np
import pytest

from batching import greedy_alone, greedy_together
from conftest import MODELS
from runtime import Engine, LoraSource, SessionConfig

GEMMA3 = MODELS / "gemma3"
MODEL = GEMMA3 / "model.tflite"
MANIFEST = json.loads((GEMMA3 / "MANIFEST.json").read_text())
ADAPTERS = sorted(MANIFEST["adapters"])
TOLERANCE = 1e-4
WINDOW = MANIFEST["export"]["attention_windows"][0]
SLIDING = MANIFEST["transformers_config"]["sliding_window"]


def reference() -> dict[str, np.ndarray]:
    with np.load(GEMMA3 / "reference.npz") as data:
        return {key: data[key] for key in data.files}


def config_of(adapter: str | None) -> SessionConfig:
    return SessionConfig(lora_path=GEMMA3 / adapter if adapter else None)


@pytest.mark.parametrize("adapter", [None, *ADAPTERS], ids=["plain", *ADAPTERS])
def test_logits_match_float64_transformers(adapter: str | None) -> None:
    expected_all = reference()
    tokens = [int(t) for t in expected_all["tokens"]]
    prompt_len = int(expected_all["prompt_len"])
    expected = expected_all[f"logits_{adapter}" if adapter else "logits"]
    with Engine(MODEL) as engine, engine.create_session(config_of(adapter)) as session:
        rows = [session.run_prefill(tokens[:prompt_len])]
        rows += [session.run_decode(token) for token in tokens[prompt_len:]]
    got = np.stack(rows)
    assert prompt_len + len(rows) - 1 > WINDOW > SLIDING  # steps inside and past the window, past the sliding span
    assert got.shape == expected.shape
    assert np.max(np.abs(got - expected)) <= TOLERANCE
    if adapter:
        assert np.max(np.abs(expected - expected_all["logits"])) > 0.5  # the adapter matters
    if adapter and "all_linear" in adapter:  # and its MLP part does: an attention-only reading would be off
        assert np.max(np.abs(expected - expected_all["logits_adapter"])) > 0.5


@pytest.mark.parametrize("adapter", [None, *ADAPTERS], ids=["plain", *ADAPTERS])
def test_greedy_tokens_match(adapter: str | None) -> None:
    data = reference()
    prompt = [int(t) for t in data["tokens"][: int(data["prompt_len"])]]
    expected = data[f"greedy_{adapter}" if adapter else "greedy"].tolist()
    with Engine(MODEL) as engine, engine.create_session(config_of(adapter)) as session:
        assert session.generate(prompt, max_new_tokens=len(expected), stop_tokens=[]).tokens == expected


# Sessions of every kind: attention-only and all-linear adapters, the base model, a blend of both kinds.
MIXED = [
    config_of("adapter_all_linear"),
    config_of(None),
    config_of("adapter"),
    SessionConfig(loras=[LoraSource(path=GEMMA3 / "adapter_all_linear_b", scale=0.6),
                         LoraSource(path=GEMMA3 / "adapter_b", scale=0.4)]),
    config_of("adapter_b"),
    config_of("adapter_all_linear_b"),
]


def prompt(row: int) -> list[int]:
    """Prompts of 3 to 23 tokens: rows before and past the sliding window and the attention window."""
    return [(11 * row + 5 * i) % 380 + 3 for i in range(3 + 4 * row)]


def alone(steps: int) -> list[tuple[list[int], list[np.ndarray]]]:
    """Greedy tokens and logits per session of MIXED, each stepping by itself."""
    return greedy_alone(MODEL, MIXED, prompt, steps)


def test_every_row_of_a_batch_equals_its_session_alone() -> None:
    steps = 8
    expected = alone(steps)
    with Engine(MODEL) as engine:
        sessions = [engine.create_session(config) for config in MIXED]
        logits = [s.run_prefill(prompt(row)) for row, s in enumerate(sessions)]
        assert min(s.position for s in sessions) < SLIDING and max(s.position for s in sessions) > WINDOW
        invokes = engine.stats().invokes
        tokens, batched = greedy_together(engine, sessions, logits, steps)
        for step, logits in enumerate(batched):
            for row, (_, seen) in enumerate(expected):
                assert np.abs(logits[row] - seen[step]).max() <= TOLERANCE, (row, step)
        assert tokens == [t for t, _ in expected]
        # six rows a step: a batch of 4 and one of 2, never a row alone
        assert engine.stats().invokes - invokes == 2 * steps
        assert dict(engine.stats().decode_batches) == {len(MIXED): steps}
        for s in sessions:
            s.close()


def test_the_export_has_all_linear_batched_and_windowed_signatures() -> None:
    with Engine(MODEL) as engine:
        names = set(engine.spec.signatures)
    for name in ("decode_lora_all_r8", "prefill_16_lora_all_r8", "decode_attend16_lora_all_r8",
                 "decode_batch4_attend16_lora_all_r8", "decode_batch2_lora_r8", "decode_batch4_lora_all_r8",
                 "prefill_16_attend16_lora_all_r8"):
        assert name in names
