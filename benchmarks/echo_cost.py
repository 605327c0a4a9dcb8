"""What scoring a prompt with ``echo`` costs beside its plain prefill: issue target <= 1.3x.

    python3 -m benchmarks.echo_cost MODEL.tflite [--tokens 512] [--rounds 9]

MODEL is an export with ``--score-lengths`` (e.g. SmolLM2-135M f32: ``python3 -m runtime
export SmolLM2-135M-Instruct.Q4_1.gguf --out M.tflite --kv-length 1024 --prefill-lengths 512
--score-lengths 512 --quantize none``). Each round times, on one fresh session each and in
alternating order: the plain prefill of the prompt (``run_prefill``: logits of the last
position only), and what ``/v1/completions`` with ``echo`` and ``logprobs: 1`` does for it
(``Session.score``: the logits at every position, then each token's logprob and the top one,
in float64, as :func:`runtime.serve.logprobs.token_logprobs` computes them). Prints the
medians, the ratio per round (min / median / max) and writes ``results/echo_cost.{md,json}``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, date_and_cpu, write_result
from runtime import Engine, EngineSettings
from runtime.serve.logprobs import token_logprobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", type=Path, default=RESULTS / "echo_cost")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with Engine(args.model, EngineSettings(num_threads=1, prefix_cache_bytes=0)) as engine:
        prompt = [int(t) for t in rng.integers(1, engine.spec.vocab_size, args.tokens)]

        def plain() -> float:
            with engine.create_session() as session:
                started = time.perf_counter()
                session.run_prefill(prompt)
                return time.perf_counter() - started

        def echo() -> float:
            with engine.create_session() as session:
                started = time.perf_counter()
                logits = session.score(prompt)
                token_logprobs(logits[:-1], prompt[1:], 1)
                return time.perf_counter() - started

        plain(), echo()  # warm-up: each signature's first run allocates its tensors
        rows = []
        for round_ in range(args.rounds):
            first, second = (plain, echo) if round_ % 2 == 0 else (echo, plain)
            a, b = first(), second()
            timings = {first.__name__: a, second.__name__: b}
            rows.append({"plain_s": timings["plain"], "echo_s": timings["echo"],
                         "ratio": timings["echo"] / timings["plain"]})
    ratios = sorted(row["ratio"] for row in rows)
    summary = {
        "model": str(args.model), "tokens": args.tokens, "rounds": rows,
        "plain_median_s": statistics.median(r["plain_s"] for r in rows),
        "echo_median_s": statistics.median(r["echo_s"] for r in rows),
        "ratio_min": ratios[0], "ratio_median": statistics.median(ratios), "ratio_max": ratios[-1],
        "target": 1.3, **date_and_cpu(),
    }
    summary["met"] = summary["ratio_median"] <= summary["target"]
    lines = [
        f"# Echo scoring vs plain prefill, {args.tokens} tokens, 1 thread",
        "",
        f"Model: `{args.model.name}`; {args.rounds} alternating rounds; {summary['date']}, {summary['cpu']}.",
        "",
        "| | median |",
        "|---|---:|",
        f"| plain prefill (run_prefill) | {summary['plain_median_s'] * 1000:.0f} ms |",
        f"| echo + logprobs (score + token_logprobs) | {summary['echo_median_s'] * 1000:.0f} ms |",
        f"| ratio per round, min / median / max | {ratios[0]:.2f} / {summary['ratio_median']:.2f} / {ratios[-1]:.2f} |",
        f"| target <= 1.3x met | {'yes' if summary['met'] else '**NO**'} |",
        "",
        f"Command: `python3 -m benchmarks.echo_cost {args.model} --tokens {args.tokens} --rounds {args.rounds}`",
    ]
    write_result(args.out, lines, summary)


if __name__ == "__main__":
    main()
