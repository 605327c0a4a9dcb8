"""A prompt's last few tokens as decode steps against the planner's padded prefill: what
``prefill_chunks`` would gain if decode steps were a choice wherever a padded prefill fits.

    python3 -m benchmarks.experiments.prefill_plans MODEL.tflite [--lengths 35,37,41,45,133,140] [--rounds 5]

For each prompt length, 1 thread, a fresh session each time, alternating rounds: the
prompt prefilled as the runtime plans it (the shortest plan in positions computed, each run
counted as ``RUN_COST_POSITIONS`` more, decode steps only where no padded prefill fits), and
with its last tokens as decode steps where that counts cheaper (a step counted as one run of
one position). Prints both plans, their median milliseconds and the ratio. Measured, not adopted
(docs/benchmarks.md, "Opening a model"): the break-even depends on the precision and the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import runtime.executor.litert_executor as litert_executor
from runtime import Engine, EngineSettings
from runtime.executor.litert_executor import RUN_COST_POSITIONS, prefill_chunks


def with_decode_steps(count: int, lengths: Sequence[int], room: int) -> list[int]:
    """The cheapest plan, by ``prefill_chunks``'s count, of a head planned by it and the last
    tokens as decode steps (1 each, a run of one position)."""
    plans = [(prefill_chunks(count - steps, lengths, room) if steps < count else []) + [1] * steps
             for steps in range(count + 1)]
    return min(plans, key=lambda plan: sum(RUN_COST_POSITIONS + length for length in plan))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--lengths", default="35,37,41,45,133,140", help="prompt lengths in tokens")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    planned = litert_executor.prefill_chunks
    plans = {"planned": planned, "last tokens as decode steps": with_decode_steps}
    prompt = [100 + (i * 37) % 4000 for i in range(max(int(n) for n in args.lengths.split(",")))]
    with Engine(args.model, EngineSettings(num_threads=1)) as engine:
        spec = engine.spec
        bulk = 0 if spec.prefill_has_logits else 1  # the last token is decoded when prefill has no logits
        print(f"{args.model.name}: prefill lengths {list(spec.prefill_lengths)}, medians of {args.rounds} rounds")
        print("| tokens | planned | ms | last tokens as decode steps | ms | ratio |")
        print("|---:|---|---:|---|---:|---:|")
        for count in (int(n) for n in args.lengths.split(",")):
            times: dict[str, list[float]] = {name: [] for name in plans}
            for round_ in range(args.rounds):
                for name in plans if round_ % 2 else reversed(plans):
                    litert_executor.prefill_chunks = plans[name]
                    try:
                        session = engine.create_session()
                        start = time.perf_counter()
                        session.run_prefill(prompt[:count])
                        times[name].append((time.perf_counter() - start) * 1000)
                        session.close()
                    finally:
                        litert_executor.prefill_chunks = planned
            a, b = (statistics.median(times[name]) for name in plans)
            shown = [plans[name](count - bulk, spec.prefill_lengths, spec.kv_length) for name in plans]
            print(f"| {count} | {shown[0]} | {a:.0f} | {shown[1]} | {b:.0f} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
