"""The scripts in examples/ run on the demo model as a user runs them (a subprocess each,
``python examples/X.py`` from the repository root), and what they print means something
(how long each takes is measured and written to docs/examples.md, never asserted here: the
machines running the tests are shared and noisy; a run past 300 s is a hang): NPC answers equal fresh offline sessions, the translator's pinned hot-load
is refused on a wrong digest and accepted on the right one, the client streams tokens and
gets the answers the engine gives offline, lm-eval's table shows the uppercase adapter's
skill on its generation task and on no other adapter."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from runtime import ByteTokenizer, Engine, EngineSettings, LoraSource, SessionConfig

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "runtime" / "demo_assets"
NEWLINE = 10
HANG_S = 300.0


def run_example(name: str, *args: str, refused: bool = False) -> str:
    """Runs ``examples/name`` as ``python examples/name ARGS`` from the repository root;
    its stdout (``refused``: its stderr, which must be a user's error message, not a
    traceback, with a non-zero exit). Fails past HANG_S."""
    # this checkout's runtime first, whatever is installed; the caller's path after it
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, f"examples/{name}", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=HANG_S)
    if refused:
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        return done.stderr
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def engine():
    with Engine(DEMO / "model.tflite", EngineSettings(num_threads=1),
                tokenizer=ByteTokenizer(stop_token_ids=[NEWLINE])) as opened:
        yield opened


def offline(engine: Engine, prompt, adapter: str | None, max_new_tokens: int, scale: float = 1.0) -> str:
    """What a fresh session on ``adapter`` (a demo adapter's name) answers."""
    loras = [LoraSource(path=DEMO / "adapters" / f"{adapter}.tflite", scale=scale)] if adapter else []
    with engine.create_session(SessionConfig(loras=loras)) as session:
        return session.generate(prompt, max_new_tokens=max_new_tokens).text.strip()


def test_npc_tick_answers_equal_offline_sessions_and_chain_from_one_call_to_the_next(engine, tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from npc_tick import words_of
    finally:
        sys.path.remove(str(ROOT / "examples"))
    log = tmp_path / "calls.jsonl"
    out = run_example("npc_tick.py", "--npcs", "4", "--ticks", "3", "--log", str(log))
    assert re.search(r"ticks/s \d+\.\d +tick latency p50 \d+\.\d ms +p99 \d+\.\d ms +\(12 ticks", out), out
    for role, adapter in (("planner", "json"), ("decider", "no_vowels"), ("dialogue", "uppercase")):
        assert re.search(rf"^{role} +{adapter}\.tflite +12 ", out, re.M), out
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 4 * 3 * 3
    roles = {"planner": "json", "decider": "no_vowels", "dialogue": "uppercase"}
    for call in calls:
        assert call["answer"] == offline(engine, call["prompt"], roles[call["role"]], 64), call
        assert call["prompt"] == list((call["input"] + "\n").encode())
    for first, second in zip(calls, calls[1:]):
        if first["npc"] == second["npc"] and first["tick"] == second["tick"]:  # planner -> decider -> dialogue
            assert second["input"] == words_of(first["answer"])
    # The adapters did their tasks on the chained inputs.
    dialogue = [c for c in calls if c["role"] == "dialogue"]
    assert sum(c["answer"] == c["input"].upper() for c in dialogue) >= len(dialogue) - 1
    assert all(c["answer"].startswith('{"text": ') for c in calls if c["role"] == "planner")


def test_translator_refuses_a_wrong_pin_accepts_the_right_one_swaps_and_unloads():
    out = run_example("translator.py", "--line", "hello world", "--line", "good morning")
    assert "[en-upper] 'hello world' -> 'HELLO WORLD'" in out
    assert "[en-upper] 'good morning' -> 'GOOD MORNING'" in out
    assert re.search(r"hot-load with a wrong sha256 pin: refused \(DataLossError", out), out
    assert re.search(r"hot-load with the right sha256 pin 4ea0416f3a46639d\.\.\.: accepted as adapter \d+", out), out
    assert "[en-novowel] 'hello world' -> 'hll wrld'" in out
    assert "[en-novowel] 'good morning' -> 'gd mrnng'" in out
    assert re.search(r"unloaded en-upper: resident adapter buffers (\d+) KiB -> (\d+) KiB, registered adapters "
                     r"2 -> 1", out), out
    before, after = map(int, re.search(r"buffers (\d+) KiB -> (\d+) KiB", out).groups())
    assert after < before
    assert re.search(r"materialize \(cold switch\) p50 \d+\.\d+ ms", out), out
    assert re.search(r"residency policy: (OnlyActive|KeepAll|Lru) \(", out), out


@pytest.mark.parametrize("name, args, message", [
    ("npc_tick.py", ["--model", "missing.tflite"], "missing.tflite: no such model file"),
    ("npc_tick.py", ["--planner", "missing.tflite"], "missing.tflite: no such file"),
    ("npc_tick.py", ["--chat-template", "missing.jinja"], "No such file or directory: 'missing.jinja'"),
    ("npc_tick.py", ["--npcs", "0"], "--npcs 0: expected 1 or more"),
    ("npc_tick.py", ["--ticks", "0"], "--ticks 0: expected 1 or more"),
    ("npc_tick.py", ["--max-tokens", "0"], "--max-tokens 0: expected 1 or more"),
    ("npc_tick.py", ["--npcs", "2", "--stagger-ms", "inf"], "--stagger-ms inf: expected a number of ms >= 0"),
    ("npc_tick.py", ["--stagger-ms", "-1"], "--stagger-ms -1.0: expected a number of ms >= 0"),
    ("translator.py", ["--model", "missing.tflite"], "missing.tflite: no such model file"),
    ("translator.py", ["--pair", "en-fr=missing.tflite"], "missing.tflite: no such file"),
    ("translator.py", ["--download", "en-fr=missing.tflite"], "No such file or directory: 'missing.tflite'"),
    ("translator.py", ["--max-tokens", "0"], "--max-tokens 0: expected 1 or more"),
    # the budget was read at the end, after every step ran: a ValueError, an OverflowError, Lru's error
    ("translator.py", ["--budget-kib", "nan"], "--budget-kib nan: expected a number of KiB >= 0"),
    ("translator.py", ["--budget-kib", "inf"], "--budget-kib inf: expected a number of KiB >= 0"),
    ("translator.py", ["--budget-kib", "-1"], "--budget-kib -1.0: expected a number of KiB >= 0"),
    ("translator.py", ["--pair", f"en-x={DEMO / 'adapters' / 'json.tflite'}", "--download",
                       f"en-x={DEMO / 'adapters' / 'no_vowels.tflite'}"], "--download en-x: a --pair has that name"),
    ("translator.py", ["--pair", "en-x=a.tflite", "--pair", "en-x=b.tflite"], "--pair en-x: given twice"),
    ("turbo_entities.py", ["evaluate", "--model", "m.litertlm", "--adapter", "a", "--data", "missing.jsonl"],
     "missing.jsonl: no such file or directory"),
    # --items -1 evaluated all the items but the last; --train -5 wrote an empty train.jsonl
    ("turbo_entities.py", ["evaluate", "--model", "m", "--adapter", "a", "--data", "d", "--items", "-1"],
     "--items -1: expected 1 or more"),
    ("turbo_entities.py", ["evaluate", "--model", "m", "--adapter", "a", "--data", "d", "--max-new-tokens", "0"],
     "--max-new-tokens 0: expected 1 or more"),
    ("turbo_entities.py", ["data", "--out", str(Path(tempfile.gettempdir()) / "refused"), "--train", "-5"],
     "--train -5: expected 0 or more"),
    ("serve_client.py", ["--max-tokens", "0"], "--max-tokens 0: expected 1 or more"),
])
def test_a_user_s_mistake_is_one_error_line_not_a_traceback(name, args, message):
    """A missing model, adapter or file, or a count that makes no sense: the examples printed
    a traceback (an IndexError from an empty percentile for --npcs 0)."""
    if name == "serve_client.py":
        pytest.importorskip("openai")
    assert message in run_example(name, *args, refused=True)


@pytest.mark.parametrize("name", ["npc_tick.py", "translator.py"])
def test_a_model_without_a_tokenizer_or_an_answer_past_the_context_is_one_error_line(name, tmp_path):
    """A model that brings no tokenizer (not a .tflite, no --tokenizer) was an AttributeError on
    None; in npc_tick every NPC thread printed its traceback and then numpy's percentile of no
    ticks failed: an NPC's error is now raised once, by the main thread."""
    model = tmp_path / "model.bin"
    model.write_bytes((DEMO / "model.tflite").read_bytes())
    assert f"error: {model} has no tokenizer: give --tokenizer" in run_example(name, "--model", str(model),
                                                                                 refused=True)
    if name == "npc_tick.py":
        message = run_example(name, "--npcs", "2", "--ticks", "1", "--max-tokens", "100000", refused=True)
        assert message.count("exceeds the KV cache") == 1 and "error: RESOURCE_EXHAUSTED: " in message, message


def test_serve_client_refuses_a_missing_adapter_file_and_a_server_it_cannot_reach():
    pytest.importorskip("openai")
    assert "--hot-load missing.tflite: no such file" in run_example("serve_client.py", "--hot-load", "missing.tflite",
                                                                     refused=True)
    unreachable = "http://127.0.0.1:9/v1"  # the discard port: nothing listens
    message = run_example("serve_client.py", "--base-url", unreachable, refused=True)
    assert f"error: cannot reach the server at {unreachable}/models: Connection error." in message


def test_serve_client_refuses_a_server_without_adapters():
    """Steps 2 to 4 need an adapter: a server serving none was an IndexError after step 1."""
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from local_server import runtime_serve
    finally:
        sys.path.remove(str(ROOT / "examples"))
    with runtime_serve("--model", str(DEMO / "model.tflite"), "--byte-tokens") as url:
        message = run_example("serve_client.py", "--base-url", url, refused=True)
    assert f"error: the server at {url} serves no adapter; start it with --adapters" in message


def test_serve_client_streams_blends_and_hot_loads_with_answers_equal_offline(engine):
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    out = run_example("serve_client.py", "--prompt", "hello world")
    prompt = "hello world\n"
    assert f"model='json'       'hello world' -> {offline(engine, prompt, 'json', 48)!r}" in out, out
    assert f"model='uppercase'  'hello world' -> {offline(engine, prompt, 'uppercase', 48)!r}" in out, out
    # The demo model's rank-8 slots cannot hold two rank-8 adapters: refused, then one at a scale.
    assert "need rank 16 together (attention): no LoRA slot of the model holds that (slots: r8)" in out, out
    scaled = re.search(r"instead lora=\[\{'name': 'json', 'scale': 0\.5\}\] on the base -> (.*)$", out, re.M)
    assert scaled and scaled.group(1) == repr(offline(engine, prompt, "json", 48, scale=0.5)), out
    streamed = re.search(r"^4\. streaming \(model='json'\): (.*)\n +\((\d+) chunks\)", out, re.M)
    assert streamed and int(streamed.group(2)) > 10, out
    assert streamed.group(1).replace("|", "") == offline(engine, prompt, "json", 48), out
    assert "hot-load with a wrong sha256: refused, 400 integrity_check_failed" in out, out
    assert "'id': 'hot_no_vowels'" in out and "'healthy': True" in out, out
    assert f"model='hot_no_vowels' 'hello world' -> {offline(engine, prompt, 'no_vowels', 48)!r}" in out, out
    assert "'deleted': True}; adapters now ['json', 'uppercase']" in out, out


def test_evaluate_scores_each_adapter_with_lm_eval_through_the_server():
    try:
        pytest.importorskip("lm_eval.evaluator")  # the eval extra (tests/lm_eval/ alone imports as a namespace)
    except TypeError:  # lm-eval beside the export extra's typing-extensions: tests/test_serve_lm_eval.py says why
        pytest.skip("lm-eval cannot import here (typing-extensions older than 4.13)")
    pytest.importorskip("fastapi")
    out = run_example("evaluate.py", "--models", "demo,uppercase")
    header = re.search(r"^model +demo_choice acc +demo_uppercase exact_match$", out, re.M)
    assert header, out
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in out[header.end():].strip().splitlines()}
    assert set(rows) == {"demo", "uppercase"}, out
    # The generation task is the uppercase adapter's skill: all of it there, none elsewhere.
    assert [rows["demo"][1], rows["uppercase"][1]] == [0.0, 1.0], out
    assert all(0.0 <= choice <= 1.0 for choice, _ in rows.values()), out
