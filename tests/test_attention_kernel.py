"""The decode attention's custom-op form: the committed fixtures' decode attention rewritten
into ``odml_runtime.decode_attention`` (runtime.util.attention_rewrite) at test time, in
place (``--attention-kernel native``) or beside the standard form (``auto``, the default),
run with the kernel the runtime compiles (runtime.executor.kernels), against the standard form.

Tests that run the kernel need a C compiler (cc or gcc) and skip, saying so, without one."""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from batching import assert_rows_equal_alone, four_adapter_rows
from conftest import MODELS, adapter_path, greedy, run_signature, step_inputs
from graph_passes import needs_kernel
from runtime import Engine, EngineSettings, SessionConfig
from runtime.errors import FailedPreconditionError, InternalError, InvalidArgumentError
from runtime.executor import kernels, litert_executor
from runtime.executor.litert_executor import ExecutorSettings, LlmExecutor
from runtime.executor.native import NativeModel
from runtime.executor.weight_cache import WeightCacheFile
from runtime.util import flatbuffer_model
from runtime.util.attention_rewrite import (DECODE_ATTENTION, FORMS_METADATA, LINEAR_ROWS, LORA_DELTA, OUR_OPS,
                                            attention_forms, custom_codes, rewrite_decode_attention)
from runtime.util.graph_edit import op_name
from runtime.util.signature_names import LoraSlot

FIXTURES = {"gqa": MODELS / "gqa_transposed.tflite", "gqa_grouped": MODELS / "gqa_grouped.tflite",
            "gemma3": MODELS / "gemma3" / "model.tflite"}
needs_cc = pytest.mark.skipif(kernels.compiler() is None,
                              reason="no C compiler (cc or gcc) on PATH to build the attention kernel")
# Where the runtime runs the op form of a model of both forms: a compiler and AVX2 with FMA.
TOL = 1e-5


def relative_difference(want: np.ndarray, got: np.ndarray) -> float:
    """The largest difference between two outputs over the larger of 1 and ``want``'s largest
    magnitude: float32 sums in another order (the op form's linear layers sum 16 lanes at a
    time, XNNPACK along each row) differ in proportion to the values summed."""
    return float(np.abs(got - want).max() / max(1.0, float(np.abs(want).max())))


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("native")
    paths = {}
    for name, source in FIXTURES.items():
        data, counts = rewrite_decode_attention(source.read_bytes())
        assert counts["decode"] == (3 if name == "gemma3" else 2)  # one op per layer
        assert all(key.startswith("decode") for key in counts)
        assert counts["decode_batch4_lora_r8" if name == "gemma3" else "decode_batch4_lora_r4"] == 4 * counts["decode"]
        paths[name] = folder / f"{name}.tflite"
        paths[name].write_bytes(data)
    return paths


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The fixtures with both forms in one file (what the export writes by default)."""
    folder = tmp_path_factory.mktemp("both")
    paths = {}
    for name, source in FIXTURES.items():
        data, counts = rewrite_decode_attention(source.read_bytes(), keep_standard=True)
        assert counts["decode"] == (3 if name == "gemma3" else 2)
        paths[name] = folder / f"{name}.tflite"
        paths[name].write_bytes(data)
    return paths


def test_the_pass_rewrites_decode_signatures_only(rewritten):
    for name, path in rewritten.items():
        assert custom_codes(path.read_bytes()) == set(OUR_OPS)  # both fixtures have LoRA slots and batches
        assert custom_codes(FIXTURES[name].read_bytes()) == set()
        with pytest.raises(InvalidArgumentError, match="already runs"):
            rewrite_decode_attention(path.read_bytes())


def test_the_op_form_runs_every_decode_lora_delta_as_the_op(rewritten):
    """In every decode signature with a LoRA slot, each projection's delta is one lora_delta
    op (two matmuls before) and no matmul by an adapter input is left; prefill keeps them."""
    for name, path in rewritten.items():
        model = flatbuffer_model.unpack(path.read_bytes())
        original = flatbuffer_model.unpack(FIXTURES[name].read_bytes())
        for sig in model.signatureDefs:
            key = sig.signatureKey.decode()
            if "_lora_" not in key:
                continue
            sub, before = model.subgraphs[sig.subgraphIndex], original.subgraphs[sig.subgraphIndex]
            adapters = lambda graph, op: any(b"_prime_weight" in (graph.tensors[i].name or b"")  # noqa: E731
                                             for i in op.inputs)
            by_adapter = sum(1 for op in before.operators if op_name(original, op) == "BATCH_MATMUL"
                             and adapters(before, op))
            ops = sum(1 for op in sub.operators if model.operatorCodes[op.opcodeIndex].customCode
                      in (LORA_DELTA, LORA_DELTA.encode()))
            left = sum(1 for op in sub.operators if op_name(model, op) == "BATCH_MATMUL" and adapters(sub, op))
            if key.startswith("decode"):
                assert by_adapter and (ops, left) == (by_adapter // 2, 0), key
            else:
                assert (ops, left) == (0, by_adapter), key


def test_the_op_form_runs_the_decode_linear_layers_as_the_op(rewritten):
    """In every decode signature, single-row and batched, each float32 FULLY_CONNECTED becomes
    one linear_rows op over the same weights (the lm_head too); prefill keeps them."""
    for name, path in rewritten.items():
        model = flatbuffer_model.unpack(path.read_bytes())
        original = flatbuffer_model.unpack(FIXTURES[name].read_bytes())
        for sig in model.signatureDefs:
            key = sig.signatureKey.decode()
            sub, before = model.subgraphs[sig.subgraphIndex], original.subgraphs[sig.subgraphIndex]
            linears = [op for op in before.operators if op_name(original, op) == "FULLY_CONNECTED"]
            ops = [op for op in sub.operators if model.operatorCodes[op.opcodeIndex].customCode
                   in (LINEAR_ROWS, LINEAR_ROWS.encode())]
            left = sum(1 for op in sub.operators if op_name(model, op) == "FULLY_CONNECTED")
            if key.startswith("decode"):
                assert linears and (len(ops), left) == (len(linears), 0), key
                assert sorted(int(op.inputs[1]) for op in ops) == sorted(int(op.inputs[1]) for op in linears), key
            else:
                assert (len(ops), left) == (0, len(linears)), key


def test_a_linear_of_another_form_keeps_xnnpack():
    """A batched FULLY_CONNECTED the kernel does not compute (here a fused activation, int8
    weights) stays as it is in the op form, which computes the same; its neighbours are taken."""
    model = flatbuffer_model.unpack(FIXTURES["gqa"].read_bytes())
    sig = next(sig for sig in model.signatureDefs if sig.signatureKey == b"decode_batch4_lora_r4")
    sub = model.subgraphs[sig.subgraphIndex]
    linears = [op for op in sub.operators if op_name(model, op) == "FULLY_CONNECTED"]
    activated, weights_int8 = linears[0], linears[1]
    activated.builtinOptions.fusedActivationFunction = 1  # RELU
    sub.tensors[weights_int8.inputs[1]].type = 9  # INT8
    out = flatbuffer_model.unpack(rewrite_decode_attention(flatbuffer_model.pack(model))[0])
    rewritten = next(out.subgraphs[s.subgraphIndex] for s in out.signatureDefs if s.signatureKey == sig.signatureKey)
    left = [op for op in rewritten.operators if op_name(out, op) == "FULLY_CONNECTED"]
    assert sorted(int(op.inputs[1]) for op in left) == sorted(int(op.inputs[1]) for op in (activated, weights_int8))
    assert sum(1 for op in rewritten.operators if out.operatorCodes[op.opcodeIndex].customCode
               in (LINEAR_ROWS, LINEAR_ROWS.encode())) == len(linears) - 2


def test_a_lora_delta_of_another_form_is_refused_naming_it():
    """x.A multiplied by anything but its own B input: the pass refuses the model, naming
    the signature and the delta, rather than rewrite half of it."""
    model = flatbuffer_model.unpack(FIXTURES["gqa"].read_bytes())
    sig = next(sig for sig in model.signatureDefs if sig.signatureKey == b"decode_lora_r4")
    sub = model.subgraphs[sig.subgraphIndex]
    b_input = next(sub.tensors[i] for i in sub.inputs if b"atten_q_b_prime_weight_0" in sub.tensors[i].name)
    b_input.name = b_input.name.replace(b"atten_q_b", b"atten_x_b")
    with pytest.raises(InvalidArgumentError, match=r"decode_lora_r4: the LoRA delta at op \d+ "
                                                   r"\(decode_lora_r4_lora_atten_q_a_prime_weight_0\): x.A is not "
                                                   "multiplied by its B input next"):
        rewrite_decode_attention(flatbuffer_model.pack(model))


def test_the_default_layout_is_refused():
    with pytest.raises(InvalidArgumentError, match="transposed or grouped KV layout"):
        rewrite_decode_attention((MODELS / "gqa_default.tflite").read_bytes())


@needs_cc
@pytest.mark.parametrize("fixture", sorted(FIXTURES))
def test_every_decode_signature_matches_the_standard_form(fixture, rewritten, kernel_cache):
    """Every decode signature, single-row and batched, with and without attention windows,
    at positions from 0 to the cache's last: logits and caches within 1e-5 of their largest
    value (float32 sums in another order differ in proportion to the sums: the linear
    layers, summed 16 lanes at a time here and along each row by XNNPACK, put up to 1.1e-5
    between logits of up to 5.5, 2e-6 of them)."""
    original = NativeModel(FIXTURES[fixture], num_threads=1, weight_cache=":memory:", name="original")
    native = NativeModel(rewritten[fixture], num_threads=1, weight_cache=":memory:", name="native")
    keys = [key for key in original.signatures if key.startswith("decode")]
    assert keys and set(keys) <= set(native.signatures)
    for key in keys:
        span = next(info.shape[2] for name, info in original.signatures[key].inputs.items()
                    if name.startswith("kv_cache_k"))
        for position in sorted({0, 1, 9, span // 2, span - 1}):
            inputs = step_inputs(original, key, position, seed=position)
            want, got = run_signature(original, key, inputs), run_signature(native, key, inputs)
            for name in want:
                assert np.isfinite(want[name]).all()
                difference = relative_difference(want[name], got[name])
                assert difference <= TOL, f"{key} at {position}: {name} differs by {difference:.2e} (relative)"
    original.close()
    native.close()


# -- the kernel alone, each build this CPU runs ---------------------------------------------

# The builds of the kernel this CPU can run: its own flags (the runtime's build), AVX2 alone
# (its 8-float vectors; the runtime's build on AVX2-only CPUs, built here on an AVX-512 one
# as isa_flags gives them to such a CPU), AVX2 without F16C (float16 caches converted in
# integer steps, as where /proc/cpuinfo does not list it) and none (4-float vectors). Each
# test builds with exactly these flags (tuning_flags() patched to give none).
_HERE = (*kernels.isa_flags(), *kernels.tuning_flags())
_AVX2 = pytest.mark.skipif(not {"-mavx2", "-mfma", "-mf16c"} <= set(_HERE), reason="this CPU lacks AVX2, FMA, F16C")
ISA_BUILDS = [pytest.param(_HERE, id="this cpu"),
              pytest.param(("-mavx2", "-mfma", "-mf16c"), id="avx2", marks=_AVX2),
              pytest.param(("-mavx2", "-mfma"), id="avx2 without f16c", marks=_AVX2),
              pytest.param((), id="plain")]
# The attention kernel's also with each tuning tuning_flags() gives some CPU: the K pass over
# float32 caches in four stretches at once (AMD Zen 2), the passes' lines asked into the
# second-level cache (AMD Zen 4), and with none, the sources' defaults.
ATTENTION_BUILDS = [*ISA_BUILDS,
                    pytest.param(("-mavx2", "-mfma", "-mf16c", "-DK_STREAMS_f32=4"), id="avx2, four K streams",
                                 marks=_AVX2),
                    pytest.param((*kernels.isa_flags(), "-DAHEAD_INTO_L2=1"), id="this cpu, lines asked into L2"),
                    pytest.param(kernels.isa_flags(), id="this cpu, the sources' defaults")]


def _build_with(flags: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> ctypes.CDLL:
    """The kernels' library built with exactly ``flags`` (as a CPU of that kind gets them)."""
    monkeypatch.setattr(kernels, "isa_flags", lambda: flags)
    monkeypatch.setattr(kernels, "tuning_flags", lambda: ())
    return kernels.build_library()


