"""What the resource manager reports about its adapters and their resident buffers."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.components.lora_manager import ResidencyStats


@dataclass(frozen=True)
class AdapterStats:
    """One registered adapter."""

    lora_id: int
    source: str
    format: str
    rank: int
    targets: str  # "attention" (q/k/v/o only) or "all-linear" (the MLP too): the slots that hold it
    tensor_bytes: int  # its weights as stored (memory-mapped or the caller's buffer), draft heads included
    # Buffers of the resident blends that include it (0 when none): a blend's buffers
    # count for each of its adapters, so sum EngineStats.resident, not this, for a total.
    resident_bytes: int
    sessions: int  # live sessions using it
    # Turbo LoRA: draft heads it carries (0: none, or loaded with heads=False) and their
    # bytes (held in memory from registration to unload, part of tensor_bytes).
    draft_heads: int = 0
    draft_head_bytes: int = 0


@dataclass(frozen=True)
class ResidentStats:
    """One resident blend: the adapters and scales, its LoRA slot's rank and targets
    (``"attention"`` or ``"all-linear"``), the buffer bytes."""

    blend: tuple[tuple[int, float], ...]
    slot_rank: int
    nbytes: int
    slot_targets: str = "attention"


@dataclass(frozen=True)
class AdapterReport:
    """A snapshot of every registered adapter, every resident blend and residency counters."""

    adapters: tuple[AdapterStats, ...]
    resident: tuple[ResidentStats, ...]
    residency: ResidencyStats
