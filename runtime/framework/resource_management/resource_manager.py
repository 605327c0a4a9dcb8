"""ResourceManager: what all sessions of one model share, and one session's runs over it.

It composes the :class:`AdapterRegistry` (adapter ids, pins, resident buffers), the
executors (one, or a pool of copies of the model) and the :class:`DecodeBatcher`, and
binds a context to them: each run happens inside ``with resources.run(context) as
binding:``, where the context's blend is acquired (made resident if needed, active
meanwhile) and the executor's arguments rebuilt only if those buffers changed. When the
residency policy evicts a blend, the idle contexts bound to it drop their bindings, so
its memory really goes. :meth:`ResourceManager.prefill` and :meth:`ResourceManager.decode`
are a context's two kinds of run.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from runtime.components.lora import LoRA
from runtime.components.lora_manager import Blend
from runtime.components.residency import ResidencyPolicy
from runtime.executor.litert_executor import Binding, LlmExecutor
from runtime.executor.model_spec import ModelSpec
from runtime.framework.lora_source import LoraSource
from runtime.framework.resource_management.adapter_registry import AdapterRegistry
from runtime.framework.resource_management.context_handler import ContextHandler
from runtime.framework.resource_management.decode_batcher import DecodeBatcher
from runtime.framework.resource_management.prefix_cache import PrefixCache, PrefixCacheStats
from runtime.errors import FailedPreconditionError
from runtime.adapters.draft_heads import DraftHeads
from runtime.util.latency import LatencyRecorder
from runtime.util.model_weights import ModelWeights
from runtime.util.signature_names import LoraSlot


class ResourceManager:
    """Owns the executors, the adapter registry and the decode batcher, and hands sessions
    their contexts. Thread-safe."""

    def __init__(
        self,
        executors: LlmExecutor | Sequence[LlmExecutor],
        *,
        base_weights: Callable[[], ModelWeights],
        residency: ResidencyPolicy | None = None,
        allow_non_finite: bool = False,
        batch_wait_s: float | None = None,
        output_projection: Callable[[], np.ndarray] | None = None,
        prefix_cache_bytes: int = 0,
    ) -> None:
        """``executors``: one executor, or a pool of executors of the same model; KV
        caches and adapter buffers are made by the first and bound to whichever runs.
        ``base_weights``: reads the model's projection weights (for R-only LoRA-XS).
        ``batch_wait_s``: with a model that has batched decode signatures, how long a
        batch waits for the sessions of the previous one to come back (``None``: no
        batching, sessions take turns). ``prefix_cache_bytes``: the budget of the
        :class:`PrefixCache` of prompt heads (0: none)."""
        self.executors = [executors] if isinstance(executors, LlmExecutor) else list(executors)
        self.executor = executor = self.executors[0]
        self.spec: ModelSpec = executor.spec
        # The executor given back last is taken first: a session stepping alone stays on one
        # executor (its binding and that model copy's weights stay warm) instead of alternating.
        self._idle: queue.LifoQueue[LlmExecutor] | None = None
        if len(self.executors) > 1:
            self._idle = queue.LifoQueue()
            for each in self.executors:
                self._idle.put(each)
        self.registry = AdapterRegistry(
            self.spec.lora_slots,
            executor.create_lora_buffer,
            head_dim=self.spec.head_dim,
            base_weights=base_weights,
            residency=residency,
            allow_non_finite=allow_non_finite,
            draft_width=self.spec.hidden_size,
            vocab_size=self.spec.vocab_size,
        )
        self._output_projection = output_projection
        self._lm_head: np.ndarray | None = None
        self._lm_head_lock = threading.Lock()
        self.registry.on_evict(self._unbind_evicted)
        self._contexts: weakref.WeakSet[ContextHandler] = weakref.WeakSet()
        self._contexts_lock = threading.Lock()  # WeakSet iteration is not thread-safe
        self._last_context = 0  # id() of the previous run's context (0: none yet), for switches
        self._last_lora: LoRA | None = None
        self.switch_latency = LatencyRecorder()
        self.batcher = DecodeBatcher(self, batch_wait_s)
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes else None

    def unload_adapter(self, lora_id: int) -> None:
        """Unregisters an adapter no live context uses; the prompts it computed leave the
        prefix cache."""
        self.registry.unload(lora_id)
        if self.prefix_cache is not None:
            self.prefix_cache.drop_adapter(lora_id)

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The prefix cache's counters (``None``: there is none)."""
        return self.prefix_cache.stats() if self.prefix_cache is not None else None

    def invoke_totals(self) -> tuple[int, float]:
        """Signature runs so far on all executors, and the seconds spent inside them."""
        return (sum(e.invokes for e in self.executors), sum(e.invoke_seconds for e in self.executors))

    # -- contexts ------------------------------------------------------------------

    def new_context(self, sources: Iterable[LoraSource] = (), registered: Iterable[tuple[int, float]] = ()
                    ) -> ContextHandler:
        """A fresh context using ``sources`` (registered if needed) and the already
        registered ``(lora_id, scale)`` entries; an unload cannot slip in between."""
        blend = self.registry.pinned_blend(sources, registered)
        try:
            context = ContextHandler(blend, self.executor.create_kv_cache())
        except BaseException:
            self.registry.unpin(blend)
            raise
        self._track(context)
        return context

    def clone_context(self, context: ContextHandler) -> ContextHandler:
        """A new context with a copy of ``context``'s KV cache, position, pending token and
        adapters."""
        self.registry.pin(context.blend)
        try:
            kv = self.executor.copy_kv_cache(context.kv)
        except BaseException:
            self.registry.unpin(context.blend)
            raise
        clone = ContextHandler(context.blend, kv, context.position, context.pending)
        self._track(clone)
        return clone

    def set_adapters(self, context: ContextHandler, sources: Iterable[LoraSource] = (),
                     registered: Iterable[tuple[int, float]] = ()) -> None:
        """Switches a context to ``sources`` (registered if needed) and the registered
        ``(lora_id, scale)`` entries, like :meth:`new_context`."""
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

    def run(self, context: ContextHandler, executor: LlmExecutor | None = None, slot: LoraSlot | None = None
            ) -> Run:
        """``with resources.run(context) as binding:`` one run of ``context``: its blend is
        active (and, with a pool, an executor is taken) until the block ends. The binding
        is the executor's prebuilt arguments for the context's KV cache and adapter
        buffers. ``executor`` and ``slot``: a batch's executor and the rank slot the plan
        gives this row (see :class:`Run`)."""
        return Run(self, context, executor, slot)

    def prefill(self, context: ContextHandler, tokens: Sequence[int]) -> np.ndarray:
        """Appends ``tokens`` to ``context`` at its position; the logits after the last.
        (The caller advances the position.) With a prefix cache, a prompt from position 0
        starts from the longest cached head of its blend and is cached after."""
        cache = self.prefix_cache
        with Run(self, context) as binding:
            executor = binding.executor
            if cache is None or context.position:
                return executor.prefill(binding, tokens, context.position)
            hit = cache.lookup(context.blend, tokens)
            start = 0
            if hit is not None:
                executor.write_kv_prefix(context.kv, hit.prefix, hit.length)
                start = hit.length
            logits = executor.prefill(binding, tokens[start:], start)
            if cache.wants(context.blend, tokens, self.spec.kv_cache_bytes // self.spec.kv_length):
                cache.store(context.blend, tokens, executor.read_kv_prefix(context.kv, len(tokens)))
            return logits

    def decode(self, context: ContextHandler, token: int) -> np.ndarray:
        """One decode step of ``context`` at its position, batched with other sessions'
        steps where the model allows (see :class:`DecodeBatcher`); the logits for the next
        token. (The caller advances the position.)"""
        return self.batcher.decode(context, token)

    def draft_heads(self, context: ContextHandler) -> DraftHeads | None:
        """The draft heads ``context`` speculates with: those of its adapter when it runs
        exactly one adapter that carries heads (a blend of several uses none)."""
        blend = context.blend
        return self.registry.draft_heads(blend[0][0]) if len(blend) == 1 else None

    def lm_head(self) -> np.ndarray:
        """The model's output projection ``[vocab, hidden]`` float32 (read once)."""
        with self._lm_head_lock:
            if self._lm_head is None:
                if self._output_projection is None:
                    raise FailedPreconditionError("no reader of the model's output projection was given")
                self._lm_head = self._output_projection()
            return self._lm_head

    def verify(self, context: ContextHandler, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """One verify run of ``context``: ``tokens`` at its position and after, by itself
        (not in a decode batch); the logits and final hidden states of each. (The caller
        advances the position by what it keeps.)"""
        with Run(self, context) as binding:
            return binding.executor.verify(binding, tokens, context.position)

    def score(self, context: ContextHandler, tokens: Sequence[int], decode_steps: bool = False) -> np.ndarray:
        """``tokens`` appended to ``context`` at its position, by themselves (no prefix
        cache: every position's logits are computed); the logits after each, ``(n, vocab)``.
        (The caller advances the position.)"""
        with Run(self, context) as binding:
            return binding.executor.score(binding, tokens, context.position, decode_steps=decode_steps)

    def decode_alone(self, context: ContextHandler, token: int) -> np.ndarray:
        """One decode step of ``context`` by itself: the single-session path."""
        with Run(self, context) as binding:
            return binding.executor.decode(binding, token, context.position)

    @contextmanager
    def executor_for_batch(self) -> Iterator[LlmExecutor]:
        """``with resources.executor_for_batch() as executor:`` one executor, taken from the
        pool (if any) for the block: a batch's rows all run on it."""
        executor = self.take_executor()
        try:
            yield executor
        finally:
            self.give_back(executor)

    def take_executor(self) -> LlmExecutor:
        """An idle executor of the pool (waiting for one), or the only executor."""
        return self._idle.get() if self._idle is not None else self.executor

    def give_back(self, executor: LlmExecutor) -> None:
        """Returns an executor :meth:`take_executor` gave."""
        if self._idle is not None:
            self._idle.put(executor)

    def bind(self, context: ContextHandler, lora: LoRA | None, executor: LlmExecutor) -> Binding:
        """``context``'s binding to ``lora``'s buffers (or none) on ``executor``: the
        current one, a recent one, or a new one."""
        return context.use_binding(
            executor,
            lora,
            lambda: executor.bind(context.kv, lora.buffers, lora.slot)
            if lora is not None
            else executor.bind(context.kv),
        )

    def record_switch(self, context: ContextHandler, lora: LoRA | None, started: float) -> None:
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
        for executor in self.executors:
            executor.close()


class Run:
    """One run of a context, as a context manager (see :meth:`ResourceManager.run`).

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
        if self._pooled:
            self._executor = resources.take_executor()
        executor = self._executor
        try:
            binding = context.binding  # the session's own thread is the only one setting it
            if binding is None or context.bound_lora is not lora or binding.executor is not executor:
                binding = resources.bind(context, lora, executor)
        except BaseException:
            self.__exit__()
            raise
        if self._pooled:
            resources.record_switch(context, lora, started)
        return binding

    def __exit__(self, *exc_info: object) -> None:
        if self._pooled:
            self._resources.give_back(self._executor)
        if self._blend:
            self._resources.registry.release(self._blend, self._slot)
