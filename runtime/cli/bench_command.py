"""``bench``: a quick table of what adapters cost on one model (decode, switch)."""

from __future__ import annotations

import argparse
from pathlib import Path

from runtime.bench import quick_table, render


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Registers the ``bench`` sub-command."""
    parser = commands.add_parser(
        "bench",
        help="measure decode and switch costs with and without adapters",
        description="Measures decode step time for the base model, each adapter and a blend of the "
        "first two, and the cost of switching sessions and adapters (medians of repeated, "
        "interleaved runs). The full suite, with llama.cpp side by side: benchmarks/run.py.",
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--lora", action="append", default=[], type=Path, metavar="PATH",
                        help="an adapter to measure; repeat (two or more also measure switching)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps per run")
    parser.add_argument("--repeats", type=int, default=7, help="runs per measurement (median)")
    parser.add_argument("--threads", type=int, default=1)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Prints the table."""
    rows = quick_table(args.model, [str(p) for p in args.lora], steps=args.steps, repeats=args.repeats,
                       num_threads=args.threads)
    print(render(rows, f"Model: {args.model} ({args.threads} thread(s)), median of {args.repeats} runs"))
    return 0
