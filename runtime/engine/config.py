"""Settings for an engine and for each session."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.components.residency import KeepAll, ResidencyPolicy
from runtime.components.sampler import SamplerConfig
from runtime.errors import InvalidArgumentError
from runtime.framework.lora_source import LoraSource
from runtime.util.adapter_formats import AdapterBuffer


@dataclass(frozen=True)
class EngineSettings:
    """How the engine runs the model.

    ``num_threads``: CPU threads for XNNPACK (0 lets the library choose).
    ``lora_residency``: which used adapters keep their buffers: ``KeepAll()`` (default),
    ``Lru(max_resident=K, max_bytes=None)`` or ``OnlyActive()``.
    ``allow_non_finite_weights``: accept adapters holding NaN or Inf (refused by default).
    ``executors``: how many copies of the model run sessions in parallel (each costs the
    model's memory again; the default 1 serializes runs, interleaving sessions step by step).
    """

    num_threads: int = 1
    lora_residency: ResidencyPolicy = field(default_factory=KeepAll)
    allow_non_finite_weights: bool = False
    executors: int = 1

    def __post_init__(self) -> None:
        if self.executors < 1:
            raise InvalidArgumentError(f"executors={self.executors}, expected >= 1")
        if self.num_threads < 0:
            raise InvalidArgumentError(f"num_threads={self.num_threads}, expected >= 0")


@dataclass(frozen=True)
class SessionConfig:
    """What one session runs with.

    One adapter: ``lora_path`` (a ``.tflite``, GGUF or PEFT adapter) or ``lora_buffer``
    (``.tflite`` bytes, or a PEFT state dict with ``lora_peft_config``) at ``lora_scale``. Several: ``loras=[LoraSource(...), ...]``, applied together, each
    with its own scale. None of them: the base model. ``sampler`` is what
    :meth:`Session.generate` uses when it is given none.
    """

    lora_path: str | os.PathLike[str] | None = None
    lora_buffer: AdapterBuffer | Mapping[str, Any] | None = None
    lora_scale: float = 1.0
    lora_peft_config: Mapping[str, Any] | None = None
    loras: Sequence[LoraSource] = ()
    sampler: SamplerConfig = field(default_factory=SamplerConfig)

    def __post_init__(self) -> None:
        if self.lora_path is not None and self.lora_buffer is not None:
            raise InvalidArgumentError("SessionConfig takes lora_path= or lora_buffer=, not both")
        if not math.isfinite(self.lora_scale):
            raise InvalidArgumentError(f"lora_scale={self.lora_scale}, expected a finite number")
        if any(not isinstance(source, LoraSource) for source in self.loras):
            raise InvalidArgumentError("SessionConfig.loras takes LoraSource objects")

    def sources(self) -> list[LoraSource]:
        """Every adapter this session asks for, as LoraSource objects."""
        single = []
        if self.lora_path is not None:
            single.append(LoraSource(path=self.lora_path, scale=self.lora_scale))
        if self.lora_buffer is not None:
            single.append(
                LoraSource(buffer=self.lora_buffer, scale=self.lora_scale, peft_config=self.lora_peft_config)
            )
        return single + list(self.loras)
