"""What a run costs per input it is given: signatures of one CONCATENATION over N small float32
inputs, each run timed through the same C API calls ``runtime/executor/native.py`` makes.

    python3 -m benchmarks.experiments.kernel_probe.input_count [--inputs 2,30,130,430] [--runs 2000]

Why: an all-linear rank-8 adapter's signature takes 420 more inputs than the plain one (A and
B of 7 projections in 30 layers), and its step costs ~0.5 ms more than its ops' work
(RESULTS.md section 10). Every input is [1, 8] float32 and the op copies 32 bytes of each, so
the difference between two counts is LiteRT's handling of the inputs themselves. Prints the
median microseconds per run of 5 alternating rounds and the slope per input.
"""

from __future__ import annotations

import argparse
import statistics
import time

from ai_edge_litert import schema_py_generated as s

from benchmarks.experiments.kernel_probe.graph import Graph
from runtime.executor.native import HostBuffer, NativeModel


def model(counts: list[int]) -> bytes:
    """One signature ``in_N`` per count: N inputs [1, 8] concatenated into [N, 8]."""
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
    return graph.to_bytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--inputs", default="2,30,130,430")
    parser.add_argument("--runs", type=int, default=2000, help="runs a signature per round")
    args = parser.parse_args()
    counts = [int(n) for n in args.inputs.split(",")]
    native = NativeModel(model(counts), num_threads=1, weight_cache=":memory:", name="input_count")
    prepared = {}
    for n in counts:
        info = native.signatures[f"in_{n}"]
        buffers = [HostBuffer(t) for t in (*info.inputs.values(), *info.outputs.values())]
        prepared[n] = native.prepare(info.index, buffers[:n], buffers[n:])
    times: dict[int, list[float]] = {n: [] for n in counts}
    for r in range(5):
        for n in counts if r % 2 == 0 else counts[::-1]:
            native.run(prepared[n])
            start = time.perf_counter()
            for _ in range(args.runs):
                native.run(prepared[n])
            times[n].append((time.perf_counter() - start) / args.runs * 1e6)
    print("| inputs | us per run (median of 5 rounds) |")
    print("|---:|---:|")
    for n in counts:
        print(f"| {n} | {statistics.median(times[n]):.1f} |")
    first, last = counts[0], counts[-1]
    slope = (statistics.median(times[last]) - statistics.median(times[first])) / (last - first)
    print(f"per input: {slope:.2f} us ({first} -> {last} inputs)")
    native.close()


if __name__ == "__main__":
    main()
