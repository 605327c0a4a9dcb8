"""What the numba kernels share: LiteRT's buffer functions as ctypes prototypes numba
calls directly, the C signatures of a custom op's callbacks, and intrinsics numba lacks
(stack out-parameters, pointer casts, bit casts, calls through an address)."""

from __future__ import annotations

import ctypes

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic
from numba.core import cgutils

from .custom_ops import litert_path

_lib = ctypes.CDLL(litert_path())  # the process's one copy of the library (already loaded by the runtime)
_I64P, _I32P = ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int32)


def _proto(name: str, *argtypes):
    function = getattr(_lib, name)
    function.restype, function.argtypes = ctypes.c_int, list(argtypes)
    return function


host_memory = _proto("LiteRtGetTensorBufferHostMemory", ctypes.c_void_p, _I64P)
buffer_size = _proto("LiteRtGetTensorBufferSize", ctypes.c_void_p, _I64P)
tensor_type = _proto("LiteRtGetTensorBufferTensorType", ctypes.c_void_p, _I32P)
lock = _proto("LiteRtLockTensorBuffer", ctypes.c_void_p, _I64P)
unlock = _proto("LiteRtUnlockTensorBuffer", ctypes.c_void_p)


@intrinsic
def stack_i64(typingctx):
    """A fresh int64 on the stack (an out-parameter)."""
    def codegen(context, builder, signature, args):
        return cgutils.alloca_once(builder, ir.IntType(64))
    return types.CPointer(types.int64)(), codegen


@intrinsic
def stack_type(typingctx):
    """32 int32 on the stack: room for a LiteRtRankedTensorType (18 words)."""
    def codegen(context, builder, signature, args):
        return cgutils.alloca_once(builder, ir.IntType(32), size=32)
    return types.CPointer(types.int32)(), codegen


def _pointer_of(numba_type, llvm_type):
    @intrinsic
    def cast(typingctx, address):
        def codegen(context, builder, signature, args):
            value = args[0]
            if isinstance(value.type, ir.PointerType):
                return builder.bitcast(value, llvm_type.as_pointer())
            return builder.inttoptr(value, llvm_type.as_pointer())
        return types.CPointer(numba_type)(address), codegen
    return cast


@intrinsic
def address(typingctx, pointer):
    """A pointer's address as an int64 (0 for NULL)."""
    def codegen(context, builder, signature, args):
        return builder.ptrtoint(args[0], ir.IntType(64))
    return types.int64(pointer), codegen


f32_at = _pointer_of(types.float32, ir.FloatType())
i32_at = _pointer_of(types.int32, ir.IntType(32))
i64_at = _pointer_of(types.int64, ir.IntType(64))

INIT = types.int32(types.voidptr, types.voidptr, types.uintp)
LAYOUTS = types.int32(types.voidptr, types.uintp, types.CPointer(types.int32), types.uintp, types.CPointer(types.int32))
RUN = types.int32(types.voidptr, types.uintp, types.CPointer(types.voidptr), types.uintp, types.CPointer(types.voidptr))
DESTROY = types.int32(types.voidptr)
LAYOUT_WORDS = 17  # LiteRtLayout: the rank word, 8 dims, 8 strides




FASTMATH = {"reassoc", "contract"}  # vectorized sums; exp, tanh and comparisons as written


@intrinsic
def f32_from_bits(typingctx, bits):
    """An int32's bits read as a float32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@intrinsic
def bits_from_f32(typingctx, value):
    """A float32's bits as an int32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(types.float32), codegen




@njit(fastmath=FASTMATH, inline="always")
def exp_le0(x):
    """exp(x) for x <= 0: kernels.c's exp16, one lane: 2^n p(r), 0 below -87."""
    xc = x if x > np.float32(-87.0) else np.float32(-87.0)
    n = (xc * np.float32(1.44269504) + np.float32(12582912.0)) - np.float32(12582912.0)
    r = xc - n * np.float32(0.693145752) - n * np.float32(1.42860677e-6)
    p = np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    scale = f32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))
    return p * scale if x > np.float32(-87.0) else np.float32(0.0)


# ---- A cacheable form. numba will not cache a function that calls a ctypes function
# ("uses dynamic globals"), so these kernels take LiteRT's functions from a table that
# user_data points to (filled in each process), called through the addresses read there:
# compiled once into NUMBA_CACHE_DIR / __pycache__, loaded from it by later processes.

@intrinsic
def call_status(typingctx, function, first, second):
    """``((int (*)(void *, void *)) function)(first, second)``."""
    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(8).as_pointer(), ir.IntType(8).as_pointer()])
        callee = builder.inttoptr(args[0], fnty.as_pointer())
        as_void = [builder.bitcast(a, ir.IntType(8).as_pointer()) if isinstance(a.type, ir.PointerType)
                   else builder.inttoptr(a, ir.IntType(8).as_pointer()) for a in args[1:]]
        return builder.call(callee, as_void)
    return types.int32(function, first, second), codegen


TABLE_FUNCTIONS = ("LiteRtGetTensorBufferHostMemory", "LiteRtGetTensorBufferTensorType")


def function_table() -> np.ndarray:
    """The addresses a cached kernel calls, in TABLE_FUNCTIONS' order (its user_data)."""
    return np.array([ctypes.cast(getattr(_lib, name), ctypes.c_void_p).value for name in TABLE_FUNCTIONS], np.int64)
