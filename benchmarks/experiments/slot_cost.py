#!/usr/bin/env python3
"""What an adapter's slot costs a decode step, in one or more exports of SmolLM2-135M side by side.

    python3 -m benchmarks.experiments.slot_cost A.tflite[,B.tflite,...] [--rounds 11] [--steps 32]

Each export runs plain, with a random rank-8 attention-only PEFT adapter (q/k/v/o) and with a
random rank-8 all-linear one (q/k/v/o, gate/up/down), 1 thread, decode steps at positions
0..steps-1; every session of every export takes its turn in each round, and each figure is
the median over the rounds. Prints ms per step and each setting's ratio to its own export's
plain step (what a graph change to the LoRA slots moves), and with two exports B / A.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from benchmarks.experiments.adapter_kinds import FANS, decode_ms, write_peft  # SmolLM2's shapes
from runtime import Engine, EngineSettings, LoraSource, SessionConfig

SETTINGS = ("plain", "attention r8", "all-linear r8")


def main() -> int:
    """Prints the table above."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("models", help="comma-separated .tflite exports of SmolLM2-135M with rank-8 slots")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    models = [Path(p) for p in args.models.split(",")]
    adapters = Path(tempfile.mkdtemp())
    attention, all_linear = write_peft(adapters / "attention", list("qkvo"), 1), write_peft(adapters / "all", list(FANS), 2)
    engines, sessions = [], {}
    for model in models:
        engine = Engine(model, EngineSettings(num_threads=1))
        engines.append(engine)
        ids = {name: engine.register_adapter(LoraSource(path=path))
               for name, path in (("attention r8", attention), ("all-linear r8", all_linear))}
        for setting in SETTINGS:
            config = SessionConfig(adapters={ids[setting]: 1.0}) if setting in ids else SessionConfig()
            sessions[model, setting] = engine.create_session(config)
            decode_ms(sessions[model, setting], 4)
    times: dict[tuple[Path, str], list[float]] = {key: [] for key in sessions}
    for _ in range(args.rounds):
        for key, session in sessions.items():
            times[key].append(decode_ms(session, args.steps))
    median = {key: statistics.median(values) for key, values in times.items()}
    print(f"ms per decode step, 1 thread, median of {args.rounds} alternating rounds of {args.steps} steps")
    for setting in SETTINGS:
        cells = [f"{model.name}: {median[model, setting]:6.2f} ms ({median[model, setting] / median[model, 'plain']:.3f}x "
                 "its plain)" for model in models]
        ratio = f"  B/A {median[models[1], setting] / median[models[0], setting]:.3f}" if len(models) == 2 else ""
        print(f"{setting:14s} " + "  ".join(cells) + ratio)
    for engine in engines:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
