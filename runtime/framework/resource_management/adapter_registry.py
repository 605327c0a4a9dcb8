"""AdapterRegistry: adapter ids, and the LoRA manager that holds each adapter's buffers.

* The same adapter gets the same id: a file (or a PEFT directory's files) is identified
  by device, inode, size, modification and change time (so another path or a symlink to
  it is the same adapter, and a rewritten file is a new one, ``cp -p`` in place too); an in-memory blob by the
  SHA-256 of its content; an adapter without draft heads is the same whatever its
  ``heads`` flag (a Turbo LoRA's heads=False registration is apart from the one with
  its heads). Ids are assigned here and nowhere else.
* Each adapter is parsed once, under the lock; one that fails leaves no id behind.
* Sessions pin the adapters of their blend, so an adapter a live session uses cannot be
  unloaded; a blend is registered and pinned under one lock, so an unload cannot slip in
  between.

Adapter states, in the words used throughout: an adapter is *registered* (it has an id,
its file parsed and checked against the model, no buffers yet) and a blend of them is
*resident* (materialized into LoRA input buffers of one rank slot, kept by the residency
policy); a resident blend a run is using is *active* and is never evicted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping

from runtime.components.lora import LoRA
from runtime.components.lora_manager import Blend, LoraManager, normalize_blend
from runtime.components.residency import ResidencyPolicy
from runtime.errors import InvalidArgumentError, NotFoundError, StatusError
from runtime.framework.lora_source import LoraSource
from runtime.framework.resource_management.adapter_stats import AdapterReport, AdapterStats, ResidentStats
from runtime.adapters.adapter_formats import AdapterKey
from runtime.adapters.draft_heads import DraftHeads, check_heads
from runtime.util.latency import LatencyRecorder
from runtime.adapters.lora_xs import LoraXsFactors
from runtime.util.model_weights import ModelWeights
from runtime.util.signature_names import LoraSlot
from runtime.util.tensor_spec import TensorSpec


class AdapterRegistry:
    """The registered adapters of one model, their ids, pins and resident buffers. Thread-safe."""

    def __init__(
        self,
        lora_slots: Mapping[LoraSlot, Mapping[str, TensorSpec]],
        allocate: Callable[[LoraSlot, str], object],
        *,
        head_dim: int,
        base_weights: Callable[[], ModelWeights],
        residency: ResidencyPolicy | None = None,
        allow_non_finite: bool = False,
        draft_width: int | None = None,
        vocab_size: int = 0,
    ) -> None:
        """``lora_slots``: the model's LoRA inputs per slot; ``allocate(slot, name)``
        makes one input buffer; ``head_dim`` is what GGUF adapters need to undo
        llama.cpp's row order; ``base_weights`` reads the model's projection weights, which
        R-only LoRA-XS adapters are rebuilt from (called when the first one registers).
        ``draft_width``: the hidden size the model's verify signatures return (``None``:
        it has none, so adapters carrying draft heads are refused unless loaded with
        ``heads=False``); ``vocab_size``: the model's, for heads with their own projection."""
        self._manager = LoraManager(lora_slots, allocate, residency=residency, allow_non_finite=allow_non_finite)
        self._head_dim = head_dim
        self._lora_xs = LoraXsFactors(base_weights)  # shared by every adapter of the model
        self._ids: dict[tuple[AdapterKey, bool], int] = {}  # (origin, with heads) -> id
        self._heads: dict[int, DraftHeads] = {}  # the draft heads of Turbo adapters, read at register
        self._draft_width = draft_width
        self._vocab_size = vocab_size
        self._next_id = 1
        self._lock = threading.RLock()
        self.load_latency = LatencyRecorder()

    def register(self, source: LoraSource) -> int:
        """Registers ``source`` once and returns its id; a failure registers nothing. A
        ``sha256`` it carries is checked every time, the adapter registered already or not."""
        if not isinstance(source, LoraSource):  # LiteRT-LM's AssignLoraId takes a path
            raise InvalidArgumentError(f"adapter {source!r:.80}: expected a LoraSource (LoraSource(path=...) names "
                                       "a file, LoraSource(buffer=...) its bytes)")
        origin = source.origin()
        key = (origin.key, source.heads)
        with self._lock:
            if source.sha256 is not None:
                origin.check_sha256(source.sha256)
            # The same adapter registered with the other heads flag, carrying no draft heads:
            # without heads, the flag changes nothing, and it is that adapter again.
            twin = self._ids.get((origin.key, not source.heads))
            if twin is not None and (twin in self._heads or not self._manager.has_lora(twin)):
                twin = None
            if twin is not None and not source.heads:
                self._ids[key] = twin
                return twin
            known = key in self._ids
            lora_id = self._id_for(key)
            if self._manager.has_lora(lora_id):
                return lora_id
            started = time.perf_counter()
            try:
                data = origin.open(head_dim=self._head_dim, lora_xs=self._lora_xs, heads=source.heads)
                try:
                    heads = data.draft_heads
                    if heads is None and twin is not None:  # it has none: the twin registered without
                        data.close()
                        self._give_back(key, lora_id, known)
                        self._ids[key] = twin
                        return twin
                    if heads is not None:
                        check_heads(heads, self._draft_width, self._vocab_size, origin.name)
                    self._manager.load_lora(lora_id, data, identity=repr(origin.key))
                except BaseException:
                    data.close()
                    raise
            except BaseException:
                self._give_back(key, lora_id, known)
                raise
            if heads is not None:
                self._heads[lora_id] = heads
            self.load_latency.record(time.perf_counter() - started)
            return lora_id

    def draft_heads(self, lora_id: int) -> DraftHeads | None:
        """The draft heads registered with adapter ``lora_id`` (``None``: it has none)."""
        return self._heads.get(lora_id)

    def unload(self, lora_id: int) -> None:
        """Unregisters an adapter no live session uses, drops its buffers and forgets its id."""
        with self._lock:
            self._manager.unload_lora(lora_id)
            self._heads.pop(lora_id, None)
            for key in [k for k, v in self._ids.items() if v == lora_id]:
                del self._ids[key]

    def ids(self) -> list[int]:
        """The ids of the registered adapters, ascending."""
        return self._manager.loaded_ids()

    def pinned_blend(self, sources: Iterable[LoraSource], registered: Iterable[tuple[int, float]]) -> Blend:
        """Registers ``sources`` and pins the blend of them and the ``(lora_id, scale)``
        entries of ``registered`` under one lock; :meth:`unpin` gives the pins back. On a
        failure nothing is pinned, and the adapters this call registered are unregistered."""
        with self._lock:
            before = set(self._manager.loaded_ids())
            entries = []
            try:
                for source in sources:
                    entries.append((self.register(source), source.scale))
                registered = list(registered)
                unknown = [lora_id for lora_id, _ in registered if not self._manager.has_lora(lora_id)]
                if unknown:  # checked here: a zero scale leaves an entry out of the blend
                    raise NotFoundError(f"LoRA id {unknown[0]} is not registered")
                blend = normalize_blend(entries + registered)
                if blend:
                    self._manager.slot_for(blend)  # raises for unknown ids or too large a rank
                self.pin(blend)
            except BaseException:  # the adapters this call registered go again: nothing is left half-done
                for lora_id in {lora_id for lora_id, _ in entries} - before:
                    self.unload(lora_id)
                raise
        return blend

    def pin(self, blend: Blend) -> None:
        """Marks ``blend``'s adapters as used by one more live session (all or none)."""
        pinned = []
        try:
            for lora_id, _ in blend:
                self._manager.pin(lora_id)
                pinned.append(lora_id)
        except BaseException:
            for lora_id in pinned:
                self._manager.unpin(lora_id)
            raise

    def unpin(self, blend: Blend) -> None:
        """Ends one :meth:`pin` of ``blend``."""
        for lora_id, _ in blend:
            self._manager.unpin(lora_id)

    def slot_for(self, blend: Blend, names: Mapping[int, str] | None = None) -> LoraSlot:
        """The cheapest LoRA slot that runs ``blend``, or ``InvalidArgumentError`` naming its
        adapters and why none does (their summed rank, the projections they touch, a DoRA
        adapter in a blend), each as ``names`` names it (default: its source);
        ``NotFoundError`` for an id that is not registered."""
        return self._manager.slot_for(blend, names)

    def slot_or_none(self, blend: Blend) -> LoraSlot | None:
        """The LoRA slot ``blend`` runs in; ``None`` for the base model, or when an adapter
        of it is gone (the row's own acquire then reports why)."""
        if not blend:
            return None
        try:
            return self._manager.slot_for(blend)
        except StatusError:
            return None

    def acquire(self, blend: Blend, slot: LoraSlot | None = None) -> LoRA:
        """Makes ``blend`` resident in LoRA slot ``slot`` (default: its own) and active
        until :meth:`release` with the same arguments."""
        return self._manager.acquire(blend, slot)

    def release(self, blend: Blend, slot: LoraSlot | None = None) -> None:
        """Ends one :meth:`acquire`: the blend may be evicted again."""
        self._manager.release(blend, slot)

    def on_evict(self, listener: Callable[[Blend, LoRA], None]) -> None:
        """Calls ``listener(blend, buffers)`` whenever a resident blend's buffers are dropped."""
        self._manager.add_evict_listener(listener)

    def set_residency(self, policy: ResidencyPolicy) -> None:
        """Changes which resident blends stay resident; applied at once."""
        self._manager.set_residency(policy)

    def report(self) -> AdapterReport:
        """Every registered adapter with its bytes and sessions, the resident blends, and
        the residency counters."""
        manager = self._manager
        resident = self._resident()
        adapters = []
        for lora_id in manager.loaded_ids():
            try:
                adapters.append(self._stats(lora_id, resident))
            except NotFoundError:
                continue  # unloaded meanwhile
        return AdapterReport(tuple(adapters), resident, manager.residency_stats())

    def stats(self, lora_id: int) -> AdapterStats:
        """Adapter ``lora_id``'s source, format, rank, projections, bytes and sessions;
        ``NotFoundError`` when no adapter has that id."""
        return self._stats(lora_id, self._resident())

    def _resident(self) -> tuple[ResidentStats, ...]:
        return tuple(
            ResidentStats(blend, lora.slot.rank, lora.nbytes, lora.slot.targets)
            for (blend, _), lora in self._manager.resident().items()
        )

    def _stats(self, lora_id: int, resident: tuple[ResidentStats, ...]) -> AdapterStats:
        manager = self._manager
        plan = manager.plan(lora_id)
        heads = self._heads.get(lora_id)
        return AdapterStats(
            lora_id=lora_id,
            source=plan.source_name,
            format=plan.data.format_name,
            rank=plan.rank,
            targets=plan.targets,
            tensor_bytes=plan.data.nbytes + (heads.nbytes if heads else 0),
            resident_bytes=sum(r.nbytes for r in resident if any(i == lora_id for i, _ in r.blend)),
            sessions=manager.pin_count(lora_id),
            draft_heads=heads.count if heads else 0,
            draft_head_bytes=heads.nbytes if heads else 0,
        )

    def _give_back(self, key: tuple[AdapterKey, bool], lora_id: int, known: bool) -> None:
        """Forgets the id :meth:`_id_for` just gave ``key`` (unless it was ``known`` before)."""
        if not known:
            del self._ids[key]
            if lora_id == self._next_id - 1:
                self._next_id = lora_id  # nothing saw the id: the next adapter takes it

    def _id_for(self, key: tuple[AdapterKey, bool]) -> int:
        if key not in self._ids:
            self._ids[key] = self._next_id
            self._next_id += 1
        return self._ids[key]
