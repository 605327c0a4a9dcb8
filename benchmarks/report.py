"""Turns the benchmark results into the report (``results.md``: machine, targets, tables)
and the PNG plots, each comparing our runtime with llama.cpp measured in the same run.

    python3 -m benchmarks.report [RESULTS_DIR]

re-renders both from ``results.json``, the docs' headline table (``docs/benchmarks.md``,
between its :data:`HEADLINE_BEGIN` and :data:`HEADLINE_END` lines) and the README's short
"how fast" table (between :data:`SUMMARY_BEGIN` and :data:`SUMMARY_END`);
``benchmarks/run.py`` calls the same functions.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import REPO, RESULTS
from benchmarks.measure import spread

SETTING_NAMES = {"base": "base", "r8": "rank-8", "blend": "blend of two rank-8 (0.7/0.3)", "r64": "rank-64",
                 "base_late": "base, after the long prompt"}
SHORT_SETTING_NAMES = {"base": "base", "r8": "rank-8", "blend": "blend 2x r8", "r64": "rank-64",
                       "base_late": "base after\nlong prompt"}
# (precision group, side) -> (the label a reader sees, its colour), for every table and plot.
SIDES = {
    ("f32", "ours"): ("ours f32", "#1f4e9c"),
    ("f32", "ours_first_open"): ("ours f32, first open (writes the weight cache file)", "#4a78c2"),
    ("f32", "ours_in_memory"): ("ours f32, weights packed in memory", "#6b8fcf"),
    ("f32", "theirs"): ("llama.cpp f32", "#c45a10"),
    ("int8", "ours"): ("ours int8", "#7aa6dc"),
    ("int8", "ours_first_open"): ("ours int8, first open (writes the weight cache file)", "#a8c6ea"),
    ("int8", "ours_in_memory"): ("ours int8, weights packed in memory", "#c4d8f0"),
    ("int8", "theirs"): ("llama.cpp q8_0", "#f0a35e"),
    ("q4", "theirs"): ("llama.cpp Q4_1 (original file)", "#f6d2a8"),
}
# benchmarks/turbo.py's results (each file's own JSON says which model and heads it measured).
TURBO_RESULTS = ("turbo_smollm2", "turbo_smollm2_verify4", "turbo_smollm2_int8_verify6", "turbo_smollm2_int8",
                 "turbo_smollm2_heads32")
SPEED_NOTE = "speed = llama.cpp's ms / ours (above 1: ours is faster)"
README = REPO / "README.md"
BENCHMARKS_PAGE = REPO / "docs" / "benchmarks.md"
# The benchmarks page's headline table lies between these lines, written by write_headline().
HEADLINE_BEGIN = "<!-- headline: written by benchmarks/report.py from benchmarks/results; do not edit -->"
HEADLINE_END = "<!-- /headline -->"
# The README's "how fast" table lies between these lines, written by write_summary().
SUMMARY_BEGIN = "<!-- summary: written by benchmarks/report.py from benchmarks/results; do not edit -->"
SUMMARY_END = "<!-- /summary -->"


@dataclass(frozen=True)
class Target:
    """One verdict of the report: what is asked (``target``) of which model and setting
    (``where``), the figure measured, whether it is met, what measured it (``source``), and
    whether it belongs in the headline (`docs/benchmarks.md`) (the real-size rows beside llama.cpp and
    the batch's exactness). ``met`` is None for a figure the headline shows with no target."""

    target: str
    where: str
    measured: str
    met: bool | None
    source: str = ""
    headline: bool = False

    def row(self) -> str:
        """This target's row of the report's table of targets."""
        return f"| {self.target} | {self.where} | {self.measured} | {self.verdict} |"

    def headline_row(self) -> str:
        """This target's row of the headline: a NO in bold, and what measured it."""
        verdict = "**NO**" if self.met is False else self.verdict
        target = self.target.replace("|", "\\|")  # "max |logit diff|" must not split the row's cells
        return f"| {target} | {self.where} | {self.measured} | {verdict} | {self.source} |"

    @property
    def verdict(self) -> str:
        """``yes``, ``NO``, or ``no target``."""
        return "no target" if self.met is None else "yes" if self.met else "NO"


# -- small helpers -------------------------------------------------------------------------


def _range(s: dict, fmt: str = "{:.2f}", scale: float = 1.0) -> str:
    """``median [min-max]`` of a spread."""
    return (f"{fmt.format(s['median'] * scale)} [{fmt.format(s['min'] * scale)}-"
            f"{fmt.format(s['max'] * scale)}]")


def _med(s: dict | None, fmt: str = "{:.3f}", scale: float = 1.0) -> str:
    return fmt.format(s["median"] * scale) if s else "-"


def _sets(results: dict) -> Iterator[tuple[str, dict]]:
    """The model sets measured, real size first."""
    for key in sorted(results["sets"], key=lambda k: k != "smollm2"):
        yield key, results["sets"][key]


def _threads(data: dict) -> Iterator[tuple[str, dict]]:
    yield from sorted(data["threads"].items(), key=lambda item: int(item[0]))


def _threads_label(threads: str) -> str:
    return f"{threads} thread" + ("" if threads == "1" else "s")


def _pair_label(precision: str) -> str:
    """``ours int8 / llama.cpp q8_0`` (``-`` for a side that has no such precision)."""
    return " / ".join(SIDES.get((precision, side), ("-",))[0] for side in ("ours", "theirs"))


# -- the report ------------------------------------------------------------------------------


def turbo_label(result: dict) -> str:
    """What one ``benchmarks/turbo.py`` result measured: the model file, and the heads and
    the items they were trained on (from the adapter's training.json when it had one)."""
    training = result.get("training", {})
    heads = f"{training['heads']} heads trained on {training['train_items']} items" if training else "heads"
    return f"{Path(result['model']).name}, {heads}"


def render_markdown(results: dict, folder: Path) -> str:
    """The report: machine, how to read it, the targets (the only verdicts), then tables;
    last, the sections of ``benchmarks/base_rows.py`` and ``benchmarks/qwen05b.py`` when
    ``folder`` holds their results."""
    out = ["# Benchmark results", "", *machine_lines(results["machine"]), ""]
    out += ["Every comparison is measured in alternating rounds: each round times our side and "
            "llama.cpp's back to back on the same weights (who goes first flips every round); "
            "figures are the median over rounds, `[min-max]` the range, and ratios are taken "
            f"within a round. {SPEED_NOTE}.", ""]
    for key, message in results.get("skipped", {}).items():
        out += [f"**{key} skipped**: {message}", ""]
    out += ["## Targets", "", "| target | model | measured | met |", "|---|---|---|---|",
            *(t.row() for t in all_targets(results, folder)), ""]
    out += ["## Plots", ""]
    out += [f"![{title}]({name})" for name, title in PLOT_TITLES.items()]
    for key, data in _sets(results):
        out += ["", f"## {data['title']}", ""]
        if "measured" in data:
            when = data["measured"]
            out += [_measured_line(when), ""]
        out += set_tables(key, data, shared_machine(results["machine"]))
    turbo = [(name, turbo_label(json.loads((folder / f"{name}.json").read_text()))) for name in TURBO_RESULTS
             if (folder / f"{name}.md").exists() and (folder / f"{name}.json").exists()]
    if turbo:
        out += ["", "## Turbo LoRA: draft heads against the same LoRA without them (`benchmarks/turbo.py`)", "",
                "Greedy, 1 thread, SmolLM2-135M, outputs compared token for token; each file's own run "
                "(commands in `benchmarks/turbo.py`'s docstring and the docs' Turbo LoRA page, `docs/turbo-lora.md`)."]
        for name, label in turbo:
            out += ["", f"**{label}** (`{name}.md`)", "", (folder / f"{name}.md").read_text().strip()]
    if (folder / "gemma3.md").exists():
        text = (folder / "gemma3.md").read_text().strip()
        out += ["", "## Gemma 3 270M (`benchmarks/gemma3.py`)", "", text.split("\n", 1)[1].strip()]
    for rows_file in sorted(folder.glob("base_rows_*.json")):
        from benchmarks.base_rows import rows_table

        out += ["", f"## More precisions beside llama.cpp (`benchmarks/base_rows.py`, {rows_file.stem[10:]})", "",
                *rows_table(json.loads(rows_file.read_text()))]
    if (folder / "qwen05b.json").exists():
        from benchmarks.qwen05b import markdown as qwen05b_markdown

        out += ["", "## The next size: Qwen2.5-0.5B's shapes (`benchmarks/qwen05b.py`)", "",
                qwen05b_markdown(json.loads((folder / "qwen05b.json").read_text()))]
    return "\n".join(out)


def shared_machine(m: dict) -> bool:
    """Whether other jobs ran beside the benchmark (a load average above what it adds itself)."""
    return m["load_average_start"][0] > 0.5 or m.get("load_average_end", [0])[0] > 0.5 + m["cores"]


def _measured_line(when: dict, first: bool = True) -> str:
    """When a set was measured; for a set of which only some sections were measured again
    (``run.py --sections ... --update``), which, and when the rest was."""
    on = f"on {when['cpu']}, " if "cpu" in when else ""  # recorded since sets are measured in parts
    own = (f"{when['date']} ({on}load average {when['load_average_start'][0]:.1f} at the start, "
           f"{when['load_average_end'][0]:.1f} at the end)")
    before = when.get("before")
    if not before:
        return f"Measured {own}." if first else f"the rest {own}."
    return (f"{'S' if first else 's'}ections {', '.join(when['sections'])} measured {own}; "
            + _measured_line(before, first=False))


def machine_lines(m: dict) -> list[str]:
    start, end = m["load_average_start"][0], m.get("load_average_end", [float("nan")])[0]
    busy = shared_machine(m)
    lines = [f"Measured {m['date']} on {m['cpu']} ({m['cores']} cores, {m['memory_gib']} GiB), "
             f"Python {m['python']}, ai-edge-litert {m['ai_edge_litert']}, "
             + (f"llama-cpp-python {m['llama_cpp_python']} (llama.cpp built from its sdist for this CPU, AMX off)."
                if m.get("llama_cpp_python") else "llama.cpp not measured.")]
    lines += ["", f"Load average {start:.1f} when the run started and {end:.1f} when it ended, on {m['cores']} cores: "
              + ("**other jobs shared the machine**, so absolute times are slower and noisier than on an idle one; "
                 "the ratios, taken within a round, are what to compare." if busy else "the machine was otherwise idle.")]
    return lines


def set_tables(key: str, data: dict, shared: bool) -> list[str]:
    out = []
    if shared and len(data["threads"]) > 1:
        out += [f"With {max(data['threads'], key=int)} threads, both sides competed with the other jobs for every "
                "core, and a step waits for its slowest thread: those rows show how each runtime copes with that "
                "contention more than its speed on an idle machine.", ""]
    steps = data["decode_steps"]
    if "same_weights" in data:
        out += [f"Same weights: our f32 logits vs llama.cpp's f32 logits over 16 positions: "
                + "; ".join(f"{SETTING_NAMES[s]} max |diff| {e['max_abs_diff']:.1e}, argmax agrees at "
                            f"{100 * e['argmax_agree']:.0f}%" for s, e in data["same_weights"].items()) + ".", ""]
    out += [f"### Decode (ms per token, {steps} steps from an empty context, KV length {data['n_ctx']})", "",
            f"\"After the long prompt\": the same steps after a {data['late_prompt']}-token prompt (prefilled, not "
            "timed). llama.cpp attends over the positions filled so far; our graphs attend over a fixed span: "
            "the shortest of the export's attention windows that holds the step (if it has any), else the "
            "whole KV length, so our steps grow slower in steps, at each window's end. "
            "\"x base\" and \"graph's own x\" are per-round ratios to the base model: of the whole step, and of "
            "the signature's run alone (the graph's own cost; the rest of a step is the runtime's share).", "",
            "| threads | precision | adapters | ours | llama.cpp | speed | our slot | ours x base | graph's own x | "
            "runtime's share |", "|---|---|---|---:|---:|---:|---|---:|---:|---:|"]
    for threads, by_thread in _threads(data):
        for precision, settings in by_thread["decode"].items():
            label = _pair_label(precision)
            for setting, e in settings.items():
                out.append(f"| {threads} | {label} | {SETTING_NAMES[setting]} | " + " | ".join(
                    decode_cells(by_thread, precision, setting)) + " |")
    out += ["", "### Prefill (ms for the whole prompt, base model)", "",
            "| threads | precision | tokens | ours | llama.cpp | speed |", "|---|---|---:|---:|---:|---:|"]
    for threads, by_thread in _threads(data):
        for precision, lengths in by_thread["prefill"].items():
            for n, e in lengths.items():
                out.append(f"| {threads} | {_pair_label(precision)} | {n} | "
                           f"{_med(e.get('ours_ms'), '{:.1f}')} | {_med(e.get('theirs_ms'), '{:.1f}')} | "
                           f"{_range(e['speed']) + 'x' if 'speed' in e else '-'} |")
    out += ["", "### Switching adapters (f32, rank-8 adapters A and B, both resident / loaded)", "",
            "Per decode step, as a multiple of a step with one adapter fixed (lower is better).", "",
            "| threads | pattern | ours | llama.cpp |", "|---|---|---:|---:|"]
    for threads, by_thread in _threads(data):
        sw = by_thread["switch"]
        theirs = sw.get("theirs", {})
        out += [f"| {threads} | a step, adapter fixed (ms) | {_med(sw['ours']['step_ms'])} | {_med(theirs.get('step_ms'))} |",
                f"| {threads} | one session re-targeted A<->B before each step | {_range(sw['ours']['switch_over_step'], '{:.3f}')}x | "
                f"{_range(theirs['switch_over_step'], '{:.3f}') + 'x' if theirs else '-'} |",
                f"| {threads} | two sessions (ours) / two contexts (llama.cpp), one adapter each, stepped in turn | "
                f"{_range(sw['ours']['two_sessions_over_step'], '{:.3f}')}x | "
                f"{_range(theirs['two_sessions_over_step'], '{:.3f}') + 'x' if theirs else '-'} |"]
    if "cold_switch" in data:
        out += ["", "Ours only: a cold switch (adapter evicted, its buffers rebuilt) + one decode step: "
                + ", ".join(f"{seconds * 1e3:.2f} ms for {nbytes / 1024:.0f} KiB of buffers"
                            for nbytes, seconds in data["cold_switch"]) + "."]
    out += ["", "### Registering an adapter (1 thread)", "",
            "Ours: `Engine.register_adapter` (parse and check, no weights read) + unload, from the GGUF file "
            "llama.cpp reads and from the PEFT directory it was converted from; llama.cpp: "
            "`llama_adapter_lora_init` (reads and copies the file) + free.", "",
            "| adapter | GGUF file | ours, GGUF ms | ours, PEFT directory ms | llama.cpp, GGUF ms |",
            "|---|---:|---:|---:|---:|"]
    for row in data["register"]["rows"]:
        out.append(f"| rank {row['rank']} | {row['file_mb']:.2f} MB | "
                   + " | ".join(_range(row[f]) if f in row else "-" for f in ("ours_ms", "ours_peft_ms", "theirs_ms"))
                   + " |")
    for what, error in data["register"]["errors"].items():
        out.append(f"\nOurs failed to register the {what}: `{error}`")
    out += memory_table(data["memory"])
    out += ["", "### Opening the model (fresh process, 1 thread)", "",
            "Load = until the model can run (ours: `Engine(...)`; llama.cpp: model load + context); "
            "the first decode step is separate (ours: the library prepares its kernels' weights there). "
            "Peak RSS = VmHWM after the first step; before = the process before loading (Python and the "
            "side's libraries). llama.cpp maps the file, so its RSS counts the file pages it touched. "
            "Ours opens as by default, mapping the packed weights from the weight cache file that an open "
            "before the rounds wrote (`EngineSettings.weight_cache_dir`); the first open writes that file into "
            "an empty directory; packed in memory: `weight_cache_dir=None` (`--no-weight-cache`).", "",
            "| precision | file MiB | load ms | first step ms | peak RSS MiB | before loading MiB |",
            "|---|---:|---:|---:|---:|---:|"]
    for precision, sides in data["load"].items():
        for side, e in sides.items():
            if "load_ms" in e:
                label = SIDES.get((precision, side), (f"{precision}, {side}",))[0]  # older results: their key
                out.append(f"| {label} | {e.get('file_mib', 0):.0f} | "
                           + " | ".join(_range(e[f], "{:.0f}") for f in ("load_ms", "first_decode_ms", "peak_rss_mib"))
                           + f" | {_med(e['rss_before_mib'], '{:.0f}')} |")
    if "concurrency" in data:
        out += concurrency_tables(data["concurrency"])
    return out


def threads_label(conc: dict) -> str:
    """How many threads the concurrent sessions ran on: one each, and our engine's XNNPACK
    threads per run (a batch of many sessions runs on them too) where not one."""
    engine = conc.get("engine_threads", 1)  # results measured before engines ran on more than one
    label = f"{conc['threads_per_session']} thread per session"
    if engine != 1:
        label += f", ours running each batch on {engine} threads"
    copies = conc.get("executors", 1)
    return label if copies == 1 else f"{label}, ours on {copies} executors (model copies)"


def concurrency_tables(conc: dict) -> list[str]:
    """The concurrent-sessions tables, one per precision, with batches, queue wait, memory."""
    out: list[str] = []
    for precision, entry in conc["precisions"].items():
        names = list(entry["curves"])
        counts = sorted({int(n) for curve in entry["curves"].values() for n in curve})
        out += ["", f"### Concurrent sessions ({SIDES[(precision, 'ours')][0]} vs "
                f"{SIDES[(precision, 'theirs')][0]}, {conc['adapters']}, {threads_label(conc)}; aggregate "
                "decode tokens/s)", "",
                "| sessions | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
        for n in counts:
            out.append(f"| {n} | " + " | ".join(_range(entry["curves"][name][str(n)], "{:,.0f}")
                                              if str(n) in entry["curves"][name] else "-" for name in names) + " |")
        memory = entry["memory"]
        wait = entry["queue_wait_ms"]
        out += ["", "Batches formed (rows: batches) "
                + ", ".join(f"{rows}: {count}" for rows, count in entry["decode_batches"].items())
                + f"; queue wait p50 {wait['p50']:.2f} ms, "
                f"p99 {wait['p99']:.2f} ms. RSS growth from 1 to {memory['sessions']} sessions stepping together: "
                f"{memory['rss_growth_bytes'] / 2**20:.1f} MiB for {memory['kv_and_adapter_bytes'] / 2**20:.1f} MiB "
                f"of KV caches and adapter buffers ({memory['growth_over_held']:.2f}x)."]
    return out


def decode_cells(by_thread: dict, precision: str, setting: str) -> list[str]:
    """Ours, llama.cpp, speed, slot, ours x base, graph's own x, runtime's share (``-`` where
    a side did not run)."""
    e = by_thread["decode"][precision][setting]
    speed = f"{_range(e['speed'])}x" if "speed" in e else "-"
    if "ours_ms" not in e:
        return ["-", _med(e.get("theirs_ms")), speed, "-", "-", "-", "-"]
    return [_med(e["ours_ms"]), _med(e.get("theirs_ms")), speed, f"r{e['slot']}" if e.get("slot") else "plain",
            _med(e.get("x_base")), _med(e.get("graph_x")), _med(e["glue_share"], "{:.1f}%", 100)]


def registered_adapter_bytes(ours: dict) -> float:
    """What one registered, not resident adapter keeps: the larger of the RSS growth per
    registration and the Python objects it keeps (measured since 2026-12-04; the RSS growth
    alone can hide in heap that writing the adapter files freed)."""
    return max(ours["registered_per_adapter_bytes"], ours.get("registered_python_per_adapter_bytes", 0.0))


def memory_table(mem: dict) -> list[str]:
    ours = mem["ours"]
    python = ours.get("registered_python_per_adapter_bytes")
    out = ["", "### Memory per adapter (VmRSS, f32 model, fresh processes)", "", "| what | value |", "|---|---:|",
           f"| ours: RSS per registered (not resident) rank-8 adapter | {ours['registered_per_adapter_bytes'] / 1024:.1f} KiB |",
           *([f"| ours: Python objects a registered rank-8 adapter keeps (tracemalloc) | {python / 1024:.1f} KiB |"]
             if python is not None else []),
           f"| ours: its tensor bytes (float32) | {ours['tensor_bytes_per_adapter'] / 1024:.1f} KiB |",
           f"| ours: RSS of the first resident adapter (heap growth, first binding included) | "
           f"{ours['resident_first_adapter_bytes'] / 1024:.1f} KiB |",
           f"| ours: RSS per further resident rank-8 adapter (slope, 16 resident at once) | "
           f"{ours['resident_per_adapter_bytes'] / 1024:.1f} KiB |",
           f"| ours: its slot buffers (float32) | {ours['slot_float32_bytes'] / 1024:.1f} KiB |",
           f"| ours: RSS growth with all registered, each used once under Lru(4) | "
           f"{ours['rss_all_registered_used_once_lru4_bytes'] / 1024:.0f} KiB |",
           f"| ours: RSS growth per switch+decode cycle | {ours['growth_per_switch_bytes']:.2f} B |",
           f"| ours: RSS left after unloading all | {ours['after_unload_bytes'] / 1024:.0f} KiB |"]
    for name, e in mem.get("theirs", {}).items():
        if "rss_growth_per_adapter_kib" in e:
            out.append(f"| llama.cpp: RSS per loaded {name.split('_')[0].replace('r', 'rank-')} adapter "
                       f"({e['copies']} copies; file {e['file_kib']:.0f} KiB) | {e['rss_growth_per_adapter_kib']:.1f} KiB |")
    return out


def _size(register_row: dict) -> float:
    return register_row["file_mb"]


def all_targets(results: dict, folder: Path) -> list[Target]:
    """Every target of the report: the model sets' (``results``), then those of the runs
    whose results lie in ``folder`` (serving, Turbo LoRA, Gemma 3, long context and opening)."""
    return [*targets(results), *serve_targets(folder), *npc_targets(folder), *turbo_targets(folder),
            *turbo_task_targets(folder), *gemma3_targets(folder), *long_context_targets(folder)]


def file_source(path: Path, result: dict) -> str:
    """Which result file measured a row, with the date and CPU the file records (if any)."""
    return ", ".join([f"`{path.name}`", *(result[key] for key in ("date", "cpu") if key in result)])


def measured_by(data: dict, section: str) -> str:
    """Which run of ``benchmarks/run.py`` measured ``section`` of a model set, and when."""
    when = data.get("measured", {})
    while section not in when.get("sections", [section]) and when.get("before"):
        when = when["before"]
    return f"`run.py` {section}, {when.get('date', 'date not recorded')}, {when.get('cpu', 'CPU not recorded')}"


def targets(results: dict) -> list[Target]:
    """The targets of the model sets, each with the measured figure and a verdict."""
    rows: list[Target] = []
    for key, data in _sets(results):
        real = key == "smollm2"
        name = "SmolLM2-135M" if real else "bench model"

        def add(target: str, where: str, measured: str, met: bool, section: str, headline: bool = False) -> None:
            rows.append(Target(target, where, measured, met, measured_by(data, section), headline and real))

        for threads, t in _threads(data):
            where = f"{name}, {_threads_label(threads)}"
            for precision in ("f32", "int8"):
                settings = t["decode"].get(precision, {})
                if "ours_ms" not in settings.get("base", {}):
                    continue
                if not real:
                    worst = max(e["glue_share"]["median"] for e in settings.values())
                    add("runtime's own work <= 3% of a decode step", f"{where}, {precision}",
                        f"worst {100 * worst:.1f}%", worst <= 0.03, "threads")
                for setting in ("r8", "blend", "r64"):
                    e = settings[setting]
                    add("adapter / plain decode <= the graph's own ratio + 3% (per round, median)",
                        f"{where}, {precision}, {SETTING_NAMES[setting]}",
                        f"{e['x_base']['median']:.3f} vs {e['graph_x']['median']:.3f}: "
                        f"{e['x_base_minus_graph_x']['median']:+.3f}", e["x_base_minus_graph_x"]["median"] <= 0.03,
                        "threads")
            for precision, factor in (("f32", 1.0), ("int8", 1.0 if real else 1.3)):
                for setting in ("base", "r8", "base_late"):
                    e = t["decode"].get(precision, {}).get(setting, {})
                    if "speed" in e:
                        add(f"decode tokens/s >= {factor}x llama.cpp ({SIDES[(precision, 'ours')][0]} vs "
                            f"{SIDES[(precision, 'theirs')][0]})", f"{where}, {SETTING_NAMES[setting]}",
                            f"{_range(e['speed'])}x ({_med(e['ours_ms'], '{:.1f}')} vs "
                            f"{_med(e['theirs_ms'], '{:.1f}')} ms)", e["speed"]["median"] >= factor, "threads", True)
            if real:
                for precision in ("f32", "int8"):
                    e = t["prefill"].get(precision, {}).get("512", {})
                    if "speed" in e:
                        add(f"prefill 512 tokens >= 1.0x llama.cpp ({SIDES[(precision, 'ours')][0]} vs "
                            f"{SIDES[(precision, 'theirs')][0]})", where, f"{_range(e['speed'])}x "
                            f"({_med(e['ours_ms'], '{:.0f}')} vs {_med(e['theirs_ms'], '{:.0f}')} ms)",
                            e["speed"]["median"] >= 1.0, "threads", True)
            limit = 1.02 if real else 1.05
            sw = t["switch"]["ours"]
            add(f"switch between resident adapters + next step <= {limit}x a step (two sessions)", where,
                f"{_range(sw['two_sessions_over_step'], '{:.3f}')}x", sw["two_sessions_over_step"]["median"] <= limit,
                "threads", True)
            add(f"same, one session re-targeted with set_adapters (<= {limit}x)", where,
                f"{_range(sw['switch_over_step'], '{:.3f}')}x", sw["switch_over_step"]["median"] <= limit,
                "threads", True)
        for field, source in (("ours_ms", "GGUF file"), ("ours_peft_ms", "PEFT directory")):
            measured = [row for row in data["register"]["rows"] if field in row]
            if len(measured) > 1:
                smallest, largest = min(measured, key=_size), max(measured, key=_size)
                low, high = smallest[field]["median"], largest[field]["median"]
                add(f"register time independent of file size (largest / smallest < 2), {source}", name,
                    f"{low:.2f} ms at {smallest['file_mb']:.2f} MB, {high:.2f} ms at {largest['file_mb']:.0f} MB",
                    high / low < 2.0, "register")
        mem = data["memory"]["ours"]
        kept = registered_adapter_bytes(mem)
        measured = f"{mem['registered_per_adapter_bytes'] / 1024:.1f} KiB"
        if "registered_python_per_adapter_bytes" in mem:
            measured = (f"{mem['registered_python_per_adapter_bytes'] / 1024:.1f} KiB of Python objects, "
                        f"RSS +{measured}")
        add("registered, non-resident adapter <= 64 KB (RSS growth, and Python objects kept)", name, measured,
            kept <= 64_000, "memory", True)
        ratio = mem["resident_per_adapter_bytes"] / mem["slot_float32_bytes"]
        add("resident adapter <= 1.1x its float32 buffer bytes (each beyond the first)", name, f"{ratio:.3f}x",
            ratio <= 1.1, "memory")
        if not real:
            add("0 bytes RSS growth per switch", name, f"{mem['growth_per_switch_bytes']:.2f} B",
                mem["growth_per_switch_bytes"] <= 1.0, "memory")
        if "concurrency" in data:
            source = measured_by(data, "concurrency")
            rows += [replace(t, source=source, headline=t.headline and real)
                     for t in concurrency_targets(name, data["concurrency"])]
    return rows


def concurrency_targets(name: str, conc: dict) -> list[Target]:
    """The concurrent-sessions targets of one model set (``name``); the 8-session, latency
    and exactness rows are headline rows."""
    rows: list[Target] = []

    def add(target: str, where: str, measured: str, met: bool, headline: bool = False) -> None:
        rows.append(Target(target, where, measured, met, headline=headline))

    for precision, entry in conc["precisions"].items():
        curves, label = entry["curves"], f"{name}, {SIDES[(precision, 'ours')][0]}"
        if conc.get("engine_threads", 1) != 1:
            label += f", {conc['engine_threads']} threads"
        copies = conc.get("executors", 1)  # results measured before engines ran several executors at once
        if copies != 1:
            label += f", {copies} executors"
        batched, alone = curves["ours, batched"], curves["ours, batched"]["1"]["median"]
        lone = alone / curves["ours, taking turns"]["1"]["median"]
        if "lone_discounted" in entry:  # two engines, two model copies: each one's own graph time discounted
            discounted = entry["lone_discounted"]["median"]
            add("a session alone on a batching engine >= 0.97x the tokens/s without batching (each engine's own "
                "graph time discounted: the two hold separate model copies)", label,
                f"{discounted:.3f}x (raw {lone:.3f}x)", discounted >= 0.97)
        else:
            add("a session alone on a batching engine >= 0.97x the tokens/s without batching", label,
                f"{lone:.3f}x", lone >= 0.97)
        if "8" in batched:
            eight = batched["8"]["median"] / alone
            need = 4.0 if precision == "f32" else 3.0
            held = "one model copy" if copies == 1 else f"{copies} model copies"
            theirs = curves.get("llama.cpp, a context per session", {}).get("8")
            beside = f"; llama.cpp {theirs['median']:.0f}, a context each" if theirs else ""
            add(f"8 sessions, 8 distinct rank-8 adapters, {held}: aggregate >= {need:.0f}x one session",
                label, f"{eight:.2f}x ({batched['8']['median']:.0f} vs {alone:.0f} tokens/s{beside})", eight >= need,
                True)
            latency = 8 / eight
            add("a session's per-token latency in a batch of 8 <= 2x alone", label, f"{latency:.2f}x",
                latency <= 2.0, True)
        late = next((name for name in curves if name.startswith("ours, batched, from position")), None)
        if late and {"1", "8"} <= set(curves[late]):
            ratio = curves[late]["8"]["median"] / curves[late]["1"]["median"]
            need = 3.0 if precision == "f32" else 2.5  # every row attends over (nearly) the whole cache
            add(f"the same, sessions {late.rsplit(' ', 1)[1]} tokens into their caches: aggregate >= "
                f"{need:g}x one session", label, f"{ratio:.2f}x", ratio >= need, True)
        fidelity = entry["fidelity"]
        tolerance = 1e-4 if precision == "f32" else 1e-3
        add(f"a batch's rows equal their sessions alone: max |logit diff| <= {tolerance:g}, greedy identical "
            f"({fidelity['sessions']} sessions, {fidelity['steps']} steps)", label,
            f"{fidelity['max_abs_logit_diff']:.1e}, {'identical' if fidelity['greedy_identical'] else 'DIFFERENT'}",
            fidelity["max_abs_logit_diff"] <= tolerance and fidelity["greedy_identical"], True)
        mem = entry["memory"]
        add(f"RSS growth from 1 to {mem['sessions']} sessions <= their KV caches + adapter buffers + 10%", label,
            f"{mem['growth_over_held']:.2f}x", mem["growth_over_held"] <= 1.1)
    return rows


def untargeted_figures(results: dict, folder: Path) -> list[Target]:
    """The real-size figures beside llama.cpp that have no target: prefill of a short prompt,
    opening the model, registering an adapter, and the 4-bit rows of ``benchmarks/base_rows.py``
    (``base_rows_smollm2_prompt512.json`` in ``folder``)."""
    rows = []
    base_rows = folder / "base_rows_smollm2_prompt512.json"
    if base_rows.exists():
        record = json.loads(base_rows.read_text())
        rows += [Target(f"{r['measure']} ({r['precision'].replace(' / ', ' vs ')})",
                        f"SmolLM2-135M, {_threads_label(str(record['threads']))}",
                        f"{r['speed']:.2f} [{r['speed_min']:.2f}-{r['speed_max']:.2f}]x ({r['ours_ms']:.1f} vs "
                        f"{r['llama_cpp_ms']:.1f} ms)", None, file_source(base_rows, record))
                 for r in record["rows"] if r["precision"].startswith("int4")]
    data = results["sets"].get("smollm2")
    if data is None:
        return rows
    for precision in ("f32", "int8"):
        pair = f"{SIDES[(precision, 'ours')][0]} vs {SIDES[(precision, 'theirs')][0]}"
        e = data["threads"].get("1", {}).get("prefill", {}).get(precision, {}).get("128", {})
        if "speed" in e:
            rows.append(Target(f"prefill 128 tokens ({pair})", "SmolLM2-135M, 1 thread",
                               f"{_range(e['speed'])}x ({_med(e['ours_ms'], '{:.0f}')} vs "
                               f"{_med(e['theirs_ms'], '{:.0f}')} ms)", None, measured_by(data, "threads")))
        load = data.get("load", {}).get(precision, {})
        if "ours" in load and "theirs" in load:
            ours, theirs = load["ours"], load["theirs"]
            rows.append(Target(f"open the model: load time and peak RSS ({pair})", "SmolLM2-135M",
                               f"{ours['load_ms']['median'] / 1e3:.2f} s, {ours['peak_rss_mib']['median'] / 1024:.2f} "
                               f"GiB vs {theirs['load_ms']['median'] / 1e3:.2f} s, "
                               f"{theirs['peak_rss_mib']['median'] / 1024:.2f} GiB", None, measured_by(data, "load")))
    registered = [row for row in data.get("register", {}).get("rows", []) if "theirs_ms" in row]
    if registered:
        row = min(registered, key=_size)
        peft, gguf, theirs = (_med(row.get(field), "{:.1f}") for field in ("ours_peft_ms", "ours_ms", "theirs_ms"))
        rows.append(Target(f"register a rank-{row['rank']} adapter (ours PEFT directory / GGUF vs llama.cpp GGUF)",
                           "SmolLM2-135M", f"{peft} / {gguf} vs {theirs} ms", None, measured_by(data, "register")))
    return rows


def headline(results: dict, folder: Path) -> str:
    """The benchmarks page's headline table: the report's headline targets (real size, beside
    llama.cpp, and the batch's exactness) and the real-size figures without a target, each
    with its verdict and the run that measured it."""
    lines = ["| target | model | measured | met | measured by |", "|---|---|---|---|---|"]
    rows = [t for t in all_targets(results, folder) if t.headline] + untargeted_figures(results, folder)
    lines += [t.headline_row() for t in rows]
    return "\n".join(lines)


def is_summary_row(target: Target) -> bool:
    """Whether a headline row belongs in the README's short table: one thread's plain decode
    beside llama.cpp, eight sessions at once, serving, the NPC tick at one thread, and Turbo LoRA
    on its task (greedy on ``order_json``, sampled on the worked example's; the rest is on the
    benchmarks page)."""
    if target.met is None:
        return False
    one_thread_decode = target.target.startswith("decode") and target.where.endswith(("1 thread, base", "1 thread, ours f32", "1 thread, ours int8"))
    one_thread_npc = target.target.startswith("NPC ticks/s") and ", 1 thread," in target.where
    return one_thread_decode or one_thread_npc or target.target.startswith(
        ("8 sessions", "runtime serve", "Turbo LoRA, `order_json`", "Turbo LoRA trained on its task (entities), sampled"))


def summary(results: dict, folder: Path) -> str:
    """The README's "how fast" table: the rows of :func:`headline` that :func:`is_summary_row`
    picks, without the column of what measured them (the benchmarks page has it)."""
    lines = ["| target | model | measured | met |", "|---|---|---|---|"]
    rows = [t for t in all_targets(results, folder) if t.headline and is_summary_row(t)]
    lines += [t.headline_row().rsplit(" | ", 1)[0] + " |" for t in rows]
    return "\n".join(lines)


def write_between(table: str, path: Path, begin: str, end: str) -> None:
    """Puts ``table`` between the lines ``begin`` and ``end`` of ``path`` (which must hold each once)."""
    text = path.read_text()
    if text.count(begin) != 1 or text.count(end) != 1:
        raise ValueError(f"{path}: expected one {begin!r} line and one {end!r} line")
    before, rest = text.split(begin)
    after = rest.split(end)[1]
    path.write_text(f"{before}{begin}\n{table}\n{end}{after}")


def write_headline(table: str, page: Path = BENCHMARKS_PAGE) -> None:
    """Puts ``table`` between the headline markers of ``page`` (which must hold them once)."""
    write_between(table, page, HEADLINE_BEGIN, HEADLINE_END)


def write_summary(table: str, readme: Path = README) -> None:
    """Puts ``table`` between the summary markers of ``readme`` (which must hold them once)."""
    write_between(table, readme, SUMMARY_BEGIN, SUMMARY_END)


# -- the plots ---------------------------------------------------------------------------------

PLOT_TITLES = {
    "decode.png": "decode tokens/s, ours vs llama.cpp",
    "prefill.png": "prefill tokens/s, ours vs llama.cpp",
    "switch.png": "cost of switching adapters, ours vs llama.cpp",
    "register.png": "register time vs file size, ours vs llama.cpp",
    "memory.png": "memory per adapter, ours vs llama.cpp",
    "load.png": "opening the model, ours vs llama.cpp",
    "concurrency.png": "concurrent sessions, ours vs llama.cpp",
    "serve.png": "the server under load, ours vs llama-server",
}
WHISKERS = "bars and points: median over rounds; whiskers: min-max"


def plots(results: dict, folder: Path) -> list[Path]:
    """Every plot of :data:`PLOT_TITLES` that the results have data for (none without
    matplotlib); returns the files written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plots")
        return []
    plt.rcParams.update({"font.size": 9, "axes.titlesize": 9.5, "figure.titlesize": 10.5})
    drawers = {"decode.png": plot_decode, "prefill.png": plot_prefill, "switch.png": plot_switch,
               "register.png": plot_register, "memory.png": plot_memory, "load.png": plot_load,
               "concurrency.png": plot_concurrency}
    drawers["serve.png"] = lambda plt, results: plot_serve(plt, folder)
    written = []
    for name, draw in drawers.items():
        figure = draw(plt, results)
        if figure is None:
            continue
        figure.savefig(folder / name, dpi=110, bbox_inches="tight")
        plt.close(figure)
        written.append(folder / name)
    return written


def _set_panels(results: dict) -> list[tuple[dict, str, dict]]:
    """(model set, thread count, its measurements) for every panel of a per-size plot."""
    return [(data, threads, t) for _, data in _sets(results) for threads, t in _threads(data)]


def _whiskers(spreads: list[dict], value: Callable[[float], float] = lambda v: v) -> tuple[list, list, list]:
    """Medians and the distances down to the min and up to the max, after ``value``."""
    middle, low, high = [], [], []
    for s in spreads:
        ends = sorted(value(s[k]) for k in ("min", "max"))
        m = value(s["median"])
        middle.append(m)
        low.append(m - ends[0])
        high.append(ends[1] - m)
    return middle, low, high


def _grouped_figure(plt: Any, results: dict, part: str, groups: Callable[[dict], list[str]],
                    group_label: Callable[[str], str], rate: Callable[[str, float], float], ylabel: str,
                    xlabel: Callable[[dict], str], title: str) -> Any:
    """One panel per model set and thread count; in each, a group of bars per ``groups``
    entry with a bar per side and precision (:data:`SIDES`), ``rate(group, ms)`` plotted."""
    import numpy as np

    panels = _set_panels(results)
    if not panels:
        return None
    figure, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels) + 0.6, 3.9), squeeze=False)
    # The same bar positions and colours in every panel, for every side that any panel has.
    keys = [key for key in SIDES if any(f"{key[1]}_ms" in entry for _, _, t in panels
                                        for entry in t[part].get(key[0], {}).values())]
    width = 0.8 / max(1, len(keys))
    for axis, (data, threads, t) in zip(axes[0], panels):
        names = groups(t[part])
        for i, (precision, side) in enumerate(keys):
            by_group = t[part].get(precision, {})
            present = [(g, by_group[name][f"{side}_ms"]) for g, name in enumerate(names)
                       if f"{side}_ms" in by_group.get(name, {})]
            middle, low, high = [], [], []
            for g, spread in present:
                (m,), (lo,), (hi,) = _whiskers([spread], lambda ms, name=names[g]: rate(name, ms))
                middle.append(m)
                low.append(lo)
                high.append(hi)
            axis.bar([g - 0.4 + width * (i + 0.5) for g, _ in present], middle, width, yerr=[low, high], capsize=2,
                     color=SIDES[(precision, side)][1], label=SIDES[(precision, side)][0], edgecolor="black",
                     linewidth=0.4, error_kw={"elinewidth": 0.8})
        axis.set_xticks(np.arange(len(names)), [group_label(n) for n in names])
        axis.set_ylim(bottom=0)
        axis.grid(axis="y", alpha=0.3)
        axis.set_title(f"{data['title']}, {_threads_label(threads)}")
        axis.set_ylabel(ylabel)
        axis.set_xlabel(xlabel(data))
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=SIDES[key][1], edgecolor="black", linewidth=0.4, label=SIDES[key][0]) for key in keys]
    figure.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, bbox_to_anchor=(0.5, -0.01),
                  frameon=False)
    figure.suptitle(f"{title}\n({WHISKERS})")
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    return figure


def plot_decode(plt: Any, results: dict) -> Any:
    return _grouped_figure(plt, results, "decode", lambda part: [s for s in SETTING_NAMES if s in part.get("f32", {})],
                           SHORT_SETTING_NAMES.get, lambda _, ms: 1e3 / ms, "tokens/s",
                           lambda data: f"adapters, from an empty context (long prompt: {data['late_prompt']} tokens)",
                           "Decode speed on the same weights, ours vs llama.cpp: higher is better")


def plot_prefill(plt: Any, results: dict) -> Any:
    return _grouped_figure(plt, results, "prefill",
                           lambda part: sorted({n for lengths in part.values() for n in lengths}, key=int),
                           lambda n: f"{n} tokens", lambda n, ms: int(n) * 1e3 / ms, "prompt tokens/s",
                           lambda _: "prompt length (base model)",
                           "Prefill speed on the same weights, ours vs llama.cpp: higher is better")


SWITCH_BARS = (
    ("ours", "switch_over_step", "ours: one session,\nre-targeted A<->B", "#1f4e9c"),
    ("ours", "two_sessions_over_step", "ours: two sessions,\none adapter each", "#7aa6dc"),
    ("theirs", "switch_over_step", "llama.cpp: one context,\nre-targeted A<->B", "#c45a10"),
    ("theirs", "two_sessions_over_step", "llama.cpp: two contexts,\none adapter each", "#f0a35e"),
)


def plot_switch(plt: Any, results: dict) -> Any:
    panels = _set_panels(results)
    if not panels:
        return None
    figure, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels) + 1.4, 3.4), squeeze=False, sharey=True)
    for axis, (data, threads, t) in zip(axes[0], panels):
        bars = [(label, color, t["switch"][side][field]) for side, field, label, color in SWITCH_BARS
                if side in t["switch"]]
        middle, low, high = _whiskers([s for _, _, s in bars])
        right = max(2.0, max(middle) * 1.35)
        ys = range(len(bars))[::-1]
        axis.barh(list(ys), middle, 0.65, xerr=[low, [min(h, right - m) for m, h in zip(middle, high)]], capsize=3,
                  color=[color for _, color, _ in bars], edgecolor="black", linewidth=0.4)
        for y, m, h in zip(ys, middle, high):
            clipped = f" (max {m + h:.1f}x, clipped)" if m + h > right else ""
            axis.annotate(f"{m:.2f}x{clipped}", (0.03, y), va="center", fontsize=7.5, color="white")
        limit = 1.02 if data["n_ctx"] >= 1024 else 1.05
        axis.axvline(1.0, color="black", linewidth=0.8)
        axis.axvline(limit, color="green", linestyle="--", linewidth=0.9, label=f"target: {limit}x")
        axis.set_xlim(0, right)
        axis.set_yticks(list(ys), [label for label, _, _ in bars], fontsize=7.5)
        axis.set_xlabel("time per step / a step with one adapter fixed")
        axis.set_title(f"{data['title']}, {_threads_label(threads)}")
        axis.legend(fontsize=7.5, loc="lower right")
        axis.grid(axis="x", alpha=0.3)
    figure.suptitle("Switching between two rank-8 adapters (f32) before every decode step: lower is better\n"
                    f"({WHISKERS})")
    figure.tight_layout()
    return figure


REGISTER_LINES = (("ours_ms", "ours, from the GGUF file", "#1f4e9c", "o"),
                  ("ours_peft_ms", "ours, from the PEFT directory", "#7aa6dc", "s"),
                  ("theirs_ms", "llama.cpp, from the GGUF file", "#c45a10", "o"))


def plot_register(plt: Any, results: dict) -> Any:
    from matplotlib.ticker import FuncFormatter

    rows = sorted(((data["title"], row) for _, data in _sets(results) for row in data["register"]["rows"]),
                  key=lambda item: item[1]["file_mb"])
    if not rows:
        return None
    figure, axis = plt.subplots(figsize=(6.8, 4.4))
    for field, label, color, marker in REGISTER_LINES:
        points = [(row["file_mb"], row[field]) for _, row in rows if field in row]
        if points:
            middle, low, high = _whiskers([s for _, s in points])
            axis.errorbar([x for x, _ in points], middle, yerr=[low, high], marker=marker, color=color, capsize=3,
                          label=label)
    for title, row in rows:
        axis.annotate(f"{title.split(' ')[0].split('-Instruct')[0]}\nrank {row['rank']}", (row["file_mb"], 0),
                      xycoords=("data", "axes fraction"), xytext=(0, 4), textcoords="offset points", ha="center",
                      va="bottom", fontsize=6.5, color="#555555")
    axis.set_xscale("log")
    axis.set_yscale("log")
    for ticks in (axis.xaxis, axis.yaxis):
        ticks.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ticks.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    axis.set_xlabel("adapter file size (MB; GGUF LoRA, f32)")
    axis.set_ylabel("register time (ms, log scale)")
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize=8, loc="center right")
    axis.set_title("Registering an adapter: ours parses it (no weights read), llama.cpp reads and copies it\n"
                   f"1 thread: lower is better ({WHISKERS})")
    figure.tight_layout()
    return figure


def plot_memory(plt: Any, results: dict) -> Any:
    sets = list(_sets(results))
    if not sets:
        return None
    figure, axes = plt.subplots(1, len(sets), figsize=(5.2 * len(sets) + 1.0, 3.2), squeeze=False)
    for axis, (_, data) in zip(axes[0], sets):
        mem = data["memory"]
        bars = [("ours: registered, not resident (r8)", registered_adapter_bytes(mem["ours"]) / 1024, "#7aa6dc"),
                ("ours: resident (r8)", mem["ours"]["resident_per_adapter_bytes"] / 1024, "#1f4e9c")]
        for name, label, color in (("r8_a", "llama.cpp: loaded (r8)", "#c45a10"),
                                   ("r64", "llama.cpp: loaded (r64)", "#f0a35e")):
            e = mem.get("theirs", {}).get(name, {})
            if "rss_growth_per_adapter_kib" in e:
                bars.append((label, e["rss_growth_per_adapter_kib"], color))
        ys = list(range(len(bars)))[::-1]
        axis.barh(ys, [kib for _, kib, _ in bars], 0.65, color=[c for _, _, c in bars], edgecolor="black",
                  linewidth=0.4)
        for y, (_, kib, _) in zip(ys, bars):
            axis.annotate(f" {kib:,.0f} KiB" if kib >= 10 else f" {kib:.1f} KiB", (kib, y), va="center", fontsize=7.5)
        axis.axvline(62.5, color="green", linestyle="--", linewidth=0.9, label="target, registered: 64 KB")
        axis.set_xscale("log")
        axis.set_xlim(right=max(kib for _, kib, _ in bars) * 12)
        axis.set_ylim(-0.6, len(bars) + 0.2)  # room for the legend above the bars
        axis.set_yticks(ys, [label for label, _, _ in bars], fontsize=7.5)
        axis.set_xlabel("RSS growth per adapter (KiB, log scale)")
        axis.set_title(f"{data['title']}, f32")
        axis.legend(fontsize=7.5, loc="upper right")
    figure.suptitle("Memory per adapter, measured in fresh processes: lower is better")
    figure.tight_layout()
    return figure


def plot_load(plt: Any, results: dict) -> Any:
    sets = [data for _, data in _sets(results) if data.get("load")]
    if not sets:
        return None
    figure, axes = plt.subplots(len(sets), 2, figsize=(10, 3.3 * len(sets)), squeeze=False)
    for row, data in zip(axes, sets):
        keys = [key for key in SIDES if "load_ms" in data["load"].get(key[0], {}).get(key[1], {})]
        labels = [SIDES[k][0].replace(" (original file)", "").replace(" ", "\n", 1) for k in keys]
        for i, key in enumerate(keys):
            e = data["load"][key[0]][key[1]]
            bottom = 0.0
            for hatch, field in ((None, "load_ms"), ("//", "first_decode_ms")):
                (m,), (lo,), (hi,) = _whiskers([e[field]])
                row[0].bar(i, m, 0.7, bottom=bottom, yerr=[[lo], [hi]], capsize=2, color=SIDES[key][1], hatch=hatch,
                           edgecolor="black", linewidth=0.4)
                bottom += m
            (m,), (lo,), (hi,) = _whiskers([e["peak_rss_mib"]])
            before = e["rss_before_mib"]["median"]
            row[1].bar(i, before, 0.7, color="#dddddd", edgecolor="black", linewidth=0.4,
                       label="the process before loading (Python, libraries)" if i == 0 else None)
            row[1].bar(i, m - before, 0.7, bottom=before, yerr=[[lo], [hi]], capsize=2, color=SIDES[key][1],
                       edgecolor="black", linewidth=0.4)
            row[1].annotate(f"+{m - before:,.0f}", (i, m), textcoords="offset points", xytext=(0, 3), ha="center",
                            fontsize=7.5)
        for axis, ylabel in ((row[0], "ms"), (row[1], "MiB")):
            axis.set_xticks(range(len(keys)), labels, fontsize=7.5)
            axis.set_ylabel(ylabel)
            axis.grid(axis="y", alpha=0.3)
        row[0].set_title(f"{data['title']}, 1 thread\ntime to open (plain) + the first decode step (hatched)")
        row[1].set_title(f"{data['title']}\npeak RSS after the first decode step (the model: coloured)")
        row[1].legend(fontsize=7, loc="upper right")
    figure.suptitle(f"Opening the model in a fresh process: lower is better ({WHISKERS})")
    figure.tight_layout()
    return figure


CURVE_COLORS = ("#1f4e9c", "#7aa6dc", "#c45a10", "#2e8b57", "#8a2be2", "#777777")


def plot_concurrency(plt: Any, results: dict) -> Any:
    """Aggregate tokens/s against sessions: a panel per model set and precision, a line per
    curve (ours batched, ours taking turns, llama.cpp), the mixed-rank point."""
    panels = [(data, precision, entry) for _, data in _sets(results) if "concurrency" in data
              for precision, entry in data["concurrency"]["precisions"].items()]
    if not panels:
        return None
    figure, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2), squeeze=False)
    for axis, (data, precision, entry) in zip(axes[0], panels):
        counts: set[int] = set()
        for color, (name, curve) in zip(CURVE_COLORS, entry["curves"].items()):
            xs = sorted(curve, key=int)
            counts.update(int(n) for n in xs)
            middle, low, high = _whiskers([curve[n] for n in xs])
            axis.errorbar([int(n) for n in xs], middle, yerr=[low, high], marker="o", capsize=3, color=color,
                          label=name, linestyle="none" if len(xs) == 1 else "-")
        axis.set_xscale("log", base=2)
        axis.set_xticks(sorted(counts), [str(n) for n in sorted(counts)])
        axis.set_ylim(bottom=0)
        axis.set_xlabel("concurrent sessions (a thread each)")
        axis.set_ylabel("aggregate decode tokens/s")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc="upper left")
        axis.set_title(f"{data['title']}\n{SIDES[(precision, 'ours')][0]} vs {SIDES[(precision, 'theirs')][0]}")
    conc = panels[0][0]["concurrency"]
    figure.suptitle(f"Concurrent sessions, {conc['adapters']}, {threads_label(conc)}, "
                    f"{results['machine']['cores']} cores: higher is better\n({WHISKERS})")
    figure.tight_layout()
    return figure


SERVE_LOADS = {"serve_load_smollm2.json": "SmolLM2-135M f32", "serve_load.json": "bench model f32"}


def serve_targets(folder: Path) -> list[Target]:
    """The serving target at real size (``serve_load_smollm2.json``, written beside the
    report by ``benchmarks/serve_load.py``): tokens/s at least llama-server's, time to first
    token p99 below its p99, no error, every answer equal to offline."""
    path = folder / "serve_load_smollm2.json"
    if not path.exists():
        return []
    load = json.loads(path.read_text())
    rows = {row["server"]: row for row in load["rows"]}
    ours, theirs = rows.get("runtime serve"), rows.get("llama-server")
    if ours is None or theirs is None:
        return []
    settings = load["settings"]
    ratio = theirs.get("ours_vs_this_tokens_per_s", ours["tokens_per_s"] / theirs["tokens_per_s"])  # turns' median
    met = (ratio >= 1.0 and ours["ttft_ms_p99"] < theirs["ttft_ms_p99"] and ours["errors"] == 0
           and ours["mismatches"] == 0)
    measured = (f"{ratio:.2f}x tokens/s, TTFT p99 {ours['ttft_ms_p99'] / 1e3:.1f} vs "
                f"{theirs['ttft_ms_p99'] / 1e3:.1f} s, {ours['errors']} errors, "
                f"{ours['requests'] - ours['errors'] - ours['mismatches']}/{ours['requests'] - ours['errors']} "
                "equal to offline")
    return [Target("runtime serve vs llama-server under load: tokens/s >= 1.0x, TTFT p99 below its p99, 0 errors, "
                   "every answer equal to offline",
                   f"SmolLM2-135M f32, {settings['clients']} streaming clients, {settings['adapters']} adapters",
                   measured, met, file_source(path, settings), headline=True)]


def npc_targets(folder: Path) -> list[Target]:
    """The NPC tick at real size (``npc_tick_smollm2.json``, written beside the report by
    ``benchmarks/npc_tick.py``): at 16 NPCs, per side of ours and thread count, ticks/s at least
    2x llama-server's (the median of the rounds' ratios), p99 tick latency below its p99, and
    every answer of ours equal to the offline chain with no error (llama-server's equal
    answers are shown: its q8_0 weights are not our int8 ones)."""
    path = folder / "npc_tick_smollm2.json"
    if not path.exists():
        return []
    result = json.loads(path.read_text())
    rows, settings = result["rows"], result["settings"]
    source = file_source(path, settings)
    out = []
    for row in sorted(rows, key=lambda r: (r["threads"], r["side"])):
        theirs = next((r for r in rows if r["side"] == "llama-server" and r["threads"] == row["threads"]
                       and r["npcs"] == row["npcs"]), None)
        if row["npcs"] != 16 or row["side"] == "llama-server" or theirs is None:
            continue
        ratio = row["vs_llama_server_ticks_per_s"]
        met = (ratio >= 2.0 and row["tick_ms_p99"] < theirs["tick_ms_p99"] and row["errors"] == 0
               and row["equal"] == row["calls"])
        measured = (f"{ratio:.2f}x ({row['ticks_per_s']:.1f} vs {theirs['ticks_per_s']:.1f} ticks/s), p99 "
                    f"{row['tick_ms_p99'] / 1e3:.2f} vs {theirs['tick_ms_p99'] / 1e3:.2f} s, equal {row['equal']}/"
                    f"{row['calls']} (llama-server {theirs['equal']}/{theirs['calls']}), load "
                    f"{settings['load_average_at_start']:.0f}-{settings['load_average_at_end']:.0f}")
        where = (f"SmolLM2-135M int8, {row['side']}, {row['threads']} thread{'s' if row['threads'] > 1 else ''}, "
                 "3 trained adapters")
        out.append(Target("NPC ticks/s at 16 NPCs >= 2x llama-server's, p99 tick latency lower, answers equal",
                          where, measured, met, source, headline=True))
    return out


def turbo_targets(folder: Path) -> list[Target]:
    """Turbo LoRA's targets from the f32 run of ``benchmarks/turbo.py`` (``turbo_smollm2.json``,
    written beside the report): ``order_json`` decode >= 2x the same LoRA without heads with
    every output identical, and heads that cost <= 5% on free text (default policy)."""
    path = folder / "turbo_smollm2.json"
    if not path.exists():
        return []
    result = json.loads(path.read_text())
    where = f"SmolLM2-135M, {turbo_label(result)}"
    templated, free = result["order_json"], result["free_text_default_policy"]
    fast = templated["speedup"] >= 2.0 and templated["identical"] == templated["items"]
    source = file_source(path, result)
    return [Target("Turbo LoRA, `order_json`: decode tokens/s >= 2x the same LoRA without heads, every output "
                   "identical", where, f"{templated['speedup']:.2f}x, {templated['identical']}/{templated['items']} "
                   "identical", fast, source, headline=True),
            Target("Turbo LoRA, free text: the heads cost <= 5% (default policy)", where, f"{free['speedup']:.3f}x",
                   free["speedup"] >= 0.95, source, headline=True)]


# benchmarks/turbo.py --data on docs/turbo-training.md's worked example: precision -> (result
# file, the greedy speed-up asked of it).
TURBO_TASK_RESULTS = {"f32": ("turbo_entities_f32", 2.0), "int8": ("turbo_entities_int8", 1.8)}


def turbo_task_targets(folder: Path) -> list[Target]:
    """Issue 55's targets for a Turbo adapter whose LoRA is trained on its task (the entity
    extraction of docs/turbo-training.md, ``turbo_entities_{f32,int8}.json``): greedy decode
    >= 2x (f32) / 1.8x (int8, heads trained on its own states) the same LoRA without heads with
    every output identical, sampling at the run's temperature >= 1.5x, and free text (greedy
    and sampled, default policy) costing <= 5%."""
    rows = []
    for precision, (name, asked) in TURBO_TASK_RESULTS.items():
        path = folder / f"{name}.json"
        if not path.exists():
            continue
        result = json.loads(path.read_text())
        run = result["training"]["run"]
        where = (f"SmolLM2-135M {precision}, {run['num_heads']} heads by train-turbo"
                 + (" on the export's own states" if run.get("trunk") else ""))
        task, sampled = result["task"], result["task_sampled"]
        free = min(result["free_text_default_policy"]["speedup"], result["free_text_sampled_default_policy"]["speedup"])
        source = file_source(path, result)
        rows += [Target(f"Turbo LoRA trained on its task (entities), greedy: decode tokens/s >= {asked}x the same "
                        "LoRA without heads, every output identical", where,
                        f"{task['speedup']:.2f}x, {task['identical']}/{task['items']} identical",
                        task["speedup"] >= asked and task["identical"] == task["items"], source, headline=True),
                 Target(f"Turbo LoRA trained on its task (entities), sampled at T={result['temperature']}: "
                        "decode tokens/s >= 1.5x plain sampling", where, f"{sampled['speedup']:.2f}x",
                        sampled["speedup"] >= 1.5, source, headline=True),
                 Target("Turbo LoRA trained on its task (entities), free text: the heads cost <= 5% (default policy, "
                        "greedy and sampled)", where, f"{free:.3f}x (the lower of the two)", free >= 0.95, source,
                        headline=True)]
    return rows


def gemma3_targets(folder: Path) -> list[Target]:
    """Gemma 3 270M's targets from ``benchmarks/gemma3.py``'s run (``gemma3.json``, written
    beside the report): decode f32 / int8 >= 1.0x llama.cpp f32 / q8_0, and 8 sessions with 8
    distinct rank-8 adapters >= 3x one session."""
    path = folder / "gemma3.json"
    if not path.exists():
        return []
    result = json.loads(path.read_text())
    figures = result["figures"]
    source = file_source(path, result)
    rows = []
    for ours, theirs in (("f32", "llama.cpp f32"), ("int8", "llama.cpp q8_0")):
        if f"{ours}.speed_vs_llama_cpp" not in figures:
            continue
        where = f"Gemma 3 270M, 1 thread, ours {ours}"
        speed, eight = figures[f"{ours}.speed_vs_llama_cpp"], figures[f"{ours}.batch8_aggregate_x"]
        rows += [Target(f"decode tokens/s >= 1.0x llama.cpp ({theirs})", where, f"{_range(speed)}x",
                        speed["median"] >= 1.0, source, headline=True),
                 Target("8 sessions, 8 distinct rank-8 adapters, one model copy: aggregate >= 3x one session", where,
                        f"{_range(eight)}x", eight["median"] >= 3.0, source, headline=True)]
    return rows


# Issue 53's rows, measured on each kind of box (each file records its CPU and date): the Intel
# Xeon AVX-512 box's results lie beside the report, the AMD EPYC Zen 2 box's (AVX2) in avx2/,
# the AMD EPYC Zen 4 box's (AVX-512) in zen4/.
BOX_FOLDERS = (".", "avx2", "zen4")
# benchmarks/experiments/kv_span.py with exports named kv256{f32,int8} and kv4096{f32,int8}
KV_SPAN_RESULT = "kv_span_smollm2.json"
KV_SPAN_START, KV_SPAN_DEEP = 10, 3000  # prompt lengths of the steps compared
# benchmarks/experiments/batch_cost.py --on-threads: the 8-session targets (aggregate near the
# start, ~1,000 tokens deep from BATCH_DEEP positions on) by our precision
BATCH_RESULT = "batch_cost_smollm2_{precision}.json"
BATCH_ASKED = {"f32": (4.0, 3.0), "int8": (3.0, 2.5)}
BATCH_DEEP = 900
# benchmarks/experiments/kernel_probe/kernel_bench.py: the attention op alone on cold caches
# against loops that only read the same bytes (one stream, four streams), from 1k to 4k positions
KERNEL_RESULT = "kernel_bench_smollm2.json"
KERNEL_ASKED = 0.7  # the op's share of the faster loop's rate
DEPTH_RESULT = "kernel_depth_smollm2_fa_off.json"  # benchmarks/experiments/kernel_probe/llama_depth.py
DEPTHS = (512, 2048, 4000)
DEPTH_ASKED = {"f32": 1.1, "int8": 1.3}  # ours / llama.cpp's speed, by our precision
ALL_LINEAR_RESULT = "lora_ratio_smollm2.json"  # benchmarks/experiments/kernel_probe/llama_lora_ratio.py
OPEN_RESULTS = ("open_time_quiet.json", "open_time.json")  # benchmarks/open_time.py; the first found per box
OPEN_ASKED_MS, FIRST_TOKEN_ASKED_MS = 500.0, 1000.0
# `runtime export GGUF --out ... [--quantize int8] --report` with no other flags, by our precision
EXPORT_RESULT = "export_defaults_smollm2_{precision}.json"
EXPORT_ASKED_S, EXPORT_ASKED_PROCESS_BYTES = 300.0, 2.5e9


def _box_results(folder: Path, names: Sequence[str]) -> Iterator[tuple[Path, dict]]:
    """Each box's result of the first of ``names`` that its folder holds."""
    for box in BOX_FOLDERS:
        path = next((folder / box / name for name in names if (folder / box / name).exists()), None)
        if path is not None:
            yield path, json.loads(path.read_text())


