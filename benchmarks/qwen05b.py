#!/usr/bin/env python3
"""The next size beside llama.cpp: Qwen2.5-0.5B's shapes (random weights), exported by
``runtime export`` and converted by llama.cpp's own converter from the same checkpoint.

    python3 tools/build_qwen05b.py              # checkpoint, f32 + int8 exports, fidelity
    bash benchmarks/llama_cpp/setup.sh          # llama.cpp and its f32 / q8_0 GGUF of it
    python3 benchmarks/qwen05b.py [--rounds 5] [--steps 16]

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
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "llama_cpp"))
from client import LlamaCpp, available  # noqa: E402  (benchmarks/llama_cpp/client.py)
from files import QWEN05B  # noqa: E402

from measure import prefill_seconds  # noqa: E402  (benchmarks/measure.py)
from run import both  # noqa: E402
from runtime import Engine, EngineSettings, SessionConfig  # noqa: E402
from runtime.bench import timed_decode  # noqa: E402

RESULTS = HERE / "results" / "qwen05b"
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


def measure(llama: LlamaCpp, rounds: int, steps: int) -> list[dict[str, Any]]:
    """Every row, ours and llama.cpp's alternating round by round."""
    rows = []
    for ours, theirs in PAIRS:
        samples: dict[str, list[tuple[float, float]]] = {}
        with Engine(QWEN05B.ours[ours], EngineSettings(num_threads=1)) as engine, \
                engine.create_session(SessionConfig()) as session:
            timed_decode(engine, session, 2)  # warm both sides
            llama.request("decode", kind=theirs, setting="base", threads=1, steps=2, prompt=0)
            for r in range(rounds):
                cases = {
                    "decode from position 0": (
                        lambda: timed_decode(engine, session, steps)[0] * 1e3,
                        lambda: llama.request("decode", kind=theirs, setting="base", threads=1, steps=steps,
                                              prompt=0)["ms"]),
                    f"decode after a {PROMPT}-token prompt": (
                        lambda: timed_decode(engine, session, steps, PROMPT)[0] * 1e3,
                        lambda: llama.request("decode", kind=theirs, setting="base", threads=1, steps=steps,
                                              prompt=PROMPT)["ms"]),
                    f"prefill {PROMPT} tokens": (
                        lambda: prefill_seconds(session, PROMPT) * 1e3,
                        lambda: llama.request("prefill", kind=theirs, tokens=PROMPT, threads=1)["ms"]),
                }
                for name, (mine, other) in cases.items():
                    samples.setdefault(name, []).append(both(mine, other, r))
                print(f"{ours} round {r + 1}/{rounds}", file=sys.stderr, flush=True)
        for name, pairs in samples.items():
            row = {"precision": f"{ours} / {theirs}", "measure": name,
                   "ours_ms": statistics.median(p[0] for p in pairs),
                   "llama_cpp_ms": statistics.median(p[1] for p in pairs),
                   "speed": statistics.median(p[1] / p[0] for p in pairs),
                   "speed_min": min(p[1] / p[0] for p in pairs), "speed_max": max(p[1] / p[0] for p in pairs),
                   "rounds": len(pairs)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def build_report() -> dict[str, Any]:
    """What ``tools/build_qwen05b.py`` measured of the export and its fidelity."""
    path = QWEN05B.hf.parent / "report.json"
    return json.loads(path.read_text()) if path.exists() else {}


def markdown(record: dict[str, Any]) -> str:
    """The tables of ``results/qwen05b.md`` (and of the report's section)."""
    out = [f"{QWEN05B.title}, 1 thread; measured {record['date']} (load average {record['load_average'][0]:.1f} "
           f"at the start). speed = llama.cpp's ms / ours (above 1: ours is faster); median "
           f"[min-max] over {record['rows'][0]['rounds']} alternating rounds.", "",
           "| precision (ours / llama.cpp) | measure | ours ms | llama.cpp ms | speed |", "|---|---|---|---|---|"]
    out += [f"| {r['precision']} | {r['measure']} | {r['ours_ms']:.1f} | {r['llama_cpp_ms']:.1f} | "
            f"{r['speed']:.2f}x [{r['speed_min']:.2f}-{r['speed_max']:.2f}] |" for r in record["rows"]]
    same = record["same_weights"]
    out += ["", f"Same weights: our f32 logits and llama.cpp's f32 logits over {same['positions']} positions differ "
            f"by at most {same['max_abs_diff']:.2g} (logit std {same['logit_std']:.2f}); greedy tokens agree at "
            f"{same['argmax_agree']:.0%} of positions."]
    export = record.get("export", {}).get("export")
    if export:
        gb = 1e9
        out += ["", f"Export (`{export['command']}`): {export['seconds']:.0f} s for both precisions, "
                f"{export['jobs']} jobs; peak RSS of the largest process {export['largest_process_peak_rss_bytes'] / gb:.2f} GB "
                f"(exporter {export['exporter_peak_rss_bytes'] / gb:.2f}, each worker "
                + ", ".join(f"{v / gb:.2f}" for v in export["worker_peak_rss_bytes"])
                + f", finishing process {export['finisher_peak_rss_bytes'] / gb:.2f}); all processes together "
                f"{export['tree_peak_rss_bytes'] / gb:.2f} GB RSS, {export['tree_peak_pss_bytes'] / gb:.2f} GB PSS."]
    fidelity = record.get("export", {}).get("fidelity")
    if fidelity:
        out += ["", "Against float64 transformers, max |logit difference| over "
                f"{fidelity['prompt_tokens']} prompt tokens and {fidelity['steps']} steps (logit std "
                f"{fidelity['logit_std']:.3f}): "
                + "; ".join(f"{p} {fidelity[p]['max_abs_logit_diff']:.3g}, greedy {fidelity[p]['greedy_tokens_agreeing']}"
                            f"/{fidelity[p]['of']}" for p in ("f32", "int8") if p in fidelity) + "."]
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
    from datetime import date

    record: dict[str, Any] = {"date": date.today().isoformat(), "load_average": os.getloadavg(), "threads": 1}
    with LlamaCpp(QWEN05B.key) as llama:
        record["same_weights"] = same_weights(llama)
        print(json.dumps(record["same_weights"]), flush=True)
        record["rows"] = measure(llama, args.rounds, args.steps)
    record["export"] = build_report()
    RESULTS.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    RESULTS.with_suffix(".md").write_text(markdown(record) + "\n")
    print(markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
