"""lm-eval 0.4.13 (the ``eval`` extra) through ``runtime serve`` on the demo model, per
adapter: a multiple-choice task (loglikelihood: ``local-completions`` with
``tokenizer_backend=remote``) and a generation task (``local-completions`` and
``local-chat-completions``), from the local jsonl tasks of ``tests/lm_eval/`` (no hub).
Every accuracy equals the one computed offline through the engine, and every
loglikelihood is within 1e-4 of the engine's own log-softmax."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from importlib import resources
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # ~35 s: a server, lm-eval's start-up, and its CLI once
if importlib.util.find_spec("lm_eval.evaluator") is None:  # a submodule: tests/lm_eval/ alone is a namespace package
    pytest.skip("lm-eval is not installed (the eval extra)", allow_module_level=True)
pytest.importorskip("uvicorn")

from runtime import ByteTokenizer, Engine, LoraSource, SessionConfig  # noqa: E402
from runtime.serve.logprobs import log_softmax  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "tests" / "lm_eval"
DEMO = Path(str(resources.files("runtime") / "demo_assets"))
MODEL = DEMO / "model.tflite"
NEWLINE = 10
SESSIONS = [None, "uppercase", "no_vowels", "json"]  # the base and each adapter
DOCS = [json.loads(line) for line in (TASKS / "demo_lines.jsonl").read_text().splitlines()]
MODEL_ARGS = "num_concurrent=1,max_retries=1,max_length=256"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def server():
    """``runtime serve`` as a user starts it: the demo model, its adapters, byte tokens,
    the chat template of the tests' tasks, echo by decode steps (the demo model has no
    prefill logits)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "runtime", "serve", "--model", str(MODEL), "--served-model-name", "demo",
         "--byte-tokens", "--stop-token", str(NEWLINE), "--adapters", str(DEMO / "adapters"),
         "--chat-template", str(TASKS / "demo_chat_template.jinja"), "--score-by-decode", "--port", str(port)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                break
        except OSError:
            assert process.poll() is None, process.stderr.read().decode()
            assert time.monotonic() < deadline, "runtime serve did not start"
            time.sleep(0.2)
    yield url
    process.send_signal(signal.SIGINT)
    try:
        process.wait(20)
    except subprocess.TimeoutExpired:
        process.kill()


@pytest.fixture(scope="module")
def offline():
    engine = Engine(MODEL, tokenizer=ByteTokenizer(stop_token_ids=[NEWLINE]))
    yield engine
    engine.close()


@pytest.fixture(scope="module", autouse=True)
def lm_eval_imports():
    """lm-eval imports in this environment. Checked when a test runs, not at collection:
    CI's export step (whose xdsl pin leaves typing-extensions too old for lm-eval) collects
    this file without running it."""
    try:
        import lm_eval.evaluator  # noqa: F401
    except TypeError as error:
        raise RuntimeError(
            f"lm-eval 0.4.13 needs typing-extensions>=4.13, this environment has {version('typing-extensions')} "
            "(the export extra's litert-torch pins xdsl 0.28, which caps it below 4.13): "
            "python3 -m pip install -e '.[eval]' again, or keep lm-eval in an environment of its own") from error


@pytest.fixture(autouse=True)
def from_the_repository(monkeypatch):
    """The tasks' data_files are relative to the repository; nothing comes from the hub."""
    monkeypatch.chdir(ROOT)
    for name, value in OFFLINE_ENV.items():
        monkeypatch.setenv(name, value)


@functools.cache
def local_tasks():
    """lm-eval's task index of ``tests/lm_eval/`` alone, made once: indexing lm-eval's own
    thousands of tasks as well took most of each evaluation's start-up (~10 s)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS), include_defaults=False)


def evaluate(model: str, model_args: str, tasks: list[str], **options) -> dict:
    from lm_eval import simple_evaluate

    return simple_evaluate(model=model, model_args=model_args, tasks=tasks, task_manager=local_tasks(),
                           log_samples=True, **options)


def session(engine: Engine, adapter: str | None):
    loras = [LoraSource(path=DEMO / "adapters" / f"{adapter}.tflite")] if adapter else []
    return engine.create_session(SessionConfig(loras=loras))


def loglikelihood(engine: Engine, adapter: str | None, context: str, continuation: str) -> float:
    """The engine's own log-softmax of the continuation's tokens after the context (whose
    trailing whitespace lm-eval moves to the continuation: the newline is scored too)."""
    stripped = context.rstrip()
    ctx, cont = list(stripped.encode()), list((context[len(stripped):] + continuation).encode())
    with session(engine, adapter) as s:
        logprobs = log_softmax(s.score(ctx + cont, decode_steps=True))
    return float(sum(logprobs[len(ctx) - 1 + i][token] for i, token in enumerate(cont)))


def greedy_line(engine: Engine, adapter: str | None, prompt: str) -> str:
    with session(engine, adapter) as s:
        return s.generate(prompt, 64).text.split("\n")[0]


@pytest.mark.parametrize("adapter", SESSIONS)
def test_local_completions_scores_and_generates_as_the_engine(server, offline, adapter):
    name = adapter or "demo"
    results = evaluate("local-completions", f"model={name},base_url={server}/v1/completions,"
                       f"tokenizer_backend=remote,{MODEL_ARGS}", ["demo_choice", "demo_uppercase"])
    expected_logliks = [[loglikelihood(offline, adapter, doc["line"] + "\n", choice) for choice in doc["choices"]]
                        for doc in DOCS]
    samples = sorted(results["samples"]["demo_choice"], key=lambda sample: sample["doc_id"])
    assert len(samples) == len(DOCS)
    for sample, expected in zip(samples, expected_logliks):
        got = [resp[0][0] for resp in sample["resps"]]
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)
    offline_acc = np.mean([int(np.argmax(logliks)) == doc["gold"] for doc, logliks in zip(DOCS, expected_logliks)])
    assert results["results"]["demo_choice"]["acc,none"] == pytest.approx(offline_acc, abs=1e-12)
    offline_em = np.mean([greedy_line(offline, adapter, doc["line"] + "\n") == doc["answer"] for doc in DOCS])
    assert results["results"]["demo_uppercase"]["exact_match,none"] == pytest.approx(offline_em, abs=1e-12)
    if adapter == "uppercase":
        assert offline_em >= 0.9  # the adapter's own skill, so the comparison above is not of zeros
    elif adapter is not None:
        assert offline_em == 0.0


@pytest.mark.parametrize("adapter", SESSIONS)
def test_local_chat_completions_generates_as_the_engine(server, offline, adapter):
    name = adapter or "demo"
    results = evaluate("local-chat-completions", f"model={name},base_url={server}/v1/chat/completions,{MODEL_ARGS}",
                       ["demo_uppercase_chat"], apply_chat_template=True)
    offline_em = np.mean([greedy_line(offline, adapter, doc["line"] + "\n") == doc["answer"] for doc in DOCS])
    assert results["results"]["demo_uppercase_chat"]["exact_match,none"] == pytest.approx(offline_em, abs=1e-12)


def test_the_documented_command_line_runs(server, tmp_path):
    """docs/evaluate.md's command, on the demo model: the CLI writes its results file."""
    command = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args",
               f"model=uppercase,base_url={server}/v1/completions,tokenizer_backend=remote,{MODEL_ARGS}",
               "--tasks", "demo_choice", "--include_path", str(TASKS), "--output_path", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **OFFLINE_ENV})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "demo_choice" in done.stdout and list(tmp_path.rglob("results_*.json"))
