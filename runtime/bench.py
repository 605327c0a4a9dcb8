"""What adapters cost on one model, per decode step and per switch: the quick table that
``python -m runtime bench`` prints. The full suite (memory, loading, concurrent sessions,
llama.cpp side by side) lives in ``benchmarks/`` and builds on these measurements.

Every figure is the median of repeated runs; ratios compare figures measured in the same
run, interleaved where it matters, because the machines are shared and noisy.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from runtime.engine.config import EngineSettings, SessionConfig
from runtime.engine.engine import Engine
from runtime.engine.session import Session
from runtime.errors import InvalidArgumentError
from runtime.framework.lora_source import LoraSource


@dataclass(frozen=True)
class Row:
    """One measurement: what, how much, in which unit, and a note (ratios, targets)."""

    section: str
    what: str
    value: float
    unit: str
    note: str = ""


def median_seconds(action: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``action`` over ``repeats`` runs."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def decode_loop(session: Session, steps: int) -> Callable[[], None]:
    """``steps + 1`` decode steps (fixed tokens), rewinding whenever the KV cache is full."""
    limit = session.kv_length

    def run() -> None:
        session.reset()
        for i in range(steps + 1):
            if session.position == limit:
                session.reset()
            session.run_decode(i % 97 + 1)
    return run


def timed_decode(engine: Engine, session: Session, steps: int, prompt: int = 0) -> tuple[float, float]:
    """Seconds per decode step of ``session`` and per bare invoke (the graph's share; the
    rest of the step is the runtime's) over ``steps`` steps, after a reset and, when
    ``prompt`` is not 0, a prompt of that many tokens (prefilled, not timed)."""
    session.reset()
    if prompt:
        session.run_prefill([i % 97 + 1 for i in range(prompt)])
    before = engine.stats()
    start = time.perf_counter()
    for i in range(steps):
        session.run_decode(i % 97 + 1)
    total = time.perf_counter() - start
    after = engine.stats()
    return total / steps, (after.invoke_seconds - before.invoke_seconds) / (after.invokes - before.invokes)


def decode_round(engine: Engine, sessions: dict[str, Session], steps: int) -> dict[str, tuple[float, float]]:
    """:func:`timed_decode` of each session from an empty context, one after the other."""
    return {name: timed_decode(engine, session, steps) for name, session in sessions.items()}


def bench_decode(engine: Engine, configs: dict[str, SessionConfig], steps: int, repeats: int) -> dict[str, dict]:
    """Per config: step time, bare invoke time, and the runtime's own share of the step.

    Configs are measured round-robin, one repeat each per round, so drift in the
    machine's speed hits them all alike.
    """
    sessions = {name: engine.create_session(config) for name, config in configs.items()}
    for session in sessions.values():
        decode_loop(session, 4)()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in sessions}
    for _ in range(repeats):
        for name, pair in decode_round(engine, sessions, steps).items():
            samples[name].append(pair)
    resident_slots = {r.blend: r.slot_rank for r in engine.stats().resident}
    out = {}
    for name, pairs in samples.items():
        step = statistics.median(p[0] for p in pairs)
        invoke = statistics.median(p[1] for p in pairs)
        glue = statistics.median((p[0] - p[1]) / p[0] for p in pairs)
        out[name] = {"step": step, "invoke": invoke, "glue_share": glue,
                     "slot": resident_slots.get(sessions[name].blend)}
        sessions[name].close()
    return out


class SwitchRig:
    """Sessions for measuring what switching adapters costs per decode step, in rounds:
    one session alone (adapter ``a``); two sessions alternating step by step (same
    adapter, different adapters); one session re-targeted between ``a`` and ``b``
    (both resident) before each step. Closes its sessions on ``close()``."""

    def __init__(self, engine: Engine, a: LoraSource, b: LoraSource) -> None:
        self.a, self.b = a, b
        self.one = engine.create_session(SessionConfig(loras=[a]))
        self.twin = engine.create_session(SessionConfig(loras=[a]))
        self.other = engine.create_session(SessionConfig(loras=[b]))
        self.switcher = engine.create_session(SessionConfig(loras=[a]))
        for session in (self.one, self.twin, self.other, self.switcher):
            decode_loop(session, 2)()
        self.switcher.set_adapters([b], reset=True)
        self.switcher.run_decode(1)  # both blends resident now

    def round(self, steps: int) -> dict[str, float]:
        """Seconds per decode step of each pattern: ``alone``, ``alternate_same``,
        ``alternate_other``, ``switch``."""
        return {
            "alone": median_seconds(decode_loop(self.one, steps), 1) / (steps + 1),
            "alternate_same": median_seconds(self._alternate(self.one, self.twin, steps), 1) / steps,
            "alternate_other": median_seconds(self._alternate(self.one, self.other, steps), 1) / steps,
            "switch": median_seconds(self._switching(steps), 1) / steps,
        }

    @staticmethod
    def _alternate(x: Session, y: Session, steps: int) -> Callable[[], None]:
        def run() -> None:
            for i in range(steps // 2):
                for s in (x, y):
                    if i % 32 == 0:
                        s.reset()
                    s.run_decode(i % 97 + 1)
        return run

    def _switching(self, steps: int) -> Callable[[], None]:
        def run() -> None:
            for i in range(steps // 2):
                for source in (self.b, self.a):
                    self.switcher.set_adapters([source], reset=True)
                    self.switcher.run_decode(i % 97 + 1)
        return run

    def close(self) -> None:
        for session in (self.one, self.twin, self.other, self.switcher):
            session.close()


def bench_switch(engine: Engine, a: LoraSource, b: LoraSource, steps: int, repeats: int) -> dict[str, float]:
    """:class:`SwitchRig`'s patterns, each the median of ``repeats`` rounds."""
    rig = SwitchRig(engine, a, b)
    try:
        rounds = [rig.round(steps) for _ in range(repeats)]
    finally:
        rig.close()
    return {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}


def quick_table(model: str | os.PathLike[str], adapters: Sequence[str], steps: int = 64, repeats: int = 7,
                num_threads: int = 1) -> list[Row]:
    """What ``python -m runtime bench`` prints: decode and switch costs on one model.
    ``InvalidArgumentError`` naming the command's ``--steps`` or ``--repeats`` when there is
    nothing to measure (below 1), or more steps than the model's KV cache holds (checked
    once the model is open, before any measurement)."""
    for flag, count in (("--steps", steps), ("--repeats", repeats)):
        if count < 1:
            raise InvalidArgumentError(f"{flag} {count}: expected at least 1")
    rows = []
    with Engine(model, EngineSettings(num_threads=num_threads)) as engine:
        if steps > engine.spec.kv_length:
            raise InvalidArgumentError(f"--steps {steps}: a run decodes that many positions from an empty cache, "
                                       f"expected at most the model's KV cache of {engine.spec.kv_length} positions")
        sources = [LoraSource(path=p) for p in adapters]
        configs = {"base model": SessionConfig()}
        for source in sources:
            configs[f"adapter {Path(source.path).name}"] = SessionConfig(loras=[source])
        if len(sources) >= 2:
            configs["blend of the first two (0.5/0.5)"] = SessionConfig(
                loras=[LoraSource(path=sources[0].path, scale=0.5), LoraSource(path=sources[1].path, scale=0.5)])
        prompt = list(range(1, min(32, engine.spec.kv_length - 1)))
        for name, config in list(configs.items())[:2]:
            with engine.create_session(config) as session:
                def prefill(session: Session = session) -> None:
                    session.reset()
                    session.run_prefill(prompt)
                prefill()
                rows.append(Row("prefill", f"prefill {len(prompt)} tokens, {name}",
                                median_seconds(prefill, repeats) * 1e3, "ms"))
        decode = bench_decode(engine, configs, steps, repeats)
        plain = decode["base model"]["step"]
        for name, d in decode.items():
            rows.append(Row("decode", f"decode step, {name}", d["step"] * 1e3, "ms",
                            f"{d['step'] / plain:.3f}x base; runtime's own share {100 * d['glue_share']:.1f}%"
                            + (f"; slot r{d['slot']}" if d["slot"] else "")))
        if len(sources) >= 2:
            switch = bench_switch(engine, sources[0], sources[1], steps, repeats)
            alone = switch["alone"]
            rows += [
                Row("switch", "decode step, two sessions alternating, different adapters",
                    switch["alternate_other"] * 1e3, "ms", f"{switch['alternate_other'] / alone:.3f}x one session"),
                Row("switch", "switch a session between two resident adapters + next decode step",
                    switch["switch"] * 1e3, "ms", f"{switch['switch'] / alone:.3f}x one session's step"),
            ]
    return rows


def render(rows: Sequence[Row], title: str = "") -> str:
    """Rows as a markdown table."""
    lines = [title, ""] if title else []
    lines += ["| measurement | value | note |", "|---|---:|---|"]
    lines += [f"| {r.what} | {r.value:,.4g} {r.unit} | {r.note} |" for r in rows]
    return "\n".join(lines)
