#!/usr/bin/env python3
"""Route d: the tokenizer and chat template built on a second thread while the native open
(a ctypes call: the GIL is released) runs, against one after the other.

    python3 -m benchmarks.experiments.open_probe.overlap --model M.tflite --text-from M.litertlm \\
        --weight-cache C.xnnpack --keys prefill_32,prefill_128,decode --rounds 5

Each round runs both orders in fresh processes (alternating which goes first) and prints
the wall time of the two steps together.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path


def once(args: argparse.Namespace) -> dict[str, float]:
    """Both steps in this process, overlapped or not: wall ms of each and together."""
    from runtime.components.chat_template import ChatTemplate
    from runtime.components.tokenizer import HfTokenizer
    from runtime.executor.native import NativeModel
    from runtime.util.litertlm_bundle import LitertLmBundle

    from benchmarks.experiments.open_probe import views

    out: dict[str, float] = {}

    def text() -> None:
        t = time.perf_counter()
        with LitertLmBundle(Path(args.text_from)) as bundle:
            _, data = bundle.tokenizer()
            llm = bundle.llm_metadata()
        HfTokenizer(data, llm.stop_token_ids or None)
        ChatTemplate(llm.chat_template, bos_token=llm.bos_token, eos_token=llm.eos_token)
        out["text_ms"] = (time.perf_counter() - t) * 1e3

    def native() -> None:
        t = time.perf_counter()
        view = views.subset_view(args.model, args.keys.split(","))
        NativeModel(memoryview(view.mapping), num_threads=1, weight_cache=args.weight_cache, name="probe")
        out["native_ms"] = (time.perf_counter() - t) * 1e3

    start = time.perf_counter()
    if args.overlap:
        thread = threading.Thread(target=text)
        thread.start()
        native()
        thread.join()
    else:
        native()
        text()
    out["together_ms"] = (time.perf_counter() - start) * 1e3
    return out


def main() -> None:
    """Alternating rounds of both orders, each in a fresh process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--text-from", required=True)
    parser.add_argument("--weight-cache", required=True)
    parser.add_argument("--keys", default="prefill_32,prefill_128,decode")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--overlap", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(once(args)))
        return
    base = [sys.executable, "-m", "benchmarks.experiments.open_probe.overlap", "--child", "--model", args.model,
            "--text-from", args.text_from, "--weight-cache", args.weight_cache, "--keys", args.keys]
    rows: dict[str, list[dict[str, float]]] = {"sequential": [], "overlapped": []}
    loads = []
    for rnd in range(args.rounds):
        loads.append(os.getloadavg()[0])
        order = ["sequential", "overlapped"] if rnd % 2 == 0 else ["overlapped", "sequential"]
        for name in order:
            done = subprocess.run(base + (["--overlap"] if name == "overlapped" else []), capture_output=True,
                                  text=True, check=True)
            rows[name].append(json.loads([x for x in done.stdout.splitlines() if x.startswith("{")][-1]))
    print(f"{args.rounds} rounds, load average (1 min) {min(loads):.2f}-{max(loads):.2f}")
    for name, results in rows.items():
        med = {k: statistics.median(r[k] for r in results) for k in results[0]}
        print(f"{name}: native {med['native_ms']:.0f} ms, tokenizer + template {med['text_ms']:.0f} ms, "
              f"together {med['together_ms']:.0f} ms")
    ratios = [o["together_ms"] / s["together_ms"] for o, s in zip(rows["overlapped"], rows["sequential"])]
    print(f"overlapped / sequential per round: {min(ratios):.2f} / {statistics.median(ratios):.2f} / {max(ratios):.2f}")


if __name__ == "__main__":
    main()
