#!/usr/bin/env python3
"""Where a model's open goes, and what opening fewer signatures saves (issue 53, item 4).

    python3 -m benchmarks.experiments.open_probe.probe compare --model M.tflite --weight-cache C.xnnpack \\
        --variant all --variant prefill_128,decode --rounds 5
    python3 -m benchmarks.experiments.open_probe.probe groups --model M.tflite --weight-cache C.xnnpack \\
        --group prefill_32,prefill_128,decode --group decode_lora_r8,prefill_128_lora_r8
    python3 -m benchmarks.experiments.open_probe.probe engine --model M.litertlm --keys prefill_32,prefill_128,decode \\
        --rounds 5
    python3 -m benchmarks.experiments.open_probe.probe cold --model M.tflite --keys prefill_128,decode

``compare``: each variant opened in a fresh process per round (alternating order), LiteRT's
C API calls of ``NativeModel.__init__`` timed one by one, and the process's memory after.
``all`` is the whole model; a comma list is a copy-on-write view of the file with only those
signatures (:mod:`views`). The weight cache file is the whole model's, warm.

``groups`` (route b): one process, one compiled model per group over its own view of the
file, one weight cache file; each group's open and the memory after each, beside one
process opening the whole model.

``engine``: ``runtime.Engine`` (what ``runtime generate`` builds) opening the bundle as it
is, or with its executor given the view of ``--keys`` only (the executor's constructor is
wrapped in this process; nothing in ``runtime/`` changes): Engine open, first token (prefill
of a chat prompt), and process wall time from start to first token, in fresh processes.

``cold``: a weight cache file built by a view of ``--keys``, then used by the whole model and
by the other signatures (is a cache file written by a group complete for the others?).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

START = time.perf_counter()


def load_average() -> str:
    """The 1/5/15-minute load averages, as ``uptime`` prints them."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _child(args: Sequence[str]) -> dict[str, Any]:
    """Runs this module with ``args`` in a fresh process; its JSON line."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.experiments.open_probe.probe", *args],
                         capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"child {args} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(lines[-1])


def _keys(text: str) -> list[str] | None:
    return None if text == "all" else [k for k in text.split(",") if k]


def cmd_open(args: argparse.Namespace) -> None:
    """One open in this process (a child of ``compare``): JSON on stdout."""
    from benchmarks.experiments.open_probe import steps

    import_ms = (time.perf_counter() - START) * 1e3
    result = steps.open_one(args.model, _keys(args.variant), args.weight_cache, args.threads,
                            [k for k in args.runs.split(",") if k])
    result["import_ms"] = import_ms
    print(json.dumps(result))


def cmd_compare(args: argparse.Namespace) -> None:
    """Alternating rounds of fresh-process opens per variant; a table of medians."""
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variant}
    loads = []
    for rnd in range(args.rounds):
        order = args.variant if rnd % 2 == 0 else args.variant[::-1]
        loads.append(os.getloadavg()[0])
        for variant in order:
            runs[variant].append(_child(["open", "--model", args.model, "--variant", variant,
                                         "--weight-cache", args.weight_cache, "--threads", str(args.threads)]))
    print(f"{args.model}: {args.rounds} rounds, fresh process per open, warm page cache and weight cache; "
          f"load average (1 min) at round starts {min(loads):.2f}-{max(loads):.2f}")
    names = ["view", "create_model", "compile", "destroy_model", "total", "cpu_create_model", "cpu_compile",
             "cpu_total"]
    print("| variant | signatures | " + " | ".join(f"{n} ms" for n in names)
          + " | RSS MiB | PSS anon MiB | total / all (per round) | CPU total / all |")
    print("|---|---:|" + "---:|" * len(names) + "---:|---:|---|")
    base = runs[args.variant[0]]
    for variant, results in runs.items():
        med = {n: statistics.median(r["steps"][n] for r in results) for n in names}
        ratios = [r["steps"]["total"] / b["steps"]["total"] for r, b in zip(results, base)]
        cpu = [r["steps"]["cpu_total"] / b["steps"]["cpu_total"] for r, b in zip(results, base)]
        rss = statistics.median(r["memory_after"]["rss"] for r in results)
        anon = statistics.median(r["memory_after"]["pss_anon"] for r in results)
        print(f"| {variant} | {results[0]['signatures']} | " + " | ".join(f"{med[n]:.1f}" for n in names)
              + f" | {rss:.0f} | {anon:.0f} | {min(ratios):.3f} / {statistics.median(ratios):.3f} / "
              f"{max(ratios):.3f} | {statistics.median(cpu):.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "loads": loads}, indent=1))


def cmd_groups_child(args: argparse.Namespace) -> None:
    """Route b in this process: JSON on stdout."""
    from benchmarks.experiments.open_probe import steps

    groups = [g.split(",") for g in args.group]
    print(json.dumps(steps.open_groups(args.model, groups, args.weight_cache, args.threads)))


def cmd_groups(args: argparse.Namespace) -> None:
    """Route b beside the whole model, alternating rounds."""
    common = ["--model", args.model, "--weight-cache", args.weight_cache, "--threads", str(args.threads)]
    whole, grouped, loads = [], [], []
    for rnd in range(args.rounds):
        loads.append(os.getloadavg()[0])
        jobs = [("whole", ["open", *common, "--variant", "all"]),
                ("groups", ["groups-child", *common, *sum((["--group", g] for g in args.group), [])])]
        for name, argv in (jobs if rnd % 2 == 0 else jobs[::-1]):
            (whole if name == "whole" else grouped).append(_child(argv))
    print(f"{args.model}: {args.rounds} rounds; load average (1 min) {min(loads):.2f}-{max(loads):.2f}")
    print("| compiled model | signatures | create_model ms | compile ms | open ms | RSS after MiB | PSS anon after MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    med = statistics.median
    print(f"| whole (one process) | {whole[0]['signatures']} | "
          f"{med(r['steps']['create_model'] for r in whole):.1f} | {med(r['steps']['compile'] for r in whole):.1f} | "
          f"{med(r['steps']['total'] for r in whole):.1f} | {med(r['memory_after']['rss'] for r in whole):.0f} | "
          f"{med(r['memory_after']['pss_anon'] for r in whole):.0f} |")
    total = 0.0
    for i, group in enumerate(args.group):
        rows = [g["groups"][i] for g in grouped]
        ms = med(r["steps"]["total"] + r["steps"]["view"] for r in rows)
        total += ms
        print(f"| group {i + 1}: {group} | {len(group.split(','))} | "
              f"{med(r['steps']['create_model'] for r in rows):.1f} | {med(r['steps']['compile'] for r in rows):.1f} | "
              f"{ms:.1f} | {med(r['memory_after']['rss'] for r in rows):.0f} | "
              f"{med(r['memory_after']['pss_anon'] for r in rows):.0f} |")
    print(f"sum of the groups' opens: {total:.1f} ms; memory before the first group: RSS "
          f"{med(g['memory_before']['rss'] for g in grouped):.0f} MiB")
    if args.json:
        Path(args.json).write_text(json.dumps({"whole": whole, "groups": grouped, "loads": loads}, indent=1))


def _text_parts(args: argparse.Namespace) -> dict[str, Any]:
    """For a ``.tflite``: the tokenizer and chat template of ``--text-from`` (a bundle of the
    same model), built here, inside the timed open, as ``Engine`` builds a bundle's."""
    if not args.text_from:
        return {}
    from runtime.components.chat_template import ChatTemplate
    from runtime.components.tokenizer import HfTokenizer
    from runtime.util.litertlm_bundle import LitertLmBundle

    with LitertLmBundle(Path(args.text_from)) as bundle:
        kind, data = bundle.tokenizer()
        llm = bundle.llm_metadata()
    return {"tokenizer": HfTokenizer(data, llm.stop_token_ids or None),
            "chat_template": ChatTemplate(llm.chat_template, bos_token=llm.bos_token, eos_token=llm.eos_token)}


