"""What the engine reports about its adapters, its sessions and what they cost."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.framework.resource_management.adapter_stats import AdapterStats, ResidentStats
from runtime.framework.resource_management.prefix_cache import PrefixCacheStats
from runtime.engine.speculative import SpeculationStats
from runtime.executor.weight_cache import WeightCacheEntry, WeightCacheStats
from runtime.util.latency import LatencySummary

__all__ = ["AdapterStats", "EngineStats", "PrefixCacheStats", "ResidentStats", "SessionStats", "SpeculationStats",
           "WeightCacheEntry", "WeightCacheStats"]


@dataclass(frozen=True)
class SessionStats:
    """One live session's work so far."""

    session_id: int
    lora_ids: tuple[int, ...]
    position: int
    prompt_tokens: int
    decode_tokens: int
    time_to_first_token_s: float | None  # of its last generate()
    decode_tokens_per_s: float
    # Draft heads (Turbo LoRA): drafted, accepted per head, tokens per verify forward.
    speculation: SpeculationStats = SpeculationStats()


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of :meth:`Engine.stats`."""

    adapters: tuple[AdapterStats, ...]
    resident: tuple[ResidentStats, ...]
    load: LatencySummary  # registering an adapter (parse and check)
    materialize: LatencySummary  # building an adapter's slot buffers
    switch: LatencySummary  # runtime work when a run's session or adapter differs from the last
    residency_hits: int
    residency_misses: int
    evictions: int
    sessions: tuple[SessionStats, ...]
    invokes: int = 0  # runs of the model's signatures (prefill chunks and decode steps)
    invoke_seconds: float = 0.0  # wall time inside those runs: the rest of a step is the runtime's
    # Batched decode (a model with decode_batch signatures): (rows, batches of that many
    # sessions' steps) by rows, and how long steps waited in the queue for their batch.
    decode_batches: tuple[tuple[int, int], ...] = ()
    queue_wait: LatencySummary = LatencySummary(0, 0.0, 0.0)
    # Every session's speculative decoding so far (closed sessions included).
    speculation: SpeculationStats = SpeculationStats()
    # The prefix cache of prompt heads (None: EngineSettings.prefix_cache_bytes is 0).
    prefix_cache: PrefixCacheStats | None = None
    # The XNNPACK weight cache directory: its files (least recently used first, with their
    # model, size, last use, whether in use or their model is gone), its cap, and this
    # engine's file (None: weight_cache_dir=None).
    weight_cache: WeightCacheStats | None = None
    # The signature groups compiled so far (EngineSettings.compile: the plain group at open,
    # each other group at its first need or, for a registered adapter's slot, in the
    # background), and how long those compiles after the open took.
    compiled_groups: tuple[str, ...] = ()
    group_compile: LatencySummary = LatencySummary(0, 0.0, 0.0)

    @property
    def resident_bytes(self) -> int:
        """Bytes of all resident adapter buffers."""
        return sum(r.nbytes for r in self.resident)
