"""ContextHandler: one session's state over the shared executor."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from runtime.components.lora import LoRA
from runtime.components.lora_manager import Blend
from runtime.executor.litert_executor import Binding, KvCache, LlmExecutor


@dataclass(eq=False)
class ContextHandler:
    """A session's adapters (as a blend of loaded ids and scales), KV cache and position.

    ``position`` counts the tokens in the KV cache; ``pending`` is the token a generation
    ended with: part of the session's text, written to the cache by the next call that
    runs the model on this context (a generation's last token needs no logits, so the step
    computing them is saved: llama.cpp does the same).

    ``binding`` is the executor arguments for this KV cache with the adapter buffers it
    was built for (``bound_lora``) on one executor. Bindings for a few recently used
    (executor, buffers) pairs are kept in ``recent``, so switching back and forth between
    adapters, or between the executors of a pool, rebuilds nothing.
    """

    blend: Blend
    kv: KvCache
    position: int = 0
    pending: int | None = None
    binding: Binding | None = field(default=None, repr=False)
    bound_lora: LoRA | None = field(default=None, repr=False)
    recent: dict[tuple[int, int], tuple[LoRA | None, Binding]] = field(default_factory=dict, repr=False)
    # Evictions on other threads drop bindings while the session may be binding.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    RECENT_BINDINGS: ClassVar[int] = 8

    @property
    def length(self) -> int:
        """The session's tokens: those in the cache and the pending one."""
        return self.position + (self.pending is not None)

    @property
    def lora_ids(self) -> list[int]:
        """The ids of the adapters this context uses."""
        return [lora_id for lora_id, _ in self.blend]

    def use_binding(self, executor: LlmExecutor, lora: LoRA | None, build: Callable[[], Binding]) -> Binding:
        """The binding for ``lora``'s buffers on ``executor``: the current one, a recent
        one, or ``build()``."""
        with self._lock:
            binding = self.binding
            if binding is not None and lora is self.bound_lora and binding.executor is executor:
                return binding
            key = (id(executor), id(lora))
            cached = self.recent.pop(key, None)
            binding = cached[1] if cached is not None and cached[0] is lora else build()
            self.recent[key] = (lora, binding)  # most recent last
            while len(self.recent) > self.RECENT_BINDINGS:
                del self.recent[next(iter(self.recent))]
            self.binding, self.bound_lora = binding, lora  # the binding first: see Run.__enter__
            return binding

    def forget_lora(self, lora: LoRA) -> None:
        """Drops every binding to ``lora``'s buffers (they were evicted)."""
        with self._lock:
            for key in [k for k, (cached, _) in self.recent.items() if cached is lora]:
                del self.recent[key]
            if self.bound_lora is lora:
                self.binding = self.bound_lora = None  # the binding first: see Run.__enter__

    def forget_binding(self) -> None:
        """Drops all bindings (when closing)."""
        with self._lock:
            self.binding = None
            self.bound_lora = None
            self.recent.clear()
