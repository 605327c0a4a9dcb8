"""examples/turbo_entities.py: the data it generates (deterministic, readable by
``train-turbo``, test people unseen in training) and its evaluation through the runtime, on
the tiny Turbo fixture (its word-level tokenizer knows none of the words: the numbers are
meaningless, the plumbing is what is checked)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import checkpoints
from conftest import MODELS
from runtime.export.turbo_data import read_examples

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import turbo_entities  # noqa: E402


def test_the_data_is_deterministic_and_what_train_turbo_reads(tmp_path: Path) -> None:
    train, test = turbo_entities.write_data(tmp_path / "a", 60, 12, seed=3)
    again, _ = turbo_entities.write_data(tmp_path / "b", 60, 12, seed=3)
    assert train.read_text() == again.read_text()
    examples = read_examples(tmp_path / "a")
    assert len(examples) == 72 and all(example.instruction.startswith("Extract") for example in examples)
    rows = {name: [json.loads(line) for line in path.read_text().splitlines()] for name, path in
            (("train", train), ("test", test))}
    people = {name: {json.loads(row["output"])["person"] for row in split} - {None} for name, split in rows.items()}
    assert people["test"] and not people["test"] & people["train"]
    for row in rows["train"]:
        answer = json.loads(row["output"])
        assert list(answer) == ["person", "organization", "city", "date"]
        assert all(value is None or value in row["input"] for value in answer.values())


def test_evaluate_runs_the_three_ways(tmp_path: Path) -> None:
    _, test = turbo_entities.write_data(tmp_path, 4, 3, seed=0)
    checkpoints.write_tokenizer(tmp_path, 256)
    totals = turbo_entities.evaluate(MODELS / "turbo" / "default.tflite", MODELS / "turbo" / "trained_heads", test,
                                     max_new_tokens=8, tokenizer=tmp_path / "tokenizer.json",
                                     chat_template=checkpoints.CHAT_TEMPLATE)
    assert totals["items"] == 3 and totals["identical"] == 3  # the heads never change the output
    assert totals["verifies"] > 0 and len(totals["kept_per_verify_per_head"]) == 3
    assert totals["plain_tokens"] == totals["turbo_tokens"] > 0


def test_evaluate_refuses_data_it_cannot_score_naming_where(tmp_path: Path) -> None:
    """A line that is not a record (a JSONDecodeError or KeyError traceback before), or an
    output that is not a JSON object: unparsed, it compared None with an unparsable answer
    and counted that an exact match."""
    import pytest

    from runtime.errors import InvalidArgumentError

    data = tmp_path / "test.jsonl"
    for text, match in (("not json\n", r"test.jsonl: line 1: not valid JSON"),
                        ('{"instruction": "x"}\n', r"test.jsonl: line 1: field 'output' is missing"),
                        ('{"instruction": "x", "input": "y", "output": "plain text"}\n',
                         r"test.jsonl, item 1: the output is not a JSON object: 'plain text'")):
        data.write_text(text)
        with pytest.raises(InvalidArgumentError, match=match):
            turbo_entities.evaluate(MODELS / "turbo" / "default.tflite", MODELS / "turbo" / "trained_heads", data,
                                    chat_template=checkpoints.CHAT_TEMPLATE)