def long_context_targets(folder: Path) -> list[Target]:
    """Issue 53's targets, a row per box that has a result file for it (functions below)."""
    return [*cache_length_targets(folder), *read_rate_targets(folder), *depth_targets(folder),
            *batch_on_threads_targets(folder), *all_linear_targets(folder), *export_targets(folder),
            *open_targets(folder)]


def cache_length_targets(folder: Path) -> list[Target]:
    """A step of the 4,096-position f32 export near the start <= 1.10x, after 3,000 tokens
    <= 1.35x, a step of a 256-position export, taken within rounds (int8's shown unjudged: the
    target is the default export's)."""
    rows = []
    for path, result in _box_results(folder, (KV_SPAN_RESULT,)):
        steps = {(row["export"], row["position"]): row["per_round_ms"] for row in result["rows"]}
        for precision in ("f32", "int8"):
            short = steps.get((f"kv256{precision}", KV_SPAN_START))
            for position, asked in ((KV_SPAN_START, 1.10), (KV_SPAN_DEEP, 1.35)):
                long = steps.get((f"kv4096{precision}", position))
                if short is None or long is None:
                    continue
                ratios = spread([a / b for a, b in zip(long, short)])  # within each round
                when = "near the start" if position == KV_SPAN_START else f"after {position:,} tokens"
                rows.append(Target(f"a decode step {when} <= {asked:.2f}x a step of the same model exported with a "
                                   "256-position cache", f"SmolLM2-135M {precision}, KV 4,096, 1 thread"
                                   + ("" if precision == "f32" else " (the target is for the default f32 export)"),
                                   f"{_range(ratios)}x ({statistics.median(long):.1f} vs "
                                   f"{statistics.median(short):.1f} ms)",
                                   ratios["median"] <= asked if precision == "f32" else None,
                                   file_source(path, result), headline=True))
    return rows


