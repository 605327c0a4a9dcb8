#!/usr/bin/env python3
"""A decode-attention kernel's Run called directly (through ctypes, on LiteRT tensor
buffers made from numpy arrays), outside any graph: its numbers against a float64 numpy
reference, and its speed, for quick work on the kernel itself.

    python3 -m benchmarks.experiments.kernel_probe.kernel_direct [--span 1024] [--rows 1] [--pos -1] [--window 0]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent

from runtime.executor import native
from runtime.executor.native import HostBuffer, TensorInfo

RUN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                       ctypes.c_void_p)


def info(name: str, array: np.ndarray) -> TensorInfo:
    """A TensorInfo with LiteRtRankedTensorType's bytes for ``array``'s shape and dtype."""
    element = {np.dtype(np.float32): 1, np.dtype(np.int32): 2}[array.dtype]
    raw = bytearray(native._TENSOR_TYPE_BYTES)
    raw[0:4] = element.to_bytes(4, "little")
    raw[4:8] = array.ndim.to_bytes(4, "little")
    for i, d in enumerate(array.shape):
        raw[8 + 4 * i:12 + 4 * i] = int(d).to_bytes(4, "little")
    return TensorInfo(name, array.shape, array.dtype, bytes(raw))


class Call:
    """The buffers of one call: inputs q, pos, params, K_r, V_r; output o."""

    def __init__(self, q, pos, params, caches):
        arrays = [q, pos, params, *caches]
        self.ins = [HostBuffer(info(f"i{i}", a)) for i, a in enumerate(arrays)]
        for buffer, a in zip(self.ins, arrays):
            buffer.write(a)
        self.out = HostBuffer(info("o", q))
        owner = object()  # handle_for keys handles by id(model): any object serves
        self._owner = owner
        self.in_handles = (ctypes.c_void_p * len(arrays))(*[b.handle_for(owner) for b in self.ins])
        self.out_handles = (ctypes.c_void_p * 1)(self.out.handle_for(owner))
        self.n_in = len(arrays)

    def run(self, function) -> int:
        user = None
        if isinstance(function, tuple):  # (Run, Kernel): the kernel's user_data too
            function, user = function[0], function[1].user_data
        return function(user, self.n_in, self.in_handles, 1, self.out_handles)


def reference(q, pos, scale, cap, window, caches) -> np.ndarray:
    B, G, H, D = q.shape
    out = np.zeros(q.shape, np.float64)
    for r in range(B):
        K, V = caches[2 * r][0].astype(np.float64), caches[2 * r + 1][0].astype(np.float64)
        hi = pos[r]
        lo = max(0, hi - window + 1) if window > 0 else 0
        for g in range(G):
            s = q[r, g].astype(np.float64) @ K[g, lo:hi + 1].T * scale  # [H, n]
            if cap > 0:
                s = np.tanh(s / cap) * cap
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[r, g] = p @ V[g, :, lo:hi + 1].T
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--span", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--pos", type=int, default=-1, help="every row's position (-1: the last; -2: each row a random one)")
    parser.add_argument("--window", type=int, default=0)
    parser.add_argument("--cap", type=float, default=0.0)
    parser.add_argument("--shape", default="3,3,64", help="KV groups, query heads per group, head_dim")
    parser.add_argument("--layers", type=int, default=30, help="calls per timed step (distinct caches)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kernels", default="gcc:attention_run,gcc:attention_fast_run,numba:attention_fast,numba:cached")
    args = parser.parse_args()
    from . import c_kernels
    library = c_kernels.compile_library()
    functions = {}
    for spec in args.kernels.split(","):
        flavour, name = spec.split(":")
        if flavour == "gcc":
            functions[spec] = RUN(ctypes.cast(getattr(library, name), ctypes.c_void_p).value)
        elif name == "cached":
            from . import numba_cached
            kernel = numba_cached.kernel("x")
            functions[spec] = (RUN(kernel.run), kernel)
        else:
            from . import numba_kernels
            functions[spec] = RUN(numba_kernels.RUNS[name].address)
    rng = np.random.default_rng(1)
    G, H, D = (int(x) for x in args.shape.split(","))
    T, B = args.span, args.rows
    pos = np.full(B, T - 1 if args.pos < 0 else args.pos, np.int32)
    if args.pos == -2:  # every row its own position
        pos = rng.integers(0, T, B).astype(np.int32)
    params = np.array([0.125, args.cap, args.window, 0], np.float32)
    calls, refs = [], []
    for layer in range(args.layers):
        q = rng.standard_normal((B, G, H, D), np.float32) * 2
        caches = []
        for _ in range(B):
            caches += [rng.standard_normal((1, G, T, D), np.float32), rng.standard_normal((1, G, D, T), np.float32)]
        calls.append(Call(q, pos, params, caches))
        if layer == 0:
            refs = reference(q, pos, 0.125, args.cap, args.window, caches)
    bytes_read = 2 * args.layers * G * D * 4 * sum(min(int(p) + 1, args.window or T) for p in pos)
    for spec, function in functions.items():
        status = calls[0].run(function)
        err = np.abs(calls[0].out.array - refs).max() / np.abs(refs).max()
        print(f"{spec}: status {status}, max |err| / max |ref| {err:.2e}")
    times = {spec: [] for spec in functions}
    for rnd in range(args.rounds):
        for spec in (list(functions) if rnd % 2 == 0 else list(functions)[::-1]):
            function = functions[spec]
            start, count = time.perf_counter(), 0
            while time.perf_counter() - start < 0.2:
                for call in calls:
                    call.run(function)
                count += 1
            times[spec].append((time.perf_counter() - start) / count * 1e3)
    for spec, ms in times.items():
        print(f"{spec}: {statistics.median(ms):.3f} ms per {args.layers} calls (min {min(ms):.3f}, max {max(ms):.3f}), "
              f"{bytes_read / statistics.median(ms) / 1e6:.1f} GB/s")


if __name__ == "__main__":
    main()