class _Layout(ctypes.Structure):
    _fields_ = [("bits", ctypes.c_uint32), ("dims", ctypes.c_int32 * 8), ("strides", ctypes.c_uint32 * 8)]


class _TensorType(ctypes.Structure):
    _fields_ = [("element", ctypes.c_int32), ("layout", _Layout)]


_HOST = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p))
_TYPE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(_TensorType))
_SIZE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t))
_RUN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                        ctypes.c_void_p)


# LiteRtElementType (TfLiteType's numbering) of the arrays given to the kernel.
_ELEMENTS = {np.dtype(np.float32): 1, np.dtype(np.float16): 10}


def run_kernel(library: ctypes.CDLL, arrays: list[np.ndarray], function: str = "attention_run",
               threads: int = 1) -> tuple[np.ndarray, int]:
    """The library's ``function`` on float32 or float16 ``arrays`` (the op's inputs, for
    attention q, mask, params, K, V; the output last), each buffer handle its index + 1,
    typed as its dtype: the output and the error word."""
    arrays = [np.ascontiguousarray(a) for a in arrays]

    def host(handle, out):  # noqa: ANN001, ANN202
        out[0] = arrays[handle - 1].ctypes.data
        return 0

    def tensor_type(handle, out):  # noqa: ANN001, ANN202
        array = arrays[handle - 1]
        out[0].element, out[0].layout.bits = _ELEMENTS[array.dtype], array.ndim
        for i, dim in enumerate(array.shape):
            out[0].layout.dims[i] = dim
        return 0

    def size(handle, out):  # noqa: ANN001, ANN202
        out[0] = arrays[handle - 1].nbytes
        return 0

    callbacks = _HOST(host), _TYPE(tensor_type), _SIZE(size)
    context = kernels._Context(0, *(ctypes.cast(c, ctypes.c_void_p).value for c in callbacks), threads)
    count = len(arrays) - 1
    handles = (ctypes.c_void_p * (count + 1))(*range(1, count + 2))
    kernel_run = _RUN(ctypes.cast(getattr(library, function), ctypes.c_void_p).value)
    outputs = ctypes.addressof(handles) + count * ctypes.sizeof(ctypes.c_void_p)
    status = kernel_run(ctypes.addressof(context), count, ctypes.addressof(handles), 1, outputs)
    assert (status == 0) == (context.error == 0)
    return arrays[count], context.error


def reference(q, mask, params, K, V) -> np.ndarray:  # noqa: ANN001
    """The graph's BATCH_MATMUL -> (soft-cap) -> ADD mask -> SOFTMAX -> BATCH_MATMUL in float64."""
    scores = np.einsum("ghd,gtd->ght", q[0].astype(np.float64), K[0].astype(np.float64)) * float(params[0])
    if params[1] > 0:
        scores = np.tanh(scores / params[1]) * params[1]
    scores = scores + mask.reshape(-1).astype(np.float64)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("ght,gdt->ghd", weights, V[0].astype(np.float64))[None]