def read_rate_targets(folder: Path) -> list[Target]:
    """Decode attention alone (this checkout's build) reads its caches at >= 0.7x the machine's
    read rate at every position measured from 1,000 on: the rate of the faster of kernel_bench's
    two loops over the same bytes (in order, one stream; four interleaved streams); float32
    caches (the default) judged, float16 ones shown."""
    rows = []
    for path, result in _box_results(folder, (KERNEL_RESULT,)):
        for dtype in ("f32", "f16"):
            found = [row for row in result["rows"] if row["dtype"] == dtype and row["position"] >= 1000]
            if not found:
                continue
            kernel = [statistics.median(row["kernel_ms"]["this checkout"]) for row in found]
            read = [min(statistics.median(row["read_ms"]), statistics.median(row["read4_ms"])) for row in found]
            shares = [r / k for r, k in zip(read, kernel)]
            measured = (" / ".join(f"{share:.2f}x" for share in shares) + " at "
                        + " / ".join(f"{row['position']:,}" for row in found) + " positions ("
                        + " / ".join(f"{k:.2f}" for k in kernel) + " ms for 30 layers, against "
                        + " / ".join(f"{row['mb'] / r:.1f}" for row, r in zip(found, read)) + " GB/s read)")
            rows.append(Target(f"decode attention alone on cold caches: every position from 1,000 on read at >= "
                               f"{KERNEL_ASKED}x the machine's read rate (the faster of a one-stream and a "
                               "four-stream loop over the same bytes)",
                               f"SmolLM2-135M's shapes, "
                               f"{'float32 caches' if dtype == 'f32' else 'float16 caches (not the default)'}, "
                               f"span {result['span']:,}, 1 thread", measured,
                               all(share >= KERNEL_ASKED for share in shares) if dtype == "f32" else None,
                               file_source(path, result), headline=True))
    return rows


