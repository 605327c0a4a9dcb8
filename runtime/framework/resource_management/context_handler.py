"""ContextHandler: one session's state over the shared executor."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.components.lora import LoRA
from runtime.components.lora_manager import Blend
from runtime.executor.litert_executor import Binding, KvCache


@dataclass(eq=False)
class ContextHandler:
    """A session's adapters (as a blend of loaded ids and scales), KV cache and position.

    ``binding`` caches the executor arguments for this KV cache with the adapter buffers
    it was built for (``bound_lora``); the resource manager rebuilds it only when those
    buffers change.
    """

    blend: Blend
    kv: KvCache
    position: int = 0
    binding: Binding | None = field(default=None, repr=False)
    bound_lora: LoRA | None = field(default=None, repr=False)

    @property
    def lora_ids(self) -> list[int]:
        """The ids of the adapters this context uses."""
        return [lora_id for lora_id, _ in self.blend]

    def forget_binding(self) -> None:
        """Drops the cached binding (after an adapter change or when closing)."""
        self.binding = None
        self.bound_lora = None
