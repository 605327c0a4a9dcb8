#!/usr/bin/env python3
"""The base model beside llama.cpp at given precision pairs: decode and prefill, no adapters.

    python3 -m benchmarks.base_rows --set smollm2 --pairs int4-block32:q4_0,int4-block32:q4_1,int8:q8_0
    python3 -m benchmarks.base_rows --set smollm2 --prompt 512 --model f32-w768=W768-f32.tflite \
        --pairs f32:f32,f32-w768:f32 --out base_rows_windows   # another export of ours beside the set's

1 thread (``--threads N``: both sides), for each pair (our export's precision : llama.cpp's GGUF
precision, both of the model set in ``benchmarks/llama_cpp/files.py``): ms per decode step over ``--steps`` steps
from an empty context and after a ``--prompt``-token prompt, and ms to prefill that prompt.
Our session and llama.cpp's context (in its own process) take turns round by round, who
goes first flipping every round; figures are medians over the rounds, speed is llama.cpp's
ms over ours within a round. ``benchmarks/qwen05b.py`` runs the same rows for the 0.5B set.

Writes ``benchmarks/results/base_rows_{set}.json`` and ``.md``; ``benchmarks/report.py`` puts
the table in the report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace
from datetime import date
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, both, cpu_name
from benchmarks.llama_cpp.client import LlamaCpp, available
from benchmarks.llama_cpp.files import EVERY_SET, ModelSet
from benchmarks.measure import prefill_seconds
from runtime import Engine, EngineSettings, SessionConfig
from runtime.bench import timed_decode


def measure(llama: LlamaCpp, models: ModelSet, pairs: list[tuple[str, str]], rounds: int, steps: int,
            prompt: int, threads: int) -> list[dict[str, Any]]:
    """Every row of every pair, ours and llama.cpp's alternating round by round, both on
    ``threads`` threads."""
    rows = []
    for ours, theirs in pairs:
        samples: dict[str, list[tuple[float, float]]] = {}
        with Engine(models.ours[ours], EngineSettings(num_threads=threads)) as engine, \
                engine.create_session(SessionConfig()) as session:
            timed_decode(engine, session, 2)  # warm both sides
            llama.request("decode", kind=theirs, setting="base", threads=threads, steps=2, prompt=0)
            for r in range(rounds):
                cases = {
                    "decode from position 0": (
                        lambda: timed_decode(engine, session, steps)[0] * 1e3,
                        lambda: llama.request("decode", kind=theirs, setting="base", threads=threads, steps=steps,
                                              prompt=0)["ms"]),
                    f"decode after a {prompt}-token prompt": (
                        lambda: timed_decode(engine, session, steps, prompt)[0] * 1e3,
                        lambda: llama.request("decode", kind=theirs, setting="base", threads=threads, steps=steps,
                                              prompt=prompt)["ms"]),
                    f"prefill {prompt} tokens": (
                        lambda: prefill_seconds(session, prompt) * 1e3,
                        lambda: llama.request("prefill", kind=theirs, tokens=prompt, threads=threads)["ms"]),
                }
                for name, (mine, other) in cases.items():
                    samples.setdefault(name, []).append(both(mine, other, r))
                print(f"{ours} / {theirs} round {r + 1}/{rounds}", file=sys.stderr, flush=True)
        for name, measured in samples.items():
            speeds = [theirs_ms / ours_ms for ours_ms, theirs_ms in measured]
            row = {"precision": f"{ours} / {theirs}", "measure": name,
                   "ours_ms": statistics.median(p[0] for p in measured),
                   "llama_cpp_ms": statistics.median(p[1] for p in measured),
                   "speed": statistics.median(speeds), "speed_min": min(speeds), "speed_max": max(speeds),
                   "rounds": len(measured)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def rows_table(record: dict[str, Any]) -> list[str]:
    """The rows of ``record`` (what :func:`measure` returned, with the date and load) as a
    markdown table with a line saying how to read it."""
    threads = record["threads"]
    on = f" on {record['cpu']}" if "cpu" in record else ""  # recorded since 2026-12-04
    out = [f"{record['title']}, {threads} thread{'s' if threads > 1 else ''}; measured {record['date']}{on}, "
           f"load average {record['load_average'][0]:.1f} at the start. speed = llama.cpp's ms / ours (above 1: "
           f"ours is faster); median [min-max] over {record['rows'][0]['rounds']} alternating rounds.", "",
           "| precision (ours / llama.cpp) | measure | ours ms | llama.cpp ms | speed |", "|---|---|---|---|---|"]
    out += [f"| {r['precision']} | {r['measure']} | {r['ours_ms']:.1f} | {r['llama_cpp_ms']:.1f} | "
            f"{r['speed']:.2f}x [{r['speed_min']:.2f}-{r['speed_max']:.2f}] |" for r in record["rows"]]
    return out


def record_of(llama: LlamaCpp, models: ModelSet, pairs: list[tuple[str, str]], rounds: int, steps: int,
              prompt: int, threads: int = 1) -> dict[str, Any]:
    """The measured rows with what :func:`rows_table` needs beside them."""
    start = {"title": models.title, "date": date.today().isoformat(),
             "cpu": cpu_name(Path("/proc/cpuinfo").read_text()), "load_average": os.getloadavg(), "threads": threads}
    return {**start, "rows": measure(llama, models, pairs, rounds, steps, prompt, threads)}


def main() -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--set", default="smollm2", choices=sorted(EVERY_SET))
    parser.add_argument("--pairs", required=True, help="OURS:THEIRS,... (e.g. int4-block32:q4_0)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, help="decode steps per timed run (default: the set's)")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="threads of both sides (default: 1)")
    parser.add_argument("--model", action="append", default=[], metavar="NAME=PATH",
                        help="another export of ours, usable as NAME in --pairs (repeatable)")
    parser.add_argument("--out", help="results name in benchmarks/results (default: base_rows_SET)")
    args = parser.parse_args()
    models = EVERY_SET[args.set]
    extra = dict(entry.split("=", 1) for entry in args.model)
    models = replace(models, ours={**models.ours, **{name: Path(path) for name, path in extra.items()}})
    pairs = [tuple(pair.split(":", 1)) for pair in args.pairs.split(",")]
    if not available():
        raise SystemExit("llama.cpp is not set up: bash benchmarks/llama_cpp/setup.sh")
    for ours, theirs in pairs:
        if ours not in models.ours or theirs not in models.theirs:
            raise SystemExit(f"--pairs {ours}:{theirs}: the {models.key} set has ours {', '.join(models.ours)} "
                             f"and llama.cpp's {', '.join(models.theirs)}")
    missing = [path for ours, theirs in pairs for path in (models.ours[ours], models.theirs[theirs])
               if not path.exists()]
    if missing:
        raise SystemExit(f"missing for {args.pairs}: " + ", ".join(map(str, missing)))
    with LlamaCpp(models.key) as llama:
        record = record_of(llama, models, pairs, args.rounds, args.steps or models.decode_steps, args.prompt,
                           args.threads)
    out = RESULTS / (args.out or f"base_rows_{models.key}")
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    out.with_suffix(".md").write_text("\n".join(rows_table(record)) + "\n")
    print("\n".join(rows_table(record)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
