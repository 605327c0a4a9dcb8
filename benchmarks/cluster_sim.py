"""Sizing a cluster of replicas: adapter hit rate and loads/s against the adapters each replica holds.

    python3 -m benchmarks.cluster_sim [--adapters 1000] [--replicas 8] [--zipf 1.0]
        [--k 1,2,4,8,16,32,64,125] [--load-ms MS --switch-ms MS --token-ms MS] [--model M --adapter A ...]

A simulation of ``runtime serve --replicas R --max-adapters-per-replica K`` under a
Zipf(S) request mix over N adapters, with the load, switch and per-token times measured
on this machine as inputs (``--model`` with its ``--adapter`` files: registering an adapter
is the load, the engine's switch p50 between sessions of different adapters is the switch,
a decode step the token; or give them with ``--load-ms``, ``--switch-ms``, ``--token-ms``).

The model of Ray Serve's multiplexed routing: a request goes to the least busy replica that
holds its adapter if that one has a free slot (``--slots`` requests at once); else to the
least busy replica with a free slot, which loads the adapter (least recently used evicted
beyond K); else it waits for the first slot to free. Requests arrive as a Poisson process
at ``--utilization`` of what the replicas can serve with no load at all; each takes its
tokens' time, plus the switch, plus the load on a miss. The first ``--warmup`` of the
requests fill the caches and are not counted.

Prints a table (K: hit rate, loads/s over the cluster, mean and p99 added wait) and writes
``benchmarks/results/cluster_sim.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import random
import sys
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
BENCH_MODEL = HERE / "models" / "bench_int8.tflite"
BENCH_ADAPTERS = [HERE / "models" / name for name in ("peft_r8_a", "peft_r8_b")]


def measure(model: Path, adapters: list[Path], tokens: int = 32) -> dict[str, float]:
    """Load (register), switch and decode-step times in ms, measured on ``model``."""
    from runtime import Engine, EngineSettings, LoraSource, SessionConfig

    with Engine(model, EngineSettings(num_threads=1)) as engine:
        loads = []
        for _ in range(5):
            for path in adapters:
                started = time.perf_counter()
                lora_id = engine.register_adapter(LoraSource(path=path))
                loads.append(time.perf_counter() - started)
                engine.unload_adapter(lora_id)
        ids = [engine.register_adapter(LoraSource(path=path)) for path in adapters]
        steps = []
        for turn in range(6):
            with engine.create_session(SessionConfig(adapters={ids[turn % len(ids)]: 1.0})) as session:
                times: list[float] = []
                session.generate([1, 2, 3, 4], tokens, on_token=lambda _: times.append(time.perf_counter()))
                steps += list(np.diff(times))
        switch = engine.stats().switch.p50_ms
    return {"load_ms": 1e3 * float(np.median(loads)), "switch_ms": float(switch),
            "token_ms": 1e3 * float(np.median(steps))}


class Replica:
    """One replica: its adapters (LRU, at most ``k``) and the end times of its running requests."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.held: OrderedDict[int, None] = OrderedDict()
        self.running: list[float] = []  # end times (a heap)

    def busy(self, now: float) -> int:
        while self.running and self.running[0] <= now:
            heapq.heappop(self.running)
        return len(self.running)


