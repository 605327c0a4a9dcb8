#!/usr/bin/env python3
"""The next size beside llama.cpp: Qwen2.5-0.5B's shapes (random weights), exported by
``runtime export`` and converted by llama.cpp's own converter from the same checkpoint.

    python3 tools/build_qwen05b.py              # checkpoint, f32 + int8 exports, fidelity
    bash benchmarks/llama_cpp/setup.sh          # llama.cpp and its f32 / q8_0 GGUF of it
    python3 -m benchmarks.qwen05b [--rounds 5] [--steps 16]

1 thread, f32 against f32 and int8 against q8_0: ms per decode step over ``--steps`` steps
from an empty context, and after a 128-token prompt (position 128 on), and ms to prefill
128 tokens. Our session and llama.cpp's context (in its own process) take turns round by
round, who goes first flipping every round; figures are medians over the rounds, speed is
llama.cpp's ms over ours within a round. Beside them: the export's time and memory from
``tools/build_qwen05b.py``'s report.

Writes ``benchmarks/results/qwen05b.json`` and ``.md``; ``benchmarks/report.py`` puts the
table in the report.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from typing import Any

import numpy as np

from benchmarks.base_rows import record_of, rows_table
from benchmarks.common import RESULTS
from benchmarks.llama_cpp.client import LlamaCpp, available
from benchmarks.llama_cpp.files import QWEN05B
from runtime import Engine, SessionConfig

RESULT = RESULTS / "qwen05b"
PAIRS = (("f32", "f32"), ("int8", "q8_0"))  # ours -> llama.cpp's
PROMPT = 128


def same_weights(llama: LlamaCpp) -> dict[str, float]:
    """Our f32 logits vs llama.cpp's f32 logits at each of 16 positions (tokens decoded one
    by one): the two sides run the same weights."""
    tokens = [(i * 7919 + 11) % 4093 + 3 for i in range(16)]
    with Engine(QWEN05B.ours["f32"]) as engine, engine.create_session(SessionConfig()) as session, \
            tempfile.TemporaryDirectory() as tmp:
        ours = np.stack([session.run_decode(t).copy() for t in tokens])
        llama.request("logits", kind="f32", setting="base", tokens=tokens, out=f"{tmp}/theirs.npy")
        theirs = np.load(f"{tmp}/theirs.npy")
    return {"positions": len(tokens), "max_abs_diff": float(np.max(np.abs(ours - theirs))),
            "logit_std": float(ours.std()), "argmax_agree": float(np.mean(ours.argmax(-1) == theirs.argmax(-1)))}


def build_report() -> dict[str, Any]:
    """What ``tools/build_qwen05b.py`` measured of the export and its fidelity."""
    path = QWEN05B.hf.parent / "report.json"
    return json.loads(path.read_text()) if path.exists() else {}


def markdown(record: dict[str, Any]) -> str:
    """The tables of ``results/qwen05b.md`` (and of the report's section)."""
    out = rows_table(record)
    same = record["same_weights"]
    out += ["", f"Same weights: our f32 logits and llama.cpp's f32 logits over {same['positions']} positions differ "
            f"by at most {same['max_abs_diff']:.2g} (logit std {same['logit_std']:.2f}); greedy tokens agree at "
            f"{same['argmax_agree']:.0%} of positions."]
    export = record.get("export", {}).get("export")
    if export:
        gb = 1e9
        largest = export["largest_process_peak_rss_bytes"] / gb
        out += ["", f"Export (`{export['command']}`): {export['seconds']:.0f} s for both precisions, "
                f"{export['jobs']} jobs; peak RSS of the largest process {largest:.2f} GB "
                f"(exporter {export['exporter_peak_rss_bytes'] / gb:.2f}, each worker "
                + ", ".join(f"{v / gb:.2f}" for v in export["worker_peak_rss_bytes"])
                + f", finishing process {export['finisher_peak_rss_bytes'] / gb:.2f}); all processes together "
                f"{export['tree_peak_rss_bytes'] / gb:.2f} GB RSS, {export['tree_peak_pss_bytes'] / gb:.2f} GB PSS."]
    fidelity = record.get("export", {}).get("fidelity")
    if fidelity:
        out += ["", "Against float64 transformers, max |logit difference| over "
                f"{fidelity['prompt_tokens']} prompt tokens and {fidelity['steps']} steps (logit std "
                f"{fidelity['logit_std']:.3f}): "
                + "; ".join(f"{p} {fidelity[p]['max_abs_logit_diff']:.3g}, greedy "
                            f"{fidelity[p]['greedy_tokens_agreeing']}/{fidelity[p]['of']}"
                            for p in ("f32", "int8") if p in fidelity) + "."]
    return "\n".join(out)


def main() -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=QWEN05B.decode_steps)
    args = parser.parse_args()
    if not available():
        raise SystemExit("llama.cpp is not set up: bash benchmarks/llama_cpp/setup.sh")
    missing = QWEN05B.missing()
    if missing:
        raise SystemExit("missing (tools/build_qwen05b.py, then benchmarks/llama_cpp/setup.sh): "
                         + ", ".join(map(str, missing)))
    with LlamaCpp(QWEN05B.key) as llama:
        weights = same_weights(llama)
        print(json.dumps(weights), flush=True)
        record = record_of(llama, QWEN05B, list(PAIRS), args.rounds, args.steps, PROMPT)
    record.update(same_weights=weights, export=build_report())
    RESULT.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    RESULT.with_suffix(".md").write_text(markdown(record) + "\n")
    print(markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