# (G, H, D, T, the open positions [first, last] or None, soft-cap): the head sizes of the fast
# paths (64: SmolLM2, 128: Llama, 256: Gemma) and of the general ones (16, 24; H > 8), open
# spans that leave tails of every vector width, a sliding window, one position, none.
KERNEL_CASES = [(2, 3, 64, 300, (0, 250), 0.0), (3, 3, 64, 4096, (0, 4000), 0.0), (2, 4, 128, 300, (40, 290), 0.0),
                (1, 2, 256, 100, (0, 99), 30.0), (2, 8, 64, 37, (5, 5), 0.0), (2, 1, 64, 64, None, 0.0),
                (2, 5, 128, 53, (3, 52), 0.0), (2, 3, 16, 70, (0, 68), 0.0), (2, 9, 24, 50, (10, 40), 0.0)]


@pytest.fixture(scope="module")
def builds_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The builds of other flags in a cache of their own (kernel_cache holds the runtime's one)."""
    return tmp_path_factory.mktemp("isa_builds")


@needs_cc
@pytest.mark.parametrize("caches", [np.float32, np.float16], ids=["f32 caches", "f16 caches"])
@pytest.mark.parametrize("isa", ATTENTION_BUILDS)
def test_each_build_of_the_kernel_computes_attention(isa, caches, builds_cache, monkeypatch):
    """Each vector width the kernel is built for (16, 8 and 4 floats), and each count of K
    streams, called directly at real models' head sizes with float32 or float16 K and V,
    against the graph's computation in float64 from the same values: within 1e-5."""
    monkeypatch.setenv("RUNTIME_CACHE", str(builds_cache))
    library = _build_with(isa, monkeypatch)
    rng = np.random.default_rng(7)
    for G, H, D, T, open_, cap in KERNEL_CASES:
        q = (rng.standard_normal((1, G, H, D)) / np.sqrt(D)).astype(np.float32)
        mask = np.full(T, -np.finfo(np.float32).max, np.float32)
        if open_:
            mask[open_[0]:open_[1] + 1] = 0.0
        params = np.array([1.0, cap, 0.0, 0.0], np.float32)
        K = (2 * rng.standard_normal((1, G, T, D))).astype(caches)
        V = rng.standard_normal((1, G, D, T)).astype(caches)
        want = reference(q, mask, params, K, V)
        # V transposed ([1, G, D, T], params[2] 0) and grouped ([1, G, T, D], params[2] 1: as K lies)
        for layout, v, p in (("transposed", V, params), ("grouped", np.ascontiguousarray(V.transpose(0, 1, 3, 2)),
                                                         params + np.array([0, 0, 1, 0], np.float32))):
            got, error = run_kernel(library, [q, mask, p, K, v, np.zeros((1, G, H, D), np.float32)])
            assert error == 0, layout
            difference = float(np.abs(got - want).max())
            assert difference <= TOL, (f"{layout} G {G} H {H} D {D} T {T} open {open_} cap {cap}: differs by "
                                       f"{difference:.2e}")
    # A failing run: shapes it would misread give the error word and NaN, never numbers: a mask
    # of another length, V in the layout params do not name, a layout params do not know.
    for bad in ([q, mask[:-1], params, K, V], [q, mask, params + np.array([0, 0, 1, 0], np.float32), K, V],
                [q, mask, params + np.array([0, 0, 2, 0], np.float32), K, np.ascontiguousarray(V.transpose(0, 1, 3, 2))]):
        got, error = run_kernel(library, [*bad, np.zeros((1, G, H, D), np.float32)])
        assert error == 3 and np.isnan(got).all()
    # K and V of different types are refused.
    for k, v in ((K.astype(np.float32), V.astype(np.float16)), (K.astype(np.float16), V.astype(np.float32))):
        got, error = run_kernel(library, [q, mask, params, k, v, np.zeros((1, G, H, D), np.float32)])
        assert error == 4 and np.isnan(got).all()


# (x, A, B) shapes as the graphs have them: a single-row decode's [1, in] by [in, r] by
# [r, out] and a batch's [N, 1, in] by [N, in, r] by [N, r, out]; ranks on the 8-float path
# (8, 16) and off it (4, 3); outputs leaving tails of every vector width (192 = 12 x 16,
# 1536, 37); several rows by one adapter (a [2, 3, in] x); batches taken four rows at a time
# with rows left over (5, 6, 7), an `in` leaving a tail of the four taken at a time (50).
LORA_CASES = [((1, 576), (576, 8), (8, 576)), ((1, 576), (576, 8), (8, 192)), ((1, 1536), (1536, 8), (8, 576)),
              ((1, 64), (64, 4), (4, 32)), ((8, 1, 576), (8, 576, 8), (8, 8, 1536)),
              ((2, 1, 64), (2, 64, 16), (2, 16, 64)),
              ((3, 1, 50), (3, 50, 3), (3, 3, 37)), ((2, 3, 40), (40, 8), (8, 37)),
              ((6, 1, 50), (6, 50, 8), (6, 8, 37)), ((5, 1, 576), (5, 576, 16), (5, 16, 192)),
              ((7, 1, 64), (7, 64, 8), (7, 8, 50))]


# (x, W) shapes: a batch's [N, 1, K] and [N, K] rows by SmolLM2's [N_out, K] (the fused q/k/v,
# the MLP's down projection), rows below, at and past the 8 a pass takes (1-17), outputs leaving
# every remainder of the 3 taken at a time, widths leaving tails of every vector width (37, 50).
LINEAR_CASES = [((8, 1, 576), (960, 576)), ((8, 1536), (576, 1536)), ((1, 576), (577, 576)), ((2, 1, 64), (64, 64)),
                ((3, 50), (37, 50)), ((7, 1, 40), (5, 40)), ((9, 37), (38, 37)), ((16, 1, 64), (100, 64)),
                ((17, 24), (3, 24)), ((2, 3, 40), (41, 40))]


# Per op: its run function, its cases, its product in float64 from the same values.
PRODUCTS = {"lora_delta": ("lora_run", LORA_CASES, lambda x, A, B: x @ A @ B),
            "linear_rows": ("linear_run", LINEAR_CASES, lambda x, w: x @ w.T)}


def test_the_kernels_are_tuned_by_cpu(monkeypatch):
    """The kernels' tuning follows the CPU's cores, whatever its vector width: four K streams on
    AMD Zen 2 (family 23); on a Zen 4 (family 25) the linear layers' four rows of W for one row
    of x and every stream asked into the second-level cache; the sources' defaults on Intel
    CPUs."""
    for vendor, family, flags, tuning in (("AuthenticAMD", "23", "avx2 fma f16c", ("-DK_STREAMS_f32=4",)),
                                          ("AuthenticAMD", "25", "avx512f avx2 fma f16c",
                                           ("-DONE_ROW_OUTS_16=4", "-DAHEAD_INTO_L2=1")),
                                          ("GenuineIntel", "6", "avx512f avx2 fma f16c", ())):
        cpu = {"vendor_id": vendor, "cpu family": family, "flags": flags}
        monkeypatch.setattr(kernels, "_first_cpu", lambda cpu=cpu: cpu)
        assert kernels.tuning_flags() == tuning, cpu


# The matrix kernels' also with one row of x taking four rows of W at a time with AVX-512 and W
# asked into the second-level cache, as the runtime builds them for AMD Zen 4 (tuning_flags()),
# and taking one (the sources' default is three).
MATRIX_BUILDS = [*ISA_BUILDS,
                 pytest.param((*kernels.isa_flags(), "-DONE_ROW_OUTS_16=4", "-DAHEAD_INTO_L2=1"),
                              id="this cpu, four rows of W a block, W into L2"),
                 pytest.param((*kernels.isa_flags(), "-DONE_ROW_OUTS_16=1"), id="this cpu, one row of W a block")]


@needs_cc
@pytest.mark.parametrize("op", sorted(PRODUCTS))
@pytest.mark.parametrize("isa", MATRIX_BUILDS)
def test_each_build_of_the_matrix_kernels_computes_the_product(op, isa, builds_cache, monkeypatch):
    """The LoRA delta's and the linear layer's run of each build called directly at the
    graphs' shapes, against x.A.B or x.W^T in float64 from the same values: within 1e-5
    (relative to the output's largest value). The LoRA delta's factors in float32 and in
    float16 (``--lora-dtype float16``: read as float32, every sum float32)."""
    monkeypatch.setenv("RUNTIME_CACHE", str(builds_cache))
    library = _build_with(isa, monkeypatch)
    function, cases, product = PRODUCTS[op]
    rng = np.random.default_rng(11)
    for shapes, factors in itertools.product(cases, (np.float32, np.float16) if op == "lora_delta" else (np.float32,)):
        x, *weights = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
        operands = [x, *(weight.astype(factors) for weight in weights)]
        want = product(*(operand.astype(np.float64) for operand in operands))
        got, error = run_kernel(library, [*operands, np.zeros(want.shape, np.float32)], function)
        assert error == 0
        difference = float(np.abs(got - want).max() / np.abs(want).max())
        assert difference <= TOL, f"{op} {shapes} {np.dtype(factors)}: differs by {difference:.2e}"
        for threads in (2, 3):  # the engine's threads share the work, never the numbers
            again, error = run_kernel(library, [*operands, np.zeros(want.shape, np.float32)], function, threads)
            assert error == 0 and np.array_equal(again, got), (op, shapes, threads)
    # Shapes it would misread (the second operand's rows not x's width) give the error word and
    # NaN, never numbers; so do x in float16 and (LoRA) factors of two types.
    x, second, *rest = operands
    misread = [([x[..., :-1].copy(), second, *rest], 3), ([x.astype(np.float16), second, *rest], 4)]
    if op == "lora_delta":
        misread.append(([x, second.astype(np.float16), rest[0].astype(np.float32)], 4))
    for inputs, code in misread:
        got, error = run_kernel(library, [*inputs, np.zeros(want.shape, np.float32)], function)
        assert error == code and np.isnan(got).all(), (op, code)


@needs_cc
@pytest.mark.parametrize("isa", ISA_BUILDS)
def test_a_batched_lora_deltas_rows_equal_each_row_alone_bit_for_bit(isa, builds_cache, monkeypatch):
    """A batch's rows go through the LoRA delta four (down) and two (up) at a time; each row's
    output is the op's output for that row alone ([1, in] by its own [in, r] and [r, out]),
    exactly, wherever the row lies in the batch (batches of 2-9 rows, ranks 8 and 16, widths
    leaving tails), with float32 and float16 factors."""
    monkeypatch.setenv("RUNTIME_CACHE", str(builds_cache))
    library = _build_with(isa, monkeypatch)
    rng = np.random.default_rng(13)
    for rows, rank, width, out, factors in itertools.product((2, 4, 5, 8, 9), (8, 16), (50, 576), (37, 192),
                                                             (np.float32, np.float16)):
        x = rng.standard_normal((rows, 1, width)).astype(np.float32)
        A = rng.standard_normal((rows, width, rank)).astype(factors)
        B = rng.standard_normal((rows, rank, out)).astype(factors)
        together, error = run_kernel(library, [x, A, B, np.zeros((rows, 1, out), np.float32)], "lora_run")
        assert error == 0
        for row in range(rows):
            alone, error = run_kernel(library, [x[row], A[row], B[row], np.zeros((1, out), np.float32)], "lora_run")
            assert error == 0 and np.array_equal(together[row], alone), (rows, rank, width, out, factors, row)


@needs_cc
def test_a_compiler_without_openmp_gives_a_one_thread_library(tmp_path, monkeypatch):
    """Where the compiler refuses OpenMP's flag the library is built without it, and the linear
    op asked for 2 threads runs on one, with the same numbers."""
    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_OPENMP", "-fno-such-option-anywhere")
    library = kernels.build_library()
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((8, 1, 576)).astype(np.float32), rng.standard_normal((960, 576)).astype(np.float32)
    got, error = run_kernel(library, [x, w, np.zeros((8, 1, 960), np.float32)], "linear_run", threads=2)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    assert error == 0 and float(np.abs(got - want).max() / np.abs(want).max()) <= TOL
    built = list((tmp_path / "kernels").glob("*.so"))
    assert len(built) == 1
    # nm comes with the compiler (binutils): the library must be read, or the check proves nothing
    listed = subprocess.run(["nm", "-D", str(built[0])], capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    assert "linear_run" in listed.stdout and "GOMP_parallel" not in listed.stdout


_OPENMP_POLICY = """
import ctypes, os
from runtime.executor import kernels
kernels.build_library()
maps = open("/proc/self/maps").read()
print("libgomp" if "libgomp" in maps else "none", os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"),
      flush=True)
if "libgomp" in maps:
    ctypes.CDLL("libgomp.so.1").omp_display_env(1)  # to stderr, GOMP_SPINCOUNT too
"""


@needs_cc
@pytest.mark.parametrize("given", [{}, {"OMP_WAIT_POLICY": "active"}, {"GOMP_SPINCOUNT": "50"}])
def test_openmp_threads_spin_briefly_between_ops_unless_the_user_says_otherwise(given, kernel_cache):
    """The library's OpenMP runtime looks for work 1,000 times before it sleeps (libgomp's
    default 300,000 beside XNNPACK's threads made 2-thread steps slower, sleeping at once
    too), the process's environment is left as it was, and a setting the user made is kept."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | given
    done = subprocess.run([sys.executable, "-c", _OPENMP_POLICY], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    loaded, policy, spin_count = done.stdout.split()
    if loaded == "none":
        pytest.skip("the compiler built the library without OpenMP")
    # the environment as it was: unset stays unset
    assert (policy, spin_count) == (given.get("OMP_WAIT_POLICY", "None"), given.get("GOMP_SPINCOUNT", "None"))
    if "OMP_WAIT_POLICY" in given:
        assert "OMP_WAIT_POLICY = 'ACTIVE'" in done.stderr and "GOMP_SPINCOUNT = '1000'" not in done.stderr
    else:  # libgomp's default spins 300,000 times
        assert f"GOMP_SPINCOUNT = '{given.get('GOMP_SPINCOUNT', '1000')}'" in done.stderr, done.stderr


@needs_cc
@pytest.mark.parametrize("fixture", sorted(FIXTURES))
def test_a_generation_is_the_same(fixture, rewritten, kernel_cache):
    """Greedy decoding through the attention windows (16, 32) to the cache's end: the same
    tokens, and every step's logits within 1e-5 (:func:`relative_difference`)."""
    original, native = LlmExecutor(FIXTURES[fixture]), LlmExecutor(rewritten[fixture])
    try:
        prompt = [5, 17, 42, 99, 3]
        steps = original.spec.kv_length - len(prompt) - 1
        want_tokens, want = greedy(original, prompt, steps)
        got_tokens, got = greedy(native, prompt, steps)
        assert got_tokens == want_tokens
        for position, (a, b) in enumerate(zip(want, got), start=len(prompt)):
            assert relative_difference(a, b) <= TOL, f"step at position {position}"
    finally:
        original.close()
        native.close()


@needs_cc
def test_sessions_in_threads_equal_alone(rewritten, kernel_cache):
    """Four threads, each its own session on one executor's model and its own model, step
    at once; each thread's logits equal the same steps run alone, bit for bit."""
    executors = [LlmExecutor(rewritten["gqa"]) for _ in range(2)]
    prompts = [[1 + i, 7, 30 + i] for i in range(4)]
    alone = [greedy(executors[0], prompt, 40)[1] for prompt in prompts]
    results: list = [None] * 4
    errors = []

    def work(i: int) -> None:
        try:
            results[i] = greedy(executors[i % 2], prompts[i], 40)[1]
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for i in range(4):
        assert all(np.array_equal(a, b) for a, b in zip(alone[i], results[i])), f"session {i}"
    for executor in executors:
        executor.close()


@needs_cc
def test_a_batchs_rows_equal_their_sessions_alone_bit_for_bit(rewritten, kernel_cache):
    """In the op form a batch's rows and a session alone run the same kernels (linear_rows
    computes each row as it would alone): 4 sessions with rank-4 adapters (one scaled), in the
    16-position window alone and together, give each session's logits alone exactly."""
    configs, prompt = four_adapter_rows()
    assert_rows_equal_alone(rewritten["gqa"], configs, prompt, 5)


@needs_cc
def test_rows_padded_into_a_larger_slot_or_window_equal_their_sessions_alone_bit_for_bit(rewritten, kernel_cache):
    """A row sums as it would alone wherever the batch puts it: a rank-4 adapter padded with
    zeros into the rank-16 row's slot (lora_delta sums a rank that is no multiple of 8 in
    the lanes' order), a row without an adapter with zero factors, and rows short of the
    16-position window attending in the 32-position one beside a longer row (decode_attention
    reads the filled positions only): each session's logits alone, exactly."""
    r4, other, r16 = adapter_path("torch_r4"), adapter_path("litertlm_r4"), adapter_path("torch_r16")
    configs = [SessionConfig(lora_path=r4), SessionConfig(lora_path=r16), SessionConfig(),
               SessionConfig(lora_path=other, lora_scale=0.5)]
    assert_rows_equal_alone(rewritten["gqa"], configs, lambda row: [(7 * row + 3 * i) % 250 + 1
                                                                   for i in range(2 + 6 * row)], 5)


def test_no_compiler_refuses_the_model_at_open(rewritten, tmp_path, monkeypatch):
    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(FailedPreconditionError) as caught:
        NativeModel(rewritten["gqa"], num_threads=1, weight_cache=":memory:", name="gqa-native")
    message = str(caught.value)
    assert "\n" not in message
    assert DECODE_ATTENTION in message and "no C compiler" in message
    assert "re-export with --attention-kernel auto" in message
    # The standard form opens as ever.
    NativeModel(FIXTURES["gqa"], num_threads=1, weight_cache=":memory:", name="gqa").close()


def use_fake_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing_with: str) -> None:
    """$CC a script that says it is 'cc 1.0' and fails every build running ``failing_with``
    (shell lines); the runtime's cache a fresh folder under ``tmp_path``."""
    compiler = tmp_path / "bin" / "cc"
    compiler.parent.mkdir()
    compiler.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'cc 1.0'; exit 0; fi\n"
                        f"{failing_with}\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path / "cache"))


def test_a_compile_error_refuses_the_model_at_open(rewritten, tmp_path, monkeypatch):
    use_fake_compiler(tmp_path, monkeypatch, "echo 'decode_attention.c:1:1: error: no room' >&2")
    with pytest.raises(FailedPreconditionError, match="failed: decode_attention.c:1:1: error: no room.*"
                                                      "re-export with --attention-kernel auto"):
        LlmExecutor(rewritten["gqa"])
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))  # nothing half-written left to load


