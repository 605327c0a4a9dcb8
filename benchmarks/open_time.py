"""Opening a model and `runtime generate`'s first token, compiling signature groups on
demand against compiling every signature at open (``EngineSettings.compile``).

    python3 -m benchmarks.open_time --model M.litertlm [--model M2.tflite ...] [--rounds 5] \\
        [--adapter PEFT_DIR] [--out benchmarks/results/open_time]

Every measurement is a fresh process, 1 thread, the page cache and the weight cache file
warm (one open of each model before the rounds writes the file if it is missing); rounds
alternate the order of the two modes. Per model and mode:

- **open**: ``Engine(model, EngineSettings(compile=...))`` in a fresh process, wall and CPU
  time (``time.process_time``: every thread of the process; the box is shared, so CPU time
  is what a quiet box's wall time would be), and the signature groups compiled;
- **first use of a LoRA slot** (``--adapter``, models with LoRA slots): in the same process,
  the first prefill of a session with the adapter (its slot's group compiles then, on
  demand) minus the same prefill of a second session with it;
- **generate**: ``python3 -m runtime generate --max-new-tokens 1`` as a user runs it, the
  wall time from starting the process to the first byte of the token it prints, and the
  CPU time of the whole process (``wait4``'s rusage: start, open, prefill, the token, exit).

A model whose signature names the runtime does not take (the 56-signature stand-in of
``benchmarks/experiments/open_probe/synthetic.py``: its copies are named ``*_copyN``) is
measured one level down: ``NativeModel`` over the whole file against ``NativeModel`` over the
product's view of its plain group (``runtime.util.model_view``), what ``LlmExecutor`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, date_and_cpu, write_result

MODES = ("on-demand", "all")
PROMPT = "What is the capital of France?"
# For a .tflite without a tokenizer: the chat-templated prompt's length in SmolLM2's tokens (37).
PROMPT_IDS = ",".join(str(100 + (i * 37) % 4000) for i in range(37))


def _child(argv: list[str]) -> dict[str, Any]:
    """Runs this module's ``argv`` in a fresh process; its last JSON line."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.open_time", *argv], capture_output=True, text=True,
                         check=False, env=_env())
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{argv} failed ({out.returncode}): {out.stderr[-3000:]}")
    return json.loads(lines[-1])


def _env() -> dict[str, str]:
    """The environment of the measured processes: this checkout first on the path, and
    Python's bytecode written and read as on a user's machine (pip compiles it at install,
    or the first run writes it), even where this shell sets ``PYTHONDONTWRITEBYTECODE``
    (compiling the sources again took ~130 ms of every process here)."""
    root = str(Path(__file__).resolve().parent.parent)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}


def engine_names_ok(model: str) -> bool:
    """Whether the runtime takes every signature name of ``model`` (else: measured natively)."""
    from runtime.util.litertlm_bundle import LitertLmBundle, is_litertlm
    from runtime.util.model_view import ModelFile, signature_keys
    from runtime.util.signature_names import SignatureName

    source = ModelFile(Path(model))
    if is_litertlm(Path(model)):
        with LitertLmBundle(Path(model)) as bundle:
            section = bundle.model_section()
        source = ModelFile(Path(model), section.begin, section.end)
    return all(SignatureName.parse(key) for key in signature_keys(source.header()))


def cmd_engine(args: argparse.Namespace) -> None:
    """One open (and, with ``--adapter``, a LoRA slot's first use) in this process."""
    start_cpu = time.process_time()
    from runtime import Engine, EngineSettings, LoraSource, SessionConfig

    import_cpu = time.process_time() - start_cpu
    t, c = time.perf_counter(), time.process_time()
    engine = Engine(args.model, EngineSettings(num_threads=args.threads, compile=args.compile))
    open_ms, open_cpu_ms = (time.perf_counter() - t) * 1e3, (time.process_time() - c) * 1e3
    result: dict[str, Any] = {"open_ms": open_ms, "open_cpu_ms": open_cpu_ms, "import_cpu_ms": import_cpu * 1e3,
                              "signatures": len(engine.spec.signatures), "groups": len(engine.spec.groups),
                              "compiled_at_open": list(engine.stats().compiled_groups)}
    if args.adapter and engine.spec.slots:
        ids = list(range(100, 132))
        config = SessionConfig(loras=[LoraSource(path=args.adapter, heads=False)])
        times = []
        for _ in range(2):
            with engine.create_session(config) as session:
                t, c = time.perf_counter(), time.process_time()
                session.run_prefill(ids)
                times.append(((time.perf_counter() - t) * 1e3, (time.process_time() - c) * 1e3))
        result.update(first_slot_use_ms=times[0][0] - times[1][0], first_slot_use_cpu_ms=times[0][1] - times[1][1],
                      slot_prefill_ms=times[1][0], compiled_after_adapter=list(engine.stats().compiled_groups))
    engine.close()
    print(json.dumps(result))


