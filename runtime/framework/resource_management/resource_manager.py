"""ResourceManager: adapter ids, the LoRA manager and the executor, shared by all sessions.

* The same adapter gets the same id: a file (or a PEFT directory's files) is identified
  by device, inode, size and modification time (so another path or a symlink to it is
  the same adapter, and a rewritten file is a new one); an in-memory blob by the
  SHA-256 of its content.
* Each adapter is parsed once, under the lock; one that fails leaves no id behind.
* Contexts pin their adapters, so an adapter a live session uses cannot be unloaded.
* Each run happens inside :meth:`ResourceManager.running`: the context's blend is
  acquired (materialized if needed, protected from eviction meanwhile) and the executor
  arguments rebuilt only if those buffers changed. When the residency policy evicts a
  blend, the idle contexts bound to it drop their bindings, so its memory really goes.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import queue
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from runtime.components.lora import LoRA
from runtime.components.lora_manager import Blend, LoraManager, normalize_blend
from runtime.components.residency import ResidencyPolicy
from runtime.errors import DataLossError, InvalidArgumentError
from runtime.executor.litert_executor import Binding, LlmExecutor
from runtime.framework.lora_source import LoraSource
from runtime.framework.resource_management.context_handler import ContextHandler
from runtime.util.adapter_formats import (
    PEFT,
    AdapterBuffer,
    AdapterKey,
    buffer_identity,
    detect_format,
    file_identity,
    open_adapter,
    open_adapter_buffer,
)
from runtime.util.latency import LatencyRecorder
from runtime.util.peft_data import WEIGHTS_FILE
from runtime.util.scoped_file import ScopedFile


class ResourceManager:
    """Owns the executor's adapters and hands sessions their contexts. Thread-safe."""

    def __init__(
        self,
        executors: LlmExecutor | Sequence[LlmExecutor],
        *,
        residency: ResidencyPolicy | None = None,
        allow_non_finite: bool = False,
    ) -> None:
        """``executors``: one executor, or a pool of executors of the same model; KV
        caches and adapter buffers are made by the first and bound to whichever runs."""
        self.executors = [executors] if isinstance(executors, LlmExecutor) else list(executors)
        self.executor = executor = self.executors[0]
        spec = executor.spec
        self._idle: queue.SimpleQueue[LlmExecutor] | None = None
        if len(self.executors) > 1:
            self._idle = queue.SimpleQueue()
            for each in self.executors:
                self._idle.put(each)
        self.lora_manager = LoraManager(
            spec.lora_slots,
            executor.create_lora_buffer,
            residency=residency,
            allow_non_finite=allow_non_finite,
        )
        self.lora_manager.add_evict_listener(self._unbind_evicted)
        self._ids: dict[AdapterKey, int] = {}
        self._next_id = 1
        self._lock = threading.RLock()
        self._contexts: weakref.WeakSet[ContextHandler] = weakref.WeakSet()
        self._contexts_lock = threading.Lock()  # WeakSet iteration is not thread-safe
        self._last_context = 0  # id() of the previous run's context (0: none yet), for switches
        self._last_lora: LoRA | None = None
        self.load_latency = LatencyRecorder()
        self.switch_latency = LatencyRecorder()

    # -- adapter ids ---------------------------------------------------------------

    def assign_lora_id(
        self,
        path: str | os.PathLike[str] | None = None,
        buffer: AdapterBuffer | Mapping[str, Any] | None = None,
        peft_config: Mapping[str, Any] | None = None,
    ) -> int:
        """The id for the adapter at ``path`` or in ``buffer``: existing, or newly reserved."""
        if (path is None) == (buffer is None):
            raise InvalidArgumentError("assign_lora_id takes exactly one of path= or buffer=")
        key = file_identity(path) if path is not None else buffer_identity(_immutable(buffer), peft_config)
        with self._lock:
            return self._id_for(key)

    def register(self, source: LoraSource) -> int:
        """Loads ``source`` once and returns its id; a failure registers nothing.

        A mutable in-memory buffer (bytearray, writable memoryview or mmap, or a state
        dict of arrays) is copied once here, so that a caller changing it later cannot
        change a registered adapter behind the sessions' backs; ``bytes`` and read-only
        views are kept by reference.
        """
        if source.path is not None:
            key, buffer = file_identity(source.path), None
        else:
            buffer = _immutable(source.buffer)
            key = buffer_identity(buffer, source.peft_config)
        with self._lock:
            known = key in self._ids
            lora_id = self._id_for(key)
            if self.lora_manager.has_lora(lora_id):
                return lora_id
            started = time.perf_counter()
            try:
                if source.sha256 is not None:
                    _check_digest(source, buffer)
                if buffer is None:
                    data = open_adapter(source.path, head_dim=self.executor.spec.head_dim)
                else:
                    data = open_adapter_buffer(buffer, peft_config=source.peft_config, name=source.label)
                try:
                    self.lora_manager.load_lora(lora_id, data)
                except BaseException:
                    data.close()
                    raise
            except BaseException:
                if not known:
                    del self._ids[key]
                raise
            self.load_latency.record(time.perf_counter() - started)
            return lora_id

    def unload(self, lora_id: int) -> None:
        """Unloads an adapter no live session uses, and forgets its id."""
        with self._lock:
            self.lora_manager.unload_lora(lora_id)
            for key in [k for k, v in self._ids.items() if v == lora_id]:
                del self._ids[key]

    def _id_for(self, key: AdapterKey) -> int:
        if key not in self._ids:
            self._ids[key] = self._next_id
            self._next_id += 1
        return self._ids[key]

    # -- contexts ------------------------------------------------------------------

    def new_context(self, entries: Iterable[tuple[int, float]]) -> ContextHandler:
        """A fresh context (empty KV cache) using a blend of loaded adapters."""
        return self._context_for(self._pinned_blend(entries))

    def new_context_for_sources(self, sources: Iterable[LoraSource]) -> ContextHandler:
        """A fresh context using ``sources``, registered if needed. Registration and
        pinning happen under one lock, so a concurrent unload cannot slip in between."""
        return self._context_for(self._pinned_sources(sources))

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

    def set_blend(self, context: ContextHandler, entries: Iterable[tuple[int, float]]) -> None:
        """Switches a context's adapters; the caller decides what happens to its KV cache."""
        self._switch(context, self._pinned_blend(entries))

    def set_sources(self, context: ContextHandler, sources: Iterable[LoraSource]) -> None:
        """Switches a context to ``sources``, registered if needed (atomically with
        respect to unload, like :meth:`new_context_for_sources`)."""
        self._switch(context, self._pinned_sources(sources))

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

    def _pinned_sources(self, sources: Iterable[LoraSource]) -> Blend:
        """Registers ``sources`` and pins their blend without releasing the lock between."""
        with self._lock:
            return self._pinned_blend([(self.register(source), source.scale) for source in sources])

    def release_context(self, context: ContextHandler) -> None:
        """Unpins the context's adapters and drops its KV cache."""
        self._unpin(context.blend)
        context.blend = ()
        context.forget_binding()
        context.kv.close()

    def begin_run(self, context: ContextHandler) -> Binding:
        """Starts one run of ``context``: its blend is protected from eviction until
        :meth:`end_run` (call it in a ``finally``). Returns the binding to run with.

        Records a switch (and its latency) when this run's context or adapter buffers
        differ from the previous run's.
        """
        started = time.perf_counter()
        blend = context.blend
        lora = self.lora_manager.acquire(blend) if blend else None
        executor = self._idle.get() if self._idle is not None else self.executor
        binding = context.binding  # the session's own thread is the only one setting it
        if binding is None or context.bound_lora is not lora or binding.executor is not executor:
            try:
                binding = self._bind(context, lora, executor)
            except BaseException:
                if self._idle is not None:
                    self._idle.put(executor)
                if blend:
                    self.lora_manager.release(blend)
                raise
        if self._last_context != id(context) or self._last_lora is not lora:
            if self._last_context:
                self.switch_latency.record(time.perf_counter() - started)
            self._last_context, self._last_lora = id(context), lora
        return binding

    def end_run(self, blend: Blend, binding: Binding) -> None:
        """Ends a run started by :meth:`begin_run` (``blend``: the context's blend then)."""
        if self._idle is not None:
            self._idle.put(binding.executor)
        if blend:
            self.lora_manager.release(blend)

    def bind(self, context: ContextHandler) -> Binding:
        """The first executor's arguments for ``context``, for callers that do not run
        (no protection from eviction, no executor taken from the pool)."""
        lora = self.lora_manager.materialize(context.blend) if context.blend else None
        return self._bind(context, lora, self.executor)

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
            self.lora_manager.slot_for(blend)  # raises if unknown ids or too large a rank
        return blend

    def _pin(self, blend: Blend) -> None:
        pinned = []
        try:
            for lora_id, _ in blend:
                self.lora_manager.pin(lora_id)
                pinned.append(lora_id)
        except BaseException:
            for lora_id in pinned:
                self.lora_manager.unpin(lora_id)
            raise

    def _unpin(self, blend: Blend) -> None:
        for lora_id, _ in blend:
            self.lora_manager.unpin(lora_id)

    def close(self) -> None:
        """Closes the executors; contexts still alive can no longer run."""
        for executor in self.executors:
            executor.close()


