"""What the engine reports about its adapters, its sessions and what they cost."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.util.latency import LatencySummary


@dataclass(frozen=True)
class AdapterStats:
    """One registered adapter."""

    lora_id: int
    source: str
    format: str
    rank: int
    tensor_bytes: int  # its weights as stored (memory-mapped or the caller's buffer)
    # Buffers of the resident blends that include it (0 when none): a blend's buffers
    # count for each of its adapters, so sum EngineStats.resident, not this, for a total.
    resident_bytes: int
    sessions: int  # live sessions using it


@dataclass(frozen=True)
class ResidentStats:
    """One materialized blend: the adapters and scales, the rank slot, the buffer bytes."""

    blend: tuple[tuple[int, float], ...]
    slot_rank: int
    nbytes: int


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

    @property
    def resident_bytes(self) -> int:
        """Bytes of all materialized adapter buffers."""
        return sum(r.nbytes for r in self.resident)
