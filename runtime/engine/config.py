"""Settings for an engine and for each session."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime.components.residency import KeepAll, ResidencyPolicy, check_policy
from runtime.components.sampler import SamplerConfig, check_sampler_config
from runtime.engine.speculative import SpeculationPolicy
from runtime.errors import InvalidArgumentError
from runtime.executor.litert_executor import COMPILE_MODES, COMPILE_ON_DEMAND
from runtime.executor.weight_cache import WeightCacheDir, default_max_bytes
from runtime.framework.lora_source import LoraSource, check_scale
from runtime.adapters.adapter_formats import AdapterBuffer


def check_sources(loras: Iterable[LoraSource]) -> tuple[LoraSource, ...]:
    """``loras`` as a tuple (a generator is read once), or ``InvalidArgumentError`` if it
    is not an iterable of LoraSource."""
    if isinstance(loras, LoraSource | str | bytes | os.PathLike):
        raise InvalidArgumentError(f"loras={loras!r:.80}, expected a sequence of LoraSource")
    try:
        sources = tuple(loras)
    except TypeError:
        raise InvalidArgumentError(f"loras={loras!r:.80}, expected a sequence of LoraSource") from None
    for source in sources:
        if not isinstance(source, LoraSource):
            raise InvalidArgumentError(f"loras holds {source!r:.80}, expected LoraSource objects")
    return sources


def check_flag(value: object, name: str) -> bool:
    """``value`` if it is a bool, else ``InvalidArgumentError`` naming ``name`` (a string
    such as ``"no"`` would count as True)."""
    if not isinstance(value, bool | np.bool_):
        raise InvalidArgumentError(f"{name}={value!r:.40}, expected True or False")
    return bool(value)


def check_lora_id(lora_id: object) -> int:
    """``lora_id`` if it is an adapter id (an int >= 1: not a bool, a float or a string,
    which registry lookups would take for another id or none), else ``InvalidArgumentError``."""
    if type(lora_id) is not int or lora_id < 1:
        raise InvalidArgumentError(f"lora_id={lora_id!r:.40}, expected an adapter id (an int >= 1)")
    return lora_id


def check_adapters(adapters: Mapping[int, float]) -> dict[int, float]:
    """``adapters`` (registered adapter id -> scale) as a dict, or ``InvalidArgumentError``
    naming the entry that is not an integer id with a finite scale."""
    if not isinstance(adapters, Mapping):
        raise InvalidArgumentError(f"adapters={adapters!r:.80}, expected a mapping of adapter id to scale")
    checked = {}
    for lora_id, scale in adapters.items():
        if type(lora_id) is not int or lora_id < 1:
            raise InvalidArgumentError(f"adapters holds the id {lora_id!r:.40}, expected an adapter id (an int >= 1)")
        checked[lora_id] = check_scale(scale, f"adapters[{lora_id}]")
    return checked


@dataclass(frozen=True)
class EngineSettings:
    """How the engine runs the model.

    ``num_threads``: CPU threads for XNNPACK (0 lets the library choose).
    ``lora_residency``: which used adapters keep their buffers: ``KeepAll()`` (default),
    ``Lru(max_resident=K, max_bytes=None)`` or ``OnlyActive()``.
    ``allow_non_finite_weights``: accept adapters holding NaN or Inf (refused by default).
    ``executors``: how many copies of the model run sessions in parallel (each costs the
    model's memory again; the default 1 serializes runs).
    ``batch_wait_s``: on a model exported with batched decode signatures (``export
    --batch-sizes``), decode steps that sessions request at the same time run as one pass
    over the weights; a batch waits at most this long for the sessions of the previous
    batch to come back (a session alone never waits). ``None``: sessions take turns.
    ``speculation``: when a Turbo adapter's draft heads switch themselves off in a
    generation where they are rarely right (see :class:`SpeculationPolicy`).
    ``prefix_cache_bytes``: memory for the KV rows of recent prompts, per adapter blend; a
    session's prompt that begins like a cached one (a chat template's system prompt, the
    earlier turns of a conversation) takes those rows instead of prefilling them (0: off).
    ``weight_cache_dir``: a directory where XNNPACK's packed weights of the model are kept
    between runs, in a file named after the model file's identity (the first open writes
    about the model's size; later opens map it instead of packing again, and decode steps
    read the mapped weights faster where the file system maps them in large pages, as ext4
    on Linux 6.18 does). A directory that cannot take the file refuses the open.
    ``WeightCacheDir.USER`` (the default): the user's cache directory,
    ``~/.cache/runtime/xnnpack``, where it can take the file; else packed in memory.
    ``None``: packed in memory at every open.
    ``weight_cache_max_bytes``: the weight cache directory's cap; each open drops the files
    of models that are gone, then the least recently used files no process has open, until
    the rest fit (``None``: unbounded). Default: ``$RUNTIME_WEIGHT_CACHE_MAX_SIZE`` (``500M``,
    ``5G``, ``unlimited``), else 5 GiB. Files in use stay even above the cap.
    ``profile_ops``: attach LiteRT's op profiler to the model, so that
    :meth:`Engine.profile_ops` can record where runs spend their time, op by op.
    ``compile``: ``"on-demand"`` (the default) compiles at open only the signatures a
    short prompt without an adapter runs (decode, the shortest prefill, their attention
    windows), and each other group of signatures (a longer prefill's, a LoRA rank slot's,
    verify, score, a batch size's) when a session first needs it: that first step pays its
    compile once (SmolLM2-135M: ~30-43 ms of CPU per signature), other sessions keep running
    meanwhile; a slot's groups start compiling in the background when
    :meth:`Engine.register_adapter` registers an adapter that runs in it, so that adapter's
    first request finds them compiled. ``"all"``
    compiles every signature at open (the open costs ~30-43 ms of CPU per signature), for a
    server that wants no first-use latency. Models that cannot compile in groups (control-flow ops,
    weights packed in memory: ``weight_cache_dir=None``, ``profile_ops``) open whole either way.
    """

    num_threads: int = 1
    lora_residency: ResidencyPolicy = field(default_factory=KeepAll)
    allow_non_finite_weights: bool = False
    executors: int = 1
    batch_wait_s: float | None = 0.002
    speculation: SpeculationPolicy = field(default_factory=SpeculationPolicy)
    prefix_cache_bytes: int = 0
    weight_cache_dir: str | os.PathLike[str] | WeightCacheDir | None = WeightCacheDir.USER
    weight_cache_max_bytes: int | None = field(default_factory=default_max_bytes)
    profile_ops: bool = False
    compile: str = COMPILE_ON_DEMAND

    def __post_init__(self) -> None:
        if self.compile not in COMPILE_MODES:
            raise InvalidArgumentError(f"compile={self.compile!r}, expected one of {list(COMPILE_MODES)}")
        if self.batch_wait_s is not None and (
                type(self.batch_wait_s) not in (int, float) or not 0 <= self.batch_wait_s <= 1):
            raise InvalidArgumentError(f"batch_wait_s={self.batch_wait_s!r}, expected seconds in [0, 1] or None")
        if type(self.executors) is not int or self.executors < 1:
            raise InvalidArgumentError(f"executors={self.executors!r}, expected an integer >= 1")
        if type(self.num_threads) is not int or self.num_threads < 0:
            raise InvalidArgumentError(f"num_threads={self.num_threads!r}, expected an integer >= 0")
        if type(self.prefix_cache_bytes) is not int or self.prefix_cache_bytes < 0:
            raise InvalidArgumentError(f"prefix_cache_bytes={self.prefix_cache_bytes!r}, expected an integer >= 0")
        if self.weight_cache_dir is not None and not isinstance(self.weight_cache_dir,
                                                                (str, os.PathLike, WeightCacheDir)):
            raise InvalidArgumentError(f"weight_cache_dir={self.weight_cache_dir!r:.60}, expected a directory path, "
                                       "WeightCacheDir.USER or None")
        if self.weight_cache_max_bytes is not None and (
                type(self.weight_cache_max_bytes) is not int or self.weight_cache_max_bytes < 1):
            raise InvalidArgumentError(f"weight_cache_max_bytes={self.weight_cache_max_bytes!r:.60}, expected bytes "
                                       ">= 1 or None (unbounded); to keep no file, use weight_cache_dir=None")
        check_policy(self.lora_residency)
        if not isinstance(self.speculation, SpeculationPolicy):
            raise InvalidArgumentError(f"speculation={self.speculation!r:.60}, expected a SpeculationPolicy")


@dataclass(frozen=True)
class SessionConfig:
    """What one session runs with.

    One adapter: ``lora_path`` (a ``.tflite``, GGUF or PEFT adapter) or ``lora_buffer``
    (``.tflite`` bytes, or a PEFT state dict with ``lora_peft_config``) at ``lora_scale``.
    Several: ``loras=[LoraSource(...), ...]``, applied together, each with its own scale.
    Adapters already registered (:meth:`Engine.register_adapter`) by id, without going
    back to their files: ``adapters={lora_id: scale, ...}``. All of these are applied
    together; none of them: the base model. ``sampler`` is what :meth:`Session.generate`
    uses when it is given none.
    """

    lora_path: str | os.PathLike[str] | None = None
    lora_buffer: AdapterBuffer | Mapping[str, Any] | None = None
    lora_scale: float = 1.0
    lora_peft_config: Mapping[str, Any] | None = None
    loras: Sequence[LoraSource] = ()
    adapters: Mapping[int, float] = field(default_factory=dict)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)

    def __post_init__(self) -> None:
        if self.lora_path is not None and self.lora_buffer is not None:
            raise InvalidArgumentError("SessionConfig takes lora_path= or lora_buffer=, not both")
        if self.lora_peft_config is not None and self.lora_buffer is None:
            raise InvalidArgumentError(
                "lora_peft_config goes with a lora_buffer state dict (a PEFT directory brings its own)"
            )
        object.__setattr__(self, "lora_scale", check_scale(self.lora_scale, "lora_scale"))
        self._single()  # its LoraSource checks the path or buffer now, not at the session's creation
        object.__setattr__(self, "loras", check_sources(self.loras))
        object.__setattr__(self, "adapters", check_adapters(self.adapters))
        check_sampler_config(self.sampler)

    def sources(self) -> list[LoraSource]:
        """Every adapter this session asks for, as LoraSource objects."""
        return self._single() + list(self.loras)

    def _single(self) -> list[LoraSource]:
        """The one adapter ``lora_path`` or ``lora_buffer`` names, as a LoraSource (none:
        an empty list)."""
        single = []
        if self.lora_path is not None:
            single.append(LoraSource(path=self.lora_path, scale=self.lora_scale))
        if self.lora_buffer is not None:
            single.append(
                LoraSource(buffer=self.lora_buffer, scale=self.lora_scale, peft_config=self.lora_peft_config)
            )
        return single
