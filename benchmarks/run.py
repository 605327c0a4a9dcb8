"""The benchmark suite: what the runtime and its adapters cost, side by side with llama.cpp.

    python3 -m benchmarks.run [--quick] [--sets bench,smollm2] [--skip-llama-cpp]

Needs the ``bench`` extra (matplotlib for the plots). llama.cpp runs from its own
virtualenv (``bash benchmarks/llama_cpp/setup.sh`` once; it also converts every model set
to GGUF); without it only our side is measured. Model sets (``benchmarks/llama_cpp/files.py``):

``bench``
    the committed 5.25M-parameter Llama (``benchmarks/models/``), 1 thread;
``smollm2``
    SmolLM2-135M-Instruct at real size (the f32 and int8 exports that
    ``tools/build_smollm2.py`` writes to the cache directory; KV length 1024), 1 thread
    and all cores; skipped, with what is missing, when they are not there.

Every comparison is measured in alternating rounds: each round times our side and then
llama.cpp's (the order flips every round) on the same weights, so the ratio is taken
within a round and drift of a shared machine's speed cancels out; figures are the median
over rounds, with the min and max. The first round only warms up. Writes
``benchmarks/results/results.md``, ``results.json`` and the PNG plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS, both, date_and_cpu
from benchmarks.llama_cpp import client as llama_cpp
from benchmarks.llama_cpp.files import DECODE_SETTINGS, MODEL_SETS, PRECISION_PAIRS, SETTING_ADAPTERS, ModelSet
from benchmarks.measure import (
    ConcurrencyRig,
    batch_fidelity,
    batch_memory,
    bench_cold_switch,
    bench_memory,
    discounted_lone_ratio,
    load_cost,
    prefill_seconds,
    register_seconds,
    spread,
)
from benchmarks.report import headline, plots, render_markdown, summary, write_headline, write_summary
from runtime import Engine, EngineSettings, LoraSource, SessionConfig
from runtime.bench import SwitchRig, decode_round, timed_decode
from runtime.cli.progress import progress_bar
from runtime.errors import StatusError

LATE = "base_late"  # base model, decode after the longest prefill length's prompt
CONCURRENCY_COUNTS = (1, 2, 4, 8, 16)
SAME_WEIGHTS_TOKENS = 16


class Rounds:
    """Figures collected round by round under a key path, summarized as nested dicts of
    :func:`measure.spread` (median, min, max, rounds)."""

    def __init__(self) -> None:
        self.samples: dict[tuple, list[float]] = defaultdict(list)

    def add(self, *path_and_value: Any) -> None:
        *path, value = path_and_value
        self.samples[tuple(str(p) for p in path)].append(float(value))

    def summary(self) -> dict:
        out: dict = {}
        for path, values in self.samples.items():
            node = out
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = spread(values)
        return out


def sources(models: ModelSet, setting: str) -> list[LoraSource]:
    """Our LoraSources (PEFT directories) for one adapter setting of ``files.SETTING_ADAPTERS``."""
    return [LoraSource(path=models.adapters[name].peft, scale=scale) for name, scale in SETTING_ADAPTERS[setting]]


def in_child(function: Callable, *args: Any) -> Any:
    """Runs ``function`` in a fresh process, so other measurements do not pollute its RSS."""
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(function, args)


# -- the machine -----------------------------------------------------------------------


def machine(llama_hello: dict | None) -> dict:
    """What ran the benchmark: CPU, cores, memory, versions, date, load before the run."""
    memory_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal:"))
    return {
        **date_and_cpu(),
        "cores": os.cpu_count(),
        "memory_gib": round(memory_kib / 2**20, 1),
        "python": platform.python_version(),
        "ai_edge_litert": importlib.metadata.version("ai-edge-litert"),
        "llama_cpp_python": llama_hello["llama_cpp_python"] if llama_hello else None,
        "llama_cpp_system_info": llama_hello["system_info"] if llama_hello else None,
        "load_average_start": os.getloadavg(),
    }


# -- one model set, both sides -----------------------------------------------------------


def same_weights(models: ModelSet, llama: Any) -> dict:
    """Our f32 logits vs llama.cpp's f32 logits at each of 16 positions (tokens decoded one
    by one), base and rank-8: the two sides run the same weights."""
    tokens = [(i * 7919 + 11) % 4093 + 3 for i in range(SAME_WEIGHTS_TOKENS)]
    out = {}
    with Engine(models.ours["f32"]) as engine, tempfile.TemporaryDirectory() as tmp:
        for setting in ("base", "r8"):
            with engine.create_session(SessionConfig(loras=sources(models, setting))) as session:
                ours = np.stack([session.run_decode(t).copy() for t in tokens])
            file = Path(tmp) / f"{setting}.npy"
            llama.request("logits", kind="f32", setting=setting, tokens=tokens, out=str(file))
            theirs = np.load(file)
            out[setting] = {"max_abs_diff": float(np.max(np.abs(ours - theirs))),
                            "argmax_agree": float(np.mean(ours.argmax(-1) == theirs.argmax(-1)))}
    return out


class SideBySide:
    """One model set at one thread count, both sides open: our engines for ``precisions``
    (a session per adapter setting, and a switching rig on f32) and a llama.cpp child.
    Each ``round`` measures decode, prefill and switching on both sides."""

    def __init__(self, models: ModelSet, threads: int, precisions: tuple[str, ...], llama: Any | None,
                 stack: ExitStack) -> None:
        self.models, self.threads, self.llama = models, threads, llama
        self.steps = models.decode_steps
        self.pairs = [pair for pair in PRECISION_PAIRS if pair[0] in precisions]
        self.theirs_kinds = {theirs for _, _, theirs in self.pairs if theirs in models.theirs} if llama else set()
        self.engines = {ours: stack.enter_context(Engine(models.ours[ours], EngineSettings(num_threads=threads)))
                        for _, ours, _ in self.pairs if ours in models.ours}
        self.sessions = {p: {s: stack.enter_context(engine.create_session(SessionConfig(loras=sources(models, s))))
                             for s in DECODE_SETTINGS} for p, engine in self.engines.items()}
        self.switch_rig = None
        if "f32" in self.engines:
            self.switch_rig = SwitchRig(self.engines["f32"], *(LoraSource(path=models.adapters[n].peft)
                                                              for n in ("r8_a", "r8_b")))
            stack.callback(self.switch_rig.close)
        self.slots: dict[str, dict[str, int | None]] = {}

    def round(self, r: int, record: Callable[..., None]) -> None:
        for precision, ours_p, theirs_p in self.pairs:
            self.decode(r, record, precision, ours_p if ours_p in self.engines else None,
                        theirs_p if theirs_p in self.theirs_kinds else None)
            for n in self.models.prefill_lengths:
                self.prefill(r, record, precision, n, ours_p if ours_p in self.engines else None,
                             theirs_p if theirs_p in self.theirs_kinds else None)
        if self.switch_rig:
            self.switch(r, record)
        if not self.slots:  # every setting's adapters are resident after the first round
            self.slots = {p: {s: _slot(self.engines[p], session) for s, session in by_setting.items()}
                          for p, by_setting in self.sessions.items()}

    def decode(self, r: int, record: Callable[..., None], precision: str, ours: str | None, theirs: str | None) -> None:
        """ms per step of each setting on both sides from an empty context, and of the base
        model after the longest prompt (``LATE``); on ours also the runtime's share of the step
        (the rest is inside the signature's invoke), and the step's ratio to the base model's
        next to the same ratio of the invokes alone: the graph's own cost."""
        prompt = max(self.models.prefill_lengths)

        def ours_run() -> dict[str, tuple[float, float]]:
            if ours is None:
                return {}
            engine, sessions = self.engines[ours], self.sessions[ours]
            mine = decode_round(engine, sessions, self.steps)
            mine[LATE] = timed_decode(engine, sessions["base"], self.steps, prompt)
            return mine

        def theirs_run() -> dict[str, float]:
            if theirs is None:
                return {}
            return {s: self.llama.request("decode", kind=theirs, setting="base" if s == LATE else s,
                                          threads=self.threads, steps=self.steps,
                                          prompt=prompt if s == LATE else 0)["ms"]
                    for s in (*DECODE_SETTINGS, LATE)}

        mine, other = both(ours_run, theirs_run, r)
        for setting, (step, invoke) in mine.items():
            record("decode", precision, setting, "ours_ms", step * 1e3)
            record("decode", precision, setting, "glue_share", (step - invoke) / step)
            if setting == LATE:
                continue
            x_base, graph_x = step / mine["base"][0], invoke / mine["base"][1]
            record("decode", precision, setting, "x_base", x_base)
            record("decode", precision, setting, "graph_x", graph_x)
            record("decode", precision, setting, "x_base_minus_graph_x", x_base - graph_x)
        for setting, ms in other.items():
            record("decode", precision, setting, "theirs_ms", ms)
            if setting in mine:
                record("decode", precision, setting, "speed", ms / (mine[setting][0] * 1e3))

    def prefill(self, r: int, record: Callable[..., None], precision: str, n: int, ours: str | None,
                theirs: str | None) -> None:
        """ms to prefill ``n`` tokens (base model) on both sides."""
        mine, other = both(
            lambda: prefill_seconds(self.sessions[ours]["base"], n) * 1e3 if ours else None,
            lambda: self.llama.request("prefill", kind=theirs, tokens=n, threads=self.threads)["ms"] if theirs else None,
            r)
        if mine is not None:
            record("prefill", precision, n, "ours_ms", mine)
        if other is not None:
            record("prefill", precision, n, "theirs_ms", other)
        if mine is not None and other is not None:
            record("prefill", precision, n, "speed", other / mine)

    def switch(self, r: int, record: Callable[..., None]) -> None:
        """Switching between two rank-8 adapters (f32), as a multiple of a step, both sides."""
        mine, other = both(
            lambda: self.switch_rig.round(self.steps),
            lambda: self.llama.request("switch", kind="f32", threads=self.threads, steps=self.steps)
            if "f32" in self.theirs_kinds else {},
            r)
        record("switch", "ours", "step_ms", mine["alone"] * 1e3)
        record("switch", "ours", "switch_over_step", mine["switch"] / mine["alone"])
        record("switch", "ours", "two_sessions_over_step", mine["alternate_other"] / mine["alone"])
        record("switch", "ours", "two_sessions_same_adapter_over_step", mine["alternate_same"] / mine["alone"])
        if other:
            record("switch", "theirs", "step_ms", other["step_ms"])
            record("switch", "theirs", "switch_over_step", other["switch_ms"] / other["step_ms"])
            record("switch", "theirs", "two_sessions_over_step", other["two_contexts_ms"] / other["step_ms"])


# Our precisions measured together; f32 alone, as its export holds several GB in memory.
PHASES = (("f32",), ("int8", "q4"))


def side_by_side(models: ModelSet, threads: int, rounds: int, llama: Any | None) -> dict:
    """:class:`SideBySide` over ``rounds`` rounds after one that only warms up, one phase of
    :data:`PHASES` after the other."""
    data = Rounds()
    slots = {}
    for precisions in PHASES:
        with ExitStack() as stack:
            both_sides = SideBySide(models, threads, precisions, llama, stack)
            label = f"{models.key}, {'/'.join(precisions)}, {threads} thread(s)"
            for r in progress_bar(label, unit="round")(range(rounds + 1)):
                both_sides.round(r, data.add if r else lambda *_: None)
            slots.update(both_sides.slots)
    out = data.summary()
    for precision, ours_p, _ in PRECISION_PAIRS:
        for setting, slot in slots.get(ours_p, {}).items():
            out["decode"][precision][setting]["slot"] = slot
    return out


def _slot(engine: Engine, session: Any) -> int | None:
    """The rank slot ``session``'s adapters run in (``None``: the plain signature)."""
    return next((r.slot_rank for r in engine.stats().resident if r.blend == tuple(session.blend)), None)


def register_section(models: ModelSet, rounds: int, llama: Any | None, repeats: int = 5) -> dict:
    """Registering each of the set's adapters, by file size: ours from its GGUF LoRA file and
    from its PEFT directory, llama.cpp from the same GGUF file."""
    data = Rounds()
    errors: dict[str, str] = {}
    adapters = {name: a for name, a in models.adapters.items() if name != "r8_b"}  # r8_b is r8_a's size
    with Engine(models.ours["f32"]) as engine:
        for r in range(rounds + 1):
            record = data.add if r else (lambda *_: None)
            for name, a in adapters.items():
                def ours(a: Any = a) -> dict[str, float]:
                    paths = {"ours_peft_ms": ("PEFT directory", a.peft), "ours_ms": ("GGUF file", a.gguf if llama else None)}
                    out = {}
                    for field, (kind, path) in paths.items():
                        if path is None:
                            continue
                        try:
                            out[field] = register_seconds(engine, LoraSource(path=path), repeats) * 1e3
                        except StatusError as exc:  # reported, not fatal: the other figures stand
                            errors[f"rank-{a.rank} {kind}"] = str(exc)
                    return out

                def theirs(a: Any = a) -> dict[str, float]:
                    if not llama:
                        return {}
                    return {"theirs_ms": llama.request("register", kind="f32", adapter=str(a.gguf), repeats=repeats)["ms"]}

                mine, other = both(ours, theirs, r)
                for field, ms in {**mine, **other}.items():
                    record(name, field, ms)
    summary = data.summary()
    return {"errors": errors,
            "rows": [{"adapter": name, "rank": a.rank, "file_mb": (a.gguf if llama else a.peft / "adapter_model.safetensors")
                      .stat().st_size / 1e6, **summary[name]} for name, a in adapters.items()]}


def load_section(models: ModelSet, rounds: int, with_llama: bool) -> dict:
    """Opening each model file in a fresh process (1 thread): load time, first decode step,
    peak RSS; ours and llama.cpp's in alternating rounds. Ours three ways: with the packed
    weights in a weight cache file (the default: written by an open before the rounds), the
    first open (writing that file into an empty directory), and packed in memory
    (``weight_cache_dir=None``)."""
    data = Rounds()
    with tempfile.TemporaryDirectory(prefix="weight-cache-") as cache:
        for ours_p in {ours_p for _, ours_p, _ in PRECISION_PAIRS if ours_p in models.ours}:
            in_child(load_cost, models.ours[ours_p], 1, cache)
        for r in range(rounds):
            for precision, ours_p, theirs_p in PRECISION_PAIRS:
                ours_run = ((lambda p=ours_p: in_child(load_cost, models.ours[p], 1, cache))
                            if ours_p in models.ours else dict)
                theirs_run = ((lambda p=theirs_p: llama_cpp.load_probe(models.theirs[p], models.n_ctx, 1))
                              if with_llama and theirs_p in models.theirs else dict)
                mine, other = both(ours_run, theirs_run, r)
                first, in_memory = {}, {}
                if mine:
                    with tempfile.TemporaryDirectory(prefix="weight-cache-first-") as empty:
                        first = in_child(load_cost, models.ours[ours_p], 1, empty)
                    in_memory = in_child(load_cost, models.ours[ours_p], 1, None)
                for side, result in (("ours", mine), ("ours_first_open", first), ("ours_in_memory", in_memory)):
                    if result:
                        data.add(precision, side, "load_ms", result["load_s"] * 1e3)
                        data.add(precision, side, "first_decode_ms", result["first_decode_s"] * 1e3)
                        data.add(precision, side, "peak_rss_mib", result["peak_rss_bytes"] / 2**20)
                        data.add(precision, side, "rss_before_mib", result["rss_before_bytes"] / 2**20)
                if other:
                    data.add(precision, "theirs", "load_ms", other["load_ms"] + other["context_ms"])
                    data.add(precision, "theirs", "first_decode_ms", other["first_decode_ms"])
                    data.add(precision, "theirs", "peak_rss_mib", other["peak_rss_kib"] / 1024)
                    data.add(precision, "theirs", "rss_before_mib", other["rss_before_kib"] / 1024)
    out = data.summary()
    for precision, ours_p, theirs_p in PRECISION_PAIRS:
        sizes = {"ours": models.ours.get(ours_p), "ours_first_open": models.ours.get(ours_p),
                 "ours_in_memory": models.ours.get(ours_p),
                 "theirs": models.theirs.get(theirs_p) if with_llama else None}
        for side, path in sizes.items():
            if path is not None and precision in out:
                out[precision].setdefault(side, {})["file_mib"] = path.stat().st_size / 2**20
    return out


def memory_section(models: ModelSet, quick: bool, with_llama: bool) -> dict:
    """RSS per registered and per resident rank-8 adapter (ours), per loaded adapter
    (llama.cpp, 20 copies), each in a fresh process."""
    count, cycles = ((200, 2000) if quick else (1000, 10_000)) if models.key == "bench" else (48, 100)
    out = {"ours": in_child(bench_memory, models.ours["f32"], 8, count, cycles)}
    if with_llama:
        out["theirs"] = {name: llama_cpp.rss_per_adapter(models.theirs["f32"], models.adapters[name].gguf, 20)
                         for name in ("r8_a", "r64")}
    return out


SECTIONS = ("threads", "register", "concurrency", "load", "memory", "cold_switch")


def model_set_section(models: ModelSet, rounds: int, quick: bool, with_llama: bool,
                      sections: Sequence[str] = SECTIONS) -> dict:
    """Everything measured on one model set (or the ``sections`` named)."""
    out: dict = {"title": models.title, "decode_steps": models.decode_steps, "n_ctx": models.n_ctx,
                 "late_prompt": max(models.prefill_lengths),
                 "files": {side: {p: str(path) for p, path in paths.items()}
                           for side, paths in (("ours", models.ours), ("theirs", models.theirs))}}
    with ExitStack() as stack:
        llama = stack.enter_context(llama_cpp.LlamaCpp(models.key)) if with_llama else None
        if llama and "threads" in sections:
            out["same_weights"] = same_weights(models, llama)
        if "threads" in sections:
            out["threads"] = {str(threads): side_by_side(models, threads, rounds, llama)
                              for threads in models.threads}
        if "register" in sections:
            out["register"] = register_section(models, max(3, rounds // 3), llama)
        if "concurrency" in sections:
            out["concurrency"] = concurrency_section(models, max(3, rounds // 3), llama)
    if "load" in sections:
        out["load"] = load_section(models, 3, with_llama)
    if "memory" in sections:
        out["memory"] = memory_section(models, quick, with_llama)
    if models.key == "bench" and "cold_switch" in sections:
        out["cold_switch"] = bench_cold_switch(models.ours["f32"], [LoraSource(path=models.adapters[n].peft)
                                                                   for n in ("r8_a", "r64")], 5 if quick else 15)
    return out


def concurrency_section(models: ModelSet, rounds: int, llama: Any | None, threads: int = 1,
                        executors: int = 1) -> dict:
    """Aggregate decode tokens/s of 1-16 sessions, each with its own rank-8 adapter and a
    thread of its own, started at once, per precision: ours on one model copy, or on
    ``executors`` copies (its runs on ``threads`` XNNPACK threads, a batch's and a lone
    session's alike) with batched decode
    (steps of concurrent sessions run as one pass over the weights) and taking turns (the
    same model, batching off), and llama.cpp with a context per session (its own thread:
    up to all cores); 8 sessions of mixed ranks 8 and 16, and 1 and 8 sessions near the end
    of their caches (where no attention window is shorter) besides. Alternating rounds; one
    session's steps also record each engine's graph time, which the lone-session target takes
    out (:func:`measure.discounted_lone_ratio`). Then the RSS growth from 1 to 8 sessions
    stepping together, in a fresh process."""
    counts = CONCURRENCY_COUNTS
    # Sessions near the end of their cache: a step attends over (nearly) all of it.
    late = models.n_ctx - models.decode_steps - 2
    late_name = f"ours, batched, from position {late}"
    out: dict = {"model": models.title, "adapters": "rank 8, a distinct one per session", "threads_per_session": 1,
                 "engine_threads": threads, "executors": executors, "counts": list(counts), "precisions": {}}
    for ours_precision, _, theirs_precision in PRECISION_PAIRS:
        model = models.batched.get(ours_precision)
        if model is None or not model.exists():
            if model is not None:
                print(f"concurrent sessions, {ours_precision}: skipped, missing {model}", file=sys.stderr)
            continue
        data, lone = Rounds(), []  # lone: discounted_lone_ratio per round
        with ExitStack() as stack:
            # The batched engine also holds 4 rank-16 sessions, which with 4 rank-8 ones make the mixed case.
            batched = ConcurrencyRig(model, [8] * max(counts) + [16] * 4, num_threads=threads, executors=executors,
                                     batch_wait_s=0.002)
            turns = ConcurrencyRig(model, [8] * max(counts), num_threads=threads, executors=executors,
                                   batch_wait_s=None)
            for rig in (batched, turns):
                stack.callback(rig.close)
            for r in progress_bar(f"concurrency {ours_precision}", unit="round")(range(rounds + 1)):
                for count in counts:
                    def ours(count: int = count, r: int = r) -> dict[str, float]:
                        # Batched and taking turns alternate who goes first too: their ratio is a target.
                        rigs = {"ours, batched": batched, "ours, taking turns": turns}
                        order = sorted(rigs, reverse=r % 2 == 1)
                        if count == 1:  # and the two engines' own graph time, which the target discounts
                            timed = {name: rigs[name].lone_step(models.decode_steps) for name in order}
                            if r:
                                lone.append(discounted_lone_ratio(timed["ours, batched"], timed["ours, taking turns"]))
                            out = {name: 1 / seconds for name, (seconds, _) in timed.items()}
                        else:
                            out = {name: rigs[name].tokens_per_second(count, models.decode_steps) for name in order}
                        if count == 8:
                            out["ours, batched, ranks 8 and 16"] = batched.tokens_per_second(
                                8, models.decode_steps, first=max(counts) - 4)
                        if count in (1, 8):
                            out[late_name] = batched.tokens_per_second(count, models.decode_steps, position=late)
                        return out

                    def theirs(count: int = count) -> dict[str, float]:
                        if not llama:
                            return {}
                        reply = llama.request("concurrency", kind=theirs_precision, sessions=count,
                                              steps=models.decode_steps)
                        return {"llama.cpp, a context per session": reply["tokens_per_s"]}

                    mine, other = both(ours, theirs, r)
                    if r:
                        for name, tokens_per_s in {**mine, **other}.items():
                            data.add(name, count, tokens_per_s)
                stats = batched.engine.stats()
        out["precisions"][ours_precision] = {
            "theirs": theirs_precision, "curves": data.summary(), "lone_discounted": spread(lone),
            "decode_batches": dict(stats.decode_batches),
            "queue_wait_ms": {"p50": stats.queue_wait.p50_ms, "p99": stats.queue_wait.p99_ms},
            "memory": in_child(batch_memory, model, 8), "fidelity": in_child(batch_fidelity, model, 8)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--sets", default=",".join(MODEL_SETS), help="model sets to measure (default: %(default)s)")
    parser.add_argument("--skip-llama-cpp", action="store_true", help="measure our side only")
    parser.add_argument("--threads", type=int, action="append",
                        help="thread counts to measure (repeatable; default: each set's own)")
    parser.add_argument("--update", action="store_true",
                        help="keep the other sets of the existing results.json (re-measure only --sets)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="what to measure of each set (default: all of %(default)s); with --update the "
                        "other sections of a set measured before are kept, with its date")
    args = parser.parse_args()
    sections = args.sections.split(",")
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {', '.join(unknown)} (choose from {', '.join(SECTIONS)})")
    partial = set(sections) != set(SECTIONS)
    if partial and not args.update:
        parser.error("--sections needs --update (a report of some sections alone would drop the others)")
    rounds = 5 if args.quick else 15
    with_llama = not args.skip_llama_cpp and llama_cpp.available()
    if not with_llama and not args.skip_llama_cpp:
        print("llama.cpp is not set up (bash benchmarks/llama_cpp/setup.sh): measuring our side only", file=sys.stderr)
    hello = None
    if with_llama:
        with llama_cpp.LlamaCpp("bench") as probe:
            hello = probe.hello
    results: dict = {"machine": machine(hello), "sets": {}, "skipped": {}}
    for key in args.sets.split(","):
        models = MODEL_SETS[key]
        if args.threads:
            models = dataclasses.replace(models, threads=tuple(args.threads))
        missing = models.missing(with_llama, with_ours=set(sections) != {"concurrency"})
        if missing:
            message = f"{models.title}: skipped, missing " + ", ".join(map(str, missing))
            print(message, file=sys.stderr)
            results["skipped"][key] = message
            continue
        print(f"{models.title} ...", file=sys.stderr)
        set_rounds = rounds if key == "bench" else max(3, rounds // 2)
        started = {**date_and_cpu(), "load_average_start": os.getloadavg()}
        results["sets"][key] = model_set_section(models, set_rounds, args.quick, with_llama, sections)
        results["sets"][key]["measured"] = {**started, "load_average_end": os.getloadavg(), "sections": sections}
    results["machine"]["load_average_end"] = os.getloadavg()
    print(write_report(results, update=args.update, partial=partial))


def write_report(results: dict, *, update: bool, partial: bool) -> str:
    """Writes ``results.json``, ``results.md``, the plots, the docs' headline table and the
    README's summary; returns the markdown. With ``update``, the sets not in ``results`` are kept from the existing ``results.json``;
    with ``partial`` too (some sections measured), so are the other sections of the sets
    measured, and the header of the run that measured the rest."""
    RESULTS.mkdir(exist_ok=True)
    if update and (RESULTS / "results.json").exists():
        before = json.loads((RESULTS / "results.json").read_text())
        kept = before["sets"]
        if partial:  # the header stays the whole run's; each set says which sections are newer
            results["machine"] = before["machine"]
        for key, fresh in results["sets"].items():
            if key in kept and partial:  # the sections measured now, the rest as before
                fresh["measured"]["before"] = kept[key].get("measured")
                results["sets"][key] = {**kept[key], **fresh}
        fresh_sets = results["sets"]  # in the order of the file, new sets last
        results["sets"] = {**{k: fresh_sets.get(k, v) for k, v in kept.items()}, **fresh_sets}
        results.setdefault("skipped", before.get("skipped", {}))
    (RESULTS / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    report = render_markdown(results, RESULTS)
    (RESULTS / "results.md").write_text(report + "\n")
    write_headline(headline(results, RESULTS))
    write_summary(summary(results, RESULTS))
    for path in plots(results, RESULTS):
        print(f"wrote {path}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