def depth_targets(folder: Path) -> list[Target]:
    """Decode after 512 / 2,048 / 4,000 tokens (KV 4,096, float32 caches, the attention op),
    every one >= 1.1x llama.cpp f32 and >= 1.3x q8_0 (its f16 cache, ``-fa off``: the faster of
    its two at depth); float16 caches' ratios shown beside."""
    rows = []
    for path, result in _box_results(folder, (DEPTH_RESULT,)):
        for ours, theirs in (("f32", "f32"), ("int8", "q8_0")):
            by_depth = {row["position"]: row for row in result["rows"] if row["ours"] == ours}
            if not all(depth in by_depth for depth in DEPTHS):
                continue
            found = [by_depth[depth] for depth in DEPTHS]
            ratios = [row["ratio_native"]["median"] for row in found]
            measured = (" / ".join(f"{ratio:.2f}x" for ratio in ratios) + " ("
                        + " / ".join(f"{row['native_ms']:.1f}" for row in found) + " vs "
                        + " / ".join(f"{row['llama_cpp_ms']:.1f}" for row in found) + " ms)")
            if all("ratio_f16" in row for row in found):
                measured += "; float16 caches " + " / ".join(f"{row['ratio_f16']['median']:.2f}x" for row in found)
            asked = DEPTH_ASKED[ours]
            rows.append(Target(f"decode after 512 / 2,048 / 4,000 tokens: every one >= {asked}x llama.cpp "
                               f"(ours {ours} vs llama.cpp {theirs})",
                               "SmolLM2-135M, 1 thread, KV 4,096 (llama.cpp: f16 cache, -fa off)", measured,
                               all(ratio >= asked for ratio in ratios), file_source(path, result), headline=True))
    return rows


