"""How long OpenMP's threads should look for work before they sleep: a 2-thread decode step
by libgomp's spin count, each figure from a fresh process (libgomp reads it once, at load).

    python3 -m benchmarks.experiments.kernel_probe.openmp_spin MODEL.tflite \
        [--settings std,0,1000,runtime] [--rows 1] [--rounds 4] [--threads 2]

At 2 threads ``linear_rows`` runs on OpenMP's thread beside XNNPACK's pool on the same cores.
A setting is a ``GOMP_SPINCOUNT`` (the runtime sets ``OMP_WAIT_POLICY=passive`` beside it,
which libgomp lets the count override: ``0`` is passive alone), ``runtime`` (what the runtime
chooses with neither variable set) or ``std`` (no compiler: the file's standard form,
XNNPACK's linears and attention; needs a file of both forms). ``--rows 1`` times one plain
session's ``run_decode`` after 10 prompt tokens, ``--rows N`` N plain sessions stepping
together (``Engine.decode_together``; needs an export with ``--batch-sizes N``). Every round
runs each setting once, the order flipping every round; prints ms per step, median and range.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common import date_and_cpu

# Runs in the fresh process: prints the median ms per step of 4 timings of 6 steps.
_STEP = """
import statistics, sys, time
from runtime import Engine, EngineSettings, SessionConfig
path, rows, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with Engine(path, EngineSettings(num_threads=threads, batch_wait_s=None)) as engine:
    sessions = [engine.create_session(SessionConfig()) for _ in range(rows)]
    for session in sessions:
        session.run_prefill([i % 97 + 1 for i in range(10)])
    step = ((lambda: sessions[0].run_decode(5)) if rows == 1
            else (lambda: engine.decode_together([(s, 5) for s in sessions])))
    step()
    times = []
    for _ in range(4):
        start = time.perf_counter()
        for _ in range(6):
            step()
        times.append((time.perf_counter() - start) / 6 * 1e3)
    print(statistics.median(times))
"""


def environment(setting: str) -> dict[str, str]:
    """The fresh process's environment for one setting."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if setting == "std":
        env["CC"] = "/nonexistent/cc"  # no kernel: the file's standard form runs
    elif setting != "runtime":
        env["GOMP_SPINCOUNT"] = str(int(setting))
    return env


def main() -> int:
    """Prints ms per step by setting."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--settings", default="std,0,1000,runtime",
                        help="comma-separated: a GOMP_SPINCOUNT, 'runtime' or 'std'")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    settings = args.settings.split(",")
    for setting in settings:
        if setting not in ("std", "runtime") and not setting.isdigit():
            parser.error(f"--settings: {setting!r} is not a spin count, 'runtime' or 'std'")
    times: dict[str, list[float]] = {setting: [] for setting in settings}
    for r in range(args.rounds):
        for setting in settings if r % 2 == 0 else settings[::-1]:
            done = subprocess.run([sys.executable, "-c", _STEP, str(args.model), str(args.rows), str(args.threads)],
                                  env=environment(setting), capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"setting {setting}: the step failed:\n{done.stderr[-2000:]}")
            times[setting].append(float(done.stdout.split()[-1]))
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    where = date_and_cpu()
    print(f"{args.model.name}, {args.rows} row(s), {args.threads} threads, {where['date']}, {where['cpu']}, "
          f"load {os.getloadavg()[0]:.1f}; a fresh process per figure, {args.rounds} alternating rounds")
    print("| setting | ms per step, median [min-max] |")
    print("|---|---:|")
    for setting, values in times.items():
        print(f"| {setting} | {statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}] |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
