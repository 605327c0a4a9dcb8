"""LoraManager: the adapters of one model, loaded (parsed and checked) apart from used.

* :meth:`LoraManager.load_lora` parses and checks an adapter against the model's LoRA
  inputs from metadata only; no weight is read and no buffer allocated.
* :meth:`LoraManager.use_lora` (and :meth:`materialize` for blends) builds the slot
  buffers on first use and keeps them for the next.
* :meth:`LoraManager.unload_lora` forgets an adapter and drops its buffers, unless a
  live session still holds it (:meth:`pin`).

All methods are thread-safe.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Mapping

from runtime.components.lora import AdapterPlan, LoRA, SlotInputs, WritableBuffer, plan_adapter
from runtime.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from runtime.util.adapter_data import AdapterData

# A weighted set of loaded adapters: ((lora_id, scale), ...), sorted by id, no zero scales.
Blend = tuple[tuple[int, float], ...]


def normalize_blend(entries: Iterable[tuple[int, float]]) -> Blend:
    """Merges repeated ids (scales add up), drops zero scales, sorts by id."""
    scales: dict[int, float] = {}
    for lora_id, scale in entries:
        if not math.isfinite(scale):
            raise InvalidArgumentError(f"adapter {lora_id}: scale {scale} is not finite")
        scales[lora_id] = scales.get(lora_id, 0.0) + float(scale)
    return tuple(sorted((i, s) for i, s in scales.items() if s != 0.0))


class LoraManager:
    """Holds the adapters of one model and their materialized slot buffers."""

    def __init__(
        self,
        slots: Mapping[int, SlotInputs],
        allocate: Callable[[int, str], WritableBuffer],
        *,
        allow_non_finite: bool = False,
    ) -> None:
        """``slots`` maps each rank slot to its LoRA inputs; ``allocate(rank, name)``
        returns an empty buffer for one of them."""
        self._slots = dict(slots)
        self._allocate = allocate
        self._allow_non_finite = allow_non_finite
        self._plans: dict[int, AdapterPlan] = {}
        self._resident: dict[Blend, LoRA] = {}
        self._pins: dict[int, int] = {}
        self._current: Blend | None = None
        self._lock = threading.RLock()

    # -- loading -------------------------------------------------------------------

    def load_lora(self, lora_id: int, data: AdapterData) -> AdapterPlan:
        """Checks ``data`` against the model and registers it under ``lora_id``.

        ``AlreadyExistsError`` when the id is taken; ``InvalidArgumentError`` when the
        adapter does not fit (nothing is registered then).
        """
        plan = plan_adapter(data, self._slots)
        with self._lock:
            if lora_id in self._plans:
                raise AlreadyExistsError(f"LoRA id {lora_id} is already loaded")
            self._plans[lora_id] = plan
        return plan

    def has_lora(self, lora_id: int) -> bool:
        """Whether ``lora_id`` is loaded."""
        with self._lock:
            return lora_id in self._plans

    def plan(self, lora_id: int) -> AdapterPlan:
        """The checked adapter behind ``lora_id``."""
        with self._lock:
            return self._require(lora_id)

    def loaded_ids(self) -> list[int]:
        """Every loaded id, ascending."""
        with self._lock:
            return sorted(self._plans)

    # -- using ---------------------------------------------------------------------

    def slot_for(self, blend: Blend) -> int:
        """The smallest rank slot that holds the summed rank of ``blend``."""
        with self._lock:
            total = sum(self._require(lora_id).rank for lora_id, _ in blend)
        for slot in sorted(self._slots):
            if slot >= total:
                return slot
        raise InvalidArgumentError(
            f"adapters {[i for i, _ in blend]} need rank {total} together, more than any "
            f"LoRA slot of the model (slots: {', '.join(map(str, sorted(self._slots)))})"
        )

    def materialize(self, blend: Blend) -> LoRA:
        """The slot buffers for ``blend``, built on first request and kept."""
        if not blend:
            raise InvalidArgumentError("an empty blend has no LoRA buffers: use the base model")
        with self._lock:
            lora = self._resident.get(blend)
            if lora is None:
                slot = self.slot_for(blend)
                plans = [(self._require(lora_id), scale) for lora_id, scale in blend]
                lora = LoRA(
                    plans,
                    slot,
                    self._slots[slot],
                    lambda name: self._allocate(slot, name),
                    allow_non_finite=self._allow_non_finite,
                )
                self._resident[blend] = lora
            return lora

    def use_lora(self, lora_id: int | None, scale: float = 1.0) -> LoRA | None:
        """Makes ``lora_id`` at ``scale`` current (``None``: the base model) and returns it."""
        return self.use_blend([] if lora_id is None else [(lora_id, scale)])

    def use_blend(self, entries: Iterable[tuple[int, float]]) -> LoRA | None:
        """Makes a weighted blend current; an empty blend means the base model."""
        blend = normalize_blend(entries)
        with self._lock:
            for lora_id, _ in blend:
                self._require(lora_id)
            lora = self.materialize(blend) if blend else None
            self._current = blend
            return lora

    def get_current_lora_id(self) -> int | None:
        """The id in use when a single adapter is current; ``None`` for the base model
        or a blend (see :meth:`get_current_blend`)."""
        with self._lock:
            return self._current[0][0] if self._current and len(self._current) == 1 else None

    def get_current_blend(self) -> Blend | None:
        """The current blend (``()`` for the base model, ``None`` before any use)."""
        with self._lock:
            return self._current

    def get_lora_buffers(self) -> dict[str, WritableBuffer]:
        """The current adapter's input buffers; ``FailedPreconditionError`` if none is current."""
        with self._lock:
            if not self._current:
                raise FailedPreconditionError("no LoRA is in use: call use_lora first")
            return self.materialize(self._current).buffers

    # -- residency and unloading ---------------------------------------------------

    def resident(self) -> dict[Blend, LoRA]:
        """The materialized blends and their buffers."""
        with self._lock:
            return dict(self._resident)

    def evict(self, blend: Blend) -> bool:
        """Drops the buffers of ``blend`` (rebuilt on the next use); whether it was resident."""
        with self._lock:
            return self._resident.pop(blend, None) is not None

    def pin(self, lora_id: int) -> None:
        """Marks ``lora_id`` as held by a live session: it cannot be unloaded."""
        with self._lock:
            self._require(lora_id)
            self._pins[lora_id] = self._pins.get(lora_id, 0) + 1

    def unpin(self, lora_id: int) -> None:
        """Releases one :meth:`pin`."""
        with self._lock:
            count = self._pins.get(lora_id, 0)
            if count <= 1:
                self._pins.pop(lora_id, None)
            else:
                self._pins[lora_id] = count - 1

    def pin_count(self, lora_id: int) -> int:
        """How many live holders ``lora_id`` has."""
        with self._lock:
            return self._pins.get(lora_id, 0)

    def unload_lora(self, lora_id: int) -> None:
        """Forgets ``lora_id`` and drops every buffer built from it.

        ``NotFoundError`` for an unknown id; ``FailedPreconditionError`` while a live
        session holds it.
        """
        with self._lock:
            plan = self._require(lora_id)
            if self._pins.get(lora_id):
                raise FailedPreconditionError(
                    f"LoRA id {lora_id} ({plan.source_name}) is used by "
                    f"{self._pins[lora_id]} live session(s); close them first"
                )
            del self._plans[lora_id]
            for blend in [b for b in self._resident if any(i == lora_id for i, _ in b)]:
                del self._resident[blend]
            if self._current and any(i == lora_id for i, _ in self._current):
                self._current = None
        plan.data.close()

    def _require(self, lora_id: int) -> AdapterPlan:
        plan = self._plans.get(lora_id)
        if plan is None:
            raise NotFoundError(f"LoRA id {lora_id} is not loaded")
        return plan
