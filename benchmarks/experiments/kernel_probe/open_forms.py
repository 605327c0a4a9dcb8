"""Open time of a model of both attention forms against its standard file (docs/kernels.md).

    python3 -m benchmarks.experiments.kernel_probe.open_forms STANDARD.tflite BOTH.tflite [--rounds 5]

``BOTH.tflite`` is ``STANDARD.tflite`` through ``tools/attention_kernel.py`` (both forms). Each
variant opens an ``LlmExecutor`` with a weight-cache file of its own, warmed (with the kernel's
build) by an untimed first round; then the rounds alternate the variants:

* the standard file;
* both forms, the op form chosen (the runtime's view: LiteRT sees and compiles one form);
* both forms, the standard form chosen (the CPU's flags overridden, as without AVX2);
* both forms without the view (every subgraph compiled, the op forms' nodes checked and the
  kernel registered): what compiling both forms would cost.

Prints each open's seconds with the load average, then per variant the median, the minimum and
the median of its per-round ratio to the standard file's open.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from runtime.executor import kernels, native
from runtime.executor.litert_executor import LlmExecutor
from runtime.executor.weight_cache import WeightCacheFile

VARIANTS = ("standard file", "both, op form", "both, standard form", "both, no view")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("standard", type=Path)
    parser.add_argument("both", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    flags, select = kernels.isa_flags, native.select_attention_form
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="open_forms-") as scratch:
        for round_ in range(args.rounds + 1):
            for index, name in enumerate(VARIANTS):
                kernels.isa_flags = (lambda: ()) if name == "both, standard form" else flags
                native.select_attention_form = (lambda *_, **__: None) if name == "both, no view" else select
                model = args.standard if name == "standard file" else args.both
                directory = Path(scratch) / str(index)
                directory.mkdir(exist_ok=True)
                load = os.getloadavg()[0]
                start = time.perf_counter()
                executor = LlmExecutor(model, weight_cache=WeightCacheFile.for_model(directory, model))
                seconds = time.perf_counter() - start
                kernel = executor.attention_kernel
                executor.close()
                print(f"round {round_} {name:20} {seconds:7.3f} s  op form {kernel!s:5}  load {load:.1f}", flush=True)
                if round_:
                    times[name].append(seconds)
    kernels.isa_flags, native.select_attention_form = flags, select
    for name, seconds in times.items():
        ratios = [a / b for a, b in zip(seconds, times["standard file"])]
        print(f"{name:20} median {statistics.median(seconds):.3f} s, min {min(seconds):.3f} s, "
              f"{statistics.median(ratios):.2f}x the standard file's open (median of rounds)")


if __name__ == "__main__":
    main()
