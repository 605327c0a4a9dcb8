"""``generate``: run a prompt (token ids) through the model with adapters, with timings."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from runtime.components.sampler import SamplerConfig
from runtime.engine.config import EngineSettings, SessionConfig
from runtime.engine.engine import Engine
from runtime.errors import InvalidArgumentError
from runtime.framework.lora_source import LoraSource


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Registers the ``generate`` sub-command."""
    parser = commands.add_parser(
        "generate",
        help="generate tokens from prompt token ids",
        description="Generates from a prompt of token ids, streaming token ids as they come, "
        "and prints prefill and decode timings.",
    )
    parser.add_argument("--model", type=Path, required=True, help="the .tflite model")
    parser.add_argument(
        "--lora", action="append", default=[], metavar="PATH[:SCALE]",
        help="an adapter file, optionally with a scale; repeat to blend several",
    )
    parser.add_argument("--prompt-ids", required=True, help="comma-separated token ids, e.g. 5,17,42")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--threads", type=int, default=1)
    parser.set_defaults(run=run)


def parse_lora_argument(text: str) -> LoraSource:
    """``PATH`` or ``PATH:SCALE`` -> LoraSource."""
    path, sep, scale = text.rpartition(":")
    if sep and path:
        try:
            return LoraSource(path=path, scale=float(scale))
        except ValueError:
            pass  # a colon that is part of the path
    return LoraSource(path=text)


def parse_token_ids(text: str) -> list[int]:
    """``"5,17,42"`` -> ``[5, 17, 42]``."""
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise InvalidArgumentError(f"--prompt-ids {text!r}: expected comma-separated integers") from None


def run(args: argparse.Namespace) -> int:
    """Loads the model, generates and prints the tokens and timings."""
    prompt = parse_token_ids(args.prompt_ids)
    sampler = SamplerConfig(args.temperature, args.top_k, args.top_p, args.seed)
    loras = [parse_lora_argument(text) for text in args.lora]
    started = time.perf_counter()
    with Engine(args.model, EngineSettings(num_threads=args.threads)) as engine:
        loaded = time.perf_counter()
        session = engine.create_session(SessionConfig(loras=loras, sampler=sampler))
        ready = time.perf_counter()
        result = session.generate(prompt, max_new_tokens=args.max_new_tokens)
        print("tokens:", " ".join(map(str, result.tokens)), flush=True)
        steps = max(len(result.tokens) - 1, 1)
        print(
            f"model load {1e3 * (loaded - started):.1f} ms | adapters "
            f"{[source.label for source in loras] or 'none'} registered in {1e3 * (ready - loaded):.2f} ms | "
            f"prefill {len(prompt)} tokens {1e3 * result.prefill_seconds:.2f} ms | "
            f"first token {1e3 * result.time_to_first_token_seconds:.2f} ms | "
            f"decode {1e3 * result.decode_seconds / steps:.3f} ms/token "
            f"({result.decode_tokens_per_second:,.0f} tokens/s) | stop: {result.stop_reason}"
        )
    return 0
