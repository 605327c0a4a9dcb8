"""The attention op as a Python function behind a ctypes callback: what needs neither a
compiler nor numba. LiteRT calls it like the others; ctypes takes the GIL for the length of
each call (other Python threads wait while it runs), and numpy does the arithmetic."""

from __future__ import annotations

import ctypes

import numpy as np

from .custom_ops import Kernel, litert_path

_lib = ctypes.CDLL(litert_path())
_P = ctypes.c_void_p
_host = _lib.LiteRtGetTensorBufferHostMemory
_host.restype, _host.argtypes = ctypes.c_int, [_P, ctypes.POINTER(_P)]
_type = _lib.LiteRtGetTensorBufferTensorType
_type.restype, _type.argtypes = ctypes.c_int, [_P, _P]

INIT = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, ctypes.c_size_t)
LAYOUTS = ctypes.CFUNCTYPE(ctypes.c_int, _P, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int32), ctypes.c_size_t,
                           ctypes.POINTER(ctypes.c_int32))
RUN = ctypes.CFUNCTYPE(ctypes.c_int, _P, ctypes.c_size_t, ctypes.POINTER(_P), ctypes.c_size_t, ctypes.POINTER(_P))
DESTROY = ctypes.CFUNCTYPE(ctypes.c_int, _P)


def _array(buffer: int, dtype, shape) -> np.ndarray:
    address = _P()
    if _host(buffer, ctypes.byref(address)):
        raise RuntimeError("LiteRtGetTensorBufferHostMemory failed")
    count = int(np.prod(shape))
    raw = (ctypes.c_byte * (count * np.dtype(dtype).itemsize)).from_address(address.value)
    return np.frombuffer(raw, dtype).reshape(shape)


def _dims(buffer: int) -> tuple[int, ...]:
    raw = (ctypes.c_int32 * 32)()
    if _type(buffer, raw):
        raise RuntimeError("LiteRtGetTensorBufferTensorType failed")
    return tuple(raw[2:2 + (raw[1] & 0x7F)])


def _run(user, n_in, ins, n_out, outs) -> int:
    try:
        B, G, H, D = _dims(ins[0])
        T = _dims(ins[3])[2]
        q = _array(ins[0], np.float32, (B, G, H, D))
        pos = _array(ins[1], np.int32, (B,))
        scale, cap, window, _ = _array(ins[2], np.float32, (4,))
        out = _array(outs[0], np.float32, (B, G, H, D))
        for r in range(B):
            K = _array(ins[3 + 2 * r], np.float32, (G, T, D))
            V = _array(ins[4 + 2 * r], np.float32, (G, D, T))
            hi = int(pos[r]) if 0 <= pos[r] < T else T - 1
            lo = max(0, hi - int(window) + 1) if window > 0 else 0
            s = np.einsum("ghd,gtd->ght", q[r], K[:, lo:hi + 1]) * scale
            if cap > 0:
                s = np.tanh(s / cap) * cap
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            out[r] = np.einsum("ght,gdt->ghd", s, V[:, :, lo:hi + 1])
        return 0
    except Exception:  # noqa: BLE001  (the library ignores the status; the runtime would record it)
        return 3


def _layouts(user, n_in, layouts_in, n_out, layouts_out) -> int:
    for i in range(n_out):
        for j in range(17):
            layouts_out[i * 17 + j] = layouts_in[j]
    return 0


_CALLBACKS = (INIT(lambda user, data, size: 0), LAYOUTS(_layouts), RUN(_run), DESTROY(lambda user: 0))


def kernel(name: str) -> Kernel:
    addresses = [ctypes.cast(c, _P).value for c in _CALLBACKS]
    return Kernel(name, *addresses, keep=_CALLBACKS)
