"""The demo runs end to end on the bundled model, and each adapter does its own job."""

from __future__ import annotations

import subprocess
import sys

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


def test_demo_runs_and_every_adapter_answers_its_task():
    done = subprocess.run([sys.executable, "-m", "runtime.demo", "--prompt", "hello world"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    answers = {}
    for line in done.stdout.splitlines():
        if " -> " in line:
            name, answer = line.strip().split(" -> ")
            answers[name.strip()] = eval(answer)  # the demo prints repr() of each answer
    assert answers == EXPECTED
    assert "tokens/s alone" in done.stdout and "KiB" in done.stdout and done.stderr == ""


def test_each_adapter_solves_its_task_and_the_base_none():
    """On the task examples in demo.json, each adapter answers every one and the base none."""
    demo = load_demo()
    with Engine(ASSETS / demo["model"]["file"], tokenizer=ByteTokenizer(stop_token_ids=[10])) as engine:
        base = engine.create_session()
        for task in demo["tasks"]:
            with engine.create_session(SessionConfig(lora_path=ASSETS / task["adapter"])) as session:
                right = base_right = 0
                for example in task["examples"]:
                    for who in (session, base):
                        who.reset()
                        text = who.generate(example["input"], max_new_tokens=demo["max_new_tokens"]).text
                        correct = text + "\n" == example["output"]
                        right += correct and who is session
                        base_right += correct and who is base
                assert right == len(task["examples"]), task["name"]
                assert base_right == 0, task["name"]
    accuracy = demo["accuracy"]["runtime"]
    assert all(value == 0.0 for value in accuracy["base"].values())
    for task in demo["tasks"]:
        assert accuracy["+" + task["name"]][task["name"]] >= 0.95


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