def misfit(path: Path, out: Path) -> None:
    """The first decode_attention node of ``path`` given the V cache as its K input too."""
    from ai_edge_litert import schema_py_generated as schema

    from runtime.util.flatbuffer_model import pack as _pack

    model = schema.ModelT.InitFromPackedBuf(path.read_bytes(), 0)
    custom = next(i for i, code in enumerate(model.operatorCodes) if code.customCode == DECODE_ATTENTION.encode())
    for sub in model.subgraphs:
        op = next((op for op in sub.operators if op.opcodeIndex == custom), None)
        if op is not None:
            op.inputs = [*op.inputs[:3], op.inputs[4], op.inputs[4]]
            break
    out.write_bytes(_pack(model))


def test_a_node_of_wrong_shapes_is_refused_at_open(rewritten, tmp_path):
    bad = tmp_path / "bad.tflite"
    misfit(rewritten["gqa"], bad)
    with pytest.raises(InvalidArgumentError, match=rf"bad: custom op '{DECODE_ATTENTION}' \(subgraph \d+, node \d+\): "
                                                   r"K \[1, 2, 16, 64\], V \[1, 2, 16, 64\] .*expected K \[1, 2, T, 16\]"):
        NativeModel(bad, num_threads=1, weight_cache=":memory:", name="bad")