def cmd_native(args: argparse.Namespace) -> None:
    """``NativeModel`` over the whole file (``--compile all``) or over the view of its plain
    group (``on-demand``), naming the model's published weight cache file."""
    from runtime.executor.model_spec import PLAIN_GROUP, compile_groups
    from runtime.executor.native import NativeModel
    from runtime.executor.weight_cache import weight_cache_file, WeightCacheDir
    from runtime.util.model_view import ModelFile, signature_keys
    from runtime.util.signature_names import SignatureName

    source = ModelFile(Path(args.model))
    keys = list(signature_keys(source.header()))
    named = {key: name for key in keys if (name := SignatureName.parse(key)) is not None}
    plain = list(compile_groups(named)[PLAIN_GROUP])
    cache = weight_cache_file(WeightCacheDir.USER, args.model)
    with cache.open_for(os.path.getsize(args.model)) as use:  # type: ignore[union-attr]
        t, c = time.perf_counter(), time.process_time()
        model = source.view(plain).data if args.compile == "on-demand" else args.model
        compiled = NativeModel(model, num_threads=args.threads, weight_cache=use.path, name=args.model)
        open_ms, open_cpu_ms = (time.perf_counter() - t) * 1e3, (time.process_time() - c) * 1e3
    print(json.dumps({"open_ms": open_ms, "open_cpu_ms": open_cpu_ms, "signatures": len(keys),
                      "compiled_at_open": [f"{len(compiled.signatures)} signatures"]}))
    compiled.close()
    use.release()


def generate(model: str, mode: str, threads: int) -> dict[str, float]:
    """``runtime generate`` of one token in a fresh process: wall time to the first byte it
    prints, and the process's CPU time."""
    is_bundle = model.endswith(".litertlm")
    prompt = ["--prompt", PROMPT] if is_bundle else ["--prompt-ids", PROMPT_IDS]
    argv = [sys.executable, "-m", "runtime", "generate", "--model", model, *prompt, "--max-new-tokens", "1",
            "--threads", str(threads), "--compile", mode]
    started = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    first = os.read(process.stdout.fileno(), 1)  # type: ignore[union-attr]
    first_token_ms = (time.perf_counter() - started) * 1e3
    rest = first + process.stdout.read()  # type: ignore[union-attr]
    errors = process.stderr.read()  # type: ignore[union-attr]
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed: {errors.decode()[-3000:]}")
    text = rest.decode(errors="replace")
    load = next((float(part.split()[2]) for part in text.split("|") if part.strip().startswith("model load")), None)
    return {"first_token_ms": first_token_ms, "cpu_ms": (usage.ru_utime + usage.ru_stime) * 1e3,
            "engine_open_ms": load, "output": text.splitlines()[0] if text else ""}


