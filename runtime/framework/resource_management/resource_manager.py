"""ResourceManager: adapter ids, the LoRA manager and the executor, shared by all sessions.

* The same adapter gets the same id: a file (or a PEFT directory's files) is identified
  by device, inode, size and modification time (so another path or a symlink to it is
  the same adapter, and a rewritten file is a new one); an in-memory blob by the
  SHA-256 of its content.
* Each adapter is parsed once, under the lock; one that fails leaves no id behind.
* Contexts pin their adapters, so an adapter a live session uses cannot be unloaded.
* Each run happens inside ``with resources.run(context) as binding:``: the context's
  blend is acquired (materialized if needed, protected from eviction meanwhile) and the
  executor arguments rebuilt only if those buffers changed. When the residency policy evicts a
  blend, the idle contexts bound to it drop their bindings, so its memory really goes.
* Decode steps go through :meth:`decode`: on a model with batched decode signatures,
  steps that sessions request from different threads at the same time run together
  (a :class:`BatchScheduler`), each row with its own KV cache and adapter buffers.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import Counter
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext

import numpy as np

from runtime.components.lora import LoRA
from runtime.components.lora_manager import Blend, LoraManager, normalize_blend
from runtime.components.residency import ResidencyPolicy
from runtime.executor.batch_scheduler import BatchPolicy, BatchScheduler
from runtime.executor.litert_executor import Binding, DecodeStep, LlmExecutor
from runtime.errors import NotFoundError, StatusError
from runtime.framework.lora_source import LoraSource
from runtime.framework.resource_management.adapter_stats import AdapterReport, AdapterStats, ResidentStats
from runtime.framework.resource_management.context_handler import ContextHandler
from runtime.util.adapter_formats import AdapterKey
from runtime.util.latency import LatencyRecorder, LatencySummary


class ResourceManager:
    """Owns the executor's adapters and hands sessions their contexts. Thread-safe."""

    def __init__(
        self,
        executors: LlmExecutor | Sequence[LlmExecutor],
        *,
        residency: ResidencyPolicy | None = None,
        allow_non_finite: bool = False,
        batch_wait_s: float | None = None,
    ) -> None:
        """``executors``: one executor, or a pool of executors of the same model; KV
        caches and adapter buffers are made by the first and bound to whichever runs.
        ``batch_wait_s``: with a model that has batched decode signatures, how long a
        batch waits for the sessions of the previous one to come back (``None``: no
        batching, sessions take turns)."""
        self.executors = [executors] if isinstance(executors, LlmExecutor) else list(executors)
        self.executor = executor = self.executors[0]
        spec = executor.spec
        self._idle: queue.SimpleQueue[LlmExecutor] | None = None
        if len(self.executors) > 1:
            self._idle = queue.SimpleQueue()
            for each in self.executors:
                self._idle.put(each)
        self._lora_manager = LoraManager(
            spec.lora_slots,
            executor.create_lora_buffer,
            residency=residency,
            allow_non_finite=allow_non_finite,
        )
        self._lora_manager.add_evict_listener(self._unbind_evicted)
        self._ids: dict[AdapterKey, int] = {}
        self._next_id = 1
        self._lock = threading.RLock()
        self._contexts: weakref.WeakSet[ContextHandler] = weakref.WeakSet()
        self._contexts_lock = threading.Lock()  # WeakSet iteration is not thread-safe
        self._last_context = 0  # id() of the previous run's context (0: none yet), for switches
        self._last_lora: LoRA | None = None
        self.load_latency = LatencyRecorder()
        self.switch_latency = LatencyRecorder()
        self.queue_wait = LatencyRecorder()  # of batched decode steps
        self._batch_sizes: Counter[int] = Counter()  # rows -> batches of that many rows
        self._batch_sizes_lock = threading.Lock()  # not self._lock: registering may hold that one long
        self._batcher: BatchScheduler[tuple[ContextHandler, int], np.ndarray] | None = None
        largest = max((s.rows for s in spec.signatures.values()), default=1)
        if batch_wait_s is not None and largest > 1:
            self._batcher = BatchScheduler(self._decode_together, BatchPolicy(largest, batch_wait_s),
                                           on_batch=self._record_batch)

    # -- adapter ids ---------------------------------------------------------------

    def register(self, source: LoraSource) -> int:
        """Loads ``source`` once and returns its id; a failure registers nothing."""
        origin = source.origin()
        with self._lock:
            known = origin.key in self._ids
            lora_id = self._id_for(origin.key)
            if self._lora_manager.has_lora(lora_id):
                return lora_id
            started = time.perf_counter()
            try:
                if source.sha256 is not None:
                    origin.check_sha256(source.sha256)
                data = origin.open(head_dim=self.executor.spec.head_dim)
                try:
                    self._lora_manager.load_lora(lora_id, data)
                except BaseException:
                    data.close()
                    raise
            except BaseException:
                if not known:
                    del self._ids[origin.key]
                raise
            self.load_latency.record(time.perf_counter() - started)
            return lora_id

    def unload(self, lora_id: int) -> None:
        """Unloads an adapter no live session uses, and forgets its id."""
        with self._lock:
            self._lora_manager.unload_lora(lora_id)
            for key in [k for k, v in self._ids.items() if v == lora_id]:
                del self._ids[key]

    def adapter_ids(self) -> list[int]:
        """The ids of the registered adapters, ascending."""
        return self._lora_manager.loaded_ids()

    def set_residency(self, policy: ResidencyPolicy) -> None:
        """Changes which materialized adapters stay resident; applied at once."""
        self._lora_manager.set_residency(policy)

    def adapter_report(self) -> AdapterReport:
        """Every registered adapter with its bytes and users, the resident blends, and
        the residency counters."""
        manager = self._lora_manager
        resident = tuple(
            ResidentStats(blend, lora.slot_rank, lora.nbytes) for (blend, _), lora in manager.resident().items()
        )
        adapters = []
        for lora_id in manager.loaded_ids():
            try:
                plan = manager.plan(lora_id)
            except NotFoundError:
                continue  # unloaded meanwhile
            adapters.append(AdapterStats(
                lora_id=lora_id,
                source=plan.source_name,
                format=plan.data.format_name,
                rank=plan.rank,
                tensor_bytes=plan.data.nbytes,
                resident_bytes=sum(r.nbytes for r in resident if any(i == lora_id for i, _ in r.blend)),
                sessions=manager.pin_count(lora_id),
            ))
        return AdapterReport(tuple(adapters), resident, manager.residency_stats())

    def invoke_totals(self) -> tuple[int, float]:
        """Signature runs so far on all executors, and the seconds spent inside them."""
        return (sum(e.invokes for e in self.executors), sum(e.invoke_seconds for e in self.executors))

    def _id_for(self, key: AdapterKey) -> int:
        if key not in self._ids:
            self._ids[key] = self._next_id
            self._next_id += 1
        return self._ids[key]

    # -- contexts ------------------------------------------------------------------

    def new_context(self, sources: Iterable[LoraSource] = (), registered: Iterable[tuple[int, float]] = ()
                    ) -> ContextHandler:
        """A fresh context using ``sources`` (registered if needed) and the already
        registered ``(lora_id, scale)`` entries. Registration and pinning happen under
        one lock, so a concurrent unload cannot slip in between."""
        return self._context_for(self._pinned(sources, registered))

    def clone_context(self, context: ContextHandler) -> ContextHandler:
        """A new context with a copy of ``context``'s KV cache, position and adapters."""
        self._pin(context.blend)
        try:
            kv = self.executor.copy_kv_cache(context.kv)
        except BaseException:
            self._unpin(context.blend)
            raise
        clone = ContextHandler(context.blend, kv, context.position)
        with self._contexts_lock:
            self._contexts.add(clone)
        return clone

    def set_adapters(self, context: ContextHandler, sources: Iterable[LoraSource] = (),
                     registered: Iterable[tuple[int, float]] = ()) -> None:
        """Switches a context to ``sources`` (registered if needed) and the registered
        ``(lora_id, scale)`` entries, atomically with respect to unload, like
        :meth:`new_context`."""
        self._switch(context, self._pinned(sources, registered))

    def _context_for(self, blend: Blend) -> ContextHandler:
        """A fresh context owning ``blend``'s pins (released if the KV cache cannot be made)."""
        try:
            context = ContextHandler(blend, self.executor.create_kv_cache())
        except BaseException:
            self._unpin(blend)
            raise
        with self._contexts_lock:
            self._contexts.add(context)
        return context

    def _switch(self, context: ContextHandler, blend: Blend) -> None:
        self._unpin(context.blend)
        context.blend = blend  # the next run binds the new buffers (or a recent binding)

    def _pinned_blend(self, entries: Iterable[tuple[int, float]]) -> Blend:
        """The blend of ``entries``, checked and pinned; under the lock :meth:`unload` takes."""
        with self._lock:
            blend = self._check_blend(entries)
            self._pin(blend)
        return blend

    def _pinned(self, sources: Iterable[LoraSource], registered: Iterable[tuple[int, float]]) -> Blend:
        """Registers ``sources`` and pins their blend with ``registered`` without releasing
        the lock between."""
        with self._lock:
            entries = [(self.register(source), source.scale) for source in sources]
            return self._pinned_blend(entries + list(registered))

    def release_context(self, context: ContextHandler) -> None:
        """Unpins the context's adapters and drops its KV cache."""
        self._unpin(context.blend)
        context.blend = ()
        context.forget_binding()
        context.kv.close()

    def run(self, context: ContextHandler) -> Run:
        """``with resources.run(context) as binding:`` one run of ``context``: its blend is
        protected from eviction (and, with a pool, an executor is taken) until the block
        ends. The binding is the executor's prebuilt arguments for the context's KV cache
        and adapter buffers (see :class:`Run`)."""
        return Run(self, context)

    def decode(self, context: ContextHandler, token: int) -> np.ndarray:
        """One decode step of ``context`` at its position: the logits for the next token.
        Batched with other sessions' steps when the model allows it (the caller's thread
        waits at most the batch wait for others, and never when it is alone)."""
        if self._batcher is not None:
            return self._batcher.submit((context, token))
        with Run(self, context) as binding:
            return binding.executor.decode(binding, token, context.position)

    def streaming(self) -> AbstractContextManager[None]:
        """``with resources.streaming():`` around a loop of :meth:`decode` calls (a
        generation): batches being formed wait (briefly) for this caller's next step."""
        return self._batcher.streaming() if self._batcher is not None else nullcontext()

    def decode_together(self, steps: Sequence[tuple[ContextHandler, int]]) -> list[np.ndarray]:
        """One decode step for each ``(context, token)`` at its position, batched as the
        model allows (see :meth:`decode`); raises the first row's error if any failed."""
        outcomes = self._decode_together(steps)
        self._record_batch(len(steps), ())  # no queue: nothing waited
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return outcomes  # type: ignore[return-value]

    def batch_report(self) -> tuple[tuple[tuple[int, int], ...], LatencySummary]:
        """Batched decode so far: ``(rows, batches)`` by rows, and the steps' wait in the queue."""
        with self._batch_sizes_lock:
            sizes = tuple(sorted(self._batch_sizes.items()))
        return sizes, self.queue_wait.summary()

    def _decode_together(self, steps: Sequence[tuple[ContextHandler, int]]) -> list[np.ndarray | BaseException]:
        """Runs queued decode steps on one executor: each row's run is entered (its blend
        acquired and bound) and left around one :meth:`LlmExecutor.decode_batch`. A
        step alone runs as without batching."""
        if len(steps) == 1:
            context, token = steps[0]
            with Run(self, context) as binding:
                return [binding.executor.decode(binding, token, context.position)]
        executor = self._idle.get() if self._idle is not None else self.executor
        outcomes: list[np.ndarray | BaseException | None] = [None] * len(steps)
        slots = self._batch_slots([context.blend for context, _ in steps], executor)
        try:
            with ExitStack() as runs:
                ready, rows = [], []
                for index, ((context, token), slot) in enumerate(zip(steps, slots)):
                    try:
                        binding = runs.enter_context(Run(self, context, executor, slot))
                    except Exception as exc:  # this row alone: an evicted or unloaded adapter, a closed model
                        outcomes[index] = exc
                        continue
                    ready.append(index)
                    rows.append(DecodeStep(binding, token, context.position))
                for index, outcome in zip(ready, executor.decode_batch(rows) if rows else ()):
                    outcomes[index] = outcome
        finally:
            if self._idle is not None:
                self._idle.put(executor)
        return outcomes  # type: ignore[return-value]

    def _batch_slots(self, blends: Sequence[Blend], executor: LlmExecutor) -> list[int | None]:
        """The rank slot each row of a batch runs in: rows of smaller slots are padded into
        the largest slot among the rows that has batched signatures, so that they share
        its batch (zero rank columns: exact); ``None`` keeps a row's own slot."""
        own: list[int | None] = []
        for blend in blends:
            try:
                own.append(self._lora_manager.slot_for(blend) if blend else None)
            except StatusError:  # an unloaded adapter: the row's own run reports it
                own.append(None)
        host = max((slot for slot in own if slot is not None and executor.spec.batch_sizes(slot)), default=None)
        if host is None:
            return [None] * len(blends)
        return [host if slot is not None and slot < host else None for slot in own]

    def _record_batch(self, rows: int, waits: Sequence[float]) -> None:
        with self._batch_sizes_lock:
            self._batch_sizes[rows] += 1
        for wait in waits:
            self.queue_wait.record(wait)

    def _bind(self, context: ContextHandler, lora: LoRA | None, executor: LlmExecutor) -> Binding:
        return context.use_binding(
            executor,
            lora,
            lambda: executor.bind(context.kv, lora.buffers, lora.slot_rank)
            if lora is not None
            else executor.bind(context.kv),
        )

    def _unbind_evicted(self, blend: Blend, lora: LoRA) -> None:
        """Lets idle contexts drop their references to evicted buffers (a running context
        cannot hold them: running blends are never evicted)."""
        with self._contexts_lock:
            contexts = list(self._contexts)
        for context in contexts:
            context.forget_lora(lora)

    def _check_blend(self, entries: Iterable[tuple[int, float]]) -> Blend:
        blend = normalize_blend(entries)
        if blend:
            self._lora_manager.slot_for(blend)  # raises if unknown ids or too large a rank
        return blend

    def _pin(self, blend: Blend) -> None:
        pinned = []
        try:
            for lora_id, _ in blend:
                self._lora_manager.pin(lora_id)
                pinned.append(lora_id)
        except BaseException:
            for lora_id in pinned:
                self._lora_manager.unpin(lora_id)
            raise

    def _unpin(self, blend: Blend) -> None:
        for lora_id, _ in blend:
            self._lora_manager.unpin(lora_id)

    def close(self) -> None:
        """Closes the executors; contexts still alive can no longer run."""
        for executor in self.executors:
            executor.close()


