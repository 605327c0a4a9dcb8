"""Entry point: parses the command line and turns every StatusError into exit code 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from runtime.cli import (
    bench_command, convert_command, export_command, generate_command, inspect_command, serve_command, train_turbo_command)
from runtime.errors import StatusError

USAGE_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m runtime`` parser with one sub-command per job."""
    parser = argparse.ArgumentParser(
        prog="python -m runtime",
        description="On-device LLM runtime: one TFLite base model, many LoRA adapters.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    inspect_command.add_parser(commands)
    generate_command.add_parser(commands)
    convert_command.add_parser(commands)
    bench_command.add_parser(commands)
    export_command.add_parser(commands)
    serve_command.add_parser(commands)
    train_turbo_command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except StatusError as exc:
        message = " ".join(str(exc).split())
        print(f"error: {message}", file=sys.stderr)
        return USAGE_ERROR

