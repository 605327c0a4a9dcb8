"""The benchmark suite: what adapters cost in latency and memory, side by side with llama.cpp.

    python benchmarks/run.py [--quick] [--skip-llama-cpp]

Needs the ``bench`` extra (matplotlib for the plots) and the committed models in
``benchmarks/models/`` (rebuilt by ``tools/build_bench_models.py``). The llama.cpp column
needs ``bash benchmarks/llama_cpp/setup.sh`` once (its own virtualenv, ~6 minutes to
compile); without it that section is skipped. Every figure is the median of repeated
runs; ratios are measured in the same run. Writes ``benchmarks/results/results.md``,
``results.json`` and PNG plots.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
from pathlib import Path

from runtime import Engine, EngineSettings, LoraSource, SessionConfig
from runtime.cli.progress import progress_bar
from runtime.bench import (
    bench_cold_switch,
    bench_concurrency,
    bench_decode,
    bench_graph,
    bench_memory,
    bench_register,
    bench_switch,
    decode_step_seconds,
)

HERE = Path(__file__).resolve().parent
MODELS = HERE / "models"
RESULTS = HERE / "results"
TEST_MODEL = HERE.parent / "tests" / "models" / "gqa_default.tflite"
TEST_ADAPTERS = HERE.parent / "tests" / "models" / "adapters"
LLAMA_PYTHON = HERE / "llama_cpp" / ".venv" / "bin" / "python"
LLAMA_SCRIPT = HERE / "llama_cpp" / "bench_llama_cpp.py"

R8_A, R8_B, R64 = (LoraSource(path=MODELS / n) for n in ("peft_r8_a", "peft_r8_b", "peft_r64"))


def decode_section(repeats: int, steps: int) -> dict:
    """Decode step per model and adapter configuration, with the graph's own ratio."""
    models = {"test model (f32)": (TEST_MODEL, {
        "base": SessionConfig(),
        "rank-4 adapter": SessionConfig(lora_path=TEST_ADAPTERS / "torch_r4.tflite"),
        "blend of two rank-4": SessionConfig(loras=[LoraSource(path=TEST_ADAPTERS / "torch_r4.tflite", scale=0.7),
                                                    LoraSource(path=TEST_ADAPTERS / "litertlm_r4.tflite", scale=0.3)]),
    })}
    for label, file in (("bench model f32", "bench_f32.tflite"), ("bench model int8", "bench_int8.tflite")):
        models[label] = (MODELS / file, {
            "base": SessionConfig(),
            "rank-8 adapter": SessionConfig(loras=[R8_A]),
            "blend of two rank-8 (0.7/0.3)": SessionConfig(loras=[LoraSource(path=R8_A.path, scale=0.7),
                                                                 LoraSource(path=R8_B.path, scale=0.3)]),
            "rank-64 adapter": SessionConfig(loras=[R64]),
        })
    out = {}
    for label, (model, configs) in models.items():
        with Engine(model, EngineSettings(num_threads=1)) as engine:
            out[label] = bench_decode(engine, configs, steps, repeats)
            out[label]["_graph"] = bench_graph(model, repeats)
    return out


def _in_child(function, *args):
    """Runs a memory measurement in a fresh process, so other sections do not pollute its RSS."""
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(function, args)


def llama_cpp_section() -> dict | None:
    """llama.cpp's numbers on the same weights, from its own virtualenv (None if not set up)."""
    if not LLAMA_PYTHON.exists():
        return None
    done = subprocess.run([str(LLAMA_PYTHON), str(LLAMA_SCRIPT)], capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        print(f"llama.cpp benchmark failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout[done.stdout.index("{"):])


def head_to_head_section(rounds: int, steps: int) -> dict | None:
    """Decode ms per step, ours and llama.cpp's, in alternating rounds on the same weights.

    llama.cpp runs in a child process serving one round per request (idle in between),
    so each round measures both sides within a second of each other; the ratio is taken
    per round, then the median, so drift of this shared machine's speed cancels out.
    The first round only warms up. ``None`` without the llama.cpp virtualenv.
    """
    if not LLAMA_PYTHON.exists():
        return None
    configs = {"plain": SessionConfig(), "lora_r8": SessionConfig(loras=[R8_A])}
    ours_models = {"f32": MODELS / "bench_f32.tflite", "q8_0": MODELS / "bench_int8.tflite"}
    child = subprocess.Popen([str(LLAMA_PYTHON), str(LLAMA_SCRIPT), "--serve-decode-rounds", "--steps", str(steps)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def reply() -> dict:
        while line := child.stdout.readline():
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError("the llama.cpp decode server stopped")

    samples: dict[str, dict[str, dict[str, list[float]]]] = {}
    try:
        reply()  # ready
        with Engine(ours_models["f32"]) as f32, Engine(ours_models["q8_0"]) as int8:
            sessions = {kind: {name: engine.create_session(config) for name, config in configs.items()}
                        for kind, engine in (("f32", f32), ("q8_0", int8))}
            for round_index in range(rounds + 1):
                ours = {kind: {name: decode_step_seconds(session, steps) * 1e3
                               for name, session in by_name.items()} for kind, by_name in sessions.items()}
                child.stdin.write("round\n")
                child.stdin.flush()
                theirs = reply()
                if round_index == 0:
                    continue
                for kind, by_name in ours.items():
                    for name, ms in by_name.items():
                        entry = samples.setdefault(kind, {}).setdefault(name, {"ours": [], "theirs": [], "speed": []})
                        entry["ours"].append(ms)
                        entry["theirs"].append(theirs[kind][name])
                        entry["speed"].append(theirs[kind][name] / ms)
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    return {kind: {name: {"ours_ms": statistics.median(e["ours"]), "theirs_ms": statistics.median(e["theirs"]),
                          "speed": statistics.median(e["speed"]), "speed_min": min(e["speed"]),
                          "speed_max": max(e["speed"]), "rounds": len(e["speed"])}
                   for name, e in by_name.items()} for kind, by_name in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and cases")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    args = parser.parse_args()
    repeats, steps = (5, 48) if args.quick else (15, 96)
    bench_f32 = MODELS / "bench_f32.tflite"

    def switch() -> dict:
        with Engine(bench_f32) as engine:
            return bench_switch(engine, R8_A, R8_B, steps, repeats)

    sections = {
        "decode": lambda: decode_section(repeats, steps),
        "register": lambda: bench_register([1, 8, 64] if args.quick else [1, 8, 64, 200], repeats),
        "switch": switch,
        "cold_switch": lambda: bench_cold_switch(bench_f32, [R8_A, R64], repeats),
        "memory": lambda: _in_child(bench_memory, bench_f32, 8, 200 if args.quick else 1000,
                                    2000 if args.quick else 10_000),
        "concurrency": lambda: bench_concurrency(bench_f32, [1, 2, 4, 8], steps, rank=8),
    }
    if not args.skip_llama_cpp:
        sections["llama_cpp"] = llama_cpp_section
        sections["head_to_head"] = lambda: head_to_head_section(5 if args.quick else 15, steps)
    results: dict = {}
    for name in progress_bar("benchmark", unit="section")(list(sections)):
        print(f"{name} ...", file=sys.stderr)
        results[name] = sections[name]()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    from report import plots, render_markdown

    table = render_markdown(results)
    (RESULTS / "results.md").write_text(table + "\n")
    plots(results, RESULTS)
    print(table)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
