"""The measurements of the full benchmark suite (``benchmarks/run.py``) beyond the quick
table that ``python -m runtime bench`` prints (``runtime/bench.py``): memory, loading,
registering, cold switches, concurrent sessions and batched decode.

Every figure is the median of repeated runs; ratios compare figures measured in the same
run, interleaved where it matters, because the machines are shared and noisy.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from runtime import Engine, EngineSettings, KeepAll, LoraSource, Lru, Session, SessionConfig
from runtime.bench import decode_loop
from runtime.errors import InvalidArgumentError
from runtime.adapters.lora_util import Convention, parse_lora_input_name
from runtime.adapters.lora_writer import LoraWeights, write_lora_file
from runtime.util.signature_names import ATTENTION, LoraSlot


def rss_bytes(field: str = "VmRSS") -> int:
    """Resident set size of this process (Linux), 0 where unknown; ``field="VmHWM"`` gives
    its peak so far."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of per-round figures, and how many rounds."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": len(values)}


def prefill_seconds(session: Session, tokens: int) -> float:
    """Seconds to prefill ``tokens`` tokens into ``session`` from an empty context."""
    prompt = [i % 97 + 1 for i in range(tokens)]
    session.reset()
    start = time.perf_counter()
    session.run_prefill(prompt)
    return time.perf_counter() - start