class Run:
    """One run of a context, as a context manager (see :meth:`ResourceManager.run`).

    Entering acquires the context's blend (materialized if needed, never evicted while
    held) and an executor, and binds them; leaving gives both back. A switch (and its
    latency) is recorded when this run's context or adapter buffers differ from the
    previous run's. A plain class rather than a generator: it brackets every decode step.
    """

    __slots__ = ("_resources", "_context", "_blend", "_executor", "_pooled", "_slot")

    def __init__(self, resources: ResourceManager, context: ContextHandler, executor: LlmExecutor | None = None,
                 slot: int | None = None) -> None:
        """``executor``: the one a batch runs on (its rows record no switches); ``None``
        takes one (from the pool, if any) for this run. ``slot``: a larger rank slot than
        the blend's own to run it in (zero-padded), for a batch of that slot."""
        self._resources = resources
        self._context = context
        self._executor = executor
        self._slot = slot
        self._pooled = executor is None and resources._idle is not None

    def __enter__(self) -> Binding:
        started = time.perf_counter()
        resources, context = self._resources, self._context
        self._blend = blend = context.blend
        lora = resources._lora_manager.acquire(blend, self._slot) if blend else None
        batched = self._executor is not None
        if not batched:
            self._executor = resources._idle.get() if self._pooled else resources.executor
        executor = self._executor
        try:
            binding = context.binding  # the session's own thread is the only one setting it
            if binding is None or context.bound_lora is not lora or binding.executor is not executor:
                binding = resources._bind(context, lora, executor)
        except BaseException:
            self.__exit__()
            raise
        if not batched and (resources._last_context != id(context) or resources._last_lora is not lora):
            if resources._last_context:
                resources.switch_latency.record(time.perf_counter() - started)
            resources._last_context, resources._last_lora = id(context), lora
        return binding

    def __exit__(self, *exc_info: object) -> None:
        resources = self._resources
        if self._pooled:
            resources._idle.put(self._executor)
        if self._blend:
            resources._lora_manager.release(self._blend, self._slot)
