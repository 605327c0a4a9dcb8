#!/usr/bin/env python3
"""Text -> JSON entity extraction with a Turbo adapter: the worked example of
docs/turbo-training.md.

Two steps around ``python -m runtime train-turbo``::

    python3 examples/turbo_entities.py data --out DIR [--train 400] [--test 40] [--seed 0]
    python3 examples/turbo_entities.py evaluate --model MODEL.litertlm --adapter TURBO_DIR --data DIR/test.jsonl

``data`` writes ``DIR/train.jsonl`` and ``DIR/test.jsonl``: sentences about a person, an
organization, a city and a date (any of them may be missing), each with the JSON the adapter
should answer, ``{"person": ..., "organization": ..., "city": ..., "date": ...}`` (``null``
where the sentence names none), drawn from fixed lists with a seed. The test sentences use
names the training ones never do (no test item is a training item with other spellings).
Nothing is downloaded.

``evaluate`` runs every test item through the runtime, greedy, one thread, three ways: the
base model, the LoRA without its heads (``LoraSource(heads=False)``) and the Turbo adapter
(the LoRA with its heads), the last two alternating which goes first. It prints exact-match
accuracy (the answer parsed as JSON equals the expected object) of the base model and of
the LoRA, whether the Turbo outputs equal the plain LoRA's token for token, decode tokens/s
of both and their ratio, and how often each head's draft was kept per verify.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from runtime.errors import InvalidArgumentError, StatusError  # noqa: E402 (the repository root is on the path from here)

INSTRUCTION = ("Extract the person, organization, city and date named in the text. Answer with JSON only: "
               '{"person": ..., "organization": ..., "city": ..., "date": ...}, null for what the text does not name.')
FIRST = ["Maria", "James", "Aiko", "Omar", "Lena", "Carlos", "Priya", "Tomas", "Grace", "Kwame", "Sofia", "Ivan",
         "Mei", "David", "Amara", "Lukas", "Nadia", "Peter", "Yara", "Felix"]
LAST = ["Lopez", "Okafor", "Tanaka", "Schmidt", "Haddad", "Novak", "Silva", "Chen", "Larsen", "Mensah", "Rossi",
        "Kowalski", "Dubois", "Patel", "Moreau", "Berg", "Ivanova", "Kim", "Walsh", "Costa"]
ORGANIZATIONS = ["Northwind Labs", "Bluefin Capital", "Helios Energy", "Quarry Books", "Atlas Robotics",
                 "Greenleaf Foods", "Orbit Telecom", "Silverline Rail", "Cobalt Health", "Juniper Studios",
                 "Redwood Insurance", "Vantage Motors", "Lumen Optics", "Harbor Freight Lines", "Maple Analytics",
                 "Crescent Bank"]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Krakow", "Lima", "Oslo", "Accra", "Porto", "Denver", "Seoul",
          "Lyon", "Perth", "Quito", "Tallinn", "Austin"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
# {p}: person, {o}: organization, {c}: city, {d}: date; a template without a field leaves it null.
TEMPLATES = [
    "{p} joined {o} in {c} on {d}.",
    "On {d}, {o} opened a new office in {c}, led by {p}.",
    "{p} will speak for {o} at the {c} conference on {d}.",
    "{o} announced on {d} that {p} is its new chief engineer.",
    "{p} moved to {c} to work at {o}.",
    "The {c} branch of {o} closes on {d}.",
    "{p} met the board of {o} on {d}.",
    "{p} flew to {c} on {d}.",
    "{o} hired three engineers in {c} last week.",
    "A letter from {p} arrived on {d}.",
    "{p} has lived in {c} since childhood.",
    "{o} reported record sales on {d}.",
]
FIELDS = {"person": "{p}", "organization": "{o}", "city": "{c}", "date": "{d}"}


def example(rng: random.Random, people: list[str]) -> dict[str, str]:
    """One ``{"instruction", "input", "output"}`` record: a sentence and its entities' JSON."""
    template = rng.choice(TEMPLATES)
    values = {"{p}": rng.choice(people), "{o}": rng.choice(ORGANIZATIONS), "{c}": rng.choice(CITIES),
              "{d}": f"{rng.choice(MONTHS)} {rng.randint(1, 28)}, {rng.randint(2019, 2026)}"}
    text = template
    for field, value in values.items():
        text = text.replace(field, value)
    answer = {name: values[field] if field in template else None for name, field in FIELDS.items()}
    return {"instruction": INSTRUCTION, "input": text, "output": json.dumps(answer)}


def write_data(out: Path, train: int, test: int, seed: int) -> tuple[Path, Path]:
    """``out/train.jsonl`` and ``out/test.jsonl``; the test people are names (first + last)
    no training item uses."""
    rng = random.Random(seed)
    people = [f"{first} {last}" for first in FIRST for last in LAST]
    rng.shuffle(people)
    held = people[: len(people) // 5]
    splits = {"train": (train, people[len(held):]), "test": (test, held)}
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, (count, names) in splits.items():
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(example(rng, names)) + "\n" for _ in range(count)))
        paths.append(path)
    return paths[0], paths[1]


