"""Turns the benchmark results into the report (``results.md``: machine, targets, tables)
and the PNG plots, each comparing our runtime with llama.cpp measured in the same run.

    python3 benchmarks/report.py [RESULTS_DIR]

re-renders both from ``results.json`` (``benchmarks/run.py`` calls the same functions).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

SETTING_NAMES = {"base": "base", "r8": "rank-8", "blend": "blend of two rank-8 (0.7/0.3)", "r64": "rank-64"}
SHORT_SETTING_NAMES = {"base": "base", "r8": "rank-8", "blend": "blend 2x r8", "r64": "rank-64"}
# (precision group, side) -> (the label a reader sees, its colour), for every table and plot.
SIDES = {
    ("f32", "ours"): ("ours f32", "#1f4e9c"),
    ("f32", "theirs"): ("llama.cpp f32", "#c45a10"),
    ("int8", "ours"): ("ours int8", "#7aa6dc"),
    ("int8", "theirs"): ("llama.cpp q8_0", "#f0a35e"),
    ("q4", "theirs"): ("llama.cpp Q4_1 (original file)", "#f6d2a8"),
}
CURVE_COLORS = ["#1f4e9c", "#7aa6dc", "#c45a10", "#2e8b57", "#8a2be2"]
SPEED_NOTE = "speed = llama.cpp's ms / ours (above 1: ours is faster)"


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


def _own_ratio(by_thread: dict, precision: str, setting: str) -> float | None:
    """The graph's own cost ratio (bare invokes of the setting's slot / plain signature)."""
    entry = by_thread["decode"][precision][setting]
    graph = by_thread["graph_ms"].get(precision, {})
    slot = entry.get("slot")
    if not slot or f"r{slot}" not in graph:
        return None
    return graph[f"r{slot}"] / graph["plain"]


# -- the report ------------------------------------------------------------------------------


def render_markdown(results: dict) -> str:
    """The report: machine, how to read it, the targets (the only verdicts), then tables."""
    out = ["# Benchmark results", "", *machine_lines(results["machine"]), ""]
    out += ["Every comparison is measured in alternating rounds: each round times our side and "
            "llama.cpp's back to back on the same weights (who goes first flips every round); "
            "figures are the median over rounds, `[min-max]` the range, and ratios are taken "
            f"within a round. {SPEED_NOTE}.", ""]
    for key, message in results.get("skipped", {}).items():
        out += [f"**{key} skipped**: {message}", ""]
    out += ["## Targets", "", "| target | model | measured | met |", "|---|---|---|---|", *targets(results), ""]
    out += ["## Plots", ""]
    out += [f"![{title}]({name})" for name, title in PLOT_TITLES.items()]
    for key, data in _sets(results):
        out += ["", f"## {data['title']}", ""]
        out += set_tables(key, data)
    return "\n".join(out)


def machine_lines(m: dict) -> list[str]:
    start, end = m["load_average_start"][0], m.get("load_average_end", [float("nan")])[0]
    busy = start > 0.5 or end > 0.5 + m["cores"]
    lines = [f"Measured {m['date']} on {m['cpu']} ({m['cores']} cores, {m['memory_gib']} GiB), "
             f"Python {m['python']}, ai-edge-litert {m['ai_edge_litert']}, "
             + (f"llama-cpp-python {m['llama_cpp_python']} (llama.cpp built from its sdist for this CPU, AMX off)."
                if m.get("llama_cpp_python") else "llama.cpp not measured.")]
    lines += ["", f"Load average {start:.1f} when the run started and {end:.1f} when it ended, on {m['cores']} cores: "
              + ("**other jobs shared the machine**, so absolute times are slower and noisier than on an idle one; "
                 "the ratios, taken within a round, are what to compare." if busy else "the machine was otherwise idle.")]
    return lines


def set_tables(key: str, data: dict) -> list[str]:
    out = []
    steps = data["decode_steps"]
    if "same_weights" in data:
        out += [f"Same weights: our f32 logits vs llama.cpp's f32 logits over 16 positions: "
                + "; ".join(f"{SETTING_NAMES[s]} max |diff| {e['max_abs_diff']:.1e}, argmax agrees at "
                            f"{100 * e['argmax_agree']:.0f}%" for s, e in data["same_weights"].items()) + ".", ""]
    out += [f"### Decode (ms per token, {steps} steps from an empty context, KV length {data['n_ctx']})", "",
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
            "Ours: `Engine.register_adapter` (parse and check, no weights read) + unload; llama.cpp: "
            "`llama_adapter_lora_init` (reads and copies the file) + free. The same file on both sides.", "",
            "| adapter | file | ours ms | llama.cpp ms |", "|---|---:|---:|---:|"]
    for row in data["register"]:
        out.append(f"| rank {row['rank']} ({row['format']}) | {row['file_mb']:.2f} MB | {_range(row['ours_ms'])} | "
                   f"{_range(row['theirs_ms']) if 'theirs_ms' in row else '-'} |")
    out += memory_table(data["memory"])
    out += ["", "### Opening the model (fresh process, 1 thread)", "",
            "Load = until the model can run (ours: `Engine(...)`; llama.cpp: model load + context); "
            "the first decode step is separate (ours: the library prepares its kernels' weights there). "
            "Peak RSS = VmHWM after the first step.", "",
            "| precision | file MiB | load ms | first step ms | peak RSS MiB |", "|---|---:|---:|---:|---:|"]
    for precision, sides in data["load"].items():
        for side, e in sides.items():
            if "load_ms" in e:
                out.append(f"| {SIDES[(precision, side)][0]} | {e.get('file_mib', 0):.0f} | {_range(e['load_ms'], '{:.0f}')} | "
                           f"{_range(e['first_decode_ms'], '{:.0f}')} | {_range(e['peak_rss_mib'], '{:.0f}')} |")
    if "concurrency" in data:
        conc = data["concurrency"]
        names = list(conc["curves"])
        counts = sorted({int(n) for curve in conc["curves"].values() for n in curve})
        out += ["", f"### Concurrent sessions ({conc['precision']}, {conc['adapters']}, "
                f"{conc['threads_per_session']} thread per session; aggregate tokens/s)", "",
                "| sessions | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
        for n in counts:
            out.append(f"| {n} | " + " | ".join(_range(conc["curves"][name][str(n)], "{:,.0f}")
                                              if str(n) in conc["curves"][name] else "-" for name in names) + " |")
    return out


def decode_cells(by_thread: dict, precision: str, setting: str) -> list[str]:
    """Ours, llama.cpp, speed, slot, ours x base, graph's own x, runtime's share (``-`` where
    a side did not run)."""
    e = by_thread["decode"][precision][setting]
    speed = f"{_range(e['speed'])}x" if "speed" in e else "-"
    if "ours_ms" not in e:
        return ["-", _med(e.get("theirs_ms")), speed, "-", "-", "-", "-"]
    base = by_thread["decode"][precision]["base"]["ours_ms"]["median"]
    own = _own_ratio(by_thread, precision, setting) if setting != "base" else 1.0
    return [_med(e["ours_ms"]), _med(e.get("theirs_ms")), speed, f"r{e['slot']}" if e.get("slot") else "plain",
            f"{e['ours_ms']['median'] / base:.3f}", f"{own:.3f}" if own else "-", _med(e["glue_share"], "{:.1f}%", 100)]


def memory_table(mem: dict) -> list[str]:
    ours = mem["ours"]
    out = ["", "### Memory per adapter (VmRSS, f32 model, fresh processes)", "", "| what | value |", "|---|---:|",
           f"| ours: RSS per registered (not resident) rank-8 adapter | {ours['registered_per_adapter_bytes'] / 1024:.1f} KiB |",
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


def targets(results: dict) -> list[str]:
    """The targets, each with the measured figure and a verdict."""
    rows = []

    def add(target: str, where: str, measured: str, met: bool) -> None:
        rows.append(f"| {target} | {where} | {measured} | {'yes' if met else 'NO'} |")

    for key, data in _sets(results):
        real = key == "smollm2"
        name = "SmolLM2-135M" if real else "bench model"
        for threads, t in _threads(data):
            where = f"{name}, {_threads_label(threads)}"
            for precision in ("f32", "int8"):
                settings = t["decode"].get(precision, {})
                if "ours_ms" not in settings.get("base", {}):
                    continue
                if not real:
                    worst = max(e["glue_share"]["median"] for e in settings.values())
                    add("runtime's own work <= 3% of a decode step", f"{where}, {precision}",
                        f"worst {100 * worst:.1f}%", worst <= 0.03)
                base = settings["base"]["ours_ms"]["median"]
                for setting in ("r8", "blend", "r64"):
                    own = _own_ratio(t, precision, setting)
                    if own is None:
                        continue
                    ratio = settings[setting]["ours_ms"]["median"] / base
                    add("adapter / plain decode <= the graph's own ratio + 3%",
                        f"{where}, {precision}, {SETTING_NAMES[setting]}", f"{ratio:.3f} vs {own:.3f} + 0.03",
                        ratio <= own + 0.03)
            for precision, factor in (("f32", 1.0), ("int8", 1.0 if real else 1.3)):
                for setting in ("base", "r8"):
                    e = t["decode"].get(precision, {}).get(setting, {})
                    if "speed" in e:
                        add(f"decode tokens/s >= {factor}x llama.cpp ({SIDES[(precision, 'ours')][0]} vs "
                            f"{SIDES[(precision, 'theirs')][0]})", f"{where}, {SETTING_NAMES[setting]}",
                            f"{_range(e['speed'])}x", e["speed"]["median"] >= factor)
            if real:
                for precision in ("f32", "int8"):
                    e = t["prefill"].get(precision, {}).get("512", {})
                    if "speed" in e:
                        add(f"prefill 512 tokens >= 1.0x llama.cpp ({SIDES[(precision, 'ours')][0]} vs "
                            f"{SIDES[(precision, 'theirs')][0]})", where, f"{_range(e['speed'])}x",
                            e["speed"]["median"] >= 1.0)
            limit = 1.02 if real else 1.05
            sw = t["switch"]["ours"]
            add(f"switch between resident adapters + next step <= {limit}x a step (two sessions)", where,
                f"{_range(sw['two_sessions_over_step'], '{:.3f}')}x", sw["two_sessions_over_step"]["median"] <= limit)
            add(f"same, one session re-targeted with set_adapters (<= {limit}x)", where,
                f"{_range(sw['switch_over_step'], '{:.3f}')}x", sw["switch_over_step"]["median"] <= limit)
        register = data["register"]
        smallest, largest = register[0], max(register, key=lambda row: row["file_mb"])
        spread = largest["ours_ms"]["median"] / smallest["ours_ms"]["median"]
        add("register time independent of file size (largest / smallest < 2)", name,
            f"{smallest['ours_ms']['median']:.2f} ms at {smallest['file_mb']:.2f} MB, "
            f"{largest['ours_ms']['median']:.2f} ms at {largest['file_mb']:.0f} MB", spread < 2.0)
        mem = data["memory"]["ours"]
        add("registered, non-resident adapter <= 64 KB RSS", name,
            f"{mem['registered_per_adapter_bytes'] / 1024:.1f} KiB", mem["registered_per_adapter_bytes"] <= 64_000)
        ratio = mem["resident_per_adapter_bytes"] / mem["slot_float32_bytes"]
        add("resident adapter <= 1.1x its float32 buffer bytes (each beyond the first)", name, f"{ratio:.3f}x",
            ratio <= 1.1)
        if not real:
            add("0 bytes RSS growth per switch", name, f"{mem['growth_per_switch_bytes']:.2f} B",
                mem["growth_per_switch_bytes"] <= 1.0)
        if "concurrency" in data:
            curve = data["concurrency"]["curves"]["ours, 1 executor"]
            eight = curve["8"]["median"] / curve["1"]["median"]
            add("8 concurrent sessions >= 0.95x the tokens/s of one (ours, 1 executor)", name, f"{eight:.3f}x",
                eight >= 0.95)
    return rows


# -- the plots ---------------------------------------------------------------------------------

PLOT_TITLES = {
    "decode.png": "decode tokens/s, ours vs llama.cpp",
    "prefill.png": "prefill tokens/s, ours vs llama.cpp",
    "switch.png": "cost of switching adapters",
    "register.png": "register time vs file size",
    "memory.png": "memory per adapter",
    "load.png": "opening the model",
    "concurrency.png": "concurrent sessions",
}


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
    plt.rcParams.update({"font.size": 9, "axes.titlesize": 9.5, "figure.titlesize": 11})
    written = []
    for name, draw in (("decode.png", plot_decode), ("prefill.png", plot_prefill), ("switch.png", plot_switch),
                       ("register.png", plot_register), ("memory.png", plot_memory), ("load.png", plot_load),
                       ("concurrency.png", plot_concurrency)):
        figure = draw(plt, results)
        if figure is None:
            continue
        figure.savefig(folder / name, dpi=110, bbox_inches="tight")
        plt.close(figure)
        written.append(folder / name)
    return written


def _panels(plt: Any, count: int, width: float = 5.2, height: float = 3.6) -> tuple[Any, list[Any]]:
    figure, axes = plt.subplots(1, count, figsize=(width * count, height), squeeze=False)
    return figure, list(axes[0])


def _rounds_note(results: dict) -> str:
    return "bars: median over rounds; whiskers: min-max"


def _grouped_bars(axis: Any, groups: list[str], series: dict[tuple, list[dict | None]], value: Callable[[float], float]) -> None:
    """Bars per group, one per series (a (precision, side) key of SIDES), with min-max whiskers;
    ``value`` turns a median/min/max into what is plotted."""
    import numpy as np

    present = [key for key in SIDES if key in series]
    width = 0.8 / max(1, len(present))
    for i, key in enumerate(present):
        xs, heights, low, high = [], [], [], []
        for g, spread in enumerate(series[key]):
            if spread is None:
                continue
            values = sorted(value(spread[k]) for k in ("median", "min", "max"))
            middle = value(spread["median"])
            xs.append(g - 0.4 + width * (i + 0.5))
            heights.append(middle)
            low.append(middle - values[0])
            high.append(values[-1] - middle)
        axis.bar(xs, heights, width, yerr=[low, high], capsize=2, color=SIDES[key][1], label=SIDES[key][0],
                 edgecolor="black", linewidth=0.4, error_kw={"elinewidth": 0.8})
    axis.set_xticks(np.arange(len(groups)), groups)
    axis.set_ylim(bottom=0)
    axis.grid(axis="y", alpha=0.3)


def _side_series(by_kind: dict, groups: list[str], metric: tuple[str, str]) -> dict[tuple, list[dict | None]]:
    """(precision, side) -> per group the spread of ``metric`` (ours_ms / theirs_ms)."""
    series = {}
    for precision, entries in by_kind.items():
        for side, field in zip(("ours", "theirs"), metric):
            values = [entries.get(g, {}).get(field) for g in groups]
            if any(values):
                series[(precision, side)] = values
    return series


def _set_panels(results: dict) -> list[tuple[str, dict, str, dict]]:
    return [(key, data, threads, t) for key, data in _sets(results) for threads, t in _threads(data)]


def plot_decode(plt: Any, results: dict) -> Any:
    panels = _set_panels(results)
    if not panels:
        return None
    figure, axes = _panels(plt, len(panels))
    for axis, (key, data, threads, t) in zip(axes, panels):
        groups = [s for s in SETTING_NAMES if s in t["decode"]["f32"]]
        series = _side_series(t["decode"], groups, ("ours_ms", "theirs_ms"))
        _grouped_bars(axis, [SHORT_SETTING_NAMES[g] for g in groups], series, lambda ms: 1e3 / ms)
        axis.set_title(f"{data['title']}\n{_threads_label(threads)}, decode from an empty context")
        axis.set_ylabel("tokens/s")
        axis.set_xlabel("adapters")
    axes[0].legend(fontsize=7.5, loc="lower left")
    figure.suptitle(f"Decode speed, ours vs llama.cpp on the same weights: higher is better ({_rounds_note(results)})")
    figure.tight_layout()
    return figure


def plot_prefill(plt: Any, results: dict) -> Any:
    panels = _set_panels(results)
    if not panels:
        return None
    figure, axes = _panels(plt, len(panels), width=4.2)
    for axis, (key, data, threads, t) in zip(axes, panels):
        groups = sorted({n for lengths in t["prefill"].values() for n in lengths}, key=int)
        series = _side_series(t["prefill"], groups, ("ours_ms", "theirs_ms"))
        tokens_per_s = {k: [None if s is None else {m: int(groups[i]) * 1e3 / s[m] for m in ("median", "min", "max")}
                            for i, s in enumerate(v)] for k, v in series.items()}  # each group has its own length
        _grouped_bars(axis, [f"{n} tokens" for n in groups], tokens_per_s, lambda x: x)
        axis.set_title(f"{data['title']}\n{_threads_label(threads)}, base model")
        axis.set_ylabel("prompt tokens/s")
        axis.set_xlabel("prompt length")
    axes[0].legend(fontsize=7.5, loc="lower left")
    figure.suptitle(f"Prefill speed, ours vs llama.cpp on the same weights: higher is better ({_rounds_note(results)})")
    figure.tight_layout()
    return figure


SWITCH_BARS = (
    ("ours", "switch_over_step", "ours: one session\nre-targeted A<->B", "#1f4e9c"),
    ("ours", "two_sessions_over_step", "ours: two sessions,\none adapter each", "#7aa6dc"),
    ("theirs", "switch_over_step", "llama.cpp: one context\nre-targeted A<->B", "#c45a10"),
    ("theirs", "two_sessions_over_step", "llama.cpp: two contexts,\none adapter each", "#f0a35e"),
)


def plot_switch(plt: Any, results: dict) -> Any:
    panels = _set_panels(results)
    if not panels:
        return None
    figure, axes = _panels(plt, len(panels), width=4.6)
    for axis, (key, data, threads, t) in zip(axes, panels):
        bars = [(label, color, t["switch"][side][field]) for side, field, label, color in SWITCH_BARS
                if side in t["switch"]]
        for i, (label, color, s) in enumerate(bars):
            axis.bar(i, s["median"], 0.7, yerr=[[s["median"] - s["min"]], [s["max"] - s["median"]]], capsize=3,
                     color=color, edgecolor="black", linewidth=0.4)
            axis.annotate(f"{s['median']:.2f}x", (i, s["max"]), textcoords="offset points", xytext=(0, 3),
                          ha="center", fontsize=7.5)
        axis.set_xticks(range(len(bars)), [label for label, _, _ in bars], fontsize=7)
        limit = 1.02 if key == "smollm2" else 1.05
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.axhline(limit, color="green", linestyle="--", linewidth=0.8, label=f"target {limit}x")
        axis.set_ylim(0.8, max(1.3, max(s["max"] for _, _, s in bars) * 1.1))
        axis.set_title(f"{data['title']}\n{_threads_label(threads)}, f32, rank-8 adapters")
        axis.set_ylabel("a step's time / a step with the adapter fixed")
        axis.legend(fontsize=7.5, loc="upper left")
        axis.grid(axis="y", alpha=0.3)
    figure.suptitle(f"Switching between two adapters before each decode step: lower is better ({_rounds_note(results)})")
    figure.tight_layout()
    return figure


def plot_register(plt: Any, results: dict) -> Any:
    rows = [(data["title"], row) for _, data in _sets(results) for row in data["register"]]
    if not rows:
        return None
    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    rows.sort(key=lambda item: item[1]["file_mb"])
    for side, field, color in (("ours", "ours_ms", "#1f4e9c"), ("llama.cpp", "theirs_ms", "#c45a10")):
        points = [(row["file_mb"], row[field]) for _, row in rows if field in row]
        if not points:
            continue
        xs = [x for x, _ in points]
        ys = [s["median"] for _, s in points]
        axis.errorbar(xs, ys, yerr=[[s["median"] - s["min"] for _, s in points], [s["max"] - s["median"] for _, s in points]],
                      marker="o", color=color, capsize=3, label=side)
    for title, row in rows:
        axis.annotate(f"{title.split(' (')[0].replace('-Instruct', '')} r{row['rank']}", (row["file_mb"], row["ours_ms"]["median"]),
                      textcoords="offset points", xytext=(4, -10), fontsize=6.5, color="#1f4e9c")
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("adapter file size (MB, GGUF LoRA, f32)")
    axis.set_ylabel("register time (ms)")
    axis.grid(alpha=0.3, which="both")
    axis.legend()
    axis.set_title("Register an adapter: ours (parse, no weights read) vs llama.cpp (reads and copies)\n"
                   f"same file on both sides, 1 thread: lower is better ({_rounds_note(results)})")
    figure.tight_layout()
    return figure


def plot_memory(plt: Any, results: dict) -> Any:
    sets = list(_sets(results))
    if not sets:
        return None
    figure, axes = _panels(plt, len(sets), width=5.0)
    for axis, (key, data) in zip(axes, sets):
        mem = data["memory"]
        ours = mem["ours"]
        bars = [("ours: registered,\nnot resident (r8)", ours["registered_per_adapter_bytes"] / 1024, "#7aa6dc"),
                ("ours: resident (r8)", ours["resident_per_adapter_bytes"] / 1024, "#1f4e9c")]
        for name, label in (("r8_a", "llama.cpp: loaded (r8)"), ("r64", "llama.cpp: loaded (r64)")):
            e = mem.get("theirs", {}).get(name, {})
            if "rss_growth_per_adapter_kib" in e:
                bars.append((label, e["rss_growth_per_adapter_kib"], "#c45a10" if name == "r8_a" else "#f0a35e"))
        for i, (label, kib, color) in enumerate(bars):
            axis.bar(i, kib, 0.7, color=color, edgecolor="black", linewidth=0.4)
            axis.annotate(f"{kib:,.0f} KiB" if kib >= 10 else f"{kib:.1f} KiB", (i, kib), textcoords="offset points",
                          xytext=(0, 3), ha="center", fontsize=7.5)
        axis.axhline(62.5, color="green", linestyle="--", linewidth=0.8, label="target for a registered adapter: 64 KB")
        axis.set_yscale("log")
        axis.set_xticks(range(len(bars)), [label for label, _, _ in bars], fontsize=7)
        axis.set_ylabel("RSS per adapter (KiB, log scale)")
        axis.set_ylim(top=max(kib for _, kib, _ in bars) * 4)
        axis.set_title(f"{data['title']}, f32")
        axis.legend(fontsize=7.5, loc="upper left")
    figure.suptitle("Memory per adapter (RSS growth, fresh process): lower is better")
    figure.tight_layout()
    return figure


def plot_load(plt: Any, results: dict) -> Any:
    sets = [(key, data) for key, data in _sets(results) if data.get("load")]
    if not sets:
        return None
    figure, axes = plt.subplots(len(sets), 2, figsize=(10, 3.4 * len(sets)), squeeze=False)
    for row, (key, data) in zip(axes, sets):
        keys = [(p, side) for (p, side) in SIDES if side in data["load"].get(p, {}) and "load_ms" in data["load"][p][side]]
        for axis, fields, ylabel in ((row[0], ("load_ms", "first_decode_ms"), "ms"), (row[1], ("peak_rss_mib",), "MiB")):
            for i, key_ in enumerate(keys):
                e = data["load"][key_[0]][key_[1]]
                bottom = 0.0
                for j, field in enumerate(fields):
                    s = e[field]
                    axis.bar(i, s["median"], 0.7, bottom=bottom, color=SIDES[key_][1], edgecolor="black", linewidth=0.4,
                             hatch="//" if j else None, yerr=[[s["median"] - s["min"]], [s["max"] - s["median"]]],
                             capsize=2)
                    bottom += s["median"]
                if len(fields) == 1:
                    axis.annotate(f"{bottom:,.0f}", (i, bottom), textcoords="offset points", xytext=(0, 3), ha="center",
                                  fontsize=7.5)
            axis.set_xticks(range(len(keys)), [SIDES[k][0].replace(" (original file)", "") for k in keys], fontsize=7.5)
            axis.set_ylabel(ylabel)
            axis.grid(axis="y", alpha=0.3)
        row[0].set_title(f"{data['title']}, 1 thread\ntime to open (solid) + first decode step (hatched)")
        row[1].set_title(f"{data['title']}\npeak RSS after the first decode step")
    figure.suptitle(f"Opening the model in a fresh process: lower is better ({_rounds_note(results)})")
    figure.tight_layout()
    return figure


def plot_concurrency(plt: Any, results: dict) -> Any:
    found = [(data, data["concurrency"]) for _, data in _sets(results) if "concurrency" in data]
    if not found:
        return None
    data, conc = found[0]
    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    for color, (name, curve) in zip(CURVE_COLORS, conc["curves"].items()):
        counts = sorted(curve, key=int)
        ys = [curve[n]["median"] for n in counts]
        axis.errorbar([int(n) for n in counts], ys, yerr=[[curve[n]["median"] - curve[n]["min"] for n in counts],
                                                          [curve[n]["max"] - curve[n]["median"] for n in counts]],
                      marker="o", capsize=3, color=color, label=name)
    axis.set_xscale("log", base=2)
    axis.set_xticks([int(n) for n in sorted(next(iter(conc["curves"].values())), key=int)],
                    [n for n in sorted(next(iter(conc["curves"].values())), key=int)])
    axis.set_ylim(bottom=0)
    axis.set_xlabel("concurrent sessions (one thread each)")
    axis.set_ylabel("aggregate decode tokens/s")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    axis.set_title(f"{data['title']}, {conc['precision']}, {conc['adapters']}\n"
                   f"{results['machine']['cores']} cores: higher is better ({_rounds_note(results)})")
    figure.tight_layout()
    return figure


if __name__ == "__main__":
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "results"
    loaded = json.loads((folder / "results.json").read_text())
    (folder / "results.md").write_text(render_markdown(loaded) + "\n")
    for path in plots(loaded, folder):
        print(f"wrote {path}")
