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
