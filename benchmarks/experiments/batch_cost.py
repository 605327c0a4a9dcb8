"""What one batched decode step costs against one session's step, at several positions.

    python3 -m benchmarks.experiments.batch_cost MODEL.tflite [--rows 8] [--ranks 8] [--positions 8,300,600] [--rounds 4] \
        [--threads 1] [--on-threads [--out PATH]]

``rows`` sessions, each with its own random adapter (of the ``--ranks`` in turn: ``8,16``
mixes ranks, whose rows share a batch of the larger slot), are prefilled to a position;
then, in alternating rounds, one session steps alone (``Session.run_decode``) and all of
them step together (``Engine.decode_together``). Prints the median milliseconds of each,
the aggregate speed-up (rows x single / batch) and the latency ratio (batch / single), per
position: with attention windows, a position picks the window both paths run in. Needs a
model exported with ``--batch-sizes`` (and LoRA slots for the ranks). ``--threads``: the
engine's XNNPACK threads (both paths alike).

``--on-threads``: the sessions step from a thread each through the engine's batcher (batch
wait 2 ms), as ``run.py``'s concurrency section drives them, its batching and the threads'
hand-offs included: tokens/s of one session alone and of all of them, 25 steps each, from
sessions prefilled to each position, rounds alternating the positions' order. ``--out PATH``
also writes the table as ``PATH.md`` and every round's figures as ``PATH.json``; the report
(``benchmarks/report.py``) judges the 8-session targets from ``batch_cost_smollm2_{f32,int8}.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import date_and_cpu, write_result
from benchmarks.measure import ConcurrencyRig, random_adapter_files
from runtime import Engine, EngineSettings, SessionConfig
from runtime.util.signature_names import LoraSlot

STEPS = 6  # decode steps per timed run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--rows", type=int, default=8, help="sessions stepping together")
    parser.add_argument("--ranks", default="8", help="adapter ranks, given to the sessions in turn")
    parser.add_argument("--positions", default="8,300,600", help="where the sessions start, comma-separated")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="the engine's XNNPACK threads")
    parser.add_argument("--on-threads", action="store_true",
                        help="sessions stepping from a thread each through the batcher, in tokens/s")
    parser.add_argument("--out", type=Path, help="with --on-threads: also write PATH.md and PATH.json")
    args = parser.parse_args()
    positions = [int(p) for p in args.positions.split(",")]
    ranks = [int(r) for r in args.ranks.split(",")]
    if args.threads < 1:
        parser.error(f"--threads {args.threads}: expected 1 or more")
    if args.out and not args.on_threads:
        parser.error("--out: only with --on-threads")
    if args.on_threads:
        _on_threads(args.model, [ranks[row % len(ranks)] for row in range(args.rows)], positions, args.rounds,
                    args.threads, args.out)
        return
    settings = EngineSettings(batch_wait_s=None, num_threads=args.threads)
    with tempfile.TemporaryDirectory() as folder, Engine(args.model, settings) as engine:
        paths = {}
        for rank in ranks:
            (Path(folder) / f"r{rank}").mkdir()
            count = sum(1 for row in range(args.rows) if ranks[row % len(ranks)] == rank)
            paths[rank] = iter(random_adapter_files(engine, Path(folder) / f"r{rank}", count, rank, seed=rank))
        sessions = [engine.create_session(SessionConfig(lora_path=next(paths[ranks[row % len(ranks)]])))
                    for row in range(args.rows)]
        slot = engine.spec.slot_for(LoraSlot(max(ranks)))
        print(f"{args.model.name}: {args.rows} sessions of ranks {ranks} (batch slot {slot}, windows "
              f"{list(engine.spec.windows(slot, args.rows))}), {args.threads} thread(s), median of {args.rounds} "
              f"rounds of {STEPS} steps")
        print("| position | one session (ms) | batch of %d (ms) | aggregate | latency |" % args.rows)
        print("|---:|---:|---:|---:|---:|")
        for position in positions:
            if position + 2 * args.rounds * STEPS > engine.spec.kv_length:
                raise SystemExit(f"position {position}: the first session would step past the KV cache of "
                                 f"{engine.spec.kv_length} positions ({2 * args.rounds * STEPS} steps a position)")
            for session in sessions:
                session.reset()
                if position:  # position 0: the sessions' first step has no prompt before it
                    session.run_prefill([i % 97 + 1 for i in range(position)])
            alone, together = [], []
            for _ in range(args.rounds):
                alone.append(_timed(lambda: sessions[0].run_decode(5)))
                together.append(_timed(lambda: engine.decode_together([(s, 5) for s in sessions])))
            single, batch = statistics.median(alone), statistics.median(together)
            print(f"| {position} | {single:.2f} | {batch:.2f} | {args.rows * single / batch:.2f}x | "
                  f"{batch / single:.2f}x |")


def _on_threads(model: Path, ranks: list[int], positions: list[int], rounds: int, threads: int,
                out: Path | None) -> None:
    """The table of ``--on-threads``: medians over rounds of one session's tokens/s and of
    all sessions' together, each session on its own thread (and, given ``out``, the rounds)."""
    steps = 24
    rig = ConcurrencyRig(model, ranks, num_threads=threads, batch_wait_s=0.002)
    try:
        rates: dict[int, list[tuple[float, float]]] = {position: [] for position in positions}
        for round_ in range(rounds + 1):  # the first round warms up
            for position in positions if round_ % 2 else positions[::-1]:
                one = rig.tokens_per_second(1, steps, position=position)
                together = rig.tokens_per_second(len(ranks), steps, position=position)
                if round_:
                    rates[position].append((one, together))
    finally:
        rig.close()
    lines = [f"{model.name}: {len(ranks)} sessions of ranks {ranks} on a thread each, {threads} thread(s), medians of "
             f"{rounds} rounds of {steps + 1} steps", "",
             f"| position | one session (tokens/s) | {len(ranks)} sessions (tokens/s) | aggregate [min-max] | latency |",
             "|---:|---:|---:|---:|---:|"]
    for position, measured in rates.items():
        gains = sorted(together / one for one, together in measured)
        gain = statistics.median(gains)
        lines.append(f"| {position} | {statistics.median(one for one, _ in measured):.1f} | "
                     f"{statistics.median(together for _, together in measured):.1f} | {gain:.2f}x "
                     f"[{gains[0]:.2f}-{gains[-1]:.2f}] | {len(ranks) / gain:.2f}x |")
    if out is None:
        print("\n".join(lines))
        return
    lines += ["", "Command: `python3 -m benchmarks.experiments.batch_cost " + " ".join(sys.argv[1:]) + "`"]
    rows = [{"position": position, "one_tokens_per_s": [one for one, _ in measured],
             "together_tokens_per_s": [together for _, together in measured]} for position, measured in rates.items()]
    write_result(out, lines, {"model": str(model), "sessions": len(ranks), "ranks": ranks, "threads": threads,
                              "rounds": rounds, "steps": steps + 1, "rows": rows, **date_and_cpu()})


def _timed(step) -> float:
    """Milliseconds per call of ``step`` over STEPS calls."""
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    return (time.perf_counter() - start) / STEPS * 1000


if __name__ == "__main__":
    main()
