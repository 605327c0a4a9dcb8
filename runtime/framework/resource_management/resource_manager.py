"""ResourceManager: what the sessions of one model share, and one session's runs over it.

It hands out adapter ids (through the :class:`AdapterRegistry`: LiteRT-LM's
``AssignLoraId``), makes and clones contexts (``CreateContextHandler``,
``CloneContextHandler``), and lends executors (``AcquireExecutor``), bound to a context
for a run (``AcquireExecutorWithContextHandler``): each run happens inside ``with
resources.acquire_executor_with_context_handler(context) as binding:``, where the
context's blend is acquired (made resident if needed, active meanwhile) and the
executor's arguments rebuilt only if those buffers changed. When the residency policy
evicts a blend, the idle contexts bound to it drop their bindings, so its memory really
goes. :meth:`ResourceManager.prefill`, :meth:`ResourceManager.decode_alone` and
:meth:`ResourceManager.verify` are a context's kinds of run; batching them is the
:class:`DecodeBatcher`'s job, speculation the engine's.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager

import numpy as np

from runtime.components.lora import LoRA
from runtime.components.lora_manager import Blend
from runtime.executor.litert_executor import Binding, LlmExecutor
from runtime.executor.model_spec import ModelSpec
from runtime.framework.lora_source import LoraSource
from runtime.framework.resource_management.adapter_registry import AdapterRegistry
from runtime.framework.resource_management.context_handler import ContextHandler
from runtime.framework.resource_management.executor_pool import ExecutorPool
from runtime.framework.resource_management.prefix_cache import PrefixCache, PrefixCacheStats
from runtime.util.latency import LatencyRecorder
from runtime.util.signature_names import LoraSlot


class ResourceManager:
    """Adapter ids, contexts, and the executors lent to their runs. Thread-safe."""

    def __init__(self, pool: ExecutorPool, registry: AdapterRegistry, *, prefix_cache_bytes: int = 0) -> None:
        """``pool``: the model's executors; ``registry``: its adapters (built on the
        pool's first executor's buffers); ``prefix_cache_bytes``: the budget of the
        :class:`PrefixCache` of prompt heads (0: none)."""
        self.pool = pool
        self.registry = registry
        self.spec: ModelSpec = pool.spec
        registry.on_evict(self._unbind_evicted)
        self._contexts: weakref.WeakSet[ContextHandler] = weakref.WeakSet()
        self._contexts_lock = threading.Lock()  # WeakSet iteration is not thread-safe
        self._last_context = 0  # id() of the previous run's context (0: none yet), for switches
        self._last_lora: LoRA | None = None
        self.switch_latency = LatencyRecorder()
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes else None

    # -- adapters ------------------------------------------------------------------

    def assign_lora_id(self, source: LoraSource) -> int:
        """The id of adapter ``source``, registering it the first time (LiteRT-LM's
        ``AssignLoraId``): the same file or bytes get the same id."""
        return self.registry.register(source)

    def unload_adapter(self, lora_id: int) -> None:
        """Unregisters an adapter no live context uses; the prompts it computed leave the
        prefix cache."""
        self.registry.unload(lora_id)
        if self.prefix_cache is not None:
            self.prefix_cache.drop_adapter(lora_id)

    def slot_for(self, blend: Blend, names: Mapping[int, str] | None = None) -> LoraSlot | None:
        """The LoRA slot ``blend`` runs in (``None``: the base model), or
        ``InvalidArgumentError`` naming its adapters (as ``names`` does, default their
        sources) and why no slot of the model can run it."""
        return self.registry.slot_for(blend, names) if blend else None

    def row_slot(self, blend: Blend) -> LoraSlot | None:
        """:meth:`slot_for` for a batch row: ``None`` also when an adapter of it is gone
        (the row's own acquire then reports why)."""
        return self.registry.slot_or_none(blend)

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The prefix cache's counters (``None``: there is none)."""
        return self.prefix_cache.stats() if self.prefix_cache is not None else None

    # -- contexts ------------------------------------------------------------------

    def create_context_handler(self, sources: Iterable[LoraSource] = (),
                               registered: Iterable[tuple[int, float]] = ()) -> ContextHandler:
        """A fresh context using ``sources`` (registered if needed) and the already
        registered ``(lora_id, scale)`` entries; an unload cannot slip in between. The KV
        cache is made first, so a failure (an adapter refused, no memory for the cache)
        leaves no adapter registered or pinned by this call."""
        kv = self.pool.primary.create_kv_cache()
        try:
            blend = self.registry.pinned_blend(sources, registered)
        except BaseException:
            kv.close()
            raise
        context = ContextHandler(blend, kv)
        self._track(context)
        return context

    def clone_context_handler(self, context: ContextHandler) -> ContextHandler:
        """A new context with a copy of ``context``'s KV cache, position, pending token and
        adapters."""
        self.registry.pin(context.blend)
        try:
            kv = self.pool.primary.copy_kv_cache(context.kv, context.position)
        except BaseException:
            self.registry.unpin(context.blend)
            raise
        clone = ContextHandler(context.blend, kv, context.position, context.pending)
        self._track(clone)
        return clone

    def set_adapters(self, context: ContextHandler, sources: Iterable[LoraSource] = (),
                     registered: Iterable[tuple[int, float]] = ()) -> None:
        """Switches a context to ``sources`` (registered if needed) and the registered
        ``(lora_id, scale)`` entries, like :meth:`create_context_handler`."""
        blend = self.registry.pinned_blend(sources, registered)
        self.registry.unpin(context.blend)
        context.blend = blend  # the next run binds the new buffers (or a recent binding)

    def release_context(self, context: ContextHandler) -> None:
        """Unpins the context's adapters and drops its KV cache."""
        self.registry.unpin(context.blend)
        context.blend = ()
        context.forget_binding()
        context.kv.close()

    def _track(self, context: ContextHandler) -> None:
        with self._contexts_lock:
            self._contexts.add(context)

    # -- runs ----------------------------------------------------------------------

    def acquire_executor(self) -> AbstractContextManager[LlmExecutor]:
        """``with resources.acquire_executor() as executor:`` one executor of the pool for
        the block, bound to no context (a batch binds each of its rows)."""
        return self.pool.borrow()

    def acquire_executor_with_context_handler(self, context: ContextHandler, executor: LlmExecutor | None = None,
                                              slot: LoraSlot | None = None) -> Run:
        """``with resources.acquire_executor_with_context_handler(context) as binding:``
        one run of ``context``: its blend is active (and an executor taken) until the
        block ends. The binding is the executor's prebuilt arguments for the context's KV
        cache and adapter buffers. ``executor`` and ``slot``: a batch's executor and the
        rank slot the plan gives this row (see :class:`Run`)."""
        return Run(self, context, executor, slot)

    def prefill(self, context: ContextHandler, tokens: Sequence[int]) -> np.ndarray:
        """Appends ``tokens`` to ``context`` at its position; the logits after the last.
        (The caller advances the position.) With a prefix cache, a prompt from position 0
        starts from the longest cached head of its blend whose rest runs the decode steps
        a whole prefill would (the same positions computed the same way: the logits are
        a fresh prefill's, bit for bit), and the positions its prefill signatures wrote
        are cached after. A prompt longer than the KV cache takes nothing from the cache:
        its prefill refuses it as without one."""
        cache = self.prefix_cache
        with self.acquire_executor_with_context_handler(context) as binding:
            executor = binding.executor
            if cache is None or context.position or len(tokens) > self.spec.kv_length:
                return executor.prefill(binding, tokens, context.position)
            decoded = executor.prefill_decode_steps(len(tokens), 0)
            hit = cache.lookup(context.blend, tokens, usable=lambda length: decoded == executor.prefill_decode_steps(
                len(tokens) - length, length))
            start = 0
            if hit is not None:
                executor.write_kv_prefix(context.kv, hit.prefix, hit.length)
                start = hit.length
            logits = executor.prefill(binding, tokens[start:], start)
            prefilled = tokens[:len(tokens) - decoded]
            if cache.wants(context.blend, prefilled, self.spec.kv_cache_bytes // self.spec.kv_length):
                cache.store(context.blend, prefilled, executor.read_kv_prefix(context.kv, len(prefilled)))
            return logits

    def verify(self, context: ContextHandler, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """One verify run of ``context``: ``tokens`` at its position and after, by itself
        (not in a decode batch); the logits and final hidden states of each. (The caller
        advances the position by what it keeps.)"""
        with self.acquire_executor_with_context_handler(context) as binding:
            return binding.executor.verify(binding, tokens, context.position)

    def score(self, context: ContextHandler, tokens: Sequence[int], decode_steps: bool = False) -> np.ndarray:
        """``tokens`` appended to ``context`` at its position, by themselves (no prefix
        cache: every position's logits are computed); the logits after each, ``(n, vocab)``.
        (The caller advances the position.)"""
        with Run(self, context) as binding:
            return binding.executor.score(binding, tokens, context.position, decode_steps=decode_steps)

    def decode_alone(self, context: ContextHandler, token: int) -> np.ndarray:
        """One decode step of ``context`` by itself: the single-session path."""
        with self.acquire_executor_with_context_handler(context) as binding:
            return binding.executor.decode(binding, token, context.position)

    def _bind(self, context: ContextHandler, lora: LoRA | None, executor: LlmExecutor) -> Binding:
        """``context``'s binding to ``lora``'s buffers (or none) on ``executor``: the
        current one, a recent one, or a new one."""
        return context.use_binding(
            executor,
            lora,
            lambda: executor.bind(context.kv, lora.buffers, lora.slot)
            if lora is not None
            else executor.bind(context.kv),
        )

    def _record_switch(self, context: ContextHandler, lora: LoRA | None, started: float) -> None:
        """Records a switch (and its latency since ``started``) when a single-session run's
        context or adapter buffers differ from the previous one's."""
        if self._last_context != id(context) or self._last_lora is not lora:
            if self._last_context:
                self.switch_latency.record(time.perf_counter() - started)
            self._last_context, self._last_lora = id(context), lora

    def _unbind_evicted(self, blend: Blend, lora: LoRA) -> None:
        """Lets idle contexts drop their references to evicted buffers (a running context
        cannot hold them: active blends are never evicted)."""
        with self._contexts_lock:
            contexts = list(self._contexts)
        for context in contexts:
            context.forget_lora(lora)

    def close(self) -> None:
        """Closes the executors; contexts still alive can no longer run."""
        self.pool.close()


class Run:
    """One run of a context, as a context manager (see :meth:`ResourceManager.acquire_executor_with_context_handler`).

    Entering acquires the context's blend (resident if needed, active until the run ends)
    and an executor, and binds them; leaving gives both back. A switch (and its latency)
    is recorded when this run's context or adapter buffers differ from the previous
    run's. A plain class rather than a generator: it brackets every decode step.
    """

    __slots__ = ("_resources", "_context", "_blend", "_executor", "_pooled", "_slot")

    def __init__(self, resources: ResourceManager, context: ContextHandler, executor: LlmExecutor | None = None,
                 slot: LoraSlot | None = None) -> None:
        """``executor``: the one a batch runs on (its rows record no switches); ``None``
        takes one (from the pool, if any) for this run. ``slot``: the rank slot to bind
        the blend in (a larger one than its own holds it zero-padded; ``None``: its own)."""
        self._resources = resources
        self._context = context
        self._executor = executor
        self._slot = slot
        self._pooled = executor is None

    def __enter__(self) -> Binding:
        started = time.perf_counter()
        resources, context = self._resources, self._context
        self._blend = blend = context.blend
        lora = resources.registry.acquire(blend, self._slot) if blend else None
        try:
            if self._pooled:  # waits while the pool's executors are busy: an interrupt lands here
                self._executor = resources.pool.take()
            executor = self._executor
            # Only the session's own thread binds (use_binding); an eviction on another thread
            # may drop the binding meanwhile (forget_lora). Both write the binding before its
            # LoRA, so the LoRA is read first: the other way round, a binding read just before
            # an eviction of its buffers, its LoRA read as None just after, passed for a
            # base-model binding.
            bound_lora = context.bound_lora
            binding = context.binding
            if binding is None or bound_lora is not lora or binding.executor is not executor:
                binding = resources._bind(context, lora, executor)
        except BaseException:
            self.__exit__()
            raise
        if self._pooled:
            resources._record_switch(context, lora, started)
        return binding

    def __exit__(self, *exc_info: object) -> None:
        if self._pooled and self._executor is not None:  # None: interrupted before the pool lent one
            self._resources.pool.give_back(self._executor)
        if self._blend:
            self._resources.registry.release(self._blend, self._slot)