def measure(models: list[str], rounds: int, threads: int, adapter: str | None) -> dict[str, Any]:
    """Alternating rounds over the models and modes; the raw measurements."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    loads: list[list[float]] = []
    kinds = {model: "engine" if engine_names_ok(model) else "native" for model in models}
    for model in models:  # the weight cache file and the bytecode, written if missing (not measured)
        _child([kinds[model], "--model", model, "--compile", "all", "--threads", str(threads)])
        if kinds[model] == "engine":
            generate(model, "all", threads)
    for round_index in range(rounds):
        loads.append(list(os.getloadavg()))
        order = MODES if round_index % 2 == 0 else MODES[::-1]
        for model in models:
            for mode in order:
                argv = [kinds[model], "--model", model, "--compile", mode, "--threads", str(threads)]
                if adapter and kinds[model] == "engine":
                    argv += ["--adapter", adapter]
                row = _child(argv)
                if kinds[model] == "engine":
                    row["generate"] = generate(model, mode, threads)
                runs.setdefault(model, {}).setdefault(mode, []).append(row)
                print(f"round {round_index + 1}: {Path(model).name} {mode}: open {row['open_ms']:.0f} ms "
                      f"(CPU {row['open_cpu_ms']:.0f})"
                      + (f", generate first token {row['generate']['first_token_ms']:.0f} ms"
                         if "generate" in row else ""), flush=True)
    return {"runs": runs, "kinds": kinds, "loads": loads, "threads": threads, "rounds": rounds, **date_and_cpu()}


def _med(rows: list[dict[str, Any]], *path: str) -> float:
    values = []
    for row in rows:
        for part in path:
            row = row.get(part) if isinstance(row, dict) else None
        if row is not None:
            values.append(row)
    return statistics.median(values) if values else float("nan")


def table(data: dict[str, Any], command: str) -> list[str]:
    """The Markdown of a run: one row per model and mode, medians; per-round ratios."""
    loads = [load[0] for load in data["loads"]]
    lines = [f"Open and first token, compiling on demand vs all at open ({data['cpu']}, {data['date']}; "
             f"{data['threads']} thread, {data['rounds']} rounds alternating, fresh process per measurement, "
             f"load average (1 min) {min(loads):.1f}-{max(loads):.1f} at round starts). Medians; CPU = the "
             "process's CPU time (what a quiet box's wall time would be).", "",
             "| model | signatures | compile | compiled at open | open ms | open CPU ms | open CPU / all | "
             "generate: start to first token ms | generate CPU ms | first use of a LoRA slot ms (CPU) |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for model, modes in data["runs"].items():
        every = modes["all"]
        for mode in MODES:
            rows = modes[mode]
            ratio = statistics.median(r["open_cpu_ms"] / a["open_cpu_ms"] for r, a in zip(rows, every))
            groups = rows[0]["compiled_at_open"]
            generated = (f"{_med(rows, 'generate', 'first_token_ms'):.0f} | {_med(rows, 'generate', 'cpu_ms'):.0f}"
                         if "generate" in rows[0] else "- | -")
            slot = (f"{_med(rows, 'first_slot_use_ms'):.0f} ({_med(rows, 'first_slot_use_cpu_ms'):.0f})"
                    if "first_slot_use_ms" in rows[0] else "-")
            where = "" if data["kinds"][model] == "engine" else " (NativeModel)"
            lines.append(f"| {Path(model).parent.name}/{Path(model).name}{where} | {rows[0]['signatures']} | {mode} | "
                         f"{', '.join(groups) if len(groups) <= 3 else f'{len(groups)} groups'} | "
                         f"{_med(rows, 'open_ms'):.0f} | {_med(rows, 'open_cpu_ms'):.0f} | {ratio:.2f} | "
                         f"{generated} | {slot} |")
    lines += ["", f"    {command}"]
    return lines


def main() -> None:
    """The subcommands: the benchmark (default), and its measured children."""
    if len(sys.argv) > 1 and sys.argv[1] in ("engine", "native"):
        parser = argparse.ArgumentParser()
        parser.add_argument("kind")
        parser.add_argument("--model", required=True)
        parser.add_argument("--compile", choices=MODES, required=True)
        parser.add_argument("--threads", type=int, default=1)
        parser.add_argument("--adapter")
        args = parser.parse_args()
        (cmd_engine if args.kind == "engine" else cmd_native)(args)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--adapter", help="a PEFT adapter of the models, for the first use of its LoRA slot")
    parser.add_argument("--out", type=Path, default=RESULTS / "open_time")
    args = parser.parse_args()
    data = measure([str(Path(m).expanduser()) for m in args.model], args.rounds, args.threads, args.adapter)
    command = "python3 -m benchmarks.open_time " + " ".join(sys.argv[1:])
    write_result(args.out, table(data, command), data)


if __name__ == "__main__":
    main()
