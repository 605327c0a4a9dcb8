"""``generate``: run a prompt through the model with adapters, streaming tokens, with timings."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from runtime.cli.options import add_compile_mode, add_weight_cache_dir, weight_cache_settings
from runtime.components.sampler import SamplerConfig
from runtime.components.tokenizer import ByteTokenizer, TextStream, Tokenizer
from runtime.engine.config import EngineSettings, SessionConfig
from runtime.engine.engine import Engine
from runtime.errors import InvalidArgumentError
from runtime.framework.lora_source import LoraSource

# The bundled demo's line format (runtime/demo_assets/demo.json): the prompt is one line of
# UTF-8 bytes ended by a newline, and the answer ends at the next newline.
DEMO_NEWLINE = 10
DEMO_MAX_NEW_TOKENS = 96


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Registers the ``generate`` sub-command."""
    parser = commands.add_parser(
        "generate",
        help="generate from a prompt (text or token ids), streaming",
        description="Generates from a prompt, streaming tokens as they are produced, then prints "
        "prefill and decode timings. Text prompts need a tokenizer: the model's bundle, "
        "--tokenizer, or --byte-tokens for byte-level models.",
    )
    parser.add_argument("--model", type=Path, required=True, help="a .tflite model or .litertlm bundle")
    parser.add_argument(
        "--lora", action="append", default=[], metavar="PATH[:SCALE]",
        help="an adapter (.tflite, GGUF or PEFT directory), optionally with a scale; repeat to blend",
    )
    parser.add_argument("--lora-buffer", action="store_true",
                        help="also read one .tflite adapter's bytes from standard input (an in-memory adapter)")
    parser.add_argument("--lora-buffer-scale", type=float, default=1.0)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 5,17,42")
    prompt.add_argument("--prompt", help="prompt text (needs a tokenizer); a user message through the model's chat "
                        "template when it has one (a bundle's)")
    parser.add_argument("--no-chat-template", action="store_true",
                        help="send --prompt as it is, even when the model has a chat template")
    tokens = parser.add_mutually_exclusive_group()
    tokens.add_argument("--tokenizer", type=Path, help="a tokenizer.json or SentencePiece model")
    tokens.add_argument("--byte-tokens", action="store_true", help="UTF-8 bytes are the tokens")
    tokens.add_argument("--demo-format", action="store_true",
                        help="the bundled demo's format: UTF-8 bytes are the tokens, a newline is added "
                        "after the prompt and the answer stops at the next newline")
    parser.add_argument("--stop-token", type=int, action="append", default=None,
                        help="a token id that ends the generation; repeatable")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help=f"default 16 ({DEMO_MAX_NEW_TOKENS} with --demo-format)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--threads", type=int, default=1)
    add_weight_cache_dir(parser)
    add_compile_mode(parser)
    parser.add_argument("--profile-ops", action="store_true",
                        help="record the generation's runs with LiteRT's op profiler and print where their time "
                        "went, op by op (the recorded runs are slower)")
    parser.add_argument("--no-draft-heads", action="store_true",
                        help="load Turbo LoRA adapters without their draft heads (plain decoding; also what a model "
                        "exported without --verify-lengths needs)")
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
    """Loads the model, generates (printing tokens as they come) and prints the timings."""
    sampler = SamplerConfig(args.temperature, args.top_k, args.top_p, args.seed)
    loras = [parse_lora_argument(text) for text in args.lora]
    if args.no_draft_heads:
        loras = [dataclasses.replace(source, heads=False) for source in loras]
    if args.lora_buffer:
        blob = sys.stdin.buffer.read()
        if not blob:
            raise InvalidArgumentError("--lora-buffer: nothing was read from standard input")
        loras.append(LoraSource(buffer=blob, scale=args.lora_buffer_scale))
    tokenizer: Tokenizer | Path | None = args.tokenizer
    stop_tokens = args.stop_token
    default_max_new_tokens = 16
    if args.byte_tokens:
        tokenizer = ByteTokenizer(stop_token_ids=args.stop_token or ())
    if args.demo_format:
        stop_tokens = [*(args.stop_token or ()), DEMO_NEWLINE]
        tokenizer = ByteTokenizer(stop_token_ids=stop_tokens)
        default_max_new_tokens = DEMO_MAX_NEW_TOKENS
    max_new_tokens = default_max_new_tokens if args.max_new_tokens is None else args.max_new_tokens
    started = time.perf_counter()
    settings = EngineSettings(num_threads=args.threads, **weight_cache_settings(args),
                              profile_ops=args.profile_ops, compile=args.compile)
    with Engine(args.model, settings, tokenizer=tokenizer) as engine:
        loaded = time.perf_counter()
        if args.prompt is not None and engine.tokenizer is None:
            raise InvalidArgumentError("--prompt needs a tokenizer: give --tokenizer or --byte-tokens")
        session = engine.create_session(SessionConfig(loras=loras, sampler=sampler))
        ready = time.perf_counter()
        prompt = args.prompt if args.prompt is not None else parse_token_ids(args.prompt_ids)
        if args.demo_format:
            prompt = prompt + "\n" if isinstance(prompt, str) else [*prompt, DEMO_NEWLINE]
        elif args.prompt is not None and engine.chat_template is not None and not args.no_chat_template:
            prompt = engine.chat_template.render([{"role": "user", "content": args.prompt}])
        stream = TextStream(engine.tokenizer.decode) if args.prompt is not None else None

        def show(token: int) -> None:
            sys.stdout.write(stream.add(token) if stream is not None else f"{token} ")
            sys.stdout.flush()

        with engine.profile_ops() if args.profile_ops else nullcontext() as recording:
            result = session.generate(prompt, max_new_tokens=max_new_tokens, stop_tokens=stop_tokens,
                                      on_token=show)
        if stream is not None:
            sys.stdout.write(stream.finish())
        steps = max(len(result.tokens) - 1, 1)
        print()
        print(
            f"model load {1e3 * (loaded - started):.1f} ms | adapters "
            f"{[source.label for source in loras] or 'none'} registered in {1e3 * (ready - loaded):.2f} ms | "
            f"prefill {result.prompt_tokens} tokens {1e3 * result.prefill_seconds:.2f} ms | "
            f"first token {1e3 * result.time_to_first_token_seconds:.2f} ms | "
            f"decode {1e3 * result.decode_seconds / steps:.3f} ms/token "
            f"({result.decode_tokens_per_second:,.0f} tokens/s) | stop: {result.stop_reason}"
        )
        if recording is not None:
            print(f"\nops of the generation (prefill and decode, recorded): {recording.profile.table()}")
        speculation = session.stats().speculation
        if speculation.verifies:
            print(f"draft heads: {speculation.drafted} drafted, accepted per head {list(speculation.accepted)}, "
                  f"{speculation.tokens_per_verify:.2f} tokens per verify forward")
    return 0