@needs_cc
def test_a_failing_run_raises_naming_the_op(rewritten, kernel_cache):
    """A run whose kernel fails (here: its error word set as the kernel sets it) raises,
    naming the op; the next run is clean."""
    model = NativeModel(rewritten["gqa"], num_threads=1, weight_cache=":memory:", name="native")
    inputs = step_inputs(model, "decode", 3, seed=1)
    run_signature(model, "decode", inputs)
    contexts = {name: context for name, context, _ in model._kernels.ops}
    for op, words in ((DECODE_ATTENTION, "the tensors' shapes do not fit q"),
                      (LORA_DELTA, "the tensors' shapes do not fit x"),
                      (LINEAR_ROWS, "the tensors' shapes do not fit x")):
        contexts[op].error = 3
        with pytest.raises(InternalError, match=rf"custom op '{op}' failed in this run: {words}"):
            run_signature(model, "decode", inputs)
        run_signature(model, "decode", inputs)
    model.close()


@needs_cc
def test_inspect_names_the_native_kernel(rewritten, kernel_cache):
    done = subprocess.run([sys.executable, "-m", "runtime", "inspect", str(rewritten["gemma3"])], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "RUNTIME_CACHE": str(kernel_cache)})
    assert done.returncode == 0, done.stderr
    assert f"decode attention native kernel ({DECODE_ATTENTION}" in done.stdout


@needs_cc
def test_the_library_is_built_once_and_reused(kernel_cache, rewritten):
    NativeModel(rewritten["gqa"], num_threads=1, weight_cache=":memory:", name="native").close()
    built = list((kernel_cache / "kernels").glob("kernels-*.so"))
    assert len(built) == 1
    assert not [p for p in (kernel_cache / "kernels").iterdir() if p.name.startswith(".build-")]


