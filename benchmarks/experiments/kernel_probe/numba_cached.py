"""numba_kernels.attention_fast_run in a form numba caches on disk (``cache=True``):
numba refuses to cache a function that calls a ctypes function ("uses dynamic globals"),
so this one calls LiteRT's buffer functions through the addresses in the table its
user_data points to (:func:`numba_kernels.function_table`, filled in each process).
The body is attention_fast_run's with those two calls replaced (kept in step by hand).
The first process compiles it into NUMBA_CACHE_DIR (or __pycache__ beside this file);
later processes load the machine code.
"""

from __future__ import annotations

import numpy as np
from numba import cfunc

from .custom_ops import Kernel
from .numba_base import (DESTROY, FASTMATH, INIT, LAYOUT_WORDS, LAYOUTS, RUN, call_status, exp_le0, f32_at,
                        function_table, i32_at, i64_at, stack_i64, stack_type)


@cfunc(INIT, nopython=True, cache=True)
def init(user, data, size):
    return 0


@cfunc(LAYOUTS, nopython=True, cache=True)
def output_layouts(user, n_in, layouts_in, n_out, layouts_out):
    """Every output takes input 0's layout (the query's: [B, G, H, D])."""
    for i in range(n_out):
        for j in range(LAYOUT_WORDS):
            layouts_out[i * LAYOUT_WORDS + j] = layouts_in[j]
    return 0


@cfunc(DESTROY, nopython=True, cache=True)
def destroy(user):
    return 0


@cfunc(RUN, nopython=True, fastmath=FASTMATH, cache=True)
def attention_cached_run(user, n_in, ins, n_out, outs):
    """numba_kernels.attention_fast_run with LiteRT's functions called through the
    table user_data points to (numba_kernels.function_table())."""
    if n_in < 5 or (n_in - 3) % 2 != 0 or n_out != 1:
        return 1
    slot, qt, kt = stack_i64(), stack_type(), stack_type()
    if call_status(i64_at(user)[1], ins[0], qt) or call_status(i64_at(user)[1], ins[3], kt):
        return 3
    B, G, H, D = qt[2], qt[3], qt[4], qt[5]
    T = kt[4]
    if B * 2 + 3 != n_in or kt[3] != G or kt[5] != D:
        return 1
    call_status(i64_at(user)[0], ins[0], slot)
    q = f32_at(slot[0])
    call_status(i64_at(user)[0], ins[1], slot)
    pos = i32_at(slot[0])
    call_status(i64_at(user)[0], ins[2], slot)
    params = f32_at(slot[0])
    call_status(i64_at(user)[0], outs[0], slot)
    o = f32_at(slot[0])
    scale, cap, window = params[0], params[1], np.int32(params[2])
    S = T + 16 + (16 if T % 1024 < 16 else 0)
    scratch = np.empty(H * S, np.float32)
    sc = f32_at(scratch.ctypes.data)
    for r in range(B):
        call_status(i64_at(user)[0], ins[3 + 2 * r], slot)
        K = f32_at(slot[0])
        call_status(i64_at(user)[0], ins[4 + 2 * r], slot)
        V = f32_at(slot[0])
        hi = pos[r]
        if hi < 0 or hi >= T:
            hi = T - 1
        lo = hi - window + 1 if window > 0 and hi - window + 1 > 0 else 0
        n = hi - lo + 1
        for g in range(G):
            qg = (r * G + g) * H * D
            kg = g * T * D
            if D == 64:  # a literal trip count: the loop unrolled and vectorized whole
                for t in range(lo, hi + 1):
                    k = kg + t * 64
                    for h in range(H):
                        acc = np.float32(0.0)
                        qh = qg + h * 64
                        for d in range(64):
                            acc += q[qh + d] * K[k + d]
                        sc[h * S + t] = acc * scale
            elif D == 128:
                for t in range(lo, hi + 1):
                    k = kg + t * 128
                    for h in range(H):
                        acc = np.float32(0.0)
                        qh = qg + h * 128
                        for d in range(128):
                            acc += q[qh + d] * K[k + d]
                        sc[h * S + t] = acc * scale
            elif D == 256:
                for t in range(lo, hi + 1):
                    k = kg + t * 256
                    for h in range(H):
                        acc = np.float32(0.0)
                        qh = qg + h * 256
                        for d in range(256):
                            acc += q[qh + d] * K[k + d]
                        sc[h * S + t] = acc * scale
            else:
                for t in range(lo, hi + 1):
                    k = kg + t * D
                    for h in range(H):
                        acc = np.float32(0.0)
                        qh = qg + h * D
                        for d in range(D):
                            acc += q[qh + d] * K[k + d]
                        sc[h * S + t] = acc * scale
            for h in range(H):
                base = h * S
                if cap > 0:
                    for i in range(lo, hi + 1):
                        sc[base + i] = np.tanh(sc[base + i] / cap) * cap
                m = sc[base + lo]
                for i in range(lo, hi + 1):
                    m = max(m, sc[base + i])
                total = np.float32(0.0)
                for i in range(lo, hi + 1):
                    e = exp_le0(sc[base + i] - m)
                    sc[base + i] = e
                    total += e
                inv = np.float32(1.0) / total
                for i in range(lo, hi + 1):
                    sc[base + i] *= inv
            vg = g * D * T
            d = 0
            while d + 4 <= D:
                v0 = vg + d * T
                for h in range(H):
                    a0 = np.float32(0.0)
                    a1 = np.float32(0.0)
                    a2 = np.float32(0.0)
                    a3 = np.float32(0.0)
                    base = h * S
                    for i in range(lo, hi + 1):
                        p = sc[base + i]
                        a0 += p * V[v0 + i]
                        a1 += p * V[v0 + T + i]
                        a2 += p * V[v0 + 2 * T + i]
                        a3 += p * V[v0 + 3 * T + i]
                    out = qg + h * D + d
                    o[out] = a0
                    o[out + 1] = a1
                    o[out + 2] = a2
                    o[out + 3] = a3
                d += 4
            while d < D:
                for h in range(H):
                    acc = np.float32(0.0)
                    for i in range(lo, hi + 1):
                        acc += sc[h * S + i] * V[vg + d * T + i]
                    o[qg + h * D + d] = acc
                d += 1
    return 0




def kernel(name: str) -> Kernel:
    """The attention op, its user_data the function table."""
    table = function_table()
    return Kernel(name, init.address, output_layouts.address, attention_cached_run.address, destroy.address,
                  table.ctypes.data, keep=(init, output_layouts, attention_cached_run, destroy, table))
