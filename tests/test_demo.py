"""The demo runs end to end on the bundled model, and each adapter does its own job,
also on words the model never saw in training."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from runtime import ByteTokenizer, Engine, SessionConfig
from runtime import demo
from runtime.demo import ASSETS, load_demo

EXPECTED = {
    "base model": "hello world",  # the base echoes the line
    "uppercase": "HELLO WORLD",
    "no_vowels": "hll wrld",
    "json (from memory)": '{"text": "hello world", "words": 2}',
    "uppercase (litert-lm, float16)": "HELLO WORLD",
}

# What a newcomer types (issue 15 quotes the first, fourth and fifth line as answered
# wrongly by an earlier model): every word is one of the everyday words that
# tools/train_demo.py holds out of all training.
NEWCOMER_LINES = ("apple garden", "good morning", "green tea", "light apple music large",
                  "small dark stone quick", "red fox jump")


def expected_answer(task: str, line: str) -> str:
    """What ``task`` should answer for ``line``, written out here independently of the
    training script."""
    if task == "echo":
        return line
    if task == "uppercase":
        return line.upper()
    if task == "no_vowels":
        return line.translate(str.maketrans("", "", "aeiou"))
    if task == "json":
        return json.dumps({"text": line, "words": len(line.split())})
    raise ValueError(task)


def answer(session, line: str, max_new_tokens: int) -> str:
    session.reset()
    return session.generate(line + "\n", max_new_tokens=max_new_tokens).text


def test_demo_runs_and_every_adapter_answers_its_task():
    done = subprocess.run([sys.executable, "-m", "runtime.demo", "--prompt", "hello world"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    answers = {}
    for line in done.stdout.splitlines():
        if " -> " in line:
            name, text = line.strip().split(" -> ")
            answers[name.strip()] = eval(text)  # the demo prints repr() of each answer
    assert answers == EXPECTED
    assert "tokens/s alone" in done.stdout and "KiB" in done.stdout and done.stderr == ""


def test_newcomer_words_never_seen_in_training_get_every_skill_right():
    demo_json = load_demo()
    held_out = set(demo_json["training"]["word_list"]["held_out_everyday_words"])
    assert all(set(line.split()) <= held_out for line in NEWCOMER_LINES)
    max_new_tokens = demo_json["max_new_tokens"]
    with Engine(ASSETS / demo_json["model"]["file"], tokenizer=ByteTokenizer(stop_token_ids=[10])) as engine:
        sessions = {"echo": engine.create_session()}
        for task in demo_json["tasks"]:
            sessions[task["name"]] = engine.create_session(SessionConfig(lora_path=ASSETS / task["adapter"]))
        got = {task: [answer(session, line, max_new_tokens) for line in NEWCOMER_LINES]
               for task, session in sessions.items()}
    want = {task: [expected_answer(task, line) for line in NEWCOMER_LINES] for task in sessions}
    assert got == want
    # and no session does another's job
    for task, outputs in got.items():
        for other in sessions:
            if other != task:
                assert not any(o == expected_answer(other, line) for o, line in zip(outputs, NEWCOMER_LINES))


def test_task_examples_are_answered_by_their_adapter_only():
    """On the task examples in demo.json (held-out lines), each adapter answers every one
    and the base none."""
    demo_json = load_demo()
    with Engine(ASSETS / demo_json["model"]["file"], tokenizer=ByteTokenizer(stop_token_ids=[10])) as engine:
        base = engine.create_session()
        for task in demo_json["tasks"]:
            assert task["examples"], task["name"]
            with engine.create_session(SessionConfig(lora_path=ASSETS / task["adapter"])) as session:
                for example in task["examples"]:
                    line = example["input"].rstrip("\n")
                    assert answer(session, line, demo_json["max_new_tokens"]) + "\n" == example["output"]
                    assert answer(base, line, demo_json["max_new_tokens"]) + "\n" != example["output"]


@pytest.mark.parametrize("measuring_set", ["seen_words", "unseen_words", "random_strings"])
def test_recorded_accuracy_meets_the_floor(measuring_set):
    """demo.json's tables (measured through this runtime by tools/train_demo.py): each
    session does its own task on at least 95% of the lines and another's on none. (Issue
    15's target; the committed model reaches 97.5-100%, see docs/demo.md.)"""
    table = load_demo()["accuracy"]["runtime"][measuring_set]
    own = {"base": "echo", "+uppercase": "uppercase", "+no_vowels": "no_vowels", "+json": "json",
           "+uppercase_litertlm": "uppercase"}
    assert set(table) == set(own)
    for session, row in table.items():
        assert row[own[session]] >= 0.95, (session, row)
        assert all(value == 0.0 for task, value in row.items() if task != own[session]), (session, row)


def test_generate_demo_format_adds_the_newline_and_stops_at_the_next():
    done = subprocess.run(
        [sys.executable, "-m", "runtime", "generate", "--model", str(ASSETS / "model.tflite"),
         "--lora", str(ASSETS / "adapters" / "json.tflite"), "--demo-format", "--prompt", "good morning"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == '{"text": "good morning", "words": 2}'
    assert "stop: " in done.stdout


def test_costs_are_per_round_medians_relative_to_the_base(monkeypatch):
    lanes = [demo.Lane(name, None, session=name) for name in ("base", "a", "b")]
    alone = {"base": [1.0, 9.0, 1.0], "a": [2.0, 2.0, 30.0], "b": [1.5, 1.5, 1.5]}  # one slow round each
    calls = {name: 0 for name in alone}
    alternating = [2.0]

    def fake_step_seconds(sessions, steps=48):
        if len(sessions) == 1:
            (name,) = sessions
            calls[name] += 1
            return alone[name][calls[name] - 1]
        return alternating[0]

    monkeypatch.setattr(demo, "step_seconds", fake_step_seconds)
    base, a, b = demo.measure_costs(lanes, rounds=3)
    assert base.times_base == 1.0 and base.tokens_per_s == 1.0
    assert a.tokens_per_s == 1 / 2.0 and a.times_base == 2.0  # ratios 2, 2/9, 30 -> median 2
    assert b.times_base == 1.5
    # b and the base alternate with each other: 2.0 - (1.5 + 1.0) / 2 = 0.75 in the rounds
    # where the base took 1.0
    assert b.switch_s == base.switch_s == 0.75
    alternating[0] = 0.1  # faster than either alone: reported as no cost, never negative
    calls.update(dict.fromkeys(calls, 0))
    assert all(cost.switch_s == 0.0 for cost in demo.measure_costs(lanes, rounds=3))