@needs_cc
def test_weights_stored_after_the_flatbuffer_are_brought_inside(tmp_path, kernel_cache):
    """The quantizer stores some weights after the flatbuffer (offset and size in the
    buffer table): the pass brings them inside; the rewritten model computes the same."""
    from ai_edge_litert import schema_py_generated as schema

    from runtime.util.flatbuffer_model import pack as _pack

    model = schema.ModelT.InitFromPackedBuf(FIXTURES["gqa"].read_bytes(), 0)
    largest = max(model.buffers, key=lambda buffer: 0 if buffer.data is None else len(buffer.data))
    payload = np.asarray(largest.data, np.uint8).tobytes()
    largest.data, largest.offset, largest.size = None, 1 << 40, len(payload)  # a placeholder of the same width
    head = _pack(model)
    largest.offset = -(-len(head) // 64) * 64
    head = _pack(model)
    external = tmp_path / "external.tflite"
    external.write_bytes(head + bytes(largest.offset - len(head)) + payload)
    data, counts = rewrite_decode_attention(external.read_bytes())
    assert counts["decode"] == 2
    rewritten = tmp_path / "rewritten.tflite"
    rewritten.write_bytes(data)
    original = NativeModel(external, num_threads=1, weight_cache=":memory:", name="external")
    native = NativeModel(rewritten, num_threads=1, weight_cache=":memory:", name="native")
    inputs = step_inputs(original, "decode", 20, seed=4)
    want, got = run_signature(original, "decode", inputs), run_signature(native, "decode", inputs)
    assert float(np.abs(want["logits"] - got["logits"]).max()) <= TOL
    want_plain = run_signature(NativeModel(FIXTURES["gqa"], num_threads=1, weight_cache=":memory:", name="gqa"), "decode", inputs)
    assert np.array_equal(want_plain["logits"], want["logits"])  # the external copy is the same model


@needs_cc
def test_processes_building_at_once_each_get_a_whole_library(tmp_path):
    """Three processes build into an empty cache at once: each loads a library that runs,
    one file is left, no scratch."""
    script = ("from runtime.executor import kernels\n"
              "library = kernels.build_library()\n"
              "print(bool(library.attention_run))\n")
    env = {**os.environ, "RUNTIME_CACHE": str(tmp_path)}
    processes = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env) for _ in range(3)]
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0 and out.strip() == "True", err
    (library,) = (tmp_path / "kernels").glob("kernels-*.so")
    assert sorted(p.name for p in (tmp_path / "kernels").iterdir()) == [library.name, library.name + ".sha256"]


@needs_cc
def test_a_cached_library_cut_short_is_built_again_not_loaded(tmp_path, monkeypatch):
    """A library file that is not the bytes its build wrote (a crash or a full disk cut it
    short) would crash the process that maps it: a new process builds it again instead."""
    script = ("from runtime.executor import kernels\n"
              "print(bool(kernels.build_library().attention_run))\n")
    env = {**os.environ, "RUNTIME_CACHE": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    (library,) = (tmp_path / "kernels").glob("kernels-*.so")
    whole = library.read_bytes()
    for damaged in (whole[: len(whole) // 2], whole[: len(whole) // 2] + bytes(len(whole) - len(whole) // 2)):
        library.write_bytes(damaged)
        again = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
        assert again.returncode == 0 and again.stdout.strip() == "True", (again.returncode, again.stderr)
        assert "building the native kernels" in again.stderr
        assert library.read_bytes() == whole


def test_a_kernels_folder_every_user_can_write_is_refused_and_the_standard_form_runs(tmp_path, monkeypatch):
    """Loading a library runs its code: one from a folder another user could write into (a
    cache under /tmp) is never loaded, whatever it holds; the model runs XNNPACK's form."""
    folder = tmp_path / "kernels"
    folder.mkdir()
    folder.chmod(0o777)
    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path))
    with pytest.raises(FailedPreconditionError, match=rf"{folder} is writable by every user \(mode 777\)"):
        kernels.build_library()
    assert list(folder.iterdir()) == []  # nothing built there either
    library, why = kernels.load_for_this_cpu()
    if {"-mavx2", "-mfma"} <= set(kernels.isa_flags()):
        assert library is None and "writable by every user" in why


@needs_cc
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="gives a file to another user: root only")
def test_a_library_another_user_owns_is_not_loaded(tmp_path, monkeypatch):
    """A library whose bytes match its digest but which another user owns (who could have
    written both) is refused before it is loaded, naming its owner; this user's build is."""
    kernels.build_library()  # built in the session's cache: the same name in any cache
    (built,) = Path(os.environ["RUNTIME_CACHE"], "kernels").glob("kernels-*.so")
    folder = tmp_path / "kernels"
    folder.mkdir()
    for file in (built, built.with_name(built.name + ".sha256")):
        shutil.copy(file, folder / file.name)
    os.chown(folder / built.name, 4242, 4242)
    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path))
    with pytest.raises(FailedPreconditionError, match=rf"{folder / built.name} belongs to user id 4242"):
        kernels.build_library()
    os.chown(folder / built.name, os.geteuid(), os.getegid())
    assert kernels.build_library()._name == str(folder / built.name)  # this user's own: loaded


