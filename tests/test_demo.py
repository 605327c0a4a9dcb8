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


def test_each_task_examples_through_the_api():
    demo = load_demo()
    with Engine(ASSETS / demo["model"]["file"], tokenizer=ByteTokenizer(stop_token_ids=[10])) as engine:
        for task in demo["tasks"]:
            with engine.create_session(SessionConfig(lora_path=ASSETS / task["adapter"])) as session:
                for example in task["examples"]:
                    session.reset()
                    result = session.generate(example["input"], max_new_tokens=demo["max_new_tokens"])
                    assert result.text + "\n" == example["output"], (task["name"], example)
    assert demo["accuracy"]["runtime"]["base"] == {"uppercase": 0.0, "no_vowels": 0.0, "json": 0.0}
