"""What a prompt and its first decode step cost in each of several exports, side by side: e.g.
the default export (4,096 positions, a prefill window of 1,024) against ``--kv-length 1024``.

    python3 -m benchmarks.experiments.prompt_cost NAME=MODEL.tflite [NAME=MODEL.tflite ...] \
        [--lengths 20,100,400] [--rounds 5]

For each prompt length, every export in turn (the order flipping every round) opens a fresh
session, prefills the same random prompt, takes one decode step and closes the session, 1
thread; prints the median milliseconds per export. A fresh session is what a new chat pays:
the prompt's chunks (in a prefill window's cache where one holds them) and the first step
(which moves the context into the whole cache when the prompt ran in a window).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from runtime import Engine, EngineSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("models", nargs="+", metavar="NAME=MODEL")
    parser.add_argument("--lengths", default="20,100,400", help="prompt lengths in tokens")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    settings = EngineSettings(num_threads=1, prefix_cache_bytes=0, batch_wait_s=None)
    engines = {name: Engine(path, settings) for name, path in (model.split("=", 1) for model in args.models)}
    try:
        rng = np.random.default_rng(0)
        print("ms for a prompt and its first decode step, fresh session, 1 thread, median of "
              f"{args.rounds} alternating rounds")
        print("| prompt tokens | " + " | ".join(engines) + " |")
        print("|---:|" + "---:|" * len(engines))
        for length in (int(x) for x in args.lengths.split(",")):
            vocab = next(iter(engines.values())).spec.vocab_size
            prompt = [int(t) for t in rng.integers(1, vocab, length)]
            times: dict[str, list[float]] = {name: [] for name in engines}
            for round_ in range(args.rounds):
                for name in (list(engines) if round_ % 2 == 0 else list(reversed(engines))):
                    session = engines[name].create_session()
                    started = time.perf_counter()
                    session.run_prefill(prompt)
                    session.run_decode(7)
                    times[name].append(time.perf_counter() - started)
                    session.close()
            print(f"| {length} | " + " | ".join(f"{1e3 * statistics.median(t):.1f}" for t in times.values()) + " |")
    finally:
        for engine in engines.values():
            engine.close()


if __name__ == "__main__":
    main()