@needs_cc
def test_a_library_without_the_kernels_is_refused_naming_the_function(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_SYMBOLS", (*kernels._SYMBOLS, "attention_no_such_function"))
    with pytest.raises(FailedPreconditionError, match="lacks the kernel function attention_no_such_function"):
        kernels.build_library()


def test_a_compiler_that_fails_in_bytes_not_utf8_is_a_clean_refusal(tmp_path, monkeypatch):
    use_fake_compiler(tmp_path, monkeypatch, "printf 'error: \\377\\376 bad\\n' >&2")
    with pytest.raises(FailedPreconditionError, match="failed: error: .* bad"):
        kernels.build_library()


def test_scratch_folders_of_killed_builds_are_removed(tmp_path, monkeypatch):
    """A build killed midway leaves its scratch folder; the next build removes those an hour old."""
    folder = tmp_path / "kernels"
    stale, fresh = folder / ".build-stale", folder / ".build-fresh"
    for scratch in (stale, fresh):
        scratch.mkdir(parents=True)
        (scratch / "decode_attention.c").write_text("")
    os.utime(stale, (time.time() - 2 * 3600,) * 2)
    kernels._remove_stale_builds(folder)
    assert not stale.exists() and fresh.exists()


def lora_steps(executor: LlmExecutor, prompt: list[int], steps: int) -> list[np.ndarray]:
    """Decode logits of ``steps`` steps on the rank-4 LoRA slot (fixed factors) after ``prompt``."""
    slot = LoraSlot(4)
    buffers = {name: executor.create_lora_buffer(slot, name) for name in executor.spec.slot_inputs(slot)}
    for index, buffer in enumerate(buffers.values()):
        buffer.write(np.full(buffer.info.shape, 0.01 * (index % 5), np.float32))
    binding = executor.bind(executor.create_kv_cache(), buffers, slot)
    executor.prefill(binding, prompt, 0)
    return [executor.decode(binding, 7 + i, len(prompt) + i) for i in range(steps)]


def assert_same_runs(on_demand: LlmExecutor, whole: LlmExecutor) -> None:
    """The plain group at open, the LoRA slot's group at its first binding: greedy steps and
    LoRA steps bit for bit those of ``whole``."""
    assert on_demand.compiled_groups == ("plain",)
    prompt = [5, 17, 42, 99, 3]
    want_tokens, want = greedy(whole, prompt, 30)
    got_tokens, got = greedy(on_demand, prompt, 30)
    assert got_tokens == want_tokens
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(lora_steps(whole, prompt, 20), lora_steps(on_demand, prompt, 20)):
        np.testing.assert_array_equal(a, b)
    assert on_demand.compiled_groups == ("plain", "lora_r4")


@needs_cc
def test_signature_groups_compiled_on_demand_get_the_kernel(rewritten, kernel_cache, tmp_path):
    """Each group compiled on demand registers the kernel: the same logits as the model compiled whole."""
    path = rewritten["gqa"]
    on_demand = LlmExecutor(path, weight_cache=WeightCacheFile.for_model(tmp_path, path))
    whole = LlmExecutor(path, ExecutorSettings(compile="all"))
    try:
        assert_same_runs(on_demand, whole)
    finally:
        on_demand.close()
        whole.close()


# -- both forms in one file (--attention-kernel auto) ---------------------------------------


def test_both_forms_share_every_weight(both):
    """The op forms are appended subgraphs paired with every decode signature's subgraph,
    no signature names them, and they share the standard subgraphs' weights and tensor
    tables: the file grows by the operators only (a few percent of these tiny fixtures,
    whose weights are small)."""
    from ai_edge_litert import schema_py_generated as schema

    for name, path in both.items():
        data, standard = path.read_bytes(), FIXTURES[name].read_bytes()
        model, original = schema.Model.GetRootAs(data, 0), schema.Model.GetRootAs(standard, 0)
        forms = attention_forms(data)
        keys = {model.SignatureDefs(i).SignatureKey().decode(): model.SignatureDefs(i).SubgraphIndex()
                for i in range(model.SignatureDefsLength())}
        assert sorted(forms) == sorted({index for key, index in keys.items() if key.startswith("decode")})
        assert sorted(forms.values()) == list(range(original.SubgraphsLength(), model.SubgraphsLength()))
        assert max(keys.values()) < original.SubgraphsLength()
        assert model.BuffersLength() == original.BuffersLength() + 2  # the op's params and the pairing
        for standard_index, op_index in forms.items():
            a, b = model.Subgraphs(standard_index), model.Subgraphs(op_index)
            assert b.TensorsLength() == a.TensorsLength() + 1
            assert all(a.Tensors(i)._tab.Pos == b.Tensors(i)._tab.Pos for i in range(a.TensorsLength()))
        assert len(data) - len(standard) < 0.06 * len(standard), (name, len(standard), len(data))
        assert attention_forms(standard) == {} and attention_forms(rewrite_decode_attention(standard)[0]) == {}
        with pytest.raises(InvalidArgumentError, match="already runs"):
            rewrite_decode_attention(data, keep_standard=True)


@pytest.mark.parametrize("op_form", [True, False])
def test_choosing_a_form_leaves_a_model_of_one_form(both, op_form):
    """What LiteRT is given: the standard signatures, each decode one running its op form
    (or its standard form), no op-form subgraph and no pairing left."""
    from ai_edge_litert import schema_py_generated as schema

    from runtime.util.model_view import select_attention_form

    data = np.frombuffer(both["gqa"].read_bytes(), np.uint8).copy()
    forms = attention_forms(data)
    before = schema.Model.GetRootAs(data.tobytes(), 0)
    operators = {index: before.Subgraphs(index).OperatorsLength() for index in range(before.SubgraphsLength())}
    select_attention_form(data, forms, op_form)
    model = schema.Model.GetRootAs(data.tobytes(), 0)
    assert attention_forms(data) == {} and model.SubgraphsLength() == min(forms.values())
    assert model.SignatureDefsLength() == before.SignatureDefsLength()
    assert [model.Metadata(i).Name() for i in range(model.MetadataLength())] == [
        before.Metadata(i).Name() for i in range(before.MetadataLength() - 1)]
    for index in range(model.SubgraphsLength()):
        expected = operators[forms[index]] if op_form and index in forms else operators[index]
        assert model.Subgraphs(index).OperatorsLength() == expected


def profiled_decode(executor: LlmExecutor) -> set[str]:
    """The ops one decode step of ``executor`` ran (LiteRT's profiler)."""
    binding = executor.bind(executor.create_kv_cache())
    executor.prefill(binding, [5, 17, 42], 0)
    executor.start_profiling()
    executor.decode(binding, 7, 3)
    return {event.tag for event in executor.stop_profiling()}


@pytest.fixture
def notices(monkeypatch, caplog) -> pytest.LogCaptureFixture:
    """The executor's notices of this test alone (they are given once per process)."""
    monkeypatch.setattr(litert_executor, "_noticed", set())
    caplog.set_level(logging.WARNING, logger=litert_executor.__name__)
    return caplog


@needs_kernel
@pytest.mark.parametrize("fixture", sorted(FIXTURES))
def test_the_op_form_runs_where_the_kernel_builds(fixture, both, kernel_cache, notices):
    """A file of both forms, from a path or from bytes: the op runs (the profiler sees it and
    no batch matmul over the caches), no notice, and a generation equal to the standard form's."""
    profiled = ExecutorSettings(profile_ops=True)
    for model in (both[fixture], both[fixture].read_bytes()):
        executor = LlmExecutor(model, profiled, name="both")
        try:
            assert executor.attention_kernel
            ops = profiled_decode(executor)
            assert DECODE_ATTENTION in ops and not any("Batch Matrix Multiply" in op for op in ops), ops
        finally:
            executor.close()
    assert not notices.records


FALLBACKS = {
    "no compiler": "the kernel cannot be built here: no C compiler",
    "no AVX2": "this CPU lacks AVX2 and FMA",
}


@pytest.mark.parametrize("fixture", sorted(FIXTURES))
@pytest.mark.parametrize("why", sorted(FALLBACKS))
def test_without_the_kernel_the_standard_form_runs_with_one_notice(fixture, why, both, tmp_path, monkeypatch,
                                                                   notices):
    """No compiler (CC names a missing one, the kernel cache is empty) or a CPU without AVX2
    and FMA: the file of both forms runs its standard form, saying so once in one line with
    why and what it costs; the greedy tokens are those of the op form (or of the standard
    file where the kernel cannot run here), every step's logits within 1e-5."""
    kernel_here = kernels.load_for_this_cpu()[0] is not None
    reference = LlmExecutor(both[fixture] if kernel_here else FIXTURES[fixture])
    assert reference.attention_kernel == kernel_here
    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path / "empty"))
    if why == "no compiler":
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    else:
        monkeypatch.setattr(kernels, "isa_flags", lambda: ())
    standard = [LlmExecutor(both[fixture], ExecutorSettings(profile_ops=True)) for _ in range(2)]
    try:
        assert not any(executor.attention_kernel for executor in standard)
        ops = profiled_decode(standard[0])
        assert DECODE_ATTENTION not in ops and any("Batch Matrix Multiply" in op for op in ops), ops
        assert len(notices.records) == 1  # two opens, one notice
        notice = notices.records[0].getMessage()
        assert "\n" not in notice and notice.startswith(f"{both[fixture]}: decode attention runs in its standard form")
        assert FALLBACKS[why] in notice and kernels.STANDARD_FORM_COST in notice
        assert (f"$CC is '{tmp_path / 'no-such-cc'}'" in notice) == (why == "no compiler")
        prompt = [5, 17, 42, 99, 3]
        steps = reference.spec.kv_length - len(prompt) - 1
        want_tokens, want = greedy(reference, prompt, steps)
        got_tokens, got = greedy(standard[1], prompt, steps)
        assert got_tokens == want_tokens
        for position, (a, b) in enumerate(zip(want, got), start=len(prompt)):
            assert relative_difference(a, b) <= TOL, f"step at position {position}"
    finally:
        for executor in (reference, *standard):
            executor.close()
    assert not (tmp_path / "empty" / "kernels").exists() or not list((tmp_path / "empty" / "kernels").glob("*.so"))


@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_kernel), False], ids=["kernel", "no kernel"])
def test_groups_compiled_on_demand_run_the_form_chosen_at_open(kernel, both, rewritten, kernel_cache, tmp_path,
                                                               monkeypatch, notices):
    """A file of both forms opened with a weight cache (signature groups compiled over views):
    the form is chosen once, at open, and every group runs it: bit for bit the op-only file
    compiled whole where the kernel runs, the standard file where it does not (one notice)."""
    if not kernel:
        monkeypatch.setattr(kernels, "isa_flags", lambda: ())
    path = both["gqa"]
    on_demand = LlmExecutor(path, weight_cache=WeightCacheFile.for_model(tmp_path, path))
    whole = LlmExecutor(rewritten["gqa"] if kernel else FIXTURES["gqa"], ExecutorSettings(compile="all"))
    try:
        assert on_demand.attention_kernel == kernel
        assert_same_runs(on_demand, whole)
    finally:
        on_demand.close()
        whole.close()
    assert len(notices.records) == (0 if kernel else 1)


