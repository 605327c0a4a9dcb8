"""LoraManager: the adapters of one model, registered (parsed and checked) apart from used.

The three states of ``runtime/framework/resource_management/adapter_registry.py``: an
adapter is *registered* by :meth:`LoraManager.load_lora` (the method names follow
LiteRT-LM's ``LoadLoRA`` / ``UseLoRA``); a blend becomes *resident* when
:meth:`LoraManager.acquire` materializes its slot buffers, and is *active* while acquired.

* :meth:`LoraManager.load_lora` parses and checks an adapter against the model's LoRA
  inputs from metadata only; no weight is read and no buffer allocated.
* :meth:`LoraManager.acquire` builds a blend's slot buffers on first use and keeps them
  for the next, as the residency policy allows.
* :meth:`LoraManager.unload_lora` forgets an adapter and drops its buffers, unless a
  live session still holds it (:meth:`pin`) or a run is using it (:meth:`acquire`).
* Residency: :meth:`acquire` / :meth:`release` bracket a run; an active blend is never
  evicted, the others are kept or dropped as the :mod:`residency policy
  <runtime.components.residency>` says. A new blend is built before anything is
  evicted for it.

All methods are thread-safe.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from runtime.components.lora import (
    AdapterPlan, LoRA, ProjectionPair, SlotInputs, WritableBuffer, blend_needs, plan_adapter, slots_geometry,
)
from runtime.components.residency import KeepAll, Lru, ResidencyPolicy, check_policy, choose_evictions
from runtime.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from runtime.adapters.adapter_data import AdapterData
from runtime.util.latency import LatencyRecorder, LatencySummary
from runtime.util.signature_names import LoraSlot, cheapest_slot

# What a plan's pairs are, as a key: ((layer, projection), pair) for every pair, in order.
Layout = tuple[tuple[tuple[int, str], ProjectionPair], ...]
# A weighted set of loaded adapters: ((lora_id, scale), ...), sorted by id, no zero scales.
Blend = tuple[tuple[int, float], ...]
Materialized = tuple[Blend, LoraSlot]  # a blend in one LoRA slot
_SLOTS_REMEMBERED = 4096  # blends whose slot LoraManager.slot_for keeps


def normalize_blend(entries: Iterable[tuple[int, float]]) -> Blend:
    """Merges repeated ids (scales add up), drops zero scales, sorts by id."""
    scales: dict[int, float] = {}
    for lora_id, scale in entries:
        if not math.isfinite(scale):
            raise InvalidArgumentError(f"adapter {lora_id}: scale {scale} is not finite")
        scales[lora_id] = scales.get(lora_id, 0.0) + float(scale)
    return tuple(sorted((i, s) for i, s in scales.items() if s != 0.0))


@dataclass(frozen=True)
class ResidencyStats:
    """How often a requested blend was resident (``hits``) or had to be materialized
    (``misses``, failed materializations included: an adapter whose source no longer reads),
    and what materializing cost (failed attempts included)."""

    hits: int
    misses: int
    evictions: int  # by the residency policy (buffers dropped with their adapter's unload are not counted)
    materialize: LatencySummary


class LoraManager:
    """Holds the registered adapters of one model and their resident slot buffers."""

    def __init__(
        self,
        slots: Mapping[LoraSlot, SlotInputs],
        allocate: Callable[[LoraSlot, str], WritableBuffer],
        *,
        residency: ResidencyPolicy | None = None,
        allow_non_finite: bool = False,
    ) -> None:
        """``slots`` maps each LoRA slot to its inputs; ``allocate(slot, name)``
        returns an empty buffer for one of them."""
        self._slots = dict(slots)
        self._geometry = slots_geometry(self._slots)  # every registration checks against it
        self._allocate = allocate
        self._allow_non_finite = allow_non_finite
        self._residency = KeepAll() if residency is None else check_policy(residency)
        self._plans: dict[int, AdapterPlan] = {}
        self._order: dict[int, tuple[str, str]] = {}  # where each lies in a blend: (source name, identity)
        # Registered adapters of one layout share one pairs mapping, and how many use it: each
        # would otherwise keep a ProjectionPair per projection (24 KiB at SmolLM2 all-linear).
        self._layouts: dict[Layout, tuple[Mapping[tuple[int, str], ProjectionPair], int]] = {}
        # Materialized (blend, rank slot) pairs, least recently used first: a blend lives in
        # its own slot, and in a larger one too while it runs in a batch of that slot.
        self._resident: OrderedDict[Materialized, LoRA] = OrderedDict()
        self._active: dict[Materialized, int] = {}
        # Each blend's own slot, found once: every run asks for it (twice a decode step).
        self._slot_of: dict[Blend, LoraSlot] = {}
        self._pins: dict[int, int] = {}
        self._evict_listeners: list[Callable[[Blend, LoRA], None]] = []
        self._hits = self._misses = self._evictions = 0
        self._materialize_latency = LatencyRecorder()
        self._lock = threading.RLock()

    # -- loading -------------------------------------------------------------------

    def load_lora(self, lora_id: int, data: AdapterData, *, identity: str = "") -> AdapterPlan:
        """Checks ``data`` against the model and registers it under ``lora_id``.
        ``identity``: what tells it apart from another adapter of the same source name
        (two in-memory adapters of one size), for the order of a blend's adapters.

        ``AlreadyExistsError`` when the id is taken; ``InvalidArgumentError`` when the
        adapter does not fit (nothing is registered then).
        """
        plan = plan_adapter(data, self._slots, self._geometry)
        layout = tuple(plan.pairs.items())
        with self._lock:
            if lora_id in self._plans:
                raise AlreadyExistsError(f"LoRA id {lora_id} is already registered")
            pairs, users = self._layouts.get(layout, (plan.pairs, 0))
            self._layouts[layout] = pairs, users + 1
            plan = replace(plan, pairs=pairs)
            self._plans[lora_id] = plan
            self._order[lora_id] = plan.source_name, identity
        return plan

    def has_lora(self, lora_id: int) -> bool:
        """Whether ``lora_id`` is registered."""
        with self._lock:
            return lora_id in self._plans

    def plan(self, lora_id: int) -> AdapterPlan:
        """The checked adapter behind ``lora_id``."""
        with self._lock:
            return self._require(lora_id)

    def loaded_ids(self) -> list[int]:
        """Every registered id, ascending."""
        with self._lock:
            return sorted(self._plans)

    # -- using ---------------------------------------------------------------------

    def slot_for(self, blend: Blend, names: Mapping[int, str] | None = None) -> LoraSlot:
        """The cheapest slot that holds ``blend``: its summed rank, and the MLP's inputs
        if any of its adapters touches the MLP (see :func:`blend_needs`). The error when
        none does names each adapter as ``names`` does (default: its source)."""
        with self._lock:
            slot = self._slot_of.get(blend)
            if slot is not None:
                return slot
            plans = [(self._require(lora_id), scale) for lora_id, scale in blend]
            need = blend_needs(plans)
            slot = cheapest_slot(self._slots, need)
            if slot is not None:
                if len(self._slot_of) >= _SLOTS_REMEMBERED:  # blends of many distinct scales
                    self._slot_of.clear()
                self._slot_of[blend] = slot
                return slot
        names = names or {}
        named = ", ".join((repr(names[lora_id]) if lora_id in names else plan.source_name) + f" (rank {plan.rank}, {plan.targets})"
                          for (lora_id, _), (plan, _) in zip(blend, plans))
        need_what = f"need rank {need.rank} together" if len(plans) > 1 else f"needs rank {need.rank}"
        raise InvalidArgumentError(
            f"adapter{'s' if len(plans) > 1 else ''} {named} {need_what} ({need.targets}): no LoRA slot of the "
            f"model holds that (slots: {', '.join(map(str, self._slots)) or 'none'})"
        )

    def acquire(self, blend: Blend, slot: LoraSlot | None = None) -> LoRA:
        """Materializes ``blend`` in ``slot`` (default: :meth:`slot_for`; a slot that holds
        it, zero-padded, which is exact) and marks it active (never evicted) until
        :meth:`release` with the same arguments."""
        with self._lock:
            key = self._materialized(blend, slot)
            built = key not in self._resident
            lora = self._get_or_build(key)
            self._active[key] = self._active.get(key, 0) + 1
            if built:  # a hit adds no bytes: nothing to evict for it
                self._enforce_residency(protect=key)
            return lora

    def release(self, blend: Blend, slot: LoraSlot | None = None) -> None:
        """Ends one :meth:`acquire`; the blend (in that slot) may now be evicted."""
        with self._lock:
            _decrement(self._active, self._materialized(blend, slot))
            self._enforce_residency(protect=None)

    def _materialized(self, blend: Blend, slot: LoraSlot | None) -> Materialized:
        if not blend:
            raise InvalidArgumentError("an empty blend has no LoRA buffers: use the base model")
        own = self.slot_for(blend)
        if slot is None or slot == own:
            return blend, own
        if slot not in self._slots or not slot.holds(own):
            raise InvalidArgumentError(
                f"adapters {[i for i, _ in blend]} cannot run in LoRA slot {slot}: they need slot {own} or one "
                f"of {', '.join(map(str, self._slots))} that holds it")
        return blend, slot

    def use_lora(self, lora_id: int) -> LoRA:
        """LiteRT-LM's ``UseLoRA``: adapter ``lora_id`` alone at scale 1, made resident in
        its own slot (materialized if it is not) and returned. It is not held active: the
        residency policy may drop it again; sessions hold theirs through :meth:`acquire`."""
        blend = ((lora_id, 1.0),)
        lora = self.acquire(blend)
        self.release(blend)
        return lora

    def get_lora_buffers(self, lora_id: int) -> Mapping[str, object]:
        """LiteRT-LM's ``GetLoRABuffers``: the filled input buffers of adapter ``lora_id``
        (alone, scale 1), by the model's LoRA input names (see :meth:`use_lora`)."""
        return self.use_lora(lora_id).buffers

    def add_evict_listener(self, listener: Callable[[Blend, LoRA], None]) -> None:
        """Calls ``listener(blend, lora)`` (under the manager's lock) whenever buffers are dropped."""
        with self._lock:
            self._evict_listeners.append(listener)

    def set_residency(self, policy: ResidencyPolicy) -> None:
        """Switches the policy and applies it at once."""
        check_policy(policy)
        with self._lock:
            self._residency = policy
            self._enforce_residency(protect=None)

    def residency_stats(self) -> ResidencyStats:
        """Hits, misses, evictions and materialization latency so far."""
        with self._lock:
            hits, misses, evictions = self._hits, self._misses, self._evictions
        return ResidencyStats(hits, misses, evictions, self._materialize_latency.summary())

    def _get_or_build(self, key: Materialized) -> LoRA:
        lora = self._resident.get(key)
        if lora is not None:
            self._hits += 1
            self._resident.move_to_end(key)
            return lora
        # A miss is a request the resident buffers could not answer, counted before the build:
        # one that fails (a source no longer readable) is a miss that materialized nothing.
        self._misses += 1
        blend, slot = key
        # Side by side in the order of their sources, not of their ids: a blend's sums do not
        # depend on which of its adapters this engine happened to register first.
        plans = [(self._require(lora_id), scale, self._order[lora_id]) for lora_id, scale in blend]
        plans = [(plan, scale) for plan, scale, _ in sorted(plans, key=lambda entry: entry[2])]
        with self._materialize_latency.time():
            lora = LoRA(
                plans,
                slot,
                self._slots[slot],
                lambda name: self._allocate(slot, name),
                allow_non_finite=self._allow_non_finite,
            )
        for plan, _ in plans:
            plan.data.release_memory()  # the weights now live in the buffers
        self._resident[key] = lora
        return lora

    def _enforce_residency(self, protect: Materialized | None) -> None:
        if isinstance(self._residency, KeepAll) or len(self._resident) <= len(self._active):
            return  # nothing evictable: the common case on the decode path costs nothing
        if isinstance(self._residency, Lru) and self._within(self._residency):
            return
        protected = set(self._active)
        if protect:
            protected.add(protect)
        sizes = {key: lora.nbytes for key, lora in self._resident.items()}
        for key in choose_evictions(self._residency, sizes, protected):
            self._evictions += 1
            self._drop(key)

    def _within(self, policy: Lru) -> bool:
        if policy.max_resident is not None and len(self._resident) > policy.max_resident:
            return False
        return policy.max_bytes is None or sum(l.nbytes for l in self._resident.values()) <= policy.max_bytes

    def _drop(self, key: Materialized) -> None:
        """Drops ``key``'s buffers (an eviction, or its adapter unloaded) and tells the listeners."""
        lora = self._resident.pop(key)
        for listener in self._evict_listeners:
            listener(key[0], lora)

    # -- residency and unloading ---------------------------------------------------

    def resident(self) -> dict[Materialized, LoRA]:
        """The resident (blend, LoRA slot) pairs and their buffers."""
        with self._lock:
            return dict(self._resident)

    def pin(self, lora_id: int) -> None:
        """Marks ``lora_id`` as held by a live session: it cannot be unloaded."""
        with self._lock:
            self._require(lora_id)
            self._pins[lora_id] = self._pins.get(lora_id, 0) + 1

    def unpin(self, lora_id: int) -> None:
        """Releases one :meth:`pin`."""
        with self._lock:
            _decrement(self._pins, lora_id)

    def pin_count(self, lora_id: int) -> int:
        """How many live holders ``lora_id`` has."""
        with self._lock:
            return self._pins.get(lora_id, 0)

    def unload_lora(self, lora_id: int) -> None:
        """Forgets ``lora_id`` and drops every buffer built from it.

        ``NotFoundError`` for an unknown id; ``FailedPreconditionError`` while a live
        session holds it, or while a blend of it is active (acquired and not yet
        released: a run is reading its buffers).
        """
        with self._lock:
            plan = self._require(lora_id)
            if self._pins.get(lora_id):
                raise FailedPreconditionError(
                    f"LoRA id {lora_id} ({plan.source_name}) is used by "
                    f"{self._pins[lora_id]} live session(s); close them first"
                )
            runs = sum(count for (blend, _), count in self._active.items() if any(i == lora_id for i, _ in blend))
            if runs:
                raise FailedPreconditionError(
                    f"LoRA id {lora_id} ({plan.source_name}) is being run by {runs} run(s); unload it after they end"
                )
            del self._plans[lora_id]
            del self._order[lora_id]
            for blend in [b for b in self._slot_of if any(i == lora_id for i, _ in b)]:
                del self._slot_of[blend]
            layout = tuple(plan.pairs.items())
            pairs, users = self._layouts.pop(layout)
            if users > 1:
                self._layouts[layout] = pairs, users - 1
            for key in [k for k in self._resident if any(i == lora_id for i, _ in k[0])]:
                self._drop(key)
        plan.data.close()

    def _require(self, lora_id: int) -> AdapterPlan:
        plan = self._plans.get(lora_id)
        if plan is None:
            raise NotFoundError(f"LoRA id {lora_id} is not registered")
        return plan


def _decrement(counts: dict, key: object) -> None:
    """Counts down ``key``, forgetting it at zero."""
    count = counts.get(key, 0)
    if count <= 1:
        counts.pop(key, None)
    else:
        counts[key] = count - 1
