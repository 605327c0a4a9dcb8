#!/usr/bin/env python3
"""Score every adapter with lm-eval through ``python -m runtime serve``: a table of accuracies.

What it shows: one server, one base model, every adapter scored by EleutherAI's lm-eval
harness without reloading anything, the adapter named as lm-eval's ``model``. Without
``--base-url`` the script starts ``python -m runtime serve`` itself on a free loopback port
(the demo model, its three adapters, byte tokens, ``--score-by-decode`` since the demo model
has no ``score_{L}`` signatures) and stops it at the end. Then, for the base model and each
adapter the server lists (``GET /v1/models``), lm-eval's ``local-completions`` runs the tasks
(``tokenizer_backend=remote``: the server's own ``/tokenize``, nothing downloaded):

- a multiple-choice task, scored by loglikelihood (``/v1/completions`` with ``echo`` and
  ``logprobs``): ``demo_choice``, which of four rewritings of a line comes next;
- a generation task, greedy until the newline, exact match: ``demo_uppercase``, the line in
  capitals, the skill the ``uppercase`` adapter learned (1.0 there, 0.0 elsewhere).

Both are local files in ``tests/lm_eval/`` (no hub: the script sets ``HF_HUB_OFFLINE=1`` and
``HF_DATASETS_OFFLINE=1`` unless set; their data paths are relative to the repository root,
so run it from there). Needs the ``serve`` and ``eval`` extras (lm-eval 0.4.13, which cannot
share an environment with the ``export`` extra: docs/evaluate.md)::

    pip install -e '.[serve,eval]'
    python examples/evaluate.py
    python examples/evaluate.py --models uppercase,json --limit 5

On SmolLM2-135M-Instruct with its trained task adapters: export it with the scoring
signatures in an ``export`` environment, serve it with the adapters, and score them here
(hub tasks need the hub: ``HF_HUB_OFFLINE=0``)::

    python -m runtime export SmolLM2-135M-Instruct/ --bundle smollm2.litertlm --lora-ranks 8 \\
        --kv-length 1024 --score-lengths 128,512          # the export extra's environment
    mkdir -p adapters && cp -r ~/.cache/runtime/adapters/smollm2/{order_json,intent,reverse_words} adapters/
    python -m runtime serve --model smollm2.litertlm --adapters adapters --port 8000 &
    HF_HUB_OFFLINE=0 HF_DATASETS_OFFLINE=0 python examples/evaluate.py \\
        --base-url http://127.0.0.1:8000/v1 --tasks arc_easy,gsm8k --limit 50 --max-length 1024

``--models`` picks the served names (default: all of them); ``--tasks`` and ``--include-path``
are lm-eval's; each row of the table is one model, each column a task's metric.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from local_server import runtime_serve

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "runtime" / "demo_assets"
DEMO_TASKS = ROOT / "tests" / "lm_eval"
OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def demo_server() -> AbstractContextManager[str]:
    """``python -m runtime serve`` on the demo model and its adapters (see the docstring)."""
    return runtime_serve("--model", str(DEMO / "model.tflite"), "--served-model-name", "demo", "--byte-tokens",
                         "--stop-token", "10", "--adapters", str(DEMO / "adapters"), "--score-by-decode")


def served_models(base_url: str) -> list[str]:
    """The names ``GET /v1/models`` lists: the base model first, then the adapters."""
    with urllib.request.urlopen(base_url + "/models", timeout=30) as response:
        return [entry["id"] for entry in json.load(response)["data"]]


def task_manager(tasks: list[str], include_path: Path | None) -> TaskManager:
    """lm-eval's index of tasks: ``include_path``'s alone when it defines every one of
    ``tasks`` (indexing lm-eval's own thousands of task files takes 10-40 s), else both."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if set(tasks) <= set(local.all_tasks):
            return local
    return TaskManager(include_path=str(include_path) if include_path else None)


def evaluate(base_url: str, model: str, tasks: list[str], manager: TaskManager, limit: int | None, max_length: int,
             concurrent: int) -> dict[str, dict[str, float]]:
    """lm-eval's ``local-completions`` on ``model`` (a served name), the tasks looked up in
    ``manager`` (:func:`task_manager`), ``concurrent`` requests in flight: ``{task: {metric: value}}``."""
    from lm_eval import simple_evaluate

    model_args = (f"model={model},base_url={base_url}/completions,tokenizer_backend=remote,"
                  f"max_length={max_length},num_concurrent={concurrent},max_retries=1")
    results = simple_evaluate(model="local-completions", model_args=model_args, tasks=tasks, limit=limit,
                              task_manager=manager,
                              bootstrap_iters=0, log_samples=False, verbosity="ERROR")
    return {task: {metric.removesuffix(",none"): value for metric, value in numbers.items()
                   if isinstance(value, float) and "_stderr" not in metric}
            for task, numbers in results["results"].items()}


def table(scores: dict[str, dict[str, dict[str, float]]]) -> str:
    """One row per model, one column per task and metric."""
    columns = list(dict.fromkeys((task, metric) for per_task in scores.values()
                                 for task, metrics in per_task.items() for metric in metrics))
    headers = ["model", *(f"{task} {metric}" for task, metric in columns)]
    rows = [[model, *(f"{per_task.get(task, {}).get(metric, float('nan')):.3f}" for task, metric in columns)]
            for model, per_task in scores.items()]
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    return "\n".join("  ".join(cell.ljust(width) if i == 0 else cell.rjust(width)
                               for i, (cell, width) in enumerate(zip(row, widths)))
                     for row in [headers, *rows])


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: scores every model asked for, prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--base-url", help="a running server's /v1 URL (default: start one on the demo model)")
    parser.add_argument("--models", help="served names to score, comma-separated (default: every one listed)")
    parser.add_argument("--tasks", default="demo_choice,demo_uppercase", help="lm-eval tasks, comma-separated")
    parser.add_argument("--include-path", type=Path, default=DEMO_TASKS, help="a folder of lm-eval task files")
    parser.add_argument("--limit", type=int, help="documents per task (default: all)")
    parser.add_argument("--max-length", type=int, default=256, help="the model's context (lm-eval truncates to it)")
    parser.add_argument("--concurrent", type=int, default=4, help="requests in flight (lm-eval's num_concurrent)")
    args = parser.parse_args(argv)
    for name in OFFLINE:
        os.environ.setdefault(name, "1")
    tasks = args.tasks.split(",")
    manager = task_manager(tasks, args.include_path)

    with demo_server() if args.base_url is None else _given(args.base_url) as base_url:
        models = args.models.split(",") if args.models else served_models(base_url)
        scores = {}
        for model in models:
            began = time.perf_counter()
            scores[model] = evaluate(base_url, model, tasks, manager, args.limit, args.max_length, args.concurrent)
            print(f"scored {model} in {time.perf_counter() - began:.1f} s", flush=True)
    print(table(scores))
    return 0


@contextmanager
def _given(base_url: str) -> Iterator[str]:
    """A server the user started: its URL as given, nothing to stop."""
    yield base_url.rstrip("/")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except OSError as exc:  # a wrong --base-url (the server cannot be reached), a file that cannot be read
        sys.exit(f"error: {exc}")
