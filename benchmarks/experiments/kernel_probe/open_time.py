#!/usr/bin/env python3
"""How long opening a model takes per signature (``LiteRtCreateCompiledModel`` compiles
every signature at open), and what a first run adds.

    python3 -m benchmarks.experiments.kernel_probe.open_time [--model benchmarks/models/bench_f32.tflite] [--rounds 5]

Writes one model per signature (that signature's subgraph and the decomposition subgraphs
its composites name, every buffer kept) beside the whole model, gives each its own XNNPACK
weight-cache file (filled by one open first: the timed opens are warm), then times in
alternating rounds ``NativeModel`` opening the whole model and each single-signature model,
and the first and second run of the ``decode`` signature after an open. Prints the whole
model's open, the sum and spread of the single ones, and the first-run cost.
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

from . import graph

from runtime.executor.native import HostBuffer, NativeModel

NAMES = {v: k for k, v in vars(s.BuiltinOperator).items() if not k.startswith("_")}


def referenced(model: s.ModelT, index: int) -> list[int]:
    """Subgraph ``index`` and every subgraph its ops name (composites' decompositions,
    control flow), depth first."""
    seen, todo = [], [index]
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.append(i)
        for op in model.subgraphs[i].operators:
            options = op.builtinOptions2 if op.builtinOptions2Type else None
            for holder in (op.builtinOptions, options):
                for field in ("decompositionSubgraphIndex", "thenSubgraphIndex", "elseSubgraphIndex",
                              "condSubgraphIndex", "bodySubgraphIndex", "subgraphIndex", "initSubgraphIndex"):
                    value = getattr(holder, field, None) if holder is not None else None
                    if isinstance(value, (int, np.integer)) and value >= 0:
                        todo.append(int(value))
    return seen


def single(source: bytes, key: str) -> bytes:
    """The model with only signature ``key`` and the subgraphs it needs."""
    model = s.ModelT.InitFromPackedBuf(source, 0)
    sig = next(x for x in model.signatureDefs if x.signatureKey.decode() == key)
    keep = referenced(model, sig.subgraphIndex)
    new_index = {old: new for new, old in enumerate(keep)}
    for i in keep:
        for op in model.subgraphs[i].operators:
            for holder in (op.builtinOptions, op.builtinOptions2 if op.builtinOptions2Type else None):
                if holder is None:
                    continue
                for field in ("decompositionSubgraphIndex", "thenSubgraphIndex", "elseSubgraphIndex",
                              "condSubgraphIndex", "bodySubgraphIndex", "subgraphIndex", "initSubgraphIndex"):
                    value = getattr(holder, field, None)
                    if isinstance(value, (int, np.integer)) and value >= 0:
                        setattr(holder, field, new_index[int(value)])
    model.subgraphs = [model.subgraphs[i] for i in keep]
    sig.subgraphIndex = 0
    model.signatureDefs = [sig]
    import flatbuffers
    builder = flatbuffers.Builder(1 << 20)
    original = s.BufferT.Pack
    s.BufferT.Pack = graph._pack_aligned
    try:
        builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    finally:
        s.BufferT.Pack = original
    return bytes(builder.Output())


def open_ms(path: Path, cache: Path) -> tuple[float, NativeModel]:
    start = time.perf_counter()
    model = NativeModel(path, num_threads=1, weight_cache=str(cache), name=path.name)
    return (time.perf_counter() - start) * 1e3, model


def first_runs(model: NativeModel, key: str) -> tuple[float, float]:
    sig = model.signatures[key]
    ins = [HostBuffer(info) for info in sig.inputs.values()]
    outs = [HostBuffer(info) for info in sig.outputs.values()]
    prepared = model.prepare(sig.index, ins, outs)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        model.run(prepared)
        times.append((time.perf_counter() - start) * 1e3)
    return times[0], times[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(HERE.parents[2] / "benchmarks/models/bench_f32.tflite"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--run", default="decode", help="the signature whose first runs are timed")
    args = parser.parse_args()
    source = Path(args.model).read_bytes()
    folder = Path(tempfile.mkdtemp(prefix="open_time_"))
    whole = folder / "whole.tflite"
    whole.write_bytes(source)
    keys = [x.SignatureKey().decode() for x in (s.Model.GetRootAsModel(source, 0).SignatureDefs(i)
                                                for i in range(s.Model.GetRootAsModel(source, 0).SignatureDefsLength()))]
    paths = {"(whole)": whole}
    for key in keys:
        paths[key] = folder / f"{key}.tflite"
        paths[key].write_bytes(single(source, key))
    caches = {name: folder / f"{path.stem}.xnnpack_cache" for name, path in paths.items()}
    for name, path in paths.items():  # fill every weight cache once
        open_ms(path, caches[name])[1].close()
    times = {name: [] for name in paths}
    runs = {"(whole)": [], args.run: []}
    for rnd in range(args.rounds):
        for name in (list(paths) if rnd % 2 == 0 else list(paths)[::-1]):
            took, model = open_ms(paths[name], caches[name])
            times[name].append(took)
            if name in runs and args.run in model.signatures:
                runs[name].append(first_runs(model, args.run))
            model.close()
    whole_ms = statistics.median(times["(whole)"])
    singles = {k: statistics.median(times[k]) for k in keys}
    print(f"{args.model}: {len(keys)} signatures, {len(source) / 1e6:.1f} MB, {args.rounds} rounds, warm weight caches")
    print(f"whole model open: median {whole_ms:.1f} ms (min {min(times['(whole)']):.1f}, max {max(times['(whole)']):.1f})")
    print(f"single-signature models: sum of medians {sum(singles.values()):.1f} ms; each min / median / max "
          f"{min(singles.values()):.1f} / {statistics.median(singles.values()):.1f} / {max(singles.values()):.1f} ms")
    for key, ms in sorted(singles.items(), key=lambda kv: -kv[1]):
        print(f"  {key}: {ms:.1f} ms")
    # Steady state: the signature's run in the whole model and alone, alternating rounds.
    steady = {}
    for name in ("(whole)", args.run):
        model = NativeModel(paths[name], num_threads=1, weight_cache=str(caches[name]), name=name)
        sig = model.signatures[args.run]
        prepared = model.prepare(sig.index, [HostBuffer(i) for i in sig.inputs.values()],
                                 [HostBuffer(i) for i in sig.outputs.values()])
        model.run(prepared)
        steady[name] = (model, prepared, [])
    for rnd in range(args.rounds * 2):
        for name in (list(steady) if rnd % 2 == 0 else list(steady)[::-1]):
            model, prepared, ms = steady[name]
            start = time.perf_counter()
            for _ in range(20):
                model.run(prepared)
            ms.append((time.perf_counter() - start) / 20 * 1e3)
    ratios = [a / b for a, b in zip(steady[args.run][2], steady["(whole)"][2])]
    print(f"{args.run} steady state: in the whole model {statistics.median(steady['(whole)'][2]):.2f} ms, "
          f"alone {statistics.median(steady[args.run][2]):.2f} ms; alone / whole per round min / median / max "
          f"{min(ratios):.2f} / {statistics.median(ratios):.2f} / {max(ratios):.2f}")
    for name, pairs in runs.items():
        if pairs:
            print(f"{args.run} after opening {name}: first run {statistics.median(p[0] for p in pairs):.2f} ms, "
                  f"second {statistics.median(p[1] for p in pairs):.2f} ms (medians)")


if __name__ == "__main__":
    main()
