"""What a short session costs in a model with a long KV cache: memory, first token, clone.

    python3 -m benchmarks.experiments.short_sessions MODEL.tflite [--sessions 8] [--prompt 37]

One engine, 1 thread; each of ``--sessions`` sessions (after one that warms the engine up)
generates 4 tokens after a ``--prompt``-token prompt and is kept open. Prints the process's
RSS growth per session (the KV cache pages a session takes), each session's prompt-to-first-
token time (the first decode moves the prompt's positions out of the prefill's window into
the whole cache), and the time ``Session.clone`` of such a session takes. The numbers of
docs/export.md and docs/getting-started.md (a short session's memory, a clone) come from it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from runtime import Engine, EngineSettings


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=37, help="prompt length in tokens")
    args = parser.parse_args()
    prompt = [100 + (i * 37) % 4000 for i in range(args.prompt)]
    with Engine(args.model, EngineSettings(num_threads=1)) as engine:
        print(f"{args.model.name}: KV cache {engine.spec.kv_length} positions, "
              f"{engine.spec.kv_cache_bytes / 2**20:.0f} MiB a session at most")
        warm = engine.create_session()
        warm.generate(prompt, max_new_tokens=4)
        before, kept, first_token_ms = _rss_mb(), [], []
        for _ in range(args.sessions):
            session, tokens_at = engine.create_session(), []
            started = time.perf_counter()
            session.generate(prompt, max_new_tokens=4, on_token=lambda _token: tokens_at.append(time.perf_counter()))
            first_token_ms.append((tokens_at[0] - started) * 1e3)
            kept.append(session)
        grown = _rss_mb() - before
        clone_ms = []
        for _ in range(6):
            started = time.perf_counter()
            kept[0].clone().close()
            clone_ms.append((time.perf_counter() - started) * 1e3)
        print(f"{args.sessions} sessions of a {args.prompt}-token prompt and 4 tokens: RSS +{grown:.0f} MB "
              f"({grown / args.sessions:.1f} MB a session)")
        print(f"prompt to first token, ms: {' '.join(f'{ms:.0f}' for ms in first_token_ms)} "
              f"(median {statistics.median(first_token_ms):.0f})")
        print(f"clone of such a session, ms: {' '.join(f'{ms:.1f}' for ms in clone_ms)} "
              f"(median {statistics.median(clone_ms):.1f})")
        for session in (warm, *kept):
            session.close()


if __name__ == "__main__":
    main()
