#!/usr/bin/env python3
"""Time to first token of chat prompts with the prefix cache and without it, side by side.

    python3 -m benchmarks.experiments.prefix_cache MODEL --tokenizer tokenizer.json --chat-template chat_template.jinja \
        [--rounds 5] [--out prefix_cache_smollm2]

Two engines on the same model, one with ``EngineSettings(prefix_cache_bytes=64 MiB)`` (what
``runtime serve`` has by default) and one without; one-message conversations rendered with
the chat template, so that every prompt begins with the template's head (its default
system prompt) and then differs: each round asks about every topic of ``TOPICS`` with
another opener of ``OPENERS`` (no question is asked twice), on a fresh session of each
engine, who goes first alternating; the first round is not timed. Time to first token is
the prefill of the prompt and the sampling of the first token (``Session.generate`` with one
new token), 1 thread. The answers must be the same token for token. Writes ``benchmarks/results/{out}.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import date
from pathlib import Path

from benchmarks.common import RESULTS
from runtime import Engine, EngineSettings
from runtime.components.chat_template import ChatTemplate

OPENERS = ("What is", "Tell me about", "Explain", "Describe", "Why do people like", "Summarize")
TOPICS = ("the moon", "a bicycle", "the ocean", "music", "bread", "rain")
CACHE_BYTES = 64 << 20


def first_token_seconds(engine: Engine, prompt: list[int]) -> tuple[float, list[int]]:
    """Seconds to prefill ``prompt`` on a fresh session and sample one token; the tokens of
    an 8-token greedy answer (after the clock stops)."""
    with engine.create_session() as session:
        start = time.perf_counter()
        session.generate(prompt, 1)
        elapsed = time.perf_counter() - start
    with engine.create_session() as session:
        return elapsed, session.generate(prompt, 8).tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--chat-template", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="prefix_cache")
    args = parser.parse_args()
    template = ChatTemplate(args.chat_template.read_text())
    load = os.getloadavg()
    with (Engine(args.model, EngineSettings(batch_wait_s=None), tokenizer=args.tokenizer) as plain,
          Engine(args.model, EngineSettings(batch_wait_s=None, prefix_cache_bytes=CACHE_BYTES),
                 tokenizer=args.tokenizer) as cached):
        def prompt(text: str) -> list[int]:
            return plain.tokenizer.encode(template.render([{"role": "user", "content": text}]))

        if args.rounds + 1 > len(OPENERS):
            raise SystemExit(f"--rounds {args.rounds}: at most {len(OPENERS) - 1} (each round asks new questions)")
        asked = [[prompt(f"{OPENERS[(r + i) % len(OPENERS)]} {topic}?") for i, topic in enumerate(TOPICS)]
                 for r in range(args.rounds + 1)]
        prompts = [p for round_prompts in asked for p in round_prompts]
        samples: dict[str, list[float]] = {"without": [], "with": []}
        same = True
        for r, round_prompts in enumerate(asked):
            for i, prompt in enumerate(round_prompts):
                order = (("without", plain), ("with", cached)) if (r + i) % 2 else (("with", cached),
                                                                                   ("without", plain))
                answers = {}
                for name, engine in order:
                    seconds, answers[name] = first_token_seconds(engine, prompt)
                    if r:
                        samples[name].append(seconds)
                same = same and answers["with"] == answers["without"]
        stats = cached.stats().prefix_cache
        spec = plain.spec
    head = min(len(os.path.commonprefix(prompts)), *(len(p) - 1 for p in prompts))
    result = {
        "model": str(args.model), "date": date.today().isoformat(), "load_average": load, "threads": 1,
        "prefill_lengths": list(spec.prefill_lengths), "prompt_tokens": [len(p) for p in prompts],
        "shared_head_tokens": head, "rounds": args.rounds,
        "ttft_ms_without": 1e3 * statistics.median(samples["without"]),
        "ttft_ms_with": 1e3 * statistics.median(samples["with"]),
        "answers_identical": same,
        "cache": {"hits": stats.hits, "misses": stats.misses, "reused_tokens": stats.reused_tokens,
                  "entries": stats.entries, "bytes": stats.bytes},
    }
    result["speedup"] = result["ttft_ms_without"] / result["ttft_ms_with"]
    lines = [
        f"# Prefix cache: time to first token of chat prompts ({args.model.name})", "",
        f"`python3 -m benchmarks.experiments.prefix_cache {' '.join(sys.argv[1:])}`; {result['date']}, load average "
        f"{load[0]:.1f} at the start, 1 thread, prefill lengths {result['prefill_lengths']}, "
        f"{len(prompts)} distinct chat prompts of {min(result['prompt_tokens'])}-{max(result['prompt_tokens'])} "
        f"tokens sharing a {head}-token head, median over {args.rounds} rounds (after one untimed).", "",
        "| | TTFT ms | answers |", "|---|---:|---|",
        f"| without the prefix cache | {result['ttft_ms_without']:.1f} | |",
        f"| with it (64 MiB) | {result['ttft_ms_with']:.1f} | "
        f"{'identical' if same else 'DIFFERENT'} |", "",
        f"Speed-up {result['speedup']:.2f}x; the cache: {stats.hits} hits, {stats.misses} misses, "
        f"{stats.reused_tokens} positions reused ({stats.reused_tokens / max(stats.hits, 1):.1f} a hit), "
        f"{stats.entries} prompts kept in {stats.bytes / 2**20:.1f} MiB.",
    ]
    out = RESULTS / args.out
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
