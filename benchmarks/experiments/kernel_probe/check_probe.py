#!/usr/bin/env python3
"""Refusing at open, never wrong numbers: (1) the rewritten export opened with no kernel
and (2) with a node whose caches do not match its query are refused at open by
``custom_ops.install``'s check (LiteRT itself opens both and fails only at a run, or never);
(3) a kernel failing at run (the library ignores its status) leaves a code in the word its
user_data points to and NaN in its output, which a runtime checks after every run.

    python3 -m benchmarks.experiments.kernel_probe.check_probe
"""

from __future__ import annotations

import ctypes
import tempfile
from pathlib import Path

import numpy as np
from ai_edge_litert import schema_py_generated as s

HERE = Path(__file__).resolve().parent

from . import c_kernels
from . import rewrite_export as rw
from .custom_ops import CustomOpError, Kernel, install

from runtime.executor.native import NativeModel

OP = rw.OP


def main() -> None:
    source = (HERE.parents[2] / "tests/models/gqa_transposed.tflite").read_bytes()
    folder = Path(tempfile.mkdtemp(prefix="kernel_probe_"))
    model = s.ModelT.InitFromPackedBuf(source, 0)
    rw.rewrite(model, "decode")
    good = folder / "good.tflite"
    good.write_bytes(rw.pack(model))
    # The same, one node's V input swapped for its K (a cache the kernel would misread).
    model = s.ModelT.InitFromPackedBuf(good.read_bytes(), 0)
    sig = next(x for x in model.signatureDefs if x.signatureKey == b"decode")
    sub = model.subgraphs[sig.subgraphIndex]
    op = next(o for o in sub.operators if model.operatorCodes[o.opcodeIndex].customCode == OP.encode())
    op.inputs = [*op.inputs[:4], op.inputs[3]]
    bad = folder / "bad.tflite"
    bad.write_bytes(rw.pack(model))

    library = c_kernels.compile_library(str(folder))
    for label, path, kernels in (("no kernel", good, []), ("a misfit node", bad, None)):
        if kernels is None:
            kernels = [c_kernels.kernel(library, OP, "attention_fast_run")]
        try:
            with install(kernels):
                NativeModel(path, num_threads=1, weight_cache=":memory:", name=label)
            print(f"{label}: opened")
        except CustomOpError as exc:
            print(f"{label}: refused at open: {exc}")
    # (3) a failure at run: the node's V swapped for K, opened without the check.
    word = ctypes.c_int64(0)
    address = lambda symbol: ctypes.cast(getattr(library, symbol), ctypes.c_void_p).value  # noqa: E731
    kernel = Kernel(OP, address("plain_init"), address("probe_layouts"), address("attention_checked_run"),
                    address("plain_destroy"), ctypes.addressof(word), keep=(library, word))
    with install([kernel], check=False):
        native = NativeModel(bad, num_threads=1, weight_cache=":memory:", name="unchecked")
    inputs = {n: np.zeros(i.shape, i.dtype) for n, i in native.signatures["decode"].inputs.items()}
    logits = rw.run(native, "decode", inputs)["logits"]
    print(f"a failure at run: the run's status was success; the kernel's word {word.value}, "
          f"logits all NaN: {bool(np.isnan(logits).all())}")


if __name__ == "__main__":
    main()
