"""ResourceManager: adapter ids, the LoRA manager and the executor, shared by all sessions.

* The same adapter gets the same id: a file is identified by device, inode, size and
  modification time (so another path or a symlink to it is the same adapter, and a
  rewritten file is a new one); an in-memory blob by the SHA-256 of its bytes.
* Each adapter is parsed once, under the lock; one that fails leaves no id behind.
* Contexts pin their adapters, so an adapter a live session uses cannot be unloaded.
* Before each run a context is bound: its adapter buffers are materialized if needed
  and the executor arguments rebuilt only if those buffers changed.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from collections.abc import Iterable

from runtime.components.lora_manager import Blend, LoraManager, normalize_blend
from runtime.errors import FailedPreconditionError, InvalidArgumentError
from runtime.executor.litert_executor import Binding, LlmExecutor
from runtime.framework.lora_source import AdapterBuffer, LoraSource
from runtime.framework.resource_management.context_handler import ContextHandler
from runtime.util.lora_data import LoraData
from runtime.util.scoped_file import ScopedFile

AdapterKey = tuple


class ResourceManager:
    """Owns the executor's adapters and hands sessions their contexts. Thread-safe."""

    def __init__(self, executor: LlmExecutor, *, allow_non_finite: bool = False) -> None:
        self.executor = executor
        spec = executor.spec
        self.lora_manager = LoraManager(
            {rank: spec.lora_slot(rank) for rank in spec.lora_ranks},
            executor.create_lora_buffer,
            allow_non_finite=allow_non_finite,
        )
        self._ids: dict[AdapterKey, int] = {}
        self._next_id = 1
        self._lock = threading.RLock()

    # -- adapter ids ---------------------------------------------------------------

    def assign_lora_id(self, path: str | os.PathLike[str] | None = None, buffer: AdapterBuffer | None = None) -> int:
        """The id for the adapter at ``path`` or in ``buffer``: existing, or newly reserved."""
        if (path is None) == (buffer is None):
            raise InvalidArgumentError("assign_lora_id takes exactly one of path= or buffer=")
        if path is not None:
            with ScopedFile(path) as scoped:
                key = _file_key(scoped)
        else:
            key = _buffer_key(_immutable(buffer))
        with self._lock:
            return self._id_for(key)

    def register(self, source: LoraSource) -> int:
        """Loads ``source`` once and returns its id; a failure registers nothing.

        A mutable in-memory buffer (bytearray, writable memoryview or mmap) is copied
        once here, so that a caller changing it later cannot change a registered
        adapter behind the sessions' backs; ``bytes`` and read-only views are kept by
        reference.
        """
        buffer = None
        if source.path is not None:
            scoped = ScopedFile(source.path)
            key = _file_key(scoped)
        else:
            buffer = _immutable(source.buffer)
            scoped, key = None, _buffer_key(buffer)
        with self._lock:
            known = key in self._ids
            lora_id = self._id_for(key)
            if self.lora_manager.has_lora(lora_id):
                if scoped is not None:
                    scoped.close()
                return lora_id
            try:
                if scoped is not None:
                    data = LoraData.create_from_scoped_file(scoped, owns_file=True)
                else:
                    data = LoraData.create_from_buffer(buffer, name=source.label)
                self.lora_manager.load_lora(lora_id, data)
            except BaseException:
                if not known:
                    del self._ids[key]
                if scoped is not None:
                    scoped.close()
                raise
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
        blend = self._check_blend(entries)
        self._pin(blend)
        try:
            return ContextHandler(blend, self.executor.create_kv_cache())
        except BaseException:
            self._unpin(blend)
            raise

    def clone_context(self, context: ContextHandler) -> ContextHandler:
        """A new context with a copy of ``context``'s KV cache, position and adapters."""
        self._pin(context.blend)
        try:
            kv = self.executor.copy_kv_cache(context.kv)
        except BaseException:
            self._unpin(context.blend)
            raise
        return ContextHandler(context.blend, kv, context.position)

    def set_blend(self, context: ContextHandler, entries: Iterable[tuple[int, float]]) -> None:
        """Switches a context's adapters; the caller decides what happens to its KV cache."""
        blend = self._check_blend(entries)
        self._pin(blend)
        self._unpin(context.blend)
        context.blend = blend
        context.forget_binding()

    def release_context(self, context: ContextHandler) -> None:
        """Unpins the context's adapters and drops its KV cache."""
        self._unpin(context.blend)
        context.blend = ()
        context.forget_binding()
        context.kv.close()

    def bind(self, context: ContextHandler) -> Binding:
        """The executor arguments for ``context``, (re)built only if its buffers changed."""
        lora = self.lora_manager.materialize(context.blend) if context.blend else None
        if context.binding is None or lora is not context.bound_lora:
            context.binding = (
                self.executor.bind(context.kv, lora.buffers, lora.slot_rank)
                if lora is not None
                else self.executor.bind(context.kv)
            )
            context.bound_lora = lora
        return context.binding

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
        """Closes the executor; contexts still alive can no longer run."""
        self.executor.close()


def _file_key(scoped: ScopedFile) -> AdapterKey:
    stat = os.fstat(scoped.fileno())
    if stat.st_size == 0:
        raise InvalidArgumentError(f"{scoped.path}: file is empty")
    return ("file", stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


def _immutable(buffer: AdapterBuffer | None) -> AdapterBuffer:
    """``buffer`` itself if nobody can change it, else a private copy of its bytes."""
    if isinstance(buffer, bytes):
        return buffer
    if isinstance(buffer, memoryview) and buffer.readonly:
        return buffer
    if isinstance(buffer, bytearray | memoryview | mmap.mmap):
        try:
            return bytes(buffer)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"cannot read the in-memory adapter: {exc}") from None
    raise InvalidArgumentError(
        f"expected bytes, bytearray, memoryview or mmap for an in-memory adapter, got {type(buffer).__name__}"
    )


def _buffer_key(buffer: AdapterBuffer) -> AdapterKey:
    try:
        digest = hashlib.sha256(buffer).hexdigest()
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"cannot read the in-memory adapter: {exc}") from None
    return ("blob", digest)
