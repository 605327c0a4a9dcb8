"""One engine replica of ``runtime serve --replicas N``: an :class:`~runtime.Engine` over
the model file, the adapters it holds, and generation as a stream of events.

A request comes with its adapter set as the multiplexed model id (``name@sha256`` of each
adapter, sorted, joined by ``+``; empty for the base model alone). The replica loads a set
on its first request for it through ``@serve.multiplexed`` (Ray Serve evicts the least
recently used set beyond ``max_adapters``): each adapter's file and digest come from the
cluster's catalogue and the core checks the digest when it registers the file, so a file
changed since the ingress registered it is refused (409). An adapter stays registered while
a resident set or a running request uses it. Every half second the replica syncs with the
catalogue (dropping what was unloaded or replaced) and reports its numbers.

What a stream yields, in order: ``("replica", id, hit)``, then ``("start",)`` at the first
generated token and ``("text", delta)`` as text comes, and last ``("outcome", Outcome)``,
as lists of these events (what came while the last list was on its way leaves as one: one
item of Ray's stream per token costs ~0.6 ms); an error is raised (a status error of the
runtime, as in one process). While a request waits with nothing to send (queued behind
other requests' prefills) but the engine runs steps, ``("alive",)`` every
:data:`PROGRESS_INTERVAL_S`: the ingress's ``--replica-timeout`` then ends only the
streams of a replica whose engine is stuck (or that is frozen whole), never a busy one's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace

from runtime import ByteTokenizer, Engine, EngineSettings, LoraSource
from runtime.errors import DataLossError, FailedPreconditionError, NotFoundError
from runtime.serve.generation import GenerationJob, GenerationRequest, Outcome

log = logging.getLogger("runtime.serve")

SYNC_INTERVAL_S = 0.5
PROGRESS_INTERVAL_S = 2.0  # how often a waiting stream says that its engine still runs steps
_MULTIPLEX_WRAPPER = "__serve_multiplex_wrapper"  # where @serve.multiplexed keeps a replica's sets


def adapter_set_id(digests: dict[str, str]) -> str:
    """The multiplexed model id of a set of adapters (name -> SHA-256); '' for none."""
    return "+".join(f"{name}@{digest}" for name, digest in sorted(digests.items()))


def parse_adapter_set_id(model_id: str) -> list[tuple[str, str]]:
    """``(name, sha256)`` pairs of a multiplexed model id."""
    return [tuple(part.rsplit("@", 1)) for part in model_id.split("+")] if model_id else []


async def batches(events: asyncio.Queue, steps: Callable[[], Awaitable[int]],
                  interval: float = PROGRESS_INTERVAL_S) -> AsyncIterator[list]:
    """The lists a request's stream yields: what its job put in ``events``, all that came
    while the last list was on its way as one list; and ``[("alive",)]`` after each
    ``interval`` in which the job put nothing but the engine ran steps (``steps()``: how
    many it has run so far). Never ends by itself: the caller stops at the outcome."""
    last = await steps()
    while True:
        try:
            first = await asyncio.wait_for(events.get(), interval)
        except asyncio.TimeoutError:
            now = await steps()
            if now != last:
                last = now
                yield [("alive",)]
            continue
        batch = [first]
        while not events.empty():
            batch.append(events.get_nowait())
        yield batch


class StallWatch:
    """Whether a replica is stuck: requests running and its engine running no step for
    longer than ``limit_s`` (0: never said). A replica stuck in a step still answers Ray
    Serve's health checks from its event loop; failing them gets it replaced."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._invokes = -1
        self._since = 0.0

    def stalled_for(self, working: int, invokes: int, now: float) -> float | None:
        """Seconds without a step while ``working`` requests are at work on the engine
        (``invokes``: its steps so far; ``now``: a monotonic clock), when more than the
        limit; else None."""
        if working == 0 or invokes != self._invokes:
            self._invokes, self._since = invokes, now
            return None
        stalled = now - self._since
        return stalled if self.limit_s and stalled > self.limit_s else None


@dataclass(frozen=True)
class ReplicaConfig:
    """What every replica builds its engine from (the same on every node)."""

    model: str
    engine: EngineSettings
    tokenizer: str | None = None  # a tokenizer file; None: the bundle's, or byte tokens
    byte_tokens: bool = False
    stop_tokens: tuple[int, ...] = ()  # with byte tokens
    draft_heads: bool = True
    state_actor: str = ""
    namespace: str = ""
    # Seconds a replica with requests running may run no step before its health checks
    # fail (the ingress's --replica-timeout; 0: never).
    stall_s: float = 0.0