def _install_view(keys: list[str] | None) -> None:
    """Wraps ``Engine``'s executor constructor (in this process) so that its model is a
    private mapping showing only ``keys``; nothing when ``keys`` is None."""
    import runtime.engine.engine as engine_module
    from runtime.util.litertlm_bundle import LitertLmBundle

    if not keys:
        return
    from benchmarks.experiments.open_probe import views

    original = engine_module.LlmExecutor
    views_made: list[Any] = []

    def with_view(model: Any, settings: Any, *, name: str, weight_cache: Any) -> Any:
        """The executor over a private mapping of the model (a bundle's model section or a
        ``.tflite``), its signature table patched to ``keys``."""
        import mmap

        begin, end = 0, os.path.getsize(name)
        if name.endswith(".litertlm"):
            with LitertLmBundle(Path(name)) as bundle:
                section = bundle.model_section()
            begin, end = section.begin, section.end
        fd = os.open(name, os.O_RDONLY)
        mapping = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        part = memoryview(mapping)[begin:end]
        views.patch_signatures(part, keys)
        views_made.append(mapping)
        return original(part, settings, name=name, weight_cache=weight_cache)

    engine_module.LlmExecutor = with_view


def cmd_engine_child(args: argparse.Namespace) -> None:
    """``Engine`` open and first token in this process, the executor given a view when
    ``--keys`` names signatures: JSON on stdout."""
    keys = _keys(args.keys)
    from runtime import Engine, EngineSettings

    import_ms = (time.perf_counter() - START) * 1e3
    _install_view(keys)
    t = time.perf_counter()
    engine = Engine(args.model, EngineSettings(num_threads=args.threads), **_text_parts(args))
    open_ms = (time.perf_counter() - t) * 1e3
    session = engine.create_session()
    t = time.perf_counter()
    text = engine.chat_template.render([{"role": "user", "content": args.prompt}]) \
        if engine.chat_template is not None else args.prompt
    ids = engine.tokenizer.encode(text)
    first = int(session.run_prefill(ids).argmax())  # the first generated token (greedy)
    first_ms = (time.perf_counter() - t) * 1e3
    wall_ms = (time.perf_counter() - START) * 1e3
    print(json.dumps({"import_ms": import_ms, "open_ms": open_ms, "first_token_ms": first_ms,
                      "cpu_to_first_token_ms": time.process_time() * 1e3,
                      "wall_to_first_token_ms": wall_ms, "prompt_tokens": len(ids), "first_token": first,
                      "signatures": len(engine.spec.signatures), "rss": _rss()}))
    session.close()
    engine.close()