def simulate(adapters: int, replicas: int, k: int, zipf: float, requests: int, warmup: int, slots: int,
             utilization: float, tokens: int, times: dict[str, float], seed: int = 0) -> dict[str, float]:
    """One run: hit rate, loads per second, and the wait added to requests (ms)."""
    rng = random.Random(seed)
    weights = np.array([1.0 / (rank + 1) ** zipf for rank in range(adapters)])
    cumulative = list(np.cumsum(weights / weights.sum()))
    service = tokens * times["token_ms"] + times["switch_ms"]
    rate = utilization * replicas * slots / service  # arrivals per ms
    pool = [Replica(k) for _ in range(replicas)]
    now = 0.0
    hits = loads = counted = 0
    waits: list[float] = []
    started_counting = 0.0
    for index in range(requests + warmup):
        now += rng.expovariate(rate)
        if index == warmup:
            started_counting = now
        adapter = min(bisect.bisect_left(cumulative, rng.random()), adapters - 1)
        busy = [replica.busy(now) for replica in pool]
        holders = [i for i, replica in enumerate(pool) if adapter in replica.held and busy[i] < slots]
        free = [i for i in range(replicas) if busy[i] < slots]
        start = now
        if holders:
            chosen, hit = min(holders, key=busy.__getitem__), True
        elif free:
            chosen, hit = min(free, key=busy.__getitem__), False
        else:  # every slot taken: the first to free up
            chosen = min(range(replicas), key=lambda i: pool[i].running[0])
            start = pool[chosen].running[0]
            pool[chosen].busy(start)
            hit = adapter in pool[chosen].held
        replica = pool[chosen]
        cost = service
        if hit:
            replica.held.move_to_end(adapter)
        else:
            cost += times["load_ms"]
            replica.held[adapter] = None
            if len(replica.held) > k:
                replica.held.popitem(last=False)
        heapq.heappush(replica.running, start + cost)
        if index >= warmup:
            counted += 1
            hits += hit
            loads += not hit
            waits.append(start - now + (cost - service))
    seconds = (now - started_counting) / 1e3
    return {"k": k, "hit_rate": hits / counted, "loads_per_s": loads / seconds, "requests_per_s": counted / seconds,
            "added_wait_ms_mean": float(np.mean(waits)), "added_wait_ms_p99": float(np.percentile(waits, 99))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--k", type=lambda text: [int(n) for n in text.split(",")],
                        default=[1, 2, 4, 8, 16, 32, 64, 125, 250])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--warmup", type=int, default=20_000)
    parser.add_argument("--slots", type=int, default=8, help="requests one replica runs at once")
    parser.add_argument("--utilization", type=float, default=0.7)
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    parser.add_argument("--model", type=Path, default=BENCH_MODEL, help="where load, switch and token are measured")
    parser.add_argument("--adapter", type=Path, action="append")
    parser.add_argument("--load-ms", type=float)
    parser.add_argument("--switch-ms", type=float)
    parser.add_argument("--token-ms", type=float)
    parser.add_argument("--out", type=Path, default=RESULTS / "cluster_sim")
    args = parser.parse_args(argv)

    given = {"load_ms": args.load_ms, "switch_ms": args.switch_ms, "token_ms": args.token_ms}
    times = dict(given)
    if any(value is None for value in given.values()):
        measured = measure(args.model, args.adapter or BENCH_ADAPTERS)
        times = {key: measured[key] if value is None else value for key, value in given.items()}
    print(f"inputs: load {times['load_ms']:.2f} ms, switch {times['switch_ms']:.3f} ms, token {times['token_ms']:.2f} ms "
          f"({'measured on ' + args.model.name if any(v is None for v in given.values()) else 'given'})", flush=True)
    rows = [simulate(args.adapters, args.replicas, k, args.zipf, args.requests, args.warmup, args.slots,
                     args.utilization, args.tokens, times, seed=k) for k in args.k]
    table = render(rows, args, times)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(table)
    args.out.with_suffix(".json").write_text(json.dumps({"inputs": times, "settings": {
        key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()
        if key not in ("out",)}, "rows": rows}, indent=2) + "\n")
    plot(rows, args, args.out.with_suffix(".png"))
    print(f"wrote {args.out.with_suffix('.md')}, .json and .png")
    return 0


def render(rows: list[dict], args, times: dict[str, float]) -> str:
    lines = [
        f"# {args.adapters} adapters over {args.replicas} replicas, Zipf({args.zipf:g}): hit rate and loads "
        "against K",
        "",
        f"Simulated (`benchmarks/cluster_sim.py`): {args.requests:,} requests after {args.warmup:,} of warm-up, "
        f"Poisson arrivals at {100 * args.utilization:.0f}% of the replicas' capacity ({args.slots} requests at "
        f"once each), {args.tokens} tokens per request. Inputs: load {times['load_ms']:.2f} ms, switch "
        f"{times['switch_ms']:.3f} ms, token {times['token_ms']:.2f} ms. K is `--max-adapters-per-replica`; "
        f"K x replicas = {args.replicas} K adapters held at most.",
        "",
        "| K | adapters held (K x replicas) | hit rate | loads/s (cluster) | requests/s | added wait mean / p99 (ms) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(f"| {row['k']} | {row['k'] * args.replicas} | {100 * row['hit_rate']:.1f}% "
                     f"| {row['loads_per_s']:.1f} | {row['requests_per_s']:.1f} "
                     f"| {row['added_wait_ms_mean']:.2f} / {row['added_wait_ms_p99']:.2f} |")
    lines += ["", "Command: `python3 -m benchmarks.cluster_sim " + " ".join(sys.argv[1:]) + "`", ""]
    return "\n".join(lines)


def plot(rows: list[dict], args, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return
    ks = [row["k"] for row in rows]
    figure, hit_axis = plt.subplots(figsize=(7, 4.2))
    hit_axis.plot(ks, [100 * row["hit_rate"] for row in rows], "o-", color="tab:blue", label="hit rate")
    hit_axis.set_xscale("log")
    hit_axis.set_xlabel("K: adapters per replica (--max-adapters-per-replica)")
    hit_axis.set_ylabel("adapter hit rate (%)", color="tab:blue")
    load_axis = hit_axis.twinx()
    load_axis.plot(ks, [row["loads_per_s"] for row in rows], "s--", color="tab:red", label="loads/s")
    load_axis.set_ylabel("adapter loads/s over the cluster", color="tab:red")
    hit_axis.set_title(f"{args.adapters} adapters, {args.replicas} replicas, Zipf({args.zipf:g})")
    hit_axis.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    raise SystemExit(main())
