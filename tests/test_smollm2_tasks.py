"""The generated SmolLM2 adapter tasks (tools/smollm2_tasks.py): answers right by
construction, held-out sets disjoint from training and reproducible, cache paths."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "tools" / "smollm2_tasks.py"
_SPEC = importlib.util.spec_from_file_location("smollm2_tasks", _PATH)
tasks = importlib.util.module_from_spec(_SPEC)
sys.modules["smollm2_tasks"] = tasks
_SPEC.loader.exec_module(tasks)


def _input(task_name: str, instruction: str) -> str:
    """The generated input text inside an instruction."""
    prefix, suffix = tasks.TASKS[task_name].template.split("{text}")
    assert instruction.startswith(prefix) and instruction.endswith(suffix)
    return instruction[len(prefix) : len(instruction) - len(suffix)]


def test_order_answers_name_the_singular_item_its_quantity_and_size():
    numbers = {word: i + 1 for i, word in enumerate(tasks.NUMBER_WORDS)}
    for example in tasks.held_out(tasks.TASKS["order_json"], 300):
        text = _input("order_json", example.instruction)
        record = json.loads(example.answer)
        assert list(record) == ["item", "qty", "size"]
        assert example.answer == json.dumps(record)  # one line, json.dumps spacing
        plural = dict(tasks.ITEMS)[record["item"]]
        assert re.search(rf"\b{record['item'] if record['qty'] == 1 else plural}\b", text)
        quantity = re.search(rf"\b(\d|{'|'.join(tasks.NUMBER_WORDS)})\b", text.lower())  # the first number
        assert quantity is not None
        said = quantity.group(1)
        assert (int(said) if said.isdigit() else numbers[said]) == record["qty"]
        assert record["size"] in tasks.SIZES and record["size"] in text


def test_reversal_answers_are_the_input_words_last_first():
    for example in tasks.held_out(tasks.TASKS["reverse_words"], 300):
        words = _input("reverse_words", example.instruction).split()
        assert 3 <= len(words) <= 5 and len(set(words)) == len(words)
        assert example.answer.split() == words[::-1]


def test_intent_answers_are_labels_the_instruction_lists():
    seen = set()
    for example in tasks.held_out(tasks.TASKS["intent"], 300):
        assert example.answer in tasks.INTENTS
        assert example.answer in example.instruction.split("\n")[0]
        seen.add(example.answer)
    assert seen == set(tasks.INTENTS)


@pytest.mark.parametrize("name", sorted(tasks.TASKS))
def test_test_sets_are_reproducible_distinct_and_disjoint_from_training(name):
    task = tasks.TASKS[name]
    train, test = tasks.split(task, 300, 100)
    assert len(train) == 300 and len(test) == 100
    instructions = [e.instruction for e in train + test]
    assert len(set(instructions)) == len(instructions)  # distinct, and no test item in training
    assert tasks.held_out(task, 100) == test  # independent of the training size
    assert tasks.split(task, 50, 100) == (train[:50], test)
    assert tasks.held_out(task, 100) != tasks.examples(task, 100, tasks.TRAIN_SEED)


def test_asking_for_more_distinct_examples_than_a_task_has_fails():
    with pytest.raises(ValueError, match="distinct examples"):
        tasks.examples(tasks.TASKS["intent"], 5000, 0)


def test_exact_match_ignores_surrounding_whitespace_only():
    assert tasks.is_correct(' {"a": 1}\n', '{"a": 1}')
    assert not tasks.is_correct('{"a":1}', '{"a": 1}')
    assert not tasks.is_correct("Set_alarm", "set_alarm")


def test_cache_paths_follow_runtime_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path))
    assert tasks.hf_model_dir() == tmp_path / "models" / tasks.HF_MODEL_NAME
    assert tasks.adapter_dir("intent") == tmp_path / "adapters" / "smollm2" / "intent"
    monkeypatch.delenv("RUNTIME_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert tasks.cache_root() == Path.home() / ".cache" / "runtime"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tasks.hf_model_dir() == tmp_path / "xdg" / "runtime" / "models" / tasks.HF_MODEL_NAME