def register_seconds(engine: Engine, source: LoraSource, repeats: int) -> float:
    """Median seconds to register ``source`` with ``engine`` (unloaded after each time)."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        lora_id = engine.register_adapter(source)
        samples.append(time.perf_counter() - start)
        engine.unload_adapter(lora_id)
    return statistics.median(samples)


def load_cost(model: str | os.PathLike[str], num_threads: int = 1,
              weight_cache_dir: str | os.PathLike[str] | None = None) -> dict[str, float]:
    """What opening ``model`` costs, meant for a fresh process: seconds to construct the
    Engine (with packed weights kept in ``weight_cache_dir``, if given) and to run the
    first decode step; RSS before (bytes), and RSS and peak RSS after it."""
    before = rss_bytes()
    start = time.perf_counter()
    engine = Engine(model, EngineSettings(num_threads=num_threads, weight_cache_dir=weight_cache_dir))
    loaded = time.perf_counter()
    with engine, engine.create_session() as session:
        session.run_decode(1)
        done = time.perf_counter()
        return {"load_s": loaded - start, "first_decode_s": done - loaded, "rss_before_bytes": before,
                "rss_bytes": rss_bytes(), "peak_rss_bytes": rss_bytes("VmHWM")}


def bench_cold_switch(model: str | os.PathLike[str], sources: Sequence[LoraSource], repeats: int) -> list[tuple[int, float]]:
    """Cold switch (adapter evicted, rebuilt on use) + one decode step, per adapter size."""
    results = []
    with Engine(model, EngineSettings(lora_residency=Lru(max_resident=1))) as engine:
        for source in sources:
            session = engine.create_session(SessionConfig(loras=[source]))
            evictor = engine.create_session(SessionConfig(loras=[s for s in sources if s is not source][:1]))

            def cold() -> None:
                evictor.run_decode(1)  # evicts the other blend (Lru(1))
                session.reset()
                start = time.perf_counter()
                session.run_decode(1)
                times.append(time.perf_counter() - start)

            times: list[float] = []
            for _ in range(repeats):
                cold()
            resident = engine.stats().resident
            nbytes = next((r.nbytes for r in resident if r.blend == tuple(session.blend)), 0)
            results.append((nbytes, statistics.median(times)))
            session.close()
            evictor.close()
    return results


def random_adapter_files(engine: Engine, folder: Path, count: int, rank: int, seed: int = 0,
                         targets: str = ATTENTION) -> list[Path]:
    """``count`` distinct random adapter files that fit ``engine``'s model at ``rank``, on the
    projections of ``targets`` (:class:`LoraSlot`)."""
    spec = engine.spec
    slot = spec.slot_inputs(spec.slot_for(LoraSlot(rank, targets)))
    shapes = {}
    for name, tensor in slot.items():
        parsed = parse_lora_input_name(name)
        graph = tensor.shape if parsed.convention is Convention.LITERT_TORCH or parsed.side == "b" else tensor.shape[::-1]
        shapes[(parsed.layer, parsed.projection, parsed.side)] = graph
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        weights = {}
        for (layer, proj, side), shape in shapes.items():
            if side == "a":
                a = rng.normal(0, 0.02, (shape[0], rank)).astype(np.float32)
                b = rng.normal(0, 0.02, (rank, shapes[(layer, proj, "b")][1])).astype(np.float32)
                weights[(layer, proj)] = LoraWeights(a, b)
        paths.append(write_lora_file(folder / f"adapter_{i}.tflite", weights, Convention.LITERT_TORCH))
    return paths


RESIDENT_PROBE = 16  # adapters made resident at once to measure what each costs
PYTHON_PROBE = 8  # adapters registered under tracemalloc, after the RSS measurement


def _resident_cost(engine: Engine, session: Session, paths: Sequence[Path]) -> dict[str, float]:
    """RSS of resident adapters: the first one (which also grows the allocator's arenas
    and builds the session's first adapter binding) and each further one (the slope over
    the rest), with every probed adapter resident at once."""
    policy = engine.settings.lora_residency
    engine.set_residency(KeepAll())
    marks = [rss_bytes()]
    for path in paths:
        session.set_adapters([LoraSource(path=path)], reset=True)
        session.run_decode(1)
        marks.append(rss_bytes())
    slot_bytes = engine.stats().resident[0].nbytes  # the slot's float32 inputs
    engine.set_residency(policy)
    steady = len(paths) // 4  # past the first few, which still grow the heap
    return {
        "resident_first_adapter_bytes": marks[1] - marks[0],
        "resident_per_adapter_bytes": (marks[-1] - marks[steady]) / (len(paths) - steady),
        "slot_float32_bytes": slot_bytes,
    }


def _compile_slot_first(engine: Engine, path: Path, limit_s: float = 60.0) -> None:
    """Registers the adapter at ``path``, waits (up to ``limit_s``) for the compiles of its
    LoRA slot's signature groups that registering starts in the background, and unloads it:
    that compile is the model's, once, not an adapter's, and would otherwise land in
    whichever measurement runs beside it."""
    lora_id = engine.register_adapter(LoraSource(path=path))
    groups = set(engine.spec.session_groups(engine.slot_for({lora_id: 1.0})))
    deadline = time.monotonic() + limit_s
    while not groups <= set(engine.stats().compiled_groups) and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.unload_adapter(lora_id)


def bench_memory(model: str | os.PathLike[str], rank: int, count: int = 1000, cycles: int = 10_000) -> dict[str, float]:
    """RSS per registered and per resident adapter, after unload; ``count`` adapters used in
    turn by one session under ``Lru(4)``; growth over ``cycles`` switch+decode cycles.

    A registered adapter is measured twice: the RSS growth over ``count`` registrations
    (which the heap freed by writing the adapter files can hide: it is reused first), and the
    Python objects that :data:`PYTHON_PROBE` more registrations keep (tracemalloc, which
    counts numpy's buffers too)."""
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, Engine(model, EngineSettings(lora_residency=Lru(max_resident=4))) as engine:
        paths = random_adapter_files(engine, Path(tmp), count + PYTHON_PROBE + 1, rank)
        _compile_slot_first(engine, paths.pop())
        paths, probes = paths[:count], paths[count:]
        session = engine.create_session()
        other = engine.create_session()
        for s in (session, other):
            s.run_decode(1)
        base = rss_bytes()
        ids = [engine.register_adapter(LoraSource(path=p)) for p in paths]
        out["registered_per_adapter_bytes"] = (rss_bytes() - base) / count
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        probe_ids = [engine.register_adapter(LoraSource(path=p)) for p in probes]
        out["registered_python_per_adapter_bytes"] = (tracemalloc.get_traced_memory()[0] - before) / PYTHON_PROBE
        tracemalloc.stop()
        for lora_id in probe_ids:
            engine.unload_adapter(lora_id)
        out["tensor_bytes_per_adapter"] = engine.stats().adapters[0].tensor_bytes
        out.update(_resident_cost(engine, session, paths[:RESIDENT_PROBE]))
        for path in paths[RESIDENT_PROBE:]:  # every other adapter once, through the same session
            session.set_adapters([LoraSource(path=path)], reset=True)
            session.run_decode(1)
        out["rss_all_registered_used_once_lru4_bytes"] = rss_bytes() - base
        out["resident_after_walk"] = len(engine.stats().resident)
        session.set_adapters([LoraSource(path=paths[0])], reset=True)
        other.set_adapters([LoraSource(path=paths[1])], reset=True)

        limit = engine.spec.kv_length

        def cycle(i: int) -> None:
            for s in (session, other):
                if s.position == limit:
                    s.reset()
                s.run_decode(i % 97 + 1)

        for i in range(min(500, cycles)):  # settle the allocator first
            cycle(i)
        start = rss_bytes()
        for i in range(cycles // 2):
            cycle(i)
        out["growth_per_switch_bytes"] = (rss_bytes() - start) / cycles
        session.close()
        other.close()
        for lora_id in ids:
            engine.unload_adapter(lora_id)
        out["after_unload_bytes"] = rss_bytes() - base
    return out


class ConcurrencyRig:
    """Up to ``len(ranks)`` sessions of one engine, session i with its own random adapter
    of rank ``ranks[i]`` (distinct adapters, so no two rows share weights), for aggregate
    decode throughput with N sessions on N threads. ``batch_wait_s``: the engine's (``None``:
    sessions take turns even on a model with batched signatures). Closes its engine on
    ``close()``."""

    def __init__(self, model: str | os.PathLike[str], ranks: Sequence[int], num_threads: int = 1,
                 executors: int = 1, batch_wait_s: float | None = None) -> None:
        self._folder = tempfile.TemporaryDirectory()
        self.engine = Engine(model, EngineSettings(num_threads=num_threads, executors=executors,
                                                   batch_wait_s=batch_wait_s))
        paths = []
        for rank in sorted(set(ranks)):
            folder = Path(self._folder.name) / f"r{rank}"
            folder.mkdir()
            made = iter(random_adapter_files(self.engine, folder, ranks.count(rank), rank, seed=rank))
            paths += [(i, next(made)) for i, r in enumerate(ranks) if r == rank]
        self.sessions = [self.engine.create_session(SessionConfig(lora_path=path)) for _, path in sorted(paths)]
        for session in self.sessions:
            decode_loop(session, 2)()

    def tokens_per_second(self, count: int, steps: int, first: int = 0, position: int = 0) -> float:
        """Tokens/s of ``steps + 1`` decode steps in each of ``count`` sessions (from the
        ``first``), all started at once, one thread each; with ``position``, each session
        first holds that many prompt tokens (prefilled before the clock starts)."""
        sessions = self.sessions[first:first + count]
        if position + steps + 1 > sessions[0].kv_length:
            raise InvalidArgumentError(f"{position} prompt tokens and {steps + 1} steps exceed the KV cache of "
                                       f"{sessions[0].kv_length} positions")
        # The clock starts when every session is ready, before any is let go (the barrier's
        # action runs then): read after the barrier, a session might have stepped already.
        started: list[float] = []
        barrier = threading.Barrier(len(sessions) + 1, action=lambda: started.append(time.perf_counter()))

        def drive(session: Session) -> None:
            session.reset()
            if position:
                session.run_prefill([i % 97 + 1 for i in range(position)])
            barrier.wait()
            for i in range(steps + 1):
                session.run_decode(i % 97 + 1)

        threads = [threading.Thread(target=drive, args=(s,)) for s in sessions]
        for t in threads:
            t.start()
        barrier.wait()
        for t in threads:
            t.join()
        return len(sessions) * (steps + 1) / (time.perf_counter() - started[0])

    def lone_step(self, steps: int) -> tuple[float, float]:
        """Seconds per step of one session decoding ``steps + 1`` steps, and of them the
        seconds inside the model's runs (the graph's own time)."""
        before = self.engine.stats()
        tokens_per_s = self.tokens_per_second(1, steps)
        after = self.engine.stats()
        return 1 / tokens_per_s, (after.invoke_seconds - before.invoke_seconds) / (after.invokes - before.invokes)

    def close(self) -> None:
        self.engine.close()
        self._folder.cleanup()


def discounted_lone_ratio(batched: tuple[float, float], turns: tuple[float, float]) -> float:
    """A lone session's tokens/s on the batching engine over the non-batching one's, as if
    both ran the non-batching engine's graph: each engine loads its own copy of the model,
    and two copies' bare runs differ (by up to 15% on a 2-core box), which is not batching's
    cost. ``(seconds per step, of them in the graph)`` of each."""
    (step_b, graph_b), (step_t, graph_t) = batched, turns
    return step_t / (graph_t + step_b - graph_b)


def batch_fidelity(model: str | os.PathLike[str], sessions: int, steps: int = 8, rank: int = 8) -> dict[str, float]:
    """``sessions`` sessions with distinct rank-``rank`` adapters (one without), at
    different positions, stepped together for ``steps`` greedy steps and then each alone:
    the largest logit difference and whether the greedy tokens agree."""
    with tempfile.TemporaryDirectory() as tmp, Engine(model, EngineSettings(batch_wait_s=None)) as engine:
        paths = random_adapter_files(engine, Path(tmp), sessions - 1, rank, seed=11)
        configs = [SessionConfig()] + [SessionConfig(lora_path=path) for path in paths]
        prompts = [[(7 * row + i) % 97 + 1 for i in range(1 + 3 * row)] for row in range(sessions)]

        def run(together: bool) -> tuple[list[list[int]], list[np.ndarray]]:
            group = [engine.create_session(config) for config in configs]
            tokens = [[int(np.argmax(s.run_prefill(p)))] for s, p in zip(group, prompts)]
            seen = []
            for _ in range(steps):
                if together:
                    logits = engine.decode_together([(s, t[-1]) for s, t in zip(group, tokens)])
                else:
                    logits = [s.run_decode(t[-1]) for s, t in zip(group, tokens)]
                seen.append(np.stack(logits))
                for row, out in zip(tokens, logits):
                    row.append(int(np.argmax(out)))
            for s in group:
                s.close()
            return tokens, seen

        batched_tokens, batched = run(True)
        alone_tokens, alone = run(False)
        return {"sessions": sessions, "steps": steps,
                "max_abs_logit_diff": float(max(np.abs(a - b).max() for a, b in zip(batched, alone))),
                "greedy_identical": batched_tokens == alone_tokens}


def batch_memory(model: str | os.PathLike[str], sessions: int, rank: int = 8) -> dict[str, float]:
    """RSS growth from 1 to ``sessions`` sessions stepping together, each with its own
    rank-``rank`` adapter, against what they hold (KV caches and adapter buffers). Every
    signature is warmed up first by as many plain sessions, which stay open."""
    with tempfile.TemporaryDirectory() as tmp, Engine(model) as engine:
        warm = [engine.create_session() for _ in range(sessions)]
        for _ in range(2):
            for count in range(1, sessions + 1):
                engine.decode_together([(s, 1) for s in warm[:count]])
        paths = random_adapter_files(engine, Path(tmp), sessions, rank, seed=7)
        first = engine.create_session(SessionConfig(lora_path=paths[0]))
        first.run_decode(1)
        one = rss_bytes()
        resident_one = engine.stats().resident_bytes
        rest = [engine.create_session(SessionConfig(lora_path=path)) for path in paths[1:]]
        for i in range(4):
            engine.decode_together([(s, i + 1) for s in [first, *rest]])
        grown = rss_bytes() - one
        held = (sessions - 1) * engine.spec.kv_cache_bytes + engine.stats().resident_bytes - resident_one
        return {"sessions": sessions, "rss_growth_bytes": grown, "kv_and_adapter_bytes": held,
                "growth_over_held": grown / held}
