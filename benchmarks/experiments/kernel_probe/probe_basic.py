#!/usr/bin/env python3
"""Does a custom op run from Python through LiteRT's C API, opened by the runtime's own
``NativeModel``? Builds a graph with CUSTOM ops between built-in ADDs (so XNNPACK takes the
ADDs, the interpreter the custom op), registers a kernel compiled with gcc (and, with
numba installed, one compiled by numba), runs it and checks the numbers, the callbacks'
counts, a failing kernel, and whether other Python threads run during a long kernel.

    python3 -m benchmarks.experiments.kernel_probe.probe_basic
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent

from . import c_kernels
from .custom_ops import install
from .graph import Graph

from runtime.executor.native import HostBuffer, NativeModel

N = 16


def build(add_op: str, spin_op: str, fail_op: str) -> bytes:
    g = Graph()
    g.begin("sandwich")  # out = (a + b) + b + a through ADD, CUSTOM add, ADD
    for n in ("a", "b", "t", "u", "out"):
        g.tensor(n, [N])
    g.add("a", "b", "t")
    g.custom(add_op, ["t", "b"], ["u"])
    g.add("u", "a", "out")
    g.end(["a", "b"], ["out"])
    g.begin("direct")  # the custom op's output is the signature's output
    for n in ("a", "b", "out"):
        g.tensor(n, [N])
    g.custom(add_op, ["a", "b"], ["out"])
    g.end(["a", "b"], ["out"])
    g.begin("spin")  # out = a after spinning ms[0] milliseconds in the kernel
    g.tensor("a", [N]), g.tensor("ms", [1]), g.tensor("t", [N]), g.tensor("out", [N])
    g.custom(spin_op, ["a", "ms"], ["t"])
    g.add("t", "a", "out")
    g.end(["a", "ms"], ["out"])
    g.begin("fail")
    for n in ("a", "b", "out"):
        g.tensor(n, [N])
    g.custom(fail_op, ["a", "b"], ["out"])
    g.end(["a", "b"], ["out"])
    return g.to_bytes()


def run(model: NativeModel, key: str, **inputs: np.ndarray) -> np.ndarray:
    sig = model.signatures[key]
    ins = [HostBuffer(info) for info in sig.inputs.values()]
    for buffer in ins:
        buffer.write(inputs[buffer.info.name])
    outs = [HostBuffer(info) for info in sig.outputs.values()]
    model.run(model.prepare(sig.index, ins, outs))
    return outs[0].array.copy()


def check(flavour: str, kernels, counters_of) -> None:
    print(f"== {flavour}")
    model_bytes = build("probe.add", "probe.spin", "probe.fail")
    with install(kernels):
        model = NativeModel(model_bytes, num_threads=1, weight_cache=":memory:", name=f"probe ({flavour})")
    print("counters after open:", counters_of())
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(N).astype(np.float32), rng.standard_normal(N).astype(np.float32)
    out = run(model, "sandwich", a=a, b=b)
    print("sandwich max |err|:", float(np.abs(out - (2 * a + 2 * b)).max()))
    out = run(model, "direct", a=a, b=b)
    print("direct   max |err|:", float(np.abs(out - (a + b)).max()))
    print("counters after 2 runs:", counters_of())
    try:
        run(model, "fail", a=a, b=b)
        print("fail: the run reported success (the kernel's status is not propagated)")
    except Exception as exc:  # noqa: BLE001
        print(f"fail: {type(exc).__name__}: {exc}")
    # A 300 ms kernel in one thread; count what another Python thread does meanwhile.
    ticks, stop = [0], threading.Event()

    def counter():
        while not stop.is_set():
            ticks[0] += 1

    alone_start = time.perf_counter()
    while time.perf_counter() - alone_start < 0.3:
        ticks[0] += 1
    alone, ticks[0] = ticks[0], 0
    worker = threading.Thread(target=counter)
    worker.start()
    start = time.perf_counter()
    out = run(model, "spin", a=a, ms=np.array([300.0], np.float32))
    took = time.perf_counter() - start
    stop.set()
    worker.join()
    print(f"spin: {took * 1e3:.0f} ms in the kernel; meanwhile the other Python thread counted "
          f"{ticks[0] / took / 1e6:.2f} M/s (this thread alone before: {alone / 0.3 / 1e6:.2f} M/s); "
          f"output max |err| {float(np.abs(out - 2 * a).max())}")
    model.close()
    del model
    print("counters after close:", counters_of())


def main() -> None:
    library = c_kernels.compile_library()
    counters = c_kernels.Counters()
    kernels = [c_kernels.kernel(library, "probe.add", "add_run", counters),
               c_kernels.kernel(library, "probe.spin", "spin_run"),
               c_kernels.kernel(library, "probe.fail", "fail_run")]
    check("gcc", kernels, lambda: (counters.inits, counters.layouts, counters.runs, counters.destroys))
    try:
        from . import numba_kernels
    except ImportError as exc:
        print(f"numba: not tried ({exc})")
        return
    counters_n = numba_kernels.counters()
    kernels = [numba_kernels.kernel("probe.add", "add", counters_n), numba_kernels.kernel("probe.spin", "spin"),
               numba_kernels.kernel("probe.fail", "fail")]
    check("numba", kernels, lambda: tuple(int(x) for x in counters_n))


if __name__ == "__main__":
    main()
