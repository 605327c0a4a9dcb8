#!/usr/bin/env python3
"""Decode attention as one custom op against the XNNPACK graph form, in isolation.

    python3 -m benchmarks.experiments.kernel_probe.attention_bench [--spans 128,1024,4096] [--rounds 7] [--rows 1]

Graphs of ``--layers`` attention layers (SmolLM2-135M: 3 KV groups of 3 heads of 64, 30
layers) written directly as flatbuffers, every layer's K ``[1, G, T, hd]`` and V
``[1, G, hd, T]`` (the exports' transposed layout) an input, the next layer's query
depending on the last (``q = q + attention(q, K_l, V_l)``), opened by the runtime's
``NativeModel`` (1 XNNPACK thread):

- ``xnnpack``: BATCH_MATMUL(q, K, adj_y) -> SOFTMAX -> BATCH_MATMUL(p, V, adj_y), what the
  exports do (attention_forms.py's ``cache on the right``); with ``--rows`` B, B such
  chains per layer, one per row, as the batched signatures do;
- ``gcc`` / ``numba``: one CUSTOM ``odml_runtime.decode_attention`` op per layer for all B
  rows (kernels.c / numba_kernels.py), every row at position T-1 (the whole cache, as the
  graph form reads it);
- ``empty``: the same graph with a kernel that returns at once (the cost of the op's
  dispatch and the XNNPACK partitions around it).

Every graph takes its turn in each round, the order flipping every round; prints per span
the median ms per step, GB/s through the caches, and the ratio to ``xnnpack`` in each
round (min / median / max). Checks the custom ops' outputs against the graph's first.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from ai_edge_litert import schema_py_generated as s

HERE = Path(__file__).resolve().parent

from .custom_ops import install
from .graph import Graph

from runtime.executor.native import HostBuffer, NativeModel

OP = "odml_runtime.decode_attention"
G, H, D = 3, 3, 64


def build(form: str, span: int, layers: int, rows: int) -> bytes:
    g = Graph()
    g.begin("attention")
    g.tensor("q", [rows, G, H, D])
    inputs = ["q"]
    if form not in ("xnnpack", "adds"):
        g.tensor("input_pos", [rows], np.int32)
        g.tensor("params", [4], data=np.array([1.0, 0.0, 0.0, 0.0], np.float32))
        inputs.append("input_pos")
    for layer in range(layers):
        for r in range(rows):
            g.tensor(f"k_{layer}_{r}", [1, G, span, D])
            g.tensor(f"v_{layer}_{r}", [1, G, D, span])
            inputs += [f"k_{layer}_{r}", f"v_{layer}_{r}"]
    q = "q"
    for layer in range(layers):
        out = f"a{layer}"
        g.tensor(out, [rows, G, H, D])
        if form == "xnnpack":
            row_outs = []
            for r in range(rows):
                qr = q
                if rows > 1:
                    qr = f"q{layer}_{r}"
                    g.tensor(qr, [1, G, H, D])
                    g.tensor(f"b{layer}_{r}", [4], np.int32, data=np.array([r, 0, 0, 0], np.int32))
                    g.tensor(f"z{layer}_{r}", [4], np.int32, data=np.array([1, G, H, D], np.int32))
                    g.op(s.BuiltinOperator.SLICE, [q, f"b{layer}_{r}", f"z{layer}_{r}"], [qr], s.SliceOptionsT(),
                         s.BuiltinOptions.SliceOptions)
                sc, p, ar = f"s{layer}_{r}", f"p{layer}_{r}", f"ar{layer}_{r}"
                g.tensor(sc, [1, G, H, span]), g.tensor(p, [1, G, H, span])
                mm = s.BatchMatMulOptionsT()
                mm.adjY = True
                g.op(s.BuiltinOperator.BATCH_MATMUL, [qr, f"k_{layer}_{r}"], [sc], mm, s.BuiltinOptions.BatchMatMulOptions)
                soft = s.SoftmaxOptionsT()
                soft.beta = 1.0
                g.op(s.BuiltinOperator.SOFTMAX, [sc], [p], soft, s.BuiltinOptions.SoftmaxOptions)
                if rows > 1:
                    g.tensor(ar, [1, G, H, D])
                g.op(s.BuiltinOperator.BATCH_MATMUL, [p, f"v_{layer}_{r}"], [ar if rows > 1 else out], mm,
                     s.BuiltinOptions.BatchMatMulOptions)
                row_outs.append(ar)
            if rows > 1:
                cat = s.ConcatenationOptionsT()
                cat.axis = 0
                g.op(s.BuiltinOperator.CONCATENATION, row_outs, [out], cat, s.BuiltinOptions.ConcatenationOptions)
        elif form == "adds":  # no attention: out = q + q, what the ADD chain alone costs
            g.add(q, q, out)
        else:
            caches = [n for r in range(rows) for n in (f"k_{layer}_{r}", f"v_{layer}_{r}")]
            g.custom(OP, [q, "input_pos", "params", *caches], [out])
        nxt = f"q{layer + 1}" if layer + 1 < layers else "out"
        g.tensor(nxt, [rows, G, H, D])
        g.add(q, out, nxt)
        q = nxt
    g.end(inputs, ["out"])
    return g.to_bytes()


class Timed:
    def __init__(self, form: str, span: int, layers: int, rows: int, kernels: dict, caches: dict, q: np.ndarray,
                 pos: int = -1):
        model_bytes = build(form if form in ("xnnpack", "adds") else "custom", span, layers, rows)
        path = Path(tempfile.mkdtemp(prefix="kernel_probe_")) / f"{form}-{span}.tflite"
        path.write_bytes(model_bytes)  # opened by path: mapped at a page boundary, its constants aligned
        with install(kernels.get(form, [])):
            self.model = NativeModel(path, num_threads=1, weight_cache=":memory:", name=f"{form} {span}")
        sig = self.model.signatures["attention"]
        self.inputs = {n: HostBuffer(info) for n, info in sig.inputs.items()}
        for name, buffer in self.inputs.items():
            if name == "q":
                buffer.write(q)
            elif name == "input_pos":
                buffer.write(np.full(rows, span - 1 if pos < 0 else pos, np.int32))
            else:
                buffer.write(caches[name])
        self.output = HostBuffer(sig.outputs["out"])
        self.prepared = self.model.prepare(sig.index, list(self.inputs.values()), [self.output])

    def result(self) -> np.ndarray:
        self.model.run(self.prepared)
        return self.output.array.copy()

    def ms(self, seconds: float) -> float:
        self.model.run(self.prepared)
        start, count = time.perf_counter(), 0
        while True:
            self.model.run(self.prepared)
            count += 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return elapsed / count * 1e3


def chain_reference(q: np.ndarray, caches: dict, layers: int, rows: int) -> np.ndarray:
    """The graphs' output in float64: q = q + softmax(q K^T) V, layer after layer."""
    x = q.astype(np.float64)
    for layer in range(layers):
        out = np.zeros_like(x)
        for r in range(rows):
            K = caches[f"k_{layer}_{r}"][0].astype(np.float64)  # [G, T, D]
            V = caches[f"v_{layer}_{r}"][0].astype(np.float64)  # [G, D, T]
            s = np.einsum("ghd,gtd->ght", x[r], K)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[r] = np.einsum("ght,gdt->ghd", p, V)
        x = x + out
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", default="128,1024,4096")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--forms", default="xnnpack,gcc,numba,empty,adds")
    parser.add_argument("--pos", type=int, default=-1,
                        help="the position the custom ops attend up to (-1: the last; the graph form reads all)")
    parser.add_argument("--seconds", type=float, default=0.25, help="time per measurement")
    args = parser.parse_args()
    spans = [int(x) for x in args.spans.split(",")]
    forms = args.forms.split(",")

    from . import c_kernels
    kernels: dict[str, list] = {}
    library = c_kernels.compile_library()
    kernels["gcc"] = [c_kernels.kernel(library, OP, "attention_fast_run")]
    kernels["empty"] = [c_kernels.kernel(library, OP, "empty_run")]
    if "python" in forms:
        from . import py_kernel
        kernels["python"] = [py_kernel.kernel(OP)]
    if "numba" in forms:
        start = time.perf_counter()
        from . import numba_kernels
        print(f"numba kernels compiled in {time.perf_counter() - start:.2f} s", flush=True)
        kernels["numba"] = [numba_kernels.kernel(OP, "attention_fast")]

    rng = np.random.default_rng(0)
    rows, layers = args.rows, args.layers
    for span in spans:
        caches = {}
        for layer in range(layers):
            for r in range(rows):
                caches[f"k_{layer}_{r}"] = rng.standard_normal((1, G, span, D), np.float32) * 0.5
                caches[f"v_{layer}_{r}"] = rng.standard_normal((1, G, D, span), np.float32)
        q = rng.standard_normal((rows, G, H, D), np.float32) * 0.5
        timed = {form: Timed(form, span, layers, rows, kernels, caches, q, args.pos) for form in forms}
        exact = chain_reference(q, caches, layers, rows)
        for form in (forms if args.pos < 0 else []):
            if form not in ("empty", "adds"):
                err = float(np.abs(timed[form].result() - exact).max())
                print(f"{span}: {form} against float64: max |err| {err:.2e} (max |out| {np.abs(exact).max():.1f})")
        times = {form: [] for form in forms}
        for rnd in range(args.rounds):
            for form in (forms if rnd % 2 == 0 else forms[::-1]):
                times[form].append(timed[form].ms(args.seconds))
        cache_bytes = 2 * layers * rows * G * span * D * 4
        print(f"\n{span} positions, {layers} layers, {rows} row(s), caches {cache_bytes / 1e6:.1f} MB, "
              f"{args.rounds} rounds")
        print("| form | median ms | min | max | GB/s (median) | ratio to xnnpack min / median / max |")
        print("|---|---:|---:|---:|---:|---|")
        for form in forms:
            ms = times[form]
            ratios = [a / b for a, b in zip(ms, times["xnnpack"])] if "xnnpack" in times else [float("nan")]
            print(f"| {form} | {statistics.median(ms):.3f} | {min(ms):.3f} | {max(ms):.3f} | "
                  f"{cache_bytes / statistics.median(ms) / 1e6:.1f} | {min(ratios):.3f} / "
                  f"{statistics.median(ratios):.3f} / {max(ratios):.3f} |", flush=True)
        if "empty" in times and "adds" in times:
            per = [(e - a) / layers * 1e3 for e, a in zip(times["empty"], times["adds"])]
            print(f"an empty custom op (with the XNNPACK partition after it): {statistics.median(per):.2f} us per call "
                  f"(min {min(per):.2f}, max {max(per):.2f}, from empty - adds per round / {layers})")
        del timed


if __name__ == "__main__":
    main()
