"""A whole decode step with the native attention op against the XNNPACK form, by position.

    python3 -m benchmarks.experiments.kernel_probe.whole_step XNNPACK.tflite NATIVE.tflite \
        [--positions 10,512,2048,4000] [--steps 16] [--rounds 5] [--out benchmarks/results/kernel_steps]

The two models are the same export with and without ``tools/attention_kernel.py`` (e.g. SmolLM2-135M
with ``--kv-length 4096 --prefill-lengths 512``). One session per model is filled with the same
random prompt up to each position (prefill, untimed); then, in alternating rounds (the order flips
every round), ``--steps`` decode steps of each are timed at 1 thread. Prints ms per step per
position, the native/XNNPACK ratio per round (min / median / max), and each form's step at its
last position over its step at the first (what a long context costs).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, date_and_cpu, write_result
from runtime import Engine, EngineSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("xnnpack", type=Path)
    parser.add_argument("native", type=Path)
    parser.add_argument("--positions", default="10,512,2048,4000")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "kernel_steps")
    args = parser.parse_args()
    positions = [int(p) for p in args.positions.split(",")]
    settings = EngineSettings(num_threads=1, prefix_cache_bytes=0, batch_wait_s=None)
    engines = {"xnnpack": Engine(args.xnnpack, settings), "native": Engine(args.native, settings)}
    vocab = engines["xnnpack"].spec.vocab_size
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, vocab, max(positions) + 1)]
    sessions = {name: engine.create_session() for name, engine in engines.items()}
    rows = []
    try:
        for position in positions:
            for session in sessions.values():  # fill to the position (untimed), then one warm-up step
                if session.position < position:
                    session.run_prefill(prompt[session.position:position])
                session.run_decode(7)
            per_round = {name: [] for name in sessions}
            for round_ in range(args.rounds):
                order = list(sessions) if round_ % 2 == 0 else list(reversed(sessions))
                for name in order:
                    session = sessions[name]
                    started = time.perf_counter()
                    for _ in range(args.steps):
                        session.run_decode(7)
                    per_round[name].append((time.perf_counter() - started) / args.steps)
            ratios = sorted(n / x for n, x in zip(per_round["native"], per_round["xnnpack"]))
            rows.append({"position": position, **{f"{name}_ms": 1000 * statistics.median(times)
                                                   for name, times in per_round.items()},
                         "ratio_min": ratios[0], "ratio_median": statistics.median(ratios), "ratio_max": ratios[-1]})
            print(rows[-1], flush=True)
    finally:
        for session in sessions.values():
            session.close()
        for engine in engines.values():
            engine.close()
    growth = {name: rows[-1][f"{name}_ms"] / rows[0][f"{name}_ms"] for name in engines}
    result = {"xnnpack": str(args.xnnpack), "native": str(args.native), "steps": args.steps, "rounds": args.rounds,
              "rows": rows, "growth_last_over_first": growth, **date_and_cpu()}
    lines = [f"# Decode step, native attention op vs XNNPACK form, by position ({args.xnnpack.name})", "",
             f"1 thread, {args.steps} steps a round, {args.rounds} alternating rounds; {result['date']}, {result['cpu']}.",
             "", "| position | XNNPACK ms/step | native ms/step | native / XNNPACK (min / median / max) |",
             "|---:|---:|---:|---|"]
    lines += [f"| {r['position']} | {r['xnnpack_ms']:.1f} | {r['native_ms']:.1f} | "
              f"{r['ratio_min']:.2f} / {r['ratio_median']:.2f} / {r['ratio_max']:.2f} |" for r in rows]
    lines += ["", f"Step at position {positions[-1]} over the step at {positions[0]}: XNNPACK {growth['xnnpack']:.2f}x, "
              f"native {growth['native']:.2f}x.", "",
              f"Command: `python3 -m benchmarks.experiments.kernel_probe.whole_step {args.xnnpack} {args.native} "
              f"--positions {args.positions} --steps {args.steps} --rounds {args.rounds}`"]
    write_result(args.out, lines, result)


if __name__ == "__main__":
    main()
