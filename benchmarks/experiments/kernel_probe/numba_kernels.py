"""The kernels of kernels.c written with numba: ``@cfunc`` s with LiteRT's C signatures,
compiled to machine code at import (nopython: no GIL, no Python objects), calling the
library's tensor-buffer functions through ctypes prototypes numba calls directly.

numba has no stack arrays or pointer casts in plain Python, so three small intrinsics
supply them: an 8-byte stack slot for out-parameters, a stack block for a tensor type,
and an address read back as a typed pointer.
"""

from __future__ import annotations

import numpy as np
from numba import carray, cfunc

from .custom_ops import Kernel
from .numba_base import (DESTROY, FASTMATH, INIT, LAYOUT_WORDS, LAYOUTS, RUN, address, buffer_size, exp_le0,  # noqa: F401
                        f32_at, host_memory, i32_at, i64_at, lock, stack_i64, stack_type, tensor_type, unlock)


@cfunc(INIT, nopython=True)
def probe_init(user, data, size):
    if address(user):
        i64_at(user)[0] += 1
    return 0


@cfunc(LAYOUTS, nopython=True)
def probe_layouts(user, n_in, layouts_in, n_out, layouts_out):
    """Every output takes input 0's layout."""
    if address(user):
        i64_at(user)[1] += 1
    for i in range(n_out):
        for j in range(LAYOUT_WORDS):
            layouts_out[i * LAYOUT_WORDS + j] = layouts_in[j]
    return 0


@cfunc(DESTROY, nopython=True)
def probe_destroy(user):
    if address(user):
        i64_at(user)[3] += 1
    return 0


@cfunc(RUN, nopython=True)
def add_run(user, n_in, ins, n_out, outs):
    slot = stack_i64()
    if lock(ins[0], slot):
        return 3
    a_address = slot[0]
    if lock(ins[1], slot):
        return 3
    b_address = slot[0]
    if lock(outs[0], slot):
        return 3
    c_address = slot[0]
    buffer_size(outs[0], slot)
    n = slot[0] // 4
    a, b, c = carray(f32_at(a_address), n), carray(f32_at(b_address), n), carray(f32_at(c_address), n)
    for i in range(n):
        c[i] = a[i] + b[i]
    unlock(ins[0])
    unlock(ins[1])
    unlock(outs[0])
    if address(user):
        i64_at(user)[2] += 1
    return 0


@cfunc(RUN, nopython=True)
def empty_run(user, n_in, ins, n_out, outs):
    return 0


@cfunc(RUN, nopython=True)
def fail_run(user, n_in, ins, n_out, outs):
    return 3


@cfunc(RUN, nopython=True)
def spin_run(user, n_in, ins, n_out, outs):
    """Copies input 0 to output 0 after ~ms[0] milliseconds of arithmetic."""
    slot = stack_i64()
    host_memory(ins[0], slot)
    a_address = slot[0]
    host_memory(ins[1], slot)
    ms = carray(f32_at(slot[0]), 1)[0]
    host_memory(outs[0], slot)
    c_address = slot[0]
    buffer_size(outs[0], slot)
    n = slot[0] // 4
    x = 1.0
    for _ in range(int(ms * 250_000)):
        x = x * 1.0000001 + 1e-9
    a, c = carray(f32_at(a_address), n), carray(f32_at(c_address), n)
    for i in range(n):
        c[i] = a[i] + (x - x)
    if address(user):
        i64_at(user)[2] += 1
    return 0


RUNS = {"add": add_run, "empty": empty_run, "fail": fail_run, "spin": spin_run}


def counters() -> np.ndarray:
    """inits, layouts, runs, destroys: what the probes' callbacks count into."""
    return np.zeros(4, np.int64)


def kernel(name: str, run: str, count_into: np.ndarray | None = None, run_function=None) -> Kernel:
    function = run_function if run_function is not None else RUNS[run]
    return Kernel(name, probe_init.address, probe_layouts.address, function.address, probe_destroy.address,
                  count_into.ctypes.data if count_into is not None else 0,
                  keep=(probe_init, probe_layouts, function, probe_destroy, count_into))


