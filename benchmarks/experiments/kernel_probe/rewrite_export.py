#!/usr/bin/env python3
"""A real export's decode attention replaced by the custom op, and its outputs compared.

    python3 -m benchmarks.experiments.kernel_probe.rewrite_export [--model tests/models/gqa_transposed.tflite] \
        [--signatures decode,decode_attend16,decode_attend32] [--positions 0,7,15,40,63]

For each signature named, every layer's ``BATCH_MATMUL(q, K, adj_y) -> [RESHAPE / ADD
mask] -> SOFTMAX -> BATCH_MATMUL(p, V, adj_y)`` (the transposed layout's attention; K
and V the caches after this step's DYNAMIC_UPDATE_SLICE) becomes one CUSTOM
``odml_runtime.decode_attention(q, input_pos, params, K, V)``, params a constant
``[scale 1 (q is scaled before), soft-cap 0, window 0, 0]``. The rewritten model is
written beside a temporary folder and opened by ``NativeModel`` with the gcc and the numba
kernel registered; each runs the signature against the original at several positions
(random caches, the token fixed) and prints the largest difference in logits and caches.
Single-row signatures only (the batched ones stack q over rows: the op takes them, the
rewrite here does not look for them).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from ai_edge_litert import schema_py_generated as s

HERE = Path(__file__).resolve().parent

from . import graph
from .custom_ops import install

from runtime.executor.native import HostBuffer, NativeModel

OP = "odml_runtime.decode_attention"
NAMES = {v: k for k, v in vars(s.BuiltinOperator).items() if not k.startswith("_")}


def op_name(model: s.ModelT, op: s.OperatorT) -> str:
    code = model.operatorCodes[op.opcodeIndex]
    return NAMES[max(code.builtinCode, code.deprecatedBuiltinCode)]


def rewrite(model: s.ModelT, key: str) -> int:
    """Rewrites signature ``key``'s attention in place; returns the layers rewritten."""
    sig = next(x for x in model.signatureDefs if x.signatureKey.decode() == key)
    sub = model.subgraphs[sig.subgraphIndex]
    pos_index = next(x.tensorIndex for x in sig.inputs if x.name.decode() == "input_pos")
    consumers: dict[int, list[int]] = {}
    for j, op in enumerate(sub.operators):
        for i in op.inputs:
            consumers.setdefault(int(i), []).append(j)
    code = s.OperatorCodeT()
    code.builtinCode, code.deprecatedBuiltinCode, code.customCode, code.version = 32, 32, OP, 1
    model.operatorCodes.append(code)
    custom_code = len(model.operatorCodes) - 1
    params = s.BufferT()
    params.data = np.frombuffer(np.array([1.0, 0.0, 0.0, 0.0], np.float32).tobytes(), np.uint8)
    model.buffers.append(params)
    tensor = s.TensorT()
    tensor.name, tensor.shape, tensor.type, tensor.buffer = b"odml_runtime_attention_params", [4], 0, \
        len(model.buffers) - 1
    sub.tensors.append(tensor)
    params_index = len(sub.tensors) - 1
    drop, replace = set(), {}
    for j, op in enumerate(sub.operators):
        if op_name(model, op) != "BATCH_MATMUL" or b"kv_cache_k" not in sub.tensors[op.inputs[1]].name:
            continue
        chain, at = [j], j
        while True:
            nxt = consumers.get(int(sub.operators[at].outputs[0]), [])
            if len(nxt) != 1:
                break
            at = nxt[0]
            chain.append(at)
            name = op_name(model, sub.operators[at])
            if name == "BATCH_MATMUL":
                break
            if name not in ("RESHAPE", "ADD", "SOFTMAX"):
                raise ValueError(f"{key}: op {name} between the attention's matmuls: not rewritten")
        last = sub.operators[chain[-1]]
        if op_name(model, last) != "BATCH_MATMUL" or b"kv_cache_v" not in sub.tensors[last.inputs[1]].name:
            raise ValueError(f"{key}: attention at op {j} does not end in a matmul by the V cache")
        custom = s.OperatorT()
        custom.opcodeIndex = custom_code
        custom.inputs = [int(op.inputs[0]), pos_index, params_index, int(op.inputs[1]), int(last.inputs[1])]
        custom.outputs = [int(last.outputs[0])]
        drop.update(chain[:-1])
        replace[chain[-1]] = custom
    sub.operators = [replace.get(j, op) for j, op in enumerate(sub.operators) if j not in drop]
    return len(replace)


def pack(model: s.ModelT) -> bytes:
    import flatbuffers
    builder = flatbuffers.Builder(1 << 20)
    original = s.BufferT.Pack
    s.BufferT.Pack = graph._pack_aligned
    try:
        builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    finally:
        s.BufferT.Pack = original
    return bytes(builder.Output())


