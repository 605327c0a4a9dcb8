"""What a run costs per input and per output it is given: signatures of one CONCATENATION over
N small float32 inputs, and of one SPLIT into N outputs, each run timed through the same C API
calls ``runtime/executor/native.py`` makes.

    python3 -m benchmarks.experiments.kernel_probe.input_count [--counts 2,30,130,430] [--runs 2000]

Why: an all-linear rank-8 adapter's signature takes 420 more inputs than the plain one (A and
B of 7 projections in 30 layers), and its step costs ~0.5 ms more than its ops' work
(RESULTS.md section 10); an 8-row batch's signature takes 722 inputs and gives 481 outputs. Every
input or output is [1, 8] float32 and the op copies 32 bytes of each, so the difference between
two counts is LiteRT's handling of the buffers themselves. Prints the median microseconds per
run of 5 alternating rounds and the slopes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from ai_edge_litert import schema_py_generated as s

from benchmarks.experiments.kernel_probe.graph import Graph
from runtime.executor.native import HostBuffer, NativeModel


def model(counts: list[int]) -> bytes:
    """Per count N: signature ``in_N``, N inputs [1, 8] concatenated into [N, 8]; and ``out_N``,
    one input [N, 8] split into N outputs [1, 8]."""
    graph = Graph()
    for n in counts:
        graph.begin(f"in_{n}")
        names = [f"x_{i}" for i in range(n)]
        for name in names:
            graph.tensor(name, (1, 8))
        graph.tensor("out", (n, 8))
        options = s.ConcatenationOptionsT()
        options.axis = 0
        graph.op(s.BuiltinOperator.CONCATENATION, names, ["out"], options, s.BuiltinOptions.ConcatenationOptions)
        graph.end(names, ["out"])
        graph.begin(f"out_{n}")
        graph.tensor("axis", (), np.int32, np.zeros((), np.int32))
        graph.tensor("x", (n, 8))
        for name in names:
            graph.tensor(name, (1, 8))
        options = s.SplitOptionsT()
        options.numSplits = n
        graph.op(s.BuiltinOperator.SPLIT, ["axis", "x"], names, options, s.BuiltinOptions.SplitOptions)
        graph.end(["x"], names)
    return graph.to_bytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--counts", default="2,30,130,430", help="the N of the signatures")
    parser.add_argument("--runs", type=int, default=2000, help="runs a signature per round")
    args = parser.parse_args()
    counts = [int(n) for n in args.counts.split(",")]
    native = NativeModel(model(counts), num_threads=1, weight_cache=":memory:", name="input_count")
    prepared = {}
    for key, info in native.signatures.items():
        inputs = [HostBuffer(t) for t in info.inputs.values()]
        outputs = [HostBuffer(t) for t in info.outputs.values()]
        prepared[key] = native.prepare(info.index, inputs, outputs)
    keys = [f"{kind}_{n}" for n in counts for kind in ("in", "out")]
    times: dict[str, list[float]] = {key: [] for key in keys}
    for r in range(5):
        for key in keys if r % 2 == 0 else keys[::-1]:
            native.run(prepared[key])
            start = time.perf_counter()
            for _ in range(args.runs):
                native.run(prepared[key])
            times[key].append((time.perf_counter() - start) / args.runs * 1e6)
    median = {key: statistics.median(values) for key, values in times.items()}
    print("| buffers N | us per run, N inputs (CONCATENATION) | us per run, N outputs (SPLIT) |")
    print("|---:|---:|---:|")
    for n in counts:
        print(f"| {n} | {median[f'in_{n}']:.1f} | {median[f'out_{n}']:.1f} |")
    first, last = counts[0], counts[-1]
    for kind, what in (("in", "input"), ("out", "output")):
        slope = (median[f"{kind}_{last}"] - median[f"{kind}_{first}"]) / (last - first)
        print(f"per {what}: {slope:.2f} us ({first} -> {last})")
    native.close()


if __name__ == "__main__":
    main()