class AdapterSet:
    """The adapters of one multiplexed id on one replica (name -> the engine's id); held
    in Ray Serve's cache of the replica's sets until it is evicted."""

    def __init__(self, replica: EngineReplica, model_id: str, ids: dict[str, int]) -> None:
        self.model_id = model_id
        self.ids = ids
        self._replica = replica
        self._released = False

    def release(self) -> None:
        """Lets the adapters go (unregistered once nothing else uses them); twice is harmless."""
        if not self._released:
            self._released = True
            self._replica._evicted(self)

    def __del__(self) -> None:  # what Ray Serve calls when the set is evicted
        self.release()


class EngineReplica:
    """The replica's deployment class (made a deployment, with its multiplexed loader, by
    :func:`runtime.serve.cluster.launch.deployment`)."""

    def __init__(self, config: ReplicaConfig) -> None:
        import ray
        from ray import serve

        self._serve = serve
        self.name = serve.get_replica_context().replica_id.unique_id
        tokenizer = ByteTokenizer(stop_token_ids=config.stop_tokens) if config.byte_tokens else config.tokenizer
        self.engine = Engine(config.model, config.engine, tokenizer=tokenizer)
        self._config = config
        self._state = ray.get_actor(config.state_actor, namespace=config.namespace)
        self._lock = threading.Lock()
        self._refs: dict[int, int] = {}  # the engine's adapter id -> sets and requests holding it
        self._version = 0
        self._catalogue: dict[str, dict[str, str]] = {}
        self._counts = {"loads": 0, "evictions": 0, "hits": 0, "misses": 0, "requests": 0, "generated_tokens": 0,
                        "load_seconds": 0.0}
        self._running = 0  # requests between their first event and their stream's end
        self._working = 0  # of them, those whose job is at work on the engine
        self._sync_task: asyncio.Task | None = None
        self._stalls = StallWatch(config.stall_s)

    # -- Ray Serve's calls -------------------------------------------------------

    async def load_adapter_set(self, model_id: str) -> AdapterSet:
        """Registers every adapter of ``model_id`` (each checked against its digest)."""
        started = time.perf_counter()
        ids: dict[str, int] = {}
        try:
            for name, digest in parse_adapter_set_id(model_id):
                entry = await self._state.entry.remote(name)
                if entry is None:
                    raise NotFoundError(f"adapter {name!r} is not loaded; GET /v1/models lists what is")
                if entry["sha256"] != digest:
                    raise FailedPreconditionError(
                        f"adapter {name!r} was loaded again from another file while the request was on its way")
                source = LoraSource(path=entry["path"], sha256=digest, heads=self._config.draft_heads)
                try:
                    lora_id = await asyncio.to_thread(self.engine.register_adapter, source)
                except DataLossError:
                    raise FailedPreconditionError(
                        f"adapter {name!r}: its file changed (its SHA-256 is not the one registered) since it was "
                        "loaded; unload it and load it again to use the new file") from None
                self._hold(lora_id)
                ids[name] = lora_id
        except BaseException:
            for lora_id in ids.values():
                self._let_go(lora_id)
            raise
        with self._lock:
            self._counts["loads"] += 1
            self._counts["load_seconds"] += time.perf_counter() - started
        return AdapterSet(self, model_id, ids)

    async def generate(self, request: GenerationRequest, scales: dict[str, float]) -> AsyncIterator[tuple]:
        """Runs one generation (adapters by name, with their scales) as a stream of events."""
        self._start_sync()
        model_id = self._serve.get_multiplexed_model_id()
        held: list[int] = []
        hit = True
        if model_id:
            hit = model_id in getattr(getattr(self, _MULTIPLEX_WRAPPER, None), "models", {})
            adapters = await self.load_adapter_set(model_id)
            with self._lock:
                self._counts["hits" if hit else "misses"] += 1
            for lora_id in adapters.ids.values():
                self._hold(lora_id)
                held.append(lora_id)
            request = replace(request, adapters={adapters.ids[name]: scale for name, scale in scales.items()})
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def put(item: object) -> None:
            loop.call_soon_threadsafe(events.put_nowait, item)

        job = GenerationJob(self.engine, request, on_text=lambda text: put(("text", text)),
                            on_start=lambda: put(("start",)))

        def work() -> None:
            try:
                job.prepare()
                put(("outcome", job.run()))
            except BaseException as exc:
                job.close()
                put(exc)
            finally:
                with self._lock:
                    self._working -= 1

        with self._lock:
            self._running += 1
            self._counts["requests"] += 1
        worker = threading.Thread(target=work, name="replica-request", daemon=True)
        try:
            yield [("replica", self.name, hit)]
            with self._lock:
                self._working += 1
            try:
                worker.start()
            except BaseException:  # no thread to count itself out
                with self._lock:
                    self._working -= 1
                raise
            async for batch in batches(events, lambda: asyncio.to_thread(lambda: self.engine.stats().invokes)):
                for item in batch:
                    if isinstance(item, BaseException):
                        raise item
                    if item[0] == "outcome":
                        with self._lock:
                            self._counts["generated_tokens"] += item[1].completion_tokens
                yield batch
                if batch[-1][0] == "outcome":
                    return
        finally:
            job.cancel()  # the caller went away (or it ended): stop before the next step
            if worker.is_alive():
                await asyncio.to_thread(worker.join)
            with self._lock:
                self._running -= 1
            for lora_id in held:
                self._let_go(lora_id)

    def report(self) -> dict:
        """This replica's numbers (also sent with every sync)."""
        stats = self.engine.stats()
        with self._lock:
            counts = dict(self._counts)
            running = self._running
        resident_sets = len(getattr(getattr(self, _MULTIPLEX_WRAPPER, None), "models", {}))
        return {**counts, "running": running, "pid": os.getpid(), "resident_sets": resident_sets,
                "registered_adapters": len(stats.adapters), "resident_bytes": stats.resident_bytes,
                "adapter_bytes": sum(adapter.tensor_bytes for adapter in stats.adapters),
                "adapters": sorted(self._names())}

    async def check_health(self) -> None:
        """Ray Serve's periodic health check: starts the sync loop if no request did, and
        fails while requests run and the engine has run no step for longer than
        ``stall_s`` (three failures in a row and Ray Serve replaces the replica)."""
        self._start_sync()
        invokes = await asyncio.to_thread(lambda: self.engine.stats().invokes)
        with self._lock:
            working = self._working
        stalled = self._stalls.stalled_for(working, invokes, time.monotonic())
        if stalled is not None:
            raise RuntimeError(f"replica {self.name}: {working} request(s) running and its engine ran no step for "
                               f"{stalled:.0f} s (--replica-timeout {self._stalls.limit_s:g}): stuck")

    # -- internals ---------------------------------------------------------------

    def _names(self) -> set[str]:
        wrapper = getattr(self, _MULTIPLEX_WRAPPER, None)
        names = set()
        for model in list(getattr(wrapper, "models", {}).values()):
            names.update(model.ids)
        return names

    def _hold(self, lora_id: int) -> None:
        with self._lock:
            self._refs[lora_id] = self._refs.get(lora_id, 0) + 1

    def _let_go(self, lora_id: int) -> None:
        with self._lock:
            self._refs[lora_id] -= 1
            if self._refs[lora_id] > 0:
                return
            del self._refs[lora_id]
        try:
            self.engine.unload_adapter(lora_id)
        except (NotFoundError, FailedPreconditionError) as exc:
            log.warning("replica %s: could not unregister adapter %d: %s", self.name, lora_id, exc)

    def _evicted(self, adapters: AdapterSet) -> None:
        with self._lock:
            self._counts["evictions"] += 1
        for lora_id in adapters.ids.values():
            self._let_go(lora_id)

    def _start_sync(self) -> None:
        if self._sync_task is None or self._sync_task.done():
            self._sync_task = asyncio.get_running_loop().create_task(self._sync_forever())

    async def _sync_forever(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self._sync()
            await asyncio.sleep(SYNC_INTERVAL_S)

    async def _sync(self) -> None:
        report = await asyncio.to_thread(self.report)
        version, entries = await self._state.sync.remote(self.name, report)
        if version == self._version:
            return
        self._version, self._catalogue = version, entries
        wrapper = getattr(self, _MULTIPLEX_WRAPPER, None)
        if wrapper is None:
            return
        stale = [model_id for model_id in list(wrapper.models) if any(
            entries.get(name, {}).get("sha256") != digest for name, digest in parse_adapter_set_id(model_id))]
        for model_id in stale:  # unloaded or replaced in the catalogue: dropped from this replica too
            adapters = wrapper.models.pop(model_id, None)
            if adapters is not None:
                adapters.release()
        if stale:
            wrapper._push_multiplexed_replica_info = True  # Ray Serve's router learns it at the next push