def _immutable(buffer: AdapterBuffer | Mapping[str, Any] | None) -> AdapterBuffer | Mapping[str, Any]:
    """``buffer`` itself if nobody can change it, else a private copy."""
    if isinstance(buffer, bytes) or (isinstance(buffer, memoryview) and buffer.readonly):
        return buffer
    if isinstance(buffer, bytearray | memoryview | mmap.mmap):
        try:
            return bytes(buffer)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"cannot read the in-memory adapter: {exc}") from None
    if isinstance(buffer, Mapping):
        snapshot = {}
        for name, value in buffer.items():
            try:
                array = np.array(value, copy=True)
            except (TypeError, ValueError) as exc:
                raise InvalidArgumentError(f"state dict tensor {name!r} is not an array: {exc}") from None
            array.flags.writeable = False
            snapshot[str(name)] = array
        return snapshot
    raise InvalidArgumentError(
        "expected bytes, bytearray, memoryview, mmap or a state dict for an in-memory adapter, "
        f"got {type(buffer).__name__}"
    )


def _check_digest(source: LoraSource, buffer: AdapterBuffer | Mapping[str, Any] | None) -> None:
    """``DataLossError`` unless the adapter's bytes have the SHA-256 the caller expects."""
    digest = hashlib.sha256()
    if buffer is None:
        path = Path(source.path)
        if detect_format(path) == PEFT:
            path = (path if path.is_dir() else path.parent) / WEIGHTS_FILE
        with ScopedFile(path) as scoped, open(scoped.fileno(), "rb", closefd=False) as file:
            for chunk in iter(lambda: file.read(1 << 20), b""):
                digest.update(chunk)
        what = str(path)
    elif isinstance(buffer, Mapping):
        raise InvalidArgumentError(f"{source.label}: sha256 checks bytes; a state dict has none")
    else:
        digest.update(buffer)
        what = source.label
    if digest.hexdigest() != source.sha256.lower():
        raise DataLossError(
            f"{what}: SHA-256 is {digest.hexdigest()}, expected {source.sha256.lower()}; nothing was registered"
        )