_TIMED = ("LitertLmBundle", "weight_cache_file", "LlmExecutor", "_tokenizer", "_chat_template", "AdapterRegistry",
          "ResourceManager", "ExecutorPool", "DecodeBatcher", "Speculation")


def cmd_engine_parts(args: argparse.Namespace) -> None:
    """Where ``Engine(...)`` spends its time: each callee of ``Engine.__init__`` wrapped
    with a timer (in this process), the native open inside the executor timed apart, then
    the first token (prefill of the chat prompt) and the second (one decode step)."""
    import runtime.engine.engine as engine_module
    import runtime.executor.litert_executor as executor_module
    from runtime import EngineSettings

    import_ms = (time.perf_counter() - START) * 1e3
    import_cpu_ms = time.process_time() * 1e3  # the interpreter's own start included
    spent: dict[str, float] = {}
    _install_view(_keys(args.keys))

    def timed(name: str, function: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t, c = time.perf_counter(), time.process_time()
            try:
                return function(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + (time.perf_counter() - t) * 1e3
                spent[f"cpu_{name}"] = spent.get(f"cpu_{name}", 0.0) + (time.process_time() - c) * 1e3
        return wrapper

    for name in _TIMED:
        setattr(engine_module, name, timed(name, getattr(engine_module, name)))
    executor_module.NativeModel = timed("NativeModel", executor_module.NativeModel)
    t, c = time.perf_counter(), time.process_time()
    engine = engine_module.Engine(args.model, EngineSettings(num_threads=args.threads), **_text_parts(args))
    open_ms, open_cpu_ms = (time.perf_counter() - t) * 1e3, (time.process_time() - c) * 1e3
    session = engine.create_session()
    text = engine.chat_template.render([{"role": "user", "content": args.prompt}])
    t = time.perf_counter()
    ids = engine.tokenizer.encode(text)
    encode_ms = (time.perf_counter() - t) * 1e3
    t, c = time.perf_counter(), time.process_time()
    first = int(session.run_prefill(ids).argmax())
    first_ms, first_cpu_ms = (time.perf_counter() - t) * 1e3, (time.process_time() - c) * 1e3
    t, c = time.perf_counter(), time.process_time()
    session.run_decode(first)
    second_ms, second_cpu_ms = (time.perf_counter() - t) * 1e3, (time.process_time() - c) * 1e3
    print(json.dumps({"import_ms": import_ms, "import_cpu_ms": import_cpu_ms, "open_ms": open_ms,
                      "open_cpu_ms": open_cpu_ms, "first_token_cpu_ms": first_cpu_ms,
                      "second_token_cpu_ms": second_cpu_ms,
                      "cpu_to_first_token_ms": time.process_time() * 1e3 - second_cpu_ms,
                      "parts": spent, "encode_ms": encode_ms,
                      "first_token_ms": first_ms, "second_token_ms": second_ms, "prompt_tokens": len(ids),
                      "wall_to_first_token_ms": import_ms + open_ms + encode_ms + first_ms, "rss": _rss()}))
    session.close()
    engine.close()


def _rss() -> float:
    with open("/proc/self/status") as file:
        return next(int(line.split()[1]) / 1024 for line in file if line.startswith("VmRSS"))


def cmd_engine(args: argparse.Namespace) -> None:
    """Engine open and first token, whole vs view, alternating rounds in fresh processes."""
    variants = [args.keys] if args.no_whole else ["all", args.keys]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    loads = []
    for rnd in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for variant in (variants if rnd % 2 == 0 else variants[::-1]):
            runs[variant].append(_child(["engine-child", "--model", args.model, "--keys", variant,
                                         "--prompt", args.prompt, "--threads", str(args.threads),
                                         *(["--text-from", args.text_from] if args.text_from else [])]))
    print(f"{args.model}: {args.rounds} rounds; load average (1 min) {min(loads):.2f}-{max(loads):.2f}")
    print("| executor sees | signatures | imports ms | Engine open ms | first token ms | process start to first "
          "token ms | CPU to first token ms | RSS MiB | open / all |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    med = statistics.median
    for variant, rows in runs.items():
        ratios = [r["open_ms"] / b["open_ms"] for r, b in zip(rows, runs[variants[0]])]
        print(f"| {variant} | {rows[0]['signatures']} | {med(r['import_ms'] for r in rows):.0f} | "
              f"{med(r['open_ms'] for r in rows):.0f} | {med(r['first_token_ms'] for r in rows):.0f} | "
              f"{med(r['wall_to_first_token_ms'] for r in rows):.0f} | "
              f"{med(r['cpu_to_first_token_ms'] for r in rows):.0f} | {med(r['rss'] for r in rows):.0f} | "
              f"{min(ratios):.3f} / {med(ratios):.3f} / {max(ratios):.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "loads": loads}, indent=1))


def cmd_cold(args: argparse.Namespace) -> None:
    """A weight cache file built by a view, then used by the whole model: build times and
    whether the file is complete for signatures the view did not have."""
    folder = Path(tempfile.mkdtemp(prefix="open_probe_cold_", dir=args.scratch))
    cache = str(folder / "view.xnnpack")
    whole_cache = str(folder / "whole.xnnpack")
    rows = [
        ("view builds its cache", ["open", "--model", args.model, "--variant", args.keys, "--weight-cache", cache]),
        ("view, its cache warm", ["open", "--model", args.model, "--variant", args.keys, "--weight-cache", cache]),
        ("whole, on the view's cache", ["open", "--model", args.model, "--variant", "all", "--weight-cache", cache]),
        ("whole builds its cache", ["open", "--model", args.model, "--variant", "all",
                                    "--weight-cache", whole_cache]),
        ("whole, its cache warm", ["open", "--model", args.model, "--variant", "all", "--weight-cache", whole_cache]),
        ("whole, in memory (no file)", ["open", "--model", args.model, "--variant", "all",
                                        "--weight-cache", ":memory:"]),
        ("view, in memory (no file)", ["open", "--model", args.model, "--variant", args.keys,
                                       "--weight-cache", ":memory:"]),
    ]
    print(f"{args.model}, view {args.keys}; load average {load_average()}")
    print("| open | create_model ms | compile ms | total ms | CPU total ms | cache file MB after | RSS MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, argv in rows:
        r = _child(argv)
        path = argv[argv.index("--weight-cache") + 1]
        size = os.path.getsize(path) / 1e6 if os.path.exists(path) else 0.0
        print(f"| {label} | {r['steps']['create_model']:.1f} | {r['steps']['compile']:.1f} | "
              f"{r['steps']['total']:.1f} | {r['steps']['cpu_total']:.1f} | {size:.0f} | "
              f"{r['memory_after']['rss']:.0f} |")
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()


def main() -> None:
    """The subcommands."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("open", "compare", "groups", "groups-child", "engine", "engine-child", "engine-parts", "cold"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True)
        p.add_argument("--threads", type=int, default=1)
        p.add_argument("--rounds", type=int, default=5)
        p.add_argument("--json", help="also write the raw measurements here")
        if name in ("open", "compare", "groups", "groups-child", "cold"):
            p.add_argument("--weight-cache", default=":memory:")
        if name in ("open",):
            p.add_argument("--variant", default="all")
            p.add_argument("--runs", default="", help="signatures to run twice after the open (first-run cost)")
        if name == "compare":
            p.add_argument("--variant", action="append", required=True)
        if name in ("groups", "groups-child"):
            p.add_argument("--group", action="append", required=True)
        if name in ("engine", "engine-child", "engine-parts", "cold"):
            p.add_argument("--keys", default="all")
            p.add_argument("--prompt", default="What is the capital of France?")
            p.add_argument("--text-from", help="a bundle whose tokenizer and chat template a .tflite model uses")
            p.add_argument("--no-whole", action="store_true",
                           help="engine: only the view (a model whose signature names the runtime refuses)")
        if name == "cold":
            p.add_argument("--scratch", default=os.path.expanduser("~/.cache/runtime/models/open_probe"))
    args = parser.parse_args()
    {"open": cmd_open, "compare": cmd_compare, "groups": cmd_groups, "groups-child": cmd_groups_child,
     "engine": cmd_engine, "engine-child": cmd_engine_child, "engine-parts": cmd_engine_parts, "cold": cmd_cold}[args.command](args)


if __name__ == "__main__":
    main()