def batch_on_threads_targets(folder: Path) -> list[Target]:
    """8 sessions with distinct adapters, a thread each through the batcher: aggregate >= 4x
    (f32) / 3x (int8) one session and a token in the batch <= 2x alone near the start, >= 3x /
    2.5x ~1,000 tokens deep; gains taken within rounds."""
    rows = []
    for precision, (asked, asked_deep) in BATCH_ASKED.items():
        for path, result in _box_results(folder, (BATCH_RESULT.format(precision=precision),)):
            sessions, source = result["sessions"], file_source(path, result)
            for row in result["rows"]:
                ratios = spread([together / one for one, together in  # within each round
                                 zip(row["one_tokens_per_s"], row["together_tokens_per_s"])])
                where = f"SmolLM2-135M, ours {precision}, 1 thread, from position {row['position']}"
                measured = (f"{_range(ratios)}x ({statistics.median(row['together_tokens_per_s']):.0f} vs "
                            f"{statistics.median(row['one_tokens_per_s']):.0f} tokens/s)")
                deep = row["position"] >= BATCH_DEEP
                wanted = asked_deep if deep else asked
                rows.append(Target(f"a batch of {sessions} sessions on a thread each, distinct rank-8 adapters"
                                   f"{', ~1,000 tokens deep' if deep else ''}: aggregate >= {wanted:g}x one session",
                                   where, measured, ratios["median"] >= wanted, source, headline=True))
                if not deep:
                    latency = sessions / ratios["median"]
                    rows.append(Target(f"a session's per-token latency in a batch of {sessions} on threads <= 2x "
                                       "alone", where, f"{latency:.2f}x", latency <= 2.0, source, headline=True))
    return rows