@needs_kernel
def test_either_form_reuses_the_weight_cache_of_the_other(both, tmp_path, monkeypatch, kernel_cache):
    """The two forms share every weight: XNNPACK's packed weights written by one form's open
    serve the other's, with the same numbers."""
    directory = tmp_path / "weights"
    directory.mkdir()
    logits = []
    for kernel in (True, False, True):
        with monkeypatch.context() as patch:
            if not kernel:
                patch.setattr(kernels, "isa_flags", lambda: ())
            executor = LlmExecutor(both["gqa"], weight_cache=WeightCacheFile.for_model(directory, both["gqa"]))
        try:
            assert executor.attention_kernel == kernel
            logits.append(greedy(executor, [5, 17, 42], 30)[1])
        finally:
            executor.close()
        assert len(list(directory.glob("*.xnnpack"))) == 1
    assert all(np.array_equal(a, b) for a, b in zip(logits[0], logits[2]))
    assert max(relative_difference(a, b) for a, b in zip(logits[0], logits[1])) <= TOL


@needs_kernel
def test_a_broken_op_node_in_a_file_of_both_forms_is_refused_naming_the_op(both, tmp_path, kernel_cache):
    """The kernel builds, but an op-form node would be misread: refused at open naming the
    op (never the standard form instead: the file is broken, not the machine)."""
    bad = tmp_path / "bad.tflite"
    misfit(both["gqa"], bad)
    assert attention_forms(bad.read_bytes())
    with pytest.raises(InvalidArgumentError, match=rf"bad.tflite: custom op '{DECODE_ATTENTION}' \(subgraph \d+, "
                                                   r"node \d+\): K \[1, 2, 16, 64\], V \[1, 2, 16, 64\]"):
        LlmExecutor(bad)


@pytest.mark.parametrize("form", ["rewritten", "both"])
def test_a_custom_op_without_a_kernel_here_is_refused_at_open(form, request, tmp_path):
    """An op no kernel of this runtime runs, in signatures whose group compiles only when a
    session first needs it (the LoRA slots' deltas): refused at open naming it, not at that
    first session (a live request, in serve)."""
    from ai_edge_litert import schema_py_generated as schema

    from runtime.util.flatbuffer_model import pack as _pack

    model = schema.ModelT.InitFromPackedBuf(request.getfixturevalue(form)["gqa"].read_bytes(), 0)
    for code in model.operatorCodes:
        if code.customCode == LORA_DELTA.encode():
            code.customCode = b"vendor.lora"
    bad = tmp_path / "bad.tflite"
    bad.write_bytes(_pack(model))
    with pytest.raises(InvalidArgumentError, match=r"bad.tflite: custom op 'vendor.lora': this runtime has no kernel"):
        Engine(bad)  # compiles on demand: the plain group alone at open


def test_a_pairing_that_does_not_read_is_refused_naming_it(both, tmp_path):
    from ai_edge_litert import schema_py_generated as schema

    from runtime.util.flatbuffer_model import pack as _pack

    model = schema.ModelT.InitFromPackedBuf(both["gqa"].read_bytes(), 0)
    entry = next(entry for entry in model.metadata if entry.name == FORMS_METADATA.encode())
    model.buffers[entry.buffer].data = np.frombuffer(b'{"op": "odml_runtime.decode_attention", '
                                                     b'"subgraphs": [[1, 2]]}', np.uint8)
    bad = tmp_path / "bad.tflite"
    bad.write_bytes(_pack(model))
    with pytest.raises(InvalidArgumentError, match=rf"bad.tflite: its {FORMS_METADATA} metadata pairs subgraphs "
                                                   r"\[\(1, 2\)\] of 57: expected the op forms to be the last"):
        LlmExecutor(bad)


@needs_kernel
def test_inspect_says_which_form_runs(both, kernel_cache, tmp_path):
    for env, runs in (({}, "the native kernel"), ({"CC": str(tmp_path / "no-such-cc"),
                                                     "RUNTIME_CACHE": str(tmp_path / "empty")}, "xnnpack")):
        done = subprocess.run([sys.executable, "-m", "runtime", "inspect", str(both["gqa"])], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "RUNTIME_CACHE": str(kernel_cache), **env})
        assert done.returncode == 0, done.stderr
        assert f"decode attention in both forms, xnnpack (standard ops) and native kernel ({DECODE_ATTENTION}" \
            in done.stdout
        assert f"this machine runs {runs}\n" in done.stdout
        assert ("decode attention runs in its standard form" in done.stderr) == (runs == "xnnpack")


@needs_cc
@pytest.mark.parametrize("fixture", sorted(FIXTURES))
def test_a_prompt_that_extends_a_cached_one_gives_a_fresh_prefills_logits_bit_for_bit(rewritten, kernel_cache,
                                                                                    fixture):
    """The prefix cache keeps the positions prefill signatures wrote, not those of decode
    steps (Gemma 3's fixture decodes a prompt's last token; every fixture decodes a remainder
    no padded prefill has room for), whose linear layers sum in the op's order, and a prompt
    takes a cached head only where its rest runs the decode steps a whole prefill would: a
    prompt that extends a cached one gives the logits of a fresh engine's prefill exactly,
    near the cache's end too, where a head that would leave more decode steps is not taken."""
    engine_settings = dict(num_threads=1, batch_wait_s=None)
    with Engine(rewritten[fixture], EngineSettings(**engine_settings, prefix_cache_bytes=1 << 20)) as cached, \
            Engine(rewritten[fixture], EngineSettings(**engine_settings)) as fresh:
        kv_length = fresh.spec.kv_length
        for head, tail, taken in ((12, 9, True), (kv_length - 20, 2, True), (kv_length - 3, 2, False)):
            prompt = [(5 * i + head) % 200 + 1 for i in range(head + tail)]
            with cached.create_session() as first:
                first.run_prefill(prompt[:head])
            hits = cached.stats().prefix_cache.hits
            with cached.create_session() as second, fresh.create_session() as alone:
                assert np.array_equal(second.run_prefill(prompt), alone.run_prefill(prompt)), (head, tail)
            assert cached.stats().prefix_cache.hits == hits + taken, (head, tail)


def test_a_build_failing_for_another_reason_than_openmp_is_not_run_again_without_it(tmp_path, monkeypatch):
    """A compile that fails for want of room (or time, or anything but OpenMP) is refused once:
    it was run a second time without OpenMP, doubling the wait at every open, and where the
    second succeeded (room freed meanwhile) a one-thread library was kept for good."""
    calls = tmp_path / "calls"
    use_fake_compiler(tmp_path, monkeypatch, f"echo \"$*\" >> {calls}\n"
                      "echo 'decode_attention.c: fatal error: error writing to /tmp/ccX.s: No space left on device' "
                      ">&2")
    with pytest.raises(FailedPreconditionError, match="No space left on device"):
        kernels.build_library()
    builds = calls.read_text().splitlines()
    assert len(builds) == 1 and kernels._OPENMP in builds[0].split()


@needs_cc
def test_without_a_cache_directory_the_kernel_is_refused_saying_why(without_home):
    """No cache variable and no home directory: build_library's refusal (the standard form
    runs, with the notice), not the RuntimeError of Path.home, which failed the open."""
    with pytest.raises(FailedPreconditionError, match="no cache directory for the runtime"):
        kernels.build_library()
