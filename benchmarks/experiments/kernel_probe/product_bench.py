#!/usr/bin/env python3
"""The product's decode-attention op (runtime/executor/kernels, as ``--attention-kernel
native`` exports it) against the XNNPACK graph form, and the kernel's build flags.

    python3 -m benchmarks.experiments.kernel_probe.product_bench [--spans 128,1024,4096] [--rounds 5] [--pos -1]

A graph of ``--layers`` attention layers at SmolLM2-135M's shapes (3 KV groups x 3 heads x
64), each ``BATCH_MATMUL(q, K, adj_y) -> ADD mask -> SOFTMAX -> BATCH_MATMUL(p, V, adj_y)``
over its own transposed caches, the next layer's query depending on the last, in a
signature ``decode``; the same graph through :func:`runtime.util.attention_rewrite.
rewrite_decode_attention` (the export's pass); both opened by ``NativeModel`` (1 thread).
The rewritten graph is opened once per build of the kernel:

- ``runtime``: the flags the runtime chooses on this CPU (``-O3`` and the vector
  extensions /proc/cpuinfo lists);
- ``native``: ``-O3 -march=native`` (what the probe used; never shipped);
- ``avx2``: ``-O3 -mavx2 -mfma`` (the runtime's build on a CPU with AVX2 but not AVX-512);
- ``plain``: ``-O3`` alone (SSE2 on x86-64: what a CPU without AVX2 gets).

The mask leaves positions 0..pos open (``--pos -1``: all, as the graph form reads them).
Alternating rounds; prints median ms per step and the ratio to ``xnnpack`` per round
(min / median / max), after checking each form's output against the graph's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np
from ai_edge_litert import schema_py_generated as s

from runtime.executor import kernels
from runtime.executor.native import HostBuffer, NativeModel
from runtime.util.attention_rewrite import rewrite_decode_attention

from . import attention_bench
from .graph import Graph

G, H, D = 3, 3, 64
BUILDS = {"runtime": None, "native": ("-march=native",), "avx2": ("-mavx2", "-mfma"), "plain": ()}


def build(span: int, layers: int) -> bytes:
    g = Graph()
    g.begin("decode")
    g.tensor("q", [1, G, H, D])
    g.tensor("mask", [1, 1, 1, span])
    inputs = ["q", "mask"]
    for layer in range(layers):
        g.tensor(f"kv_cache_k_{layer}", [1, G, span, D])
        g.tensor(f"kv_cache_v_{layer}", [1, G, D, span])
        inputs += [f"kv_cache_k_{layer}", f"kv_cache_v_{layer}"]
    q = "q"
    mm = s.BatchMatMulOptionsT()
    mm.adjY = True
    soft = s.SoftmaxOptionsT()
    soft.beta = 1.0
    for layer in range(layers):
        scores, masked, p, out = (f"{name}{layer}" for name in ("scores", "masked", "p", "a"))
        for name in (scores, masked, p):
            g.tensor(name, [1, G, H, span])
        g.tensor(out, [1, G, H, D])
        g.op(s.BuiltinOperator.BATCH_MATMUL, [q, f"kv_cache_k_{layer}"], [scores], mm,
             s.BuiltinOptions.BatchMatMulOptions)
        g.add(scores, "mask", masked)
        g.op(s.BuiltinOperator.SOFTMAX, [masked], [p], soft, s.BuiltinOptions.SoftmaxOptions)
        g.op(s.BuiltinOperator.BATCH_MATMUL, [p, f"kv_cache_v_{layer}"], [out], mm, s.BuiltinOptions.BatchMatMulOptions)
        nxt = f"q{layer + 1}" if layer + 1 < layers else "out"
        g.tensor(nxt, [1, G, H, D])
        g.add(q, out, nxt)
        q = nxt
    g.end(inputs, ["out"])
    return g.to_bytes()


class Timed(attention_bench.Timed):
    """A model of this script's, opened and bound; timed as attention_bench's."""

    def __init__(self, path: Path, name: str, values: dict[str, np.ndarray]) -> None:
        self.model = NativeModel(path, num_threads=1, weight_cache=":memory:", name=name)
        sig = self.model.signatures["decode"]
        self.inputs = [HostBuffer(info) for info in sig.inputs.values()]
        for buffer in self.inputs:
            buffer.write(values[buffer.info.name])
        self.output = HostBuffer(sig.outputs["out"])
        self.prepared = self.model.prepare(sig.index, self.inputs, [self.output])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", default="128,1024,4096")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--builds", default=",".join(BUILDS))
    parser.add_argument("--pos", type=int, default=-1, help="the last position the mask leaves open (-1: the last)")
    parser.add_argument("--seconds", type=float, default=0.15, help="time per measurement")
    args = parser.parse_args()
    builds = args.builds.split(",")
    print(f"runtime flags here: {' '.join(kernels.isa_flags()) or '(none)'}")
    chosen = kernels.isa_flags
    rng = np.random.default_rng(0)
    folder = Path(tempfile.mkdtemp(prefix="product_bench_"))
    for span in (int(x) for x in args.spans.split(",")):
        graph = build(span, args.layers)
        standard, native = folder / f"standard-{span}.tflite", folder / f"native-{span}.tflite"
        standard.write_bytes(graph)
        native.write_bytes(rewrite_decode_attention(graph)[0])
        pos = span - 1 if args.pos < 0 else min(args.pos, span - 1)
        values = {"q": rng.standard_normal((1, G, H, D), np.float32) * 0.5,
                  "mask": np.where(np.arange(span) <= pos, 0.0, np.finfo(np.float32).min).astype(np.float32)}
        for layer in range(args.layers):
            values[f"kv_cache_k_{layer}"] = rng.standard_normal((1, G, span, D), np.float32) * 0.5
            values[f"kv_cache_v_{layer}"] = rng.standard_normal((1, G, D, span), np.float32)
        timed = {"xnnpack": Timed(standard, "xnnpack", values)}
        for name in builds:
            flags = BUILDS[name]
            kernels.isa_flags = chosen if flags is None else (lambda flags=flags: flags)
            try:
                timed[name] = Timed(native, name, values)
            finally:
                kernels.isa_flags = chosen
        want = timed["xnnpack"].result()
        for name in builds:
            print(f"{span}: {name} against the graph form: max |diff| {np.abs(timed[name].result() - want).max():.2e}")
        times: dict[str, list[float]] = {name: [] for name in timed}
        order = list(timed)
        for rnd in range(args.rounds):
            for name in (order if rnd % 2 == 0 else order[::-1]):
                times[name].append(timed[name].ms(args.seconds))
        cache_mb = 2 * args.layers * G * span * D * 4 / 1e6
        print(f"\n{span} positions (open 0..{pos}), {args.layers} layers, caches {cache_mb:.1f} MB, "
              f"{args.rounds} rounds")
        print("| form | median ms | min | ratio to xnnpack min / median / max |")
        print("|---|---:|---:|---|")
        for name, ms in times.items():
            ratios = [a / b for a, b in zip(ms, times["xnnpack"])]
            print(f"| {name} | {statistics.median(ms):.3f} | {min(ms):.3f} | {min(ratios):.2f} / "
                  f"{statistics.median(ratios):.2f} / {max(ratios):.2f} |", flush=True)
        del timed


if __name__ == "__main__":
    main()