def run(model: NativeModel, key: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sig = model.signatures[key]
    ins = [HostBuffer(info) for info in sig.inputs.values()]
    for b in ins:
        b.write(inputs[b.info.name])
    outs = [HostBuffer(info) for info in sig.outputs.values()]
    model.run(model.prepare(sig.index, ins, outs))
    return {b.info.name: b.array.copy() for b in outs}


def time_steps(original: NativeModel, opened: dict, key: str, rounds: int) -> None:
    import statistics
    models = {"original": original, **opened}
    prepared = {}
    for name, model in models.items():
        sig = model.signatures[key]
        ins = [HostBuffer(info) for info in sig.inputs.values()]
        for b in ins:
            if b.info.name == "input_pos":
                b.write(np.full(b.info.shape, b.info.shape and 10, np.int32))
        prepared[name] = (model, model.prepare(sig.index, ins, [HostBuffer(i) for i in sig.outputs.values()]))
        model.run(prepared[name][1])
    times = {name: [] for name in models}
    for rnd in range(rounds):
        for name in (list(models) if rnd % 2 == 0 else list(models)[::-1]):
            model, run_ = prepared[name]
            start = time.perf_counter()
            for _ in range(200):
                model.run(run_)
            times[name].append((time.perf_counter() - start) / 200 * 1e6)
    for name, us in times.items():
        ratios = [a / b for a, b in zip(us, times["original"])]
        print(f"{key} step, {name}: median {statistics.median(us):.1f} us (min {min(us):.1f}); against the original "
              f"min / median / max {min(ratios):.2f} / {statistics.median(ratios):.2f} / {max(ratios):.2f}")


def threads_check(path: Path, kernels: dict, key: str, original: NativeModel, count: int, runs: int = 200) -> None:
    import threading
    sig = original.signatures[key]
    rng = np.random.default_rng(5)
    span = next(info.shape[2] for name, info in sig.inputs.items() if name.startswith("kv_cache_k"))
    inputs = {name: (rng.standard_normal(info.shape).astype(info.dtype) if name.startswith("kv_cache")
                     else np.full(info.shape, span // 2 if name == "input_pos" else 7, info.dtype))
              for name, info in sig.inputs.items()}
    for flavour, kernel in kernels.items():
        with install([kernel]):
            models = [NativeModel(path, num_threads=1, weight_cache=":memory:", name=f"{flavour} {i}")
                      for i in range(count)]
        want = run(models[0], key, inputs)["logits"]
        bad, errors = [0], []

        def work(model: NativeModel) -> None:
            try:
                sig_ = model.signatures[key]
                ins = [HostBuffer(info) for info in sig_.inputs.values()]
                for b in ins:
                    b.write(inputs[b.info.name])
                outs = [HostBuffer(info) for info in sig_.outputs.values()]
                prepared = model.prepare(sig_.index, ins, outs)
                logits = next(b for b in outs if b.info.name == "logits")
                for _ in range(runs):
                    model.run(prepared)
                    if not np.array_equal(logits.array, want):
                        bad[0] += 1
            except Exception as exc:  # noqa: BLE001
                errors.append(repr(exc))

        workers = [threading.Thread(target=work, args=(m,)) for m in models]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        print(f"{flavour}: {count} threads x {runs} runs of {key} in {time.perf_counter() - start:.2f} s: "
              f"{bad[0]} results differing from a run alone, errors {errors or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(HERE.parents[2] / "tests/models/gqa_transposed.tflite"))
    parser.add_argument("--signatures", default="decode,decode_attend16,decode_attend32")
    parser.add_argument("--positions", default="0,7,15,40,63")
    parser.add_argument("--time", type=int, default=0, help="also time the first signature's step, original "
                        "against rewritten, in this many alternating rounds")
    parser.add_argument("--threads", type=int, default=0,
                        help="also run the first signature from this many threads at once per kernel, each on "
                             "its own compiled model, and check every result bit for bit against one run alone")
    args = parser.parse_args()
    source = Path(args.model).read_bytes()
    model = s.ModelT.InitFromPackedBuf(source, 0)
    keys = args.signatures.split(",")
    for key in keys:
        print(f"{key}: {rewrite(model, key)} layers rewritten")
    folder = Path(tempfile.mkdtemp(prefix="kernel_probe_"))
    rewritten = folder / "rewritten.tflite"
    rewritten.write_bytes(pack(model))
    from . import c_kernels
    from . import numba_cached
    from . import numba_kernels
    library = c_kernels.compile_library(str(folder))
    kernels = {"gcc": c_kernels.kernel(library, OP, "attention_fast_run"),
               "numba": numba_kernels.kernel(OP, "attention_fast"), "numba cached": numba_cached.kernel(OP)}
    original = NativeModel(args.model, num_threads=1, weight_cache=":memory:", name="original")
    opened = {}
    for flavour, kernel in kernels.items():
        with install([kernel]):
            opened[flavour] = NativeModel(rewritten, num_threads=1, weight_cache=":memory:", name=flavour)
    rng = np.random.default_rng(0)
    if args.time:
        time_steps(original, opened, keys[0], args.time)
    if args.threads:
        threads_check(rewritten, kernels, keys[0], original, args.threads)
    for key in keys:
        sig = original.signatures[key]
        span = next(info.shape[2] for name, info in sig.inputs.items() if name.startswith("kv_cache_k"))
        for pos in (int(p) for p in args.positions.split(",")):
            if pos >= span:
                continue
            inputs = {name: (rng.standard_normal(info.shape).astype(info.dtype) if name.startswith("kv_cache")
                             else np.full(info.shape, pos if name == "input_pos" else 7, info.dtype))
                      for name, info in sig.inputs.items()}
            want = run(original, key, inputs)
            for flavour, native in opened.items():
                got = run(native, key, inputs)
                logits = float(np.abs(got["logits"] - want["logits"]).max())
                caches = max(float(np.abs(got[n] - want[n]).max()) for n in want if n != "logits")
                same = int(np.argmax(got["logits"])) == int(np.argmax(want["logits"]))
                print(f"{key} pos {pos:>2} {flavour:>12}: logits max |diff| {logits:.2e} "
                      f"(max |logit| {np.abs(want['logits']).max():.1f}), caches {caches:.1e}, argmax same: {same}")


if __name__ == "__main__":
    main()
