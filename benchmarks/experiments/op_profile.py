"""Where a decode step's time goes, op by op: one session's step and a batch's, recorded
by LiteRT's own profiler (``Engine.profile_ops``).

    python3 -m benchmarks.experiments.op_profile MODEL.tflite [--rows 8] [--rank 8] [--steps 10] [--position 8] \
        [--out benchmarks/results/op_profile_NAME.md]

``rows`` sessions, each with its own random adapter of ``rank`` (0: none), are prefilled
to ``position``; ``steps`` decode steps of one session alone are recorded, then ``steps``
steps of all of them together (``Engine.decode_together``; needs a model exported with
``--batch-sizes`` for a batch to run as one pass), each after two unrecorded steps. Prints
and writes both tables per step, with the unrecorded step's milliseconds beside them
(recording costs an event per op: the recorded steps are slower, and an op under a
microsecond reads as 0).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import date_and_cpu
from benchmarks.measure import random_adapter_files
from runtime import Engine, EngineSettings, SessionConfig

WARMUP = 2  # unrecorded steps before each recording


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--rows", type=int, default=8, help="sessions stepping together")
    parser.add_argument("--rank", type=int, default=8, help="each session's adapter rank (0: no adapter)")
    parser.add_argument("--steps", type=int, default=10, help="recorded steps of each kind")
    parser.add_argument("--position", type=int, default=8, help="the prompt length the sessions start after")
    parser.add_argument("--out", type=Path, help="also write the tables to this Markdown file")
    args = parser.parse_args()
    for name in ("rows", "steps", "position"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: expected 1 or more")
    settings = EngineSettings(batch_wait_s=None, num_threads=1, profile_ops=True)
    with tempfile.TemporaryDirectory() as folder, Engine(args.model, settings) as engine:
        # The first session steps in both kinds: WARMUP + steps unrecorded, then steps recorded, each.
        if args.position + 2 * (WARMUP + 2 * args.steps) > engine.spec.kv_length:
            parser.error(f"--position {args.position}: {args.steps} steps would run past the KV cache of "
                         f"{engine.spec.kv_length} positions")
        paths = random_adapter_files(engine, Path(folder), args.rows, args.rank) if args.rank else [None] * args.rows
        sessions = [engine.create_session(SessionConfig(lora_path=path)) for path in paths]
        for session in sessions:
            session.run_prefill([i % 97 + 1 for i in range(args.position)])
        kinds = {"one session": lambda: sessions[0].run_decode(5),
                 f"{args.rows} sessions together": lambda: engine.decode_together([(s, 5) for s in sessions])}
        adapters = f"distinct random rank-{args.rank} adapters" if args.rank else "no adapters"
        stamp = date_and_cpu()
        lines = [f"# Where a decode step's time goes: {args.model.name}", "",
                 f"{stamp['cpu']}, 1 thread, load average {os.getloadavg()[0]:.1f}, {stamp['date']}; "
                 f"{args.rows} sessions with {adapters} after {args.position} prompt tokens; {args.steps} recorded "
                 f"steps of each kind.", "",
                 f"Command: `python3 -m benchmarks.experiments.op_profile {args.model.name} --rows {args.rows} --rank "
                 f"{args.rank} --steps {args.steps} --position {args.position}`", ""]
        for kind, step in kinds.items():
            unrecorded = _median_ms(step, WARMUP + args.steps)
            with engine.profile_ops() as recording:
                for _ in range(args.steps):
                    step()
            lines += [f"## {kind}: {unrecorded:.2f} ms a step unrecorded", "",
                      recording.profile.table(steps=args.steps), ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")


def _median_ms(step: Callable[[], object], count: int) -> float:
    """The median milliseconds of ``count`` calls of ``step``."""
    times = []
    for _ in range(count):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


if __name__ == "__main__":
    main()
