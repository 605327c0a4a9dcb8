"""The demo runs end to end on the bundled model, and each adapter does its own job."""

from __future__ import annotations

import subprocess
import sys

from runtime import ByteTokenizer, Engine, SessionConfig
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
