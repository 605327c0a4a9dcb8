#!/usr/bin/env python3
"""Decode steps of SmolLM2 exports side by side: plain, with one rank-8 adapter, and eight
sessions with distinct rank-8 adapters stepping together, to time the LoRA-delta op.

    python3 -m benchmarks.experiments.lora_delta.bench BEFORE.tflite,AFTER.tflite [--rounds 9] [--steps 32] \
        [--batch-steps 16] [--rows 8] [--targets attention|all-linear]

Every export opens in one Engine (1 thread); each round times, per export (the order of the
exports alternating between rounds), ``steps`` decode steps of a plain session and of a
session with a random rank-``--rank`` adapter on the projections of ``--targets`` (in the
cheapest slot holding it) from an empty context, then ``batch-steps`` steps of
``rows`` such sessions together (``Engine.decode_together``: the batched signature, each
cache bound as its own signature's input and output). Prints the medians over the rounds,
each export's adapter step over its plain step, and the exports' ratios to the first, each
also as the median of the rounds' own ratios (paired: load drifts between rounds).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.measure import random_adapter_files
from runtime import Engine, EngineSettings, SessionConfig
from runtime.util.signature_names import ATTENTION, LORA_TARGETS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("models", help="comma-separated .tflite exports with rank-8 slots and batched decode")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batch-steps", type=int, default=16)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", choices=LORA_TARGETS, default=ATTENTION, help="the adapters' projections")
    args = parser.parse_args()
    if args.rows < 1:
        parser.error("--rows: expected 1 or more")
    models = [Path(p) for p in args.models.split(",")]
    folder = Path(tempfile.mkdtemp())
    engines, sessions = {}, {}
    for n, model in enumerate(models):
        engine = Engine(model, EngineSettings(num_threads=1, batch_wait_s=None))
        engines[model] = engine
        (folder / str(n)).mkdir()
        paths = random_adapter_files(engine, folder / str(n), args.rows, args.rank, targets=args.targets)
        sessions[model] = {"plain": engine.create_session(SessionConfig()),
                           "adapter": engine.create_session(SessionConfig(lora_path=paths[0])),
                           "rows": [engine.create_session(SessionConfig(lora_path=p)) for p in paths]}
    times = {(model, kind): [] for model in models for kind in ("plain", "adapter", "batch")}
    for r in range(args.rounds + 1):  # the first round warms up, unrecorded
        for model in (models if r % 2 else models[::-1]):
            own = sessions[model]
            for kind in ("plain", "adapter"):
                session = own[kind]
                session.reset()
                start = time.perf_counter()
                for i in range(args.steps):
                    session.run_decode(i % 97 + 1)
                if r:
                    times[model, kind].append((time.perf_counter() - start) / args.steps * 1e3)
            for session in own["rows"]:
                session.reset()
                session.run_prefill([3, 5, 7, 11])
            start = time.perf_counter()
            for i in range(args.batch_steps):
                engines[model].decode_together([(s, i % 97 + 1) for s in own["rows"]])
            if r:
                times[model, "batch"].append((time.perf_counter() - start) / args.batch_steps * 1e3)
    # Paired within each round (the machine's load moves between rounds more than within one):
    # the median of each round's ratio, beside the ratio of the medians.
    median = {key: statistics.median(values) for key, values in times.items()}
    paired = lambda a, b: statistics.median(x / y for x, y in zip(times[a], times[b]))  # noqa: E731
    print(f"ms per decode step, 1 thread, medians of {args.rounds} alternating rounds ({args.steps} steps single, "
          f"{args.batch_steps} steps of {args.rows} rows), load average {os.getloadavg()[0]:.1f}; "
          "[the median of the rounds' own ratios]")
    first = models[0]
    for model in models:
        plain, adapter = median[model, "plain"], median[model, "adapter"]
        line = (f"{model.name}: plain {plain:.2f}  {args.targets} r{args.rank} {adapter:.2f} "
                f"({adapter / plain:.3f}x plain [{paired((model, 'adapter'), (model, 'plain')):.3f}])  "
                f"{args.rows} rows together {median[model, 'batch']:.2f}")
        if model != first:
            line += "  vs first: " + "  ".join(f"{kind} {median[model, kind] / median[first, kind]:.3f} "
                                               f"[{paired((model, kind), (first, kind)):.3f}]"
                                               for kind in ("plain", "adapter", "batch"))
        print(line)
    for engine in engines.values():
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
