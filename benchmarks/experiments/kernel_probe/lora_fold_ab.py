"""Two op forms of one export side by side: plain and all-linear adapter steps of each,
alternating rounds, and the adapter's cost over the plain step in each (RESULTS.md section 18).

    python3 tools/attention_kernel.py al-f32.tflite --out al-f32-b.tflite   # after applying a patch
    python3 -m benchmarks.experiments.kernel_probe.lora_fold_ab al-f32.tflite al-f32-b.tflite [--rounds 21] [--steps 64]

Both files must carry all-linear rank-8 slots (``decode_lora_all_r8``); the adapter is
``llama_lora_ratio``'s random all-linear rank-8 GGUF. The greedy tokens of both with the
adapter are printed first (a form that computes the same gives the same tokens).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchmarks.experiments.kernel_probe.llama_lora_ratio import write_adapter
from runtime import Engine, EngineSettings, SessionConfig
from runtime.bench import timed_decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--position", type=int, default=10)
    args = parser.parse_args()
    files = {"first": args.first, "second": args.second}
    adapter = write_adapter(Path("/tmp/lora-all-linear-r8.gguf"))
    settings = EngineSettings(num_threads=1, prefix_cache_bytes=0, batch_wait_s=None)
    engines = {name: Engine(path, settings) for name, path in files.items()}
    try:
        sessions = {(name, kind): engines[name].create_session(
            SessionConfig(lora_path=adapter) if kind == "adapter" else SessionConfig())
            for name in files for kind in ("plain", "adapter")}
        prompt = [i % 97 + 1 for i in range(12)]
        for name in files:
            with engines[name].create_session(SessionConfig(lora_path=adapter)) as session:
                print(f"{name} greedy with the adapter: {session.generate(prompt, 16).tokens}", flush=True)
        times: dict[tuple[str, str], list[float]] = {key: [] for key in sessions}
        order = list(sessions)
        for round_ in range(args.rounds):
            for key in order if round_ % 2 == 0 else order[::-1]:
                step, _ = timed_decode(engines[key[0]], sessions[key], args.steps, args.position)
                times[key].append(1000 * step)
        for (name, kind), values in times.items():
            print(f"{name} {kind}: {statistics.median(values):.2f} ms a step")
        for name in files:
            plain, adapted = times[name, "plain"], times[name, "adapter"]
            ratios = [a / p for a, p in zip(adapted, plain)]
            print(f"{name}: adapter / plain {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}], "
                  f"the adapter {statistics.median(a - p for a, p in zip(adapted, plain)):.2f} ms")
    finally:
        for engine in engines.values():
            engine.close()


if __name__ == "__main__":
    main()
