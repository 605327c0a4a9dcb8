"""What the batching tests compare every batched row against: each session stepping alone."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from runtime import Engine, EngineSettings, SessionConfig


def greedy_alone(model: Path, configs: Sequence[SessionConfig], prompt: Callable[[int], list[int]],
                 steps: int) -> list[tuple[list[int], list[np.ndarray]]]:
    """Greedy tokens and the logits of each of ``steps`` decode steps, per session of
    ``configs`` (row i prefilled with ``prompt(i)``), each stepping by itself (no batching)."""
    out = []
    with Engine(model, EngineSettings(batch_wait_s=None)) as engine:
        for row, config in enumerate(configs):
            with engine.create_session(config) as session:
                logits = session.run_prefill(prompt(row))
                tokens, seen = [], []
                for _ in range(steps):
                    tokens.append(int(np.argmax(logits)))
                    logits = session.run_decode(tokens[-1])
                    seen.append(logits)
                out.append((tokens, seen))
    return out


def greedy_together(engine: Engine, sessions: Sequence, logits: list[np.ndarray],
                    steps: int) -> tuple[list[list[int]], list[list[np.ndarray]]]:
    """Steps ``sessions`` greedily ``steps`` times through ``engine.decode_together``, each
    row starting from its ``logits``; returns every row's tokens and each step's logits."""
    tokens: list[list[int]] = [[] for _ in sessions]
    seen: list[list[np.ndarray]] = []
    for _ in range(steps):
        for row in range(len(sessions)):
            tokens[row].append(int(np.argmax(logits[row])))
        logits = engine.decode_together([(s, tokens[row][-1]) for row, s in enumerate(sessions)])
        seen.append(logits)
    return tokens, seen


def four_adapter_rows() -> tuple[list[SessionConfig], Callable[[int], list[int]]]:
    """4 sessions with rank-4 adapters of two files (one scaled by 0.5) and each row's
    prompt (row i: i + 2 tokens): the rows the kernels' tests batch."""
    from conftest import adapter_path

    r4, other = adapter_path("torch_r4"), adapter_path("litertlm_r4")
    configs = [SessionConfig(lora_path=r4), SessionConfig(lora_path=other), SessionConfig(lora_path=r4, lora_scale=0.5),
               SessionConfig(lora_path=other)]
    return configs, lambda row: [(7 * row + 3 * i) % 250 + 1 for i in range(2 + row)]


def assert_rows_equal_alone(model: Path, configs: Sequence[SessionConfig], prompt: Callable[[int], list[int]],
                            steps: int) -> list[list[int]]:
    """``configs``' sessions stepped ``steps`` times in one batch give each session's logits
    alone bit for bit (every step ran as one batch of all rows); the rows' greedy tokens."""
    alone = greedy_alone(model, configs, prompt, steps)
    with Engine(model) as engine:
        sessions = [engine.create_session(config) for config in configs]
        logits = [session.run_prefill(prompt(row)) for row, session in enumerate(sessions)]
        tokens, together = greedy_together(engine, sessions, logits, steps)
        assert dict(engine.stats().decode_batches) == {len(configs): steps}
    assert tokens == [t for t, _ in alone]
    for step, rows in enumerate(together):
        for row, (_, seen) in enumerate(alone):
            assert np.array_equal(rows[row], seen[step]), (row, step)
    return tokens
