"""Concurrent sessions on one model set, on their own (the section of ``run.py``, alone).

    python3 -m benchmarks.concurrency [--set smollm2] [--rounds 3] [--skip-llama-cpp] [--threads 2] [--executors 2]

The same measurement as ``run.py``'s "Concurrent sessions" (ours batched, ours taking
turns, llama.cpp with a context per session, in alternating rounds; mixed ranks; a batch's
rows against their sessions alone; RSS growth from 1 to 8 sessions), for when the whole
suite is too long for the machine at hand. Writes ``benchmarks/results/concurrency_{set}``
``.json``, ``.md`` (targets and tables) and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import ExitStack

from benchmarks import report, run
from benchmarks.common import RESULTS
from benchmarks.run import MODEL_SETS, concurrency_section, llama_cpp, machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", default="smollm2", choices=sorted(MODEL_SETS))
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (after one warm-up round)")
    parser.add_argument("--skip-llama-cpp", action="store_true", help="measure our side only")
    parser.add_argument("--threads", type=int, default=1,
                        help="our engine's XNNPACK threads (a batch of sessions and a lone session alike); "
                             "writes concurrency_{set}_threads{N} when not 1")
    parser.add_argument("--executors", type=int, default=1,
                        help="model copies of our engine (sessions taking turns run on them in parallel); "
                             "writes concurrency_{set}_executors{N} when not 1")
    parser.add_argument("--update-report", action="store_true",
                        help="also put the section into benchmarks/results/results.json and results.md in place "
                             "of the set's (1 thread only; the report's other sections stay)")
    args = parser.parse_args()
    if args.update_report and (args.threads, args.executors) != (1, 1):
        parser.error("--update-report goes with --threads 1 --executors 1 (the report's concurrency section is on "
                     "1 thread, one model copy)")
    if args.threads < 1 or args.executors < 1:
        parser.error(f"--threads {args.threads} --executors {args.executors}: expected 1 or more")
    models = MODEL_SETS[args.set]
    with_llama = not args.skip_llama_cpp and llama_cpp.available()
    now = machine(None)
    started = {"date": now["date"], "cpu": now["cpu"], "load_average_start": os.getloadavg()}
    with ExitStack() as stack:
        llama = stack.enter_context(llama_cpp.LlamaCpp(models.key)) if with_llama else None
        section = concurrency_section(models, args.rounds, llama, args.threads, args.executors)
        results = {"machine": machine(llama.hello if llama else None),
                   "sets": {models.key: {"title": models.title, "concurrency": section}}}
    results["machine"]["load_average_end"] = os.getloadavg()
    write_report(results, args.set, args.rounds, args.threads, args.executors)
    if args.update_report:
        measured = {**started, "load_average_end": os.getloadavg(), "sections": ["concurrency"]}
        fresh = {"title": models.title, "concurrency": section, "measured": measured}
        run.write_report({"machine": results["machine"], "sets": {models.key: fresh}}, update=True, partial=True)


def write_report(results: dict, key: str, rounds: int, threads: int, executors: int) -> None:
    """``concurrency_{key}[_threads{N}][_executors{M}]`` ``.json``, ``.md`` and ``.png`` from the
    measured ``results``."""
    title = results["sets"][key]["title"]
    conc = results["sets"][key]["concurrency"]
    chosen = {name: value for name, value in (("threads", threads), ("executors", executors)) if value != 1}
    options = "".join(f" --{name} {value}" for name, value in chosen.items())
    out = RESULTS / ("_".join([f"concurrency_{key}", *(f"{name}{value}" for name, value in chosen.items())]))
    out.with_suffix(".json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    rows = [target.row() for target in report.concurrency_targets(title, conc)]
    lines = [f"# Concurrent sessions: {title}", "", *report.machine_lines(results["machine"]), "",
             f"Command: `python3 -m benchmarks.concurrency --set {key} --rounds {rounds}{options}`", "",
             "| target | model | measured | met |", "|---|---|---|---|", *rows, "",
             f"![concurrent sessions]({out.name}.png)", *report.concurrency_tables(conc)]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    report.plot_concurrency(_pyplot(), results).savefig(out.with_suffix(".png"), dpi=110)
    print("\n".join(lines))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


if __name__ == "__main__":
    sys.exit(main())