@cfunc(RUN, nopython=True, fastmath=FASTMATH)
def attention_run(user, n_in, ins, n_out, outs):
    """Decode attention over per-row caches in the transposed layout: kernels.c's
    ``attention_run`` (same inputs, same order of sums)."""
    if n_in < 5 or (n_in - 3) % 2 != 0 or n_out != 1:
        return 1
    slot, qt, kt = stack_i64(), stack_type(), stack_type()
    if tensor_type(ins[0], qt) or tensor_type(ins[3], kt):
        return 3
    B, G, H, D = qt[2], qt[3], qt[4], qt[5]
    T = kt[4]
    if B * 2 + 3 != n_in or kt[3] != G or kt[5] != D:
        return 1
    host_memory(ins[0], slot)
    q = carray(f32_at(slot[0]), B * G * H * D)
    host_memory(ins[1], slot)
    pos = carray(i32_at(slot[0]), B)
    host_memory(ins[2], slot)
    params = carray(f32_at(slot[0]), 4)
    host_memory(outs[0], slot)
    o = carray(f32_at(slot[0]), B * G * H * D)
    scale, cap, window = params[0], params[1], np.int32(params[2])
    scores = np.empty(H * T, np.float32)
    for r in range(B):
        host_memory(ins[3 + 2 * r], slot)
        K = carray(f32_at(slot[0]), G * T * D)
        host_memory(ins[4 + 2 * r], slot)
        V = carray(f32_at(slot[0]), G * D * T)
        hi = pos[r]
        if hi < 0 or hi >= T:
            hi = T - 1
        lo = hi - window + 1 if window > 0 and hi - window + 1 > 0 else 0
        n = hi - lo + 1
        for g in range(G):
            qg = (r * G + g) * H * D
            for t in range(lo, hi + 1):
                k = g * T * D + t * D
                for h in range(H):
                    acc = np.float32(0.0)
                    for d in range(D):
                        acc += q[qg + h * D + d] * K[k + d]
                    acc *= scale
                    if cap > 0:
                        acc = np.tanh(acc / cap) * cap
                    scores[h * T + t] = acc
            for h in range(H):
                base = h * T
                m = scores[base + lo]
                for i in range(lo + 1, hi + 1):
                    if scores[base + i] > m:
                        m = scores[base + i]
                total = np.float32(0.0)
                for i in range(lo, hi + 1):
                    e = np.exp(scores[base + i] - m)
                    scores[base + i] = e
                    total += e
                inv = np.float32(1.0) / total
                for i in range(lo, hi + 1):
                    scores[base + i] *= inv
            for d in range(D):
                v = g * D * T + d * T
                for h in range(H):
                    acc = np.float32(0.0)
                    base = h * T
                    for i in range(lo, hi + 1):
                        acc += scores[base + i] * V[v + i]
                    o[qg + h * D + d] = acc
    return 0


RUNS["attention"] = attention_run


@cfunc(RUN, nopython=True, fastmath=FASTMATH)
def attention_fast_run(user, n_in, ins, n_out, outs):
    """kernels.c's attention_fast_run in numba: raw pointers (no index wrap-around), each
    K row read once for the group's heads, the exp a polynomial, 4 V rows per pass over
    the scores. LLVM vectorizes the inner loops (sums reassociated)."""
    if n_in < 5 or (n_in - 3) % 2 != 0 or n_out != 1:
        return 1
    slot, qt, kt = stack_i64(), stack_type(), stack_type()
    if tensor_type(ins[0], qt) or tensor_type(ins[3], kt):
        return 3
    B, G, H, D = qt[2], qt[3], qt[4], qt[5]
    T = kt[4]
    if B * 2 + 3 != n_in or kt[3] != G or kt[5] != D:
        return 1
    host_memory(ins[0], slot)
    q = f32_at(slot[0])
    host_memory(ins[1], slot)
    pos = i32_at(slot[0])
    host_memory(ins[2], slot)
    params = f32_at(slot[0])
    host_memory(outs[0], slot)
    o = f32_at(slot[0])
    scale, cap, window = params[0], params[1], np.int32(params[2])
    S = T + 16 + (16 if T % 1024 < 16 else 0)
    scratch = np.empty(H * S, np.float32)
    sc = f32_at(scratch.ctypes.data)
    for r in range(B):
        host_memory(ins[3 + 2 * r], slot)
        K = f32_at(slot[0])
        host_memory(ins[4 + 2 * r], slot)
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


RUNS["attention_fast"] = attention_fast_run