def all_linear_targets(folder: Path) -> list[Target]:
    """An all-linear rank-8 adapter's step / a plain step no more than llama.cpp's ratio with
    the same adapter file."""
    rows = []
    for path, result in _box_results(folder, (ALL_LINEAR_RESULT,)):
        for row in result["rows"]:
            ours, theirs = row["ours ratio"]["median"], row["llama.cpp ratio"]["median"]
            rows.append(Target("all-linear rank-8 adapter: (its step / a plain step), ours over llama.cpp's with the "
                               "same adapter file <= 1.0x", f"SmolLM2-135M, 1 thread, ours {row['ours']} vs "
                               f"llama.cpp {row['llama_cpp']}",
                               f"{ours / theirs:.4f}x (ours {ours:.3f}x, llama.cpp {theirs:.3f}x)", ours <= theirs,
                               file_source(path, result), headline=True))
    return rows


def export_targets(folder: Path) -> list[Target]:
    """``runtime export``'s defaults <= 5 min per precision and <= 2.5 GB in any one process
    (the exporter's, the finishing process's or a worker's own peak)."""
    rows = []
    for precision in ("f32", "int8"):
        for path, result in _box_results(folder, (EXPORT_RESULT.format(precision=precision),)):
            largest = max(result["exporter_peak_rss_bytes"], result["finisher_peak_rss_bytes"],
                          *result["worker_peak_rss_bytes"])
            rows.append(Target("export with `runtime export`'s defaults <= 5 min per precision and <= 2.5 GB per "
                               "process",
                               f"SmolLM2-135M {precision}, KV {result['settings']['kv_length']:,}, "
                               f"{len(result['signatures'])} signatures, {result['jobs']} jobs",
                               f"{result['seconds'] / 60:.1f} min ({result['seconds']:.0f} s), the largest process "
                               f"{largest / 1e9:.2f} GB (all {result['peak_rss_bytes'] / 1e9:.2f} GB RSS, "
                               f"{result['peak_pss_bytes'] / 1e9:.2f} GB PSS)",
                               result["seconds"] <= EXPORT_ASKED_S and largest <= EXPORT_ASKED_PROCESS_BYTES,
                               file_source(path, result), headline=True))
    return rows


