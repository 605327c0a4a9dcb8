"""The decode batch plan: which signature runs which sessions' steps, in which rank slot.

Like vLLM's ``LoRAMapping``, a plan is computed once per batch by a pure function of the
model's signatures and the rows (each row's rank slot and position), then handed on: the
resource manager acquires each row's adapter buffers in the slot the plan gives it, and
the executor runs the plan. This is the one place that decides slots, windows and padding:

* Rows of smaller rank slots are padded with zeros (exact) into the largest slot among the
  rows that has batched signatures (the host slot), so that they share its runs; rows of
  a larger slot without batched signatures keep their own slot and run one by one.
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


@dataclass(frozen=True)
class DecodeRow:
    """One session's decode step, as the plan sees it: ``slot``, the rank slot its adapters
    need (``None``: no adapter), and the ``position`` it writes."""

    slot: int | None
    position: int


@dataclass(frozen=True)
class PlannedRun:
    """One run: ``signature`` over ``rows`` (indices of the planned rows, one per signature
    row in order; the signature's remaining rows are padding)."""

    signature: SignatureSpec
    rows: tuple[int, ...]


@dataclass(frozen=True)
class DecodePlan:
    """Every run of one batch. ``slots[i]`` is the rank slot row i's adapter buffers are
    bound in (its own, or the host slot it is padded into; ``None``: no adapter);
    ``overflow`` the rows that were not planned because their step would not fit the KV cache."""

    runs: tuple[PlannedRun, ...]
    slots: tuple[int | None, ...]
    overflow: tuple[int, ...]


def plan_decode(spec: ModelSpec, rows: Sequence[DecodeRow]) -> DecodePlan:
    """The runs that step ``rows`` (see the module's rules); rows keep their order within a run."""
    fits = [i for i, row in enumerate(rows) if 0 <= row.position < spec.kv_length]
    overflow = tuple(i for i in range(len(rows)) if i not in set(fits))
    host = max((rows[i].slot for i in fits if rows[i].slot is not None and spec.batch_sizes(rows[i].slot)),
               default=None)
    slots = [row.slot if row.slot is None or host is None or row.slot >= host else host for row in rows]
    groups: dict[int | None, list[int]] = {}
    for i in fits:
        groups.setdefault(slots[i], []).append(i)
    plain = groups.pop(None, [])
    if plain and not spec.batch_sizes(None):
        joined = host if host is not None else next((r for r in spec.lora_ranks if spec.batch_sizes(r)), None)
        if joined is not None:
            groups[joined] = groups.get(joined, []) + plain
            plain = []
    ordered = ([(None, plain)] if plain else []) + sorted(groups.items())
    runs: list[PlannedRun] = []
    for group_slot, members in ordered:
        runs += _group_runs(spec, rows, slots, group_slot, members)
    return DecodePlan(tuple(runs), tuple(slots), overflow)


def _group_runs(spec: ModelSpec, rows: Sequence[DecodeRow], slots: Sequence[int | None], slot: int | None,
                members: list[int]) -> list[PlannedRun]:
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