def evaluate(model: Path, adapter: Path, data: Path, *, items: int | None = None, max_new_tokens: int = 64,
             tokenizer: Path | None = None, chat_template: str | None = None) -> dict[str, Any]:
    """The three ways of every test item through the runtime (see the module notes); the
    items as ``train-turbo`` reads them, each output a JSON object (else
    ``InvalidArgumentError`` naming the item, before the model is opened)."""
    from runtime import Engine, EngineSettings, LoraSource, SessionConfig
    from runtime.export.turbo_data import read_examples

    examples = read_examples(data)[:items]
    answers = [_parsed(example.output) for example in examples]
    for number, (example, answer) in enumerate(zip(examples, answers), 1):
        if not isinstance(answer, dict):
            raise InvalidArgumentError(f"{data}, item {number}: the output is not a JSON object: "
                                       f"{example.output!r:.60}")
    totals: dict[str, Any] = {"items": len(examples), "base_exact": 0, "lora_exact": 0, "identical": 0,
                              "plain_tokens": 0, "plain_seconds": 0.0, "turbo_tokens": 0, "turbo_seconds": 0.0,
                              "verifies": 0, "accepted": None}
    with Engine(model, EngineSettings(num_threads=1), tokenizer=tokenizer, chat_template=chat_template) as engine:
        if engine.chat_template is None:
            raise SystemExit(f"{model}: no chat template (give a .litertlm bundle, or --chat-template)")
        plain, turbo = LoraSource(path=adapter, heads=False), LoraSource(path=adapter)

        def run(sources: list, prompt: str) -> tuple[Any, Any]:
            with engine.create_session(SessionConfig(loras=sources)) as session:
                return session.generate(prompt, max_new_tokens=max_new_tokens), session.stats().speculation

        for index, (example, expected) in enumerate(zip(examples, answers)):
            prompt = engine.chat_template.render([{"role": "user", "content": example.instruction}])
            base, _ = run([], prompt)
            order = [("plain", plain), ("turbo", turbo)]
            results = dict((name, run([source], prompt)) for name, source in (order if index % 2 else order[::-1]))
            (lora, _), (fast, stats) = results["plain"], results["turbo"]
            totals["base_exact"] += _parsed(base.text) == expected
            totals["lora_exact"] += _parsed(lora.text) == expected
            totals["identical"] += lora.tokens == fast.tokens
            for name, result in (("plain", lora), ("turbo", fast)):
                totals[f"{name}_tokens"] += len(result.tokens) - 1
                totals[f"{name}_seconds"] += result.decode_seconds
            totals["verifies"] += stats.verifies
            accepted = list(stats.accepted)
            totals["accepted"] = accepted if totals["accepted"] is None else [
                a + b for a, b in zip(totals["accepted"], accepted)]
    plain_rate = totals["plain_tokens"] / totals["plain_seconds"] if totals["plain_seconds"] else 0.0
    turbo_rate = totals["turbo_tokens"] / totals["turbo_seconds"] if totals["turbo_seconds"] else 0.0
    totals.update(plain_seconds=round(totals["plain_seconds"], 3), turbo_seconds=round(totals["turbo_seconds"], 3),
                  plain_tokens_per_second=round(plain_rate, 1), turbo_tokens_per_second=round(turbo_rate, 1),
                  speedup=round(turbo_rate / plain_rate, 2) if plain_rate else None,
                  kept_per_verify_per_head=[round(a / totals["verifies"], 3) for a in totals["accepted"] or []]
                  if totals["verifies"] else [])
    return totals


def _parsed(text: str | None) -> Any:
    try:
        return json.loads(text or "")
    except ValueError:
        return None


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    steps = parser.add_subparsers(dest="step", required=True)
    data = steps.add_parser("data", help="write train.jsonl and test.jsonl")
    data.add_argument("--out", type=Path, required=True)
    data.add_argument("--train", type=int, default=400)
    data.add_argument("--test", type=int, default=40)
    data.add_argument("--seed", type=int, default=0)
    check = steps.add_parser("evaluate", help="accuracy and speed through the runtime")
    check.add_argument("--model", type=Path, required=True, help="a .litertlm bundle (or a .tflite with --tokenizer)")
    check.add_argument("--adapter", type=Path, required=True, help="the train-turbo output directory")
    check.add_argument("--data", type=Path, required=True, help="test.jsonl")
    check.add_argument("--items", type=int, help="the first N items only")
    check.add_argument("--max-new-tokens", type=int, default=64)
    check.add_argument("--tokenizer", type=Path, help="tokenizer.json, for a .tflite")
    check.add_argument("--chat-template", type=Path, help="a Jinja2 chat template file, for a .tflite")
    args = parser.parse_args(argv)
    for name, least in (("train", 0), ("test", 0), ("items", 1), ("max_new_tokens", 1)):
        value = getattr(args, name, None)
        if value is not None and value < least:
            parser.error(f"--{name.replace('_', '-')} {value}: expected {least} or more")
    if args.step == "data":
        for path in write_data(args.out, args.train, args.test, args.seed):
            print(f"wrote {path}")
        return 0
    template = args.chat_template.read_text() if args.chat_template else None
    print(json.dumps(evaluate(args.model, args.adapter, args.data, items=args.items,
                              max_new_tokens=args.max_new_tokens, tokenizer=args.tokenizer,
                              chat_template=template), indent=2))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (StatusError, OSError) as exc:  # a user's mistake (a missing model, adapter or file): one line
        sys.exit(f"error: {exc}")
