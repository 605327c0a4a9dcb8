"""The examples a Turbo adapter is trained on: ``{"instruction", "output"}`` records read from
a JSON file (a list of records), a JSONL file (one record a line) or a directory of them.

An optional ``"input"`` field (Alpaca's layout) is appended to the instruction after a blank
line. Every refusal names the file, the line (JSONL) or item (JSON) and the field, so a user
can fix a data set of thousands of lines without a debugger. Reads only the standard
library: a bad file is refused before torch is imported.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.errors import InvalidArgumentError, NotFoundError

SUFFIXES = (".json", ".jsonl")
CHAT_FIELDS = ("messages", "conversations")  # chat-format data sets (OpenAI's, ShareGPT's): refused by name


@dataclass(frozen=True)
class Example:
    """One training example: the user's message and the answer the adapter should give."""

    instruction: str
    output: str


def read_examples(path: str | os.PathLike[str]) -> list[Example]:
    """The examples of a ``.json`` / ``.jsonl`` file, or of every such file directly in a
    directory (in name order); refuses a missing path, an empty data set and any malformed
    record, naming where it is."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in SUFFIXES)
        if not files:
            raise NotFoundError(f"{path}: no {' or '.join(SUFFIXES)} files in the directory")
    elif path.is_file():
        files = [path]
    elif path.exists():  # a FIFO, a socket, a device: nothing a data set is read from twice
        raise InvalidArgumentError(f"{path}: not a regular file or directory (expected a .json or .jsonl file of "
                                   "{\"instruction\", \"output\"} records, or a directory of them)")
    else:
        raise NotFoundError(f"{path}: no such file or directory (expected a .json or .jsonl file of "
                            "{\"instruction\", \"output\"} records, or a directory of them)")
    examples = [example for file in files for example in _read_file(file)]
    if not examples:
        raise InvalidArgumentError(f"{path}: no examples")
    return examples


def digest(examples: Sequence[Example]) -> str:
    """The SHA-256 of the examples as read (not of the files: a directory's order and a
    file's layout do not count), what a resumed run checks its data against."""
    text = json.dumps([[example.instruction, example.output] for example in examples], ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _read_file(file: Path) -> list[Example]:
    """The examples of one file. UTF-8, a byte-order mark allowed; a JSONL file's lines end
    at ``\\n`` only (U+2028 and the other breaks ``str.splitlines`` knows may stand raw in
    a JSON string)."""
    try:
        text = file.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InvalidArgumentError(f"{file}: not UTF-8 text: {exc}") from None
    except OSError as exc:
        raise InvalidArgumentError(f"{file}: cannot be read: {exc.strerror}") from None
    if file.suffix == ".jsonl":
        records = []
        for number, line in enumerate(text.split("\n"), 1):
            if line.strip():
                records.append((f"{file}: line {number}", _parse(line, f"{file}: line {number}")))
    else:
        if not text.strip():
            raise InvalidArgumentError(f"{file}: empty (expected a JSON list of {{\"instruction\", \"output\"}} "
                                       "records)")
        document = _parse(text, str(file), whole_file=True)
        if not isinstance(document, list):
            raise InvalidArgumentError(f"{file}: expected a JSON list of {{\"instruction\", \"output\"}} records "
                                       f"(or a .jsonl file, one record a line), got a {type(document).__name__}")
        records = [(f"{file}: item {index}", record) for index, record in enumerate(document)]
    return [_example(record, where) for where, record in records]


def _parse(text: str, where: str, whole_file: bool = False) -> Any:
    """``text`` as JSON; refused naming ``where`` when it is not (for a ``whole_file`` that
    holds more than one value, saying that a record a line is a ``.jsonl`` file's layout), or
    nests deeper than the parser recurses."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        hint = " (a record a line is JSONL: name the file .jsonl)" if whole_file and exc.msg == "Extra data" else ""
        raise InvalidArgumentError(f"{where}: not valid JSON: {exc}{hint}") from None
    except RecursionError:
        raise InvalidArgumentError(f"{where}: JSON nested too deeply to read (expected {{\"instruction\", "
                                   "\"output\"} records)") from None


def _example(record: Any, where: str) -> Example:
    if not isinstance(record, dict):
        raise InvalidArgumentError(f"{where}: expected an object with \"instruction\" and \"output\", got a "
                                   f"{type(record).__name__}")
    chat = next((name for name in CHAT_FIELDS if name in record), None)
    if chat is not None and "instruction" not in record:
        raise InvalidArgumentError(f"{where}: field {chat!r} holds a chat, which is not read: expected \"instruction\" "
                                   "and \"output\" fields (the user's message and the answer)")
    fields = {}
    for name in ("instruction", "output"):
        if name not in record:
            raise InvalidArgumentError(f"{where}: field {name!r} is missing")
        value = record[name]
        if not isinstance(value, str) or not value.strip():
            raise InvalidArgumentError(f"{where}: field {name!r} must be a non-empty string, got {value!r:.60}")
        fields[name] = _text(value, name, where)
    extra = record.get("input", "")
    if not isinstance(extra, str):
        raise InvalidArgumentError(f"{where}: field 'input' must be a string, got {extra!r:.60}")
    extra = _text(extra, "input", where)
    instruction = f"{fields['instruction']}\n\n{extra}" if extra.strip() else fields["instruction"]
    return Example(instruction=instruction, output=fields["output"])


def _text(value: str, name: str, where: str) -> str:
    """``value``, refused when it holds a lone surrogate (a ``\\ud800`` escape JSON allows but no
    tokenizer encodes)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(f"{where}: field {name!r} holds {value[exc.start]!r} at character {exc.start}, "
                                   "a lone UTF-16 surrogate: expected text that is valid Unicode") from None
    return value
