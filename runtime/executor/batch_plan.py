"""The decode batch plan: which signature runs which sessions' steps, in which LoRA slot.

Like vLLM's ``LoRAMapping``, a plan is computed once per batch by a pure function of the
model's signatures and the rows (each row's LoRA slot and position), then handed on: the
resource manager acquires each row's adapter buffers in the slot the plan gives it, and
the executor runs the plan. This is the one place that decides slots, windows and padding:

* Rows of slots the host slot holds (a smaller rank; attention-only in an all-linear slot)
  are padded with zeros (exact) into the host: the costliest slot among the rows that has
  batched signatures; they share its runs. Rows of other slots keep their own slot (and
  run one by one when it has no batched signatures).
* Rows without an adapter run in plain batched signatures if the model has them, else in
  the host slot (or the first slot with batched signatures) with zero LoRA inputs.
* A group of n rows runs in the smallest ``decode_batch{B}`` with B >= n (the largest B,
  repeatedly, for more rows; unused rows are padding), attending over the shortest window
  that holds its furthest row; a row alone runs as one session's step.
* Rows whose step would not fit the KV cache are not run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from runtime.executor.model_spec import ModelSpec, SignatureSpec
from runtime.util.signature_names import LoraSlot


@dataclass(frozen=True)
class DecodeRow:
    """One session's decode step, as the plan sees it: ``slot``, the LoRA slot its adapters
    need (``None``: no adapter), and the ``position`` it writes."""

    slot: LoraSlot | None
    position: int


@dataclass(frozen=True)
class PlannedRun:
    """One run: ``signature`` over ``rows`` (indices of the planned rows, one per signature
    row in order; the signature's remaining rows are padding)."""

    signature: SignatureSpec
    rows: tuple[int, ...]


@dataclass(frozen=True)
class DecodePlan:
    """Every run of one batch. ``slots[i]`` is the LoRA slot row i's adapter buffers are
    bound in (its own, or the host slot it is padded into; ``None``: no adapter);
    ``overflow`` the rows that were not planned because their step would not fit the KV cache."""

    runs: tuple[PlannedRun, ...]
    slots: tuple[LoraSlot | None, ...]
    overflow: tuple[int, ...]


def plan_decode(spec: ModelSpec, rows: Sequence[DecodeRow]) -> DecodePlan:
    """The runs that step ``rows`` (see the module's rules); rows keep their order within a run."""
    fits = [i for i, row in enumerate(rows) if 0 <= row.position < spec.kv_length]
    overflow = tuple(i for i in range(len(rows)) if i not in set(fits))
    host = max((rows[i].slot for i in fits if rows[i].slot is not None and spec.batch_sizes(rows[i].slot)),
               key=lambda slot: slot.cost_order, default=None)
    slots = [host if row.slot is not None and host is not None and host.holds(row.slot) else row.slot
             for row in rows]
    groups: dict[LoraSlot | None, list[int]] = {}
    for i in fits:
        groups.setdefault(slots[i], []).append(i)
    plain = groups.pop(None, [])
    if plain and not spec.batch_sizes(None):
        joined = host if host is not None else next((s for s in spec.slots if spec.batch_sizes(s)), None)
        if joined is not None:
            groups[joined] = groups.get(joined, []) + plain
            plain = []
    ordered = ([(None, plain)] if plain else []) + sorted(groups.items(), key=lambda group: group[0].cost_order)
    runs: list[PlannedRun] = []
    for group_slot, members in ordered:
        runs += _group_runs(spec, rows, slots, group_slot, members)
    return DecodePlan(tuple(runs), tuple(slots), overflow)


def _group_runs(spec: ModelSpec, rows: Sequence[DecodeRow], slots: Sequence[LoraSlot | None],
                slot: LoraSlot | None, members: list[int]) -> list[PlannedRun]:
    """The runs of one slot's rows: batches of the smallest size that holds what is left,
    a row alone (or every row, when the slot has no batched signatures) as a single step."""
    sizes = spec.batch_sizes(slot)
    runs = []
    pending = members
    while pending:
        if len(pending) == 1 or not sizes:
            row = pending[0]
            own = slots[row]
            window = spec.window_for(rows[row].position, own)
            runs.append(PlannedRun(spec.decode(own, window), (row,)))
            pending = pending[1:]
            continue
        count = next((b for b in sizes if b >= len(pending)), sizes[-1])
        chunk, pending = pending[:count], pending[count:]
        window = spec.window_for(max(rows[i].position for i in chunk), slot, count)
        runs.append(PlannedRun(spec.decode_batch(count, slot, window), tuple(chunk)))
    return runs