def open_targets(folder: Path) -> list[Target]:
    """Opening the f32 export <= 0.5 s and ``runtime generate``'s first token <= 1 s, signature
    groups compiled on demand (the default), medians of the rounds."""
    rows = []
    for path, result in _box_results(folder, OPEN_RESULTS):
        for model, modes in result["runs"].items():
            runs = modes.get("on-demand", [])
            firsts = [run["generate"]["first_token_ms"] for run in runs if run.get("generate")]
            if not runs or not firsts:
                continue
            opened, first = statistics.median(run["open_ms"] for run in runs), statistics.median(firsts)
            rows.append(Target("open the f32 export <= 0.5 s and `runtime generate`'s first token <= 1 s (warm "
                               "caches, signature groups compiled on demand)",
                               f"SmolLM2-135M f32, `{Path(model).name}`, {runs[0]['signatures']} signatures",
                               f"{opened / 1e3:.2f} s, first token {first / 1e3:.2f} s (medians of {len(runs)})",
                               opened <= OPEN_ASKED_MS and first <= FIRST_TOKEN_ASKED_MS, file_source(path, result),
                               headline=True))
    return rows


def plot_serve(plt: Any, folder: Path) -> Any:
    """``benchmarks/serve_load.py``'s results (written beside the report): tokens/s, and
    time to first token and inter-token latency p50 / p99, per server, a column per model."""
    found = [(title, json.loads((folder / name).read_text())) for name, title in SERVE_LOADS.items()
             if (folder / name).exists()]
    if not found:
        return None
    figure, axes = plt.subplots(3, len(found), figsize=(5.2 * len(found), 8.4), squeeze=False)
    for column, (title, load) in enumerate(found):
        rows = load["rows"]
        names = [row["server"] for row in rows]
        colors = [CURVE_COLORS[i % len(CURVE_COLORS)] for i in range(len(rows))]
        settings = load["settings"]
        axes[0][column].bar(names, [row["tokens_per_s"] for row in rows], color=colors)
        axes[0][column].set_title(f"{title}: {settings.get('clients')} streaming clients, "
                                  f"{settings.get('adapters')} adapters\naggregate tokens/s (higher is better)")
        for axis, key, what in ((axes[1][column], "ttft_ms", "time to first token"),
                                (axes[2][column], "itl_ms", "inter-token latency")):
            positions = np.arange(len(rows))
            axis.bar(positions - 0.2, [row[f"{key}_p50"] for row in rows], 0.4, label="p50", color="#1f4e9c")
            axis.bar(positions + 0.2, [row[f"{key}_p99"] for row in rows], 0.4, label="p99", color="#c45a10")
            axis.set_xticks(positions, names)
            axis.set_yscale("log")
            axis.set_ylabel("ms")
            axis.set_title(f"{what}, ms (lower is better; log scale)")
            axis.legend(fontsize=7)
        for axis in axes[:, column]:
            axis.tick_params(axis="x", labelsize=7)
            axis.grid(alpha=0.3, axis="y")
    figure.suptitle("Serving under load (benchmarks/serve_load.py), one run per server")
    figure.tight_layout()
    return figure


if __name__ == "__main__":
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS
    loaded = json.loads((folder / "results.json").read_text())
    (folder / "results.md").write_text(render_markdown(loaded, folder) + "\n")
    write_headline(headline(loaded, folder))
    write_summary(summary(loaded, folder))
    for path in plots(loaded, folder):
        print(f"wrote {path}")
