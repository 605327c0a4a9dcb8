"""LoRA: one adapter (or a weighted blend of several) materialized for one LoRA slot.

A model exported with LoRA slots takes, per layer and projection of the slot (attention
q/k/v/o, and the MLP's gate/up/down in an all-linear slot), an ``a`` and a ``b`` input
whose rank dimension is the slot's rank R. Materializing fills one
buffer per such input from the adapters' tensors:

* names are matched by meaning (layer, projection, side), whatever the convention;
* layouts are converted (LiteRT-LM stores ``a`` as ``[r, in]``, the graph may take
  ``[in, r]``) and dtypes cast to the input's dtype;
* each adapter's scale is folded into its ``a``; adapters of a blend are concatenated
  along the rank, which is exact: ``sum_i s_i * x A_i B_i = x [s_1 A_1 .. s_n A_n] [B_1; ..; B_n]``;
* rank left over in the slot, and inputs no adapter covers, are zero (also exact);
* a DoRA adapter (:mod:`runtime.adapters.dora`) runs alone in a DoRA slot: its output scale
  ``g`` (for the session's scale) is folded into ``b``, and ``g - 1`` written into the
  slot's scale input of each projection it covers (zeros elsewhere: plain projections).
  A blend of it with other adapters is refused: DoRA's norm is of one adapted weight.

:func:`plan_adapter` checks an adapter against the model's slots from tensor metadata
alone, before a single weight byte is read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from runtime.errors import InvalidArgumentError
from runtime.adapters.adapter_data import MAX_LISTED, AdapterData
from runtime.adapters.dora import DoraLoraData, DoraMagnitudes
from runtime.adapters.lora_util import (
    DORA_SIDE,
    MLP_PROJECTIONS,
    PROJECTIONS,
    LoraInputName,
    from_graph_layout,
    is_lora_input_name,
    lora_input_name,
    parse_lora_input_name,
    rank_axis,
    to_graph_layout,
)
from runtime.util.signature_names import ALL_LINEAR, ATTENTION, DORA, LORA_TARGETS, LoraSlot, cheapest_slot
from runtime.util.tensor_spec import TensorSpec

# A LoRA slot's inputs, by input name.
SlotInputs = Mapping[str, TensorSpec]


class WritableBuffer(Protocol):
    """What the executor hands out for a LoRA input: something an array is written into."""

    def write(self, data_array: np.ndarray) -> None:
        """Copies ``data_array`` (of the input's shape and dtype) into the buffer."""


# Creates the (empty) buffer for one LoRA input name of the slot being materialized.
BufferFactory = Callable[[str], WritableBuffer]


@dataclass(frozen=True, slots=True)  # slots: one per projection of every registered adapter
class ProjectionPair:
    """Where one adapter keeps the ``a`` and ``b`` tensors of one (layer, projection)."""

    a: LoraInputName
    a_name: str
    b: LoraInputName
    b_name: str
    rank: int


@dataclass(frozen=True)
class AdapterPlan:
    """An adapter checked against a model: its pairs, the rank they need, whether they
    touch the MLP (then only an all-linear slot holds them), and a DoRA adapter's
    magnitudes (then only a DoRA slot does)."""

    data: AdapterData
    pairs: Mapping[tuple[int, str], ProjectionPair]
    rank: int
    dora: DoraMagnitudes | None = None

    @property
    def targets(self) -> str:
        """``"dora"`` for a DoRA adapter, ``"all-linear"`` when a pair is on an MLP projection,
        else ``"attention"``."""
        if self.dora is not None:
            return DORA
        return ALL_LINEAR if any(projection in MLP_PROJECTIONS for _, projection in self.pairs) else ATTENTION

    @property
    def source_name(self) -> str:
        """The adapter's file or buffer name, for messages."""
        return self.data.source_name


@dataclass(frozen=True)
class _Geometry:
    """Fan-in and fan-out of one (layer, projection) as the model takes it."""

    fan_in: int
    fan_out: int


def model_geometry(slot: SlotInputs) -> dict[tuple[int, str], _Geometry]:
    """``{(layer, projection): (in, out)}`` read off one slot's LoRA inputs."""
    dims: dict[tuple[int, str], dict[str, int]] = {}
    for name, spec in slot.items():
        parsed = parse_lora_input_name(name)
        if parsed.side == DORA_SIDE:
            continue
        size = spec.shape[1 - rank_axis(parsed.convention, parsed.side)]  # the side that is not the rank
        dims.setdefault(parsed.pair, {})["in" if parsed.side == "a" else "out"] = size
    return {key: _Geometry(d["in"], d["out"]) for key, d in dims.items() if len(d) == 2}


def slots_geometry(slots: Mapping[LoraSlot, SlotInputs]) -> dict[tuple[int, str], _Geometry]:
    """:func:`model_geometry` of every slot together: each projection any slot takes."""
    geometry: dict[tuple[int, str], _Geometry] = {}
    for inputs in slots.values():
        geometry.update(model_geometry(inputs))
    return geometry


def plan_adapter(data: AdapterData, slots: Mapping[LoraSlot, SlotInputs],
                 geometry: Mapping[tuple[int, str], _Geometry] | None = None) -> AdapterPlan:
    """Checks that ``data`` fits the model's LoRA inputs; reads metadata only.
    ``geometry``: :func:`slots_geometry` of ``slots``, for a caller that plans many
    adapters against the same slots (working it out reads every slot's inputs).

    Raises ``InvalidArgumentError`` naming the adapter, the first tensor that does not
    fit, what it has and what the model expects.
    """
    source = data.source_name
    if not slots:
        raise InvalidArgumentError(f"{source}: the model takes no LoRA inputs (exported without lora_ranks)")
    if geometry is None:
        geometry = slots_geometry(slots)
    layers = sorted({layer for layer, _ in geometry})
    covered = [p for p in PROJECTIONS if any(projection == p for _, projection in geometry)]
    example = next(iter(next(iter(slots.values()))))
    halves: dict[tuple[int, str], dict[str, tuple[LoraInputName, str]]] = {}
    names = data.get_all_tensor_names()
    if not names:
        raise InvalidArgumentError(f"{source}: the adapter holds no tensors")
    uncovered_mlp = []
    for name in names:
        if not is_lora_input_name(name):
            raise InvalidArgumentError(
                f"{source}: tensor {name!r} is not a LoRA input name; the model takes inputs "
                f"named like {example!r}"
            )
        parsed = parse_lora_input_name(name)
        key = parsed.pair
        if parsed.side == DORA_SIDE:
            raise InvalidArgumentError(
                f"{source}: tensor {name!r} is a DoRA slot's output scale, which depends on the base weights and the "
                "session's scale: an adapter file cannot carry it (load the PEFT DoRA adapter itself)")
        if parsed.projection in MLP_PROJECTIONS and parsed.projection not in covered:
            uncovered_mlp.append(name)
            continue
        if key not in geometry:
            raise InvalidArgumentError(
                f"{source}: tensor {name!r} targets layer {parsed.layer} projection "
                f"{parsed.projection!r}, which the model has no LoRA input for (layers "
                f"{layers[0]}-{layers[-1]}, projections {'/'.join(covered)})"
            )
        halves.setdefault(key, {})[parsed.side] = (parsed, name)
    if uncovered_mlp:
        listed = ", ".join(uncovered_mlp[:MAX_LISTED]) + (
            f" and {len(uncovered_mlp) - MAX_LISTED} more" if len(uncovered_mlp) > MAX_LISTED else "")
        raise InvalidArgumentError(
            f"{source}: {len(uncovered_mlp)} tensor(s) are on MLP projections, which this model takes no LoRA "
            f"on (its slots cover {'/'.join(covered)}; re-export it with --lora-targets all-linear): {listed}")

    pairs: dict[tuple[int, str], ProjectionPair] = {}
    for key, sides in sorted(halves.items()):
        if len(sides) != 2:
            ((parsed, name),) = sides.values()
            missing = "b" if parsed.side == "a" else "a"
            expected = lora_input_name(parsed.convention, parsed.layer, parsed.projection, missing)
            raise InvalidArgumentError(
                f"{source}: tensor {name!r} has no matching {missing!r} half ({expected!r} is missing)"
            )
        (a, a_name), (b, b_name) = sides["a"], sides["b"]
        pairs[key] = _check_pair(data, a, a_name, b, b_name, geometry[key])
    dora = data.dora if isinstance(data, DoraLoraData) else None
    plan = AdapterPlan(data, pairs, max(pair.rank for pair in pairs.values()), dora)
    if dora is not None and not any(slot.targets == DORA for slot in slots):
        raise InvalidArgumentError(
            f"{source}: a DoRA adapter (use_dora) needs a model with DoRA slots, which this one has not (slots: "
            f"{', '.join(map(str, slots))}); re-export it with --dora-ranks {plan.rank}")
    if cheapest_slot(slots, LoraSlot(plan.rank, plan.targets)) is None:
        kind = {ALL_LINEAR: " all-linear", DORA: " DoRA"}.get(plan.targets, "")
        raise InvalidArgumentError(
            f"{source}: rank {plan.rank} exceeds every{kind} LoRA slot of the model (slots: "
            f"{', '.join(map(str, slots))})"
        )
    return plan


def _check_pair(
    data: AdapterData, a: LoraInputName, a_name: str, b: LoraInputName, b_name: str, geometry: _Geometry
) -> ProjectionPair:
    source = data.source_name
    a_info, b_info = data.tensor_info(a_name), data.tensor_info(b_name)
    for info in (a_info, b_info):
        if len(info.shape) != 2:
            raise InvalidArgumentError(
                f"{source}: tensor {info.name!r} has shape {list(info.shape)}, expected a 2-D matrix"
            )
    a_rank = a_info.shape[rank_axis(a.convention, "a")]
    b_rank = b_info.shape[rank_axis(b.convention, "b")]
    a_in = a_info.shape[1 - rank_axis(a.convention, "a")]
    b_out = b_info.shape[1 - rank_axis(b.convention, "b")]
    if a_in != geometry.fan_in:
        raise InvalidArgumentError(
            f"{source}: tensor {a_name!r} has shape {list(a_info.shape)}: input size {a_in}, "
            f"expected {geometry.fan_in} (an adapter made for another base model?)"
        )
    if b_out != geometry.fan_out:
        raise InvalidArgumentError(
            f"{source}: tensor {b_name!r} has shape {list(b_info.shape)}: output size {b_out}, "
            f"expected {geometry.fan_out} (an adapter made for another base model?)"
        )
    if a_rank != b_rank or a_rank == 0:
        raise InvalidArgumentError(
            f"{source}: tensors {a_name!r} {list(a_info.shape)} and {b_name!r} "
            f"{list(b_info.shape)} disagree on the rank ({a_rank} vs {b_rank})"
        )
    return ProjectionPair(a, a_name, b, b_name, a_rank)


def dora_output_scales(plan: AdapterPlan, scale: float = 1.0) -> dict[tuple[int, str], np.ndarray]:
    """A DoRA adapter's output scale ``g`` per projection at ``scale`` (reads its tensors
    and the base weights: what materializing it computes); empty for other adapters."""
    if plan.dora is None:
        return {}
    return {key: plan.dora.output_scale(key, to_graph_layout(pair.a.convention, "a", plan.data.read_tensor(pair.a_name)),
                                        to_graph_layout(pair.b.convention, "b", plan.data.read_tensor(pair.b_name)),
                                        scale)
            for key, pair in plan.pairs.items() if key in plan.dora}


def blend_needs(blend: Sequence[tuple[AdapterPlan, float]]) -> LoraSlot:
    """What a blend needs of a slot: the summed rank (adapters side by side along the
    rank), all-linear if any adapter touches the MLP, DoRA for a DoRA adapter (which
    cannot be blended: ``InvalidArgumentError`` naming it)."""
    dora = [plan for plan, _ in blend if plan.dora is not None]
    if dora and len(blend) > 1:
        raise InvalidArgumentError(
            f"{dora[0].source_name}: a DoRA adapter cannot be blended with other adapters (its output scale divides "
            "by the norm of one adapted weight); run it alone, with a scale of its own")
    targets = max((plan.targets for plan, _ in blend), key=LORA_TARGETS.index, default=ATTENTION)
    return LoraSlot(sum(plan.rank for plan, _ in blend), targets)


class LoRA:
    """A blend of adapters written into one LoRA slot's input buffers.

    ``buffers`` maps every LoRA input of the slot to its filled buffer, ready to be
    bound to both the slot's prefill and decode signatures.
    """

    def __init__(
        self,
        blend: Sequence[tuple[AdapterPlan, float]],
        slot: LoraSlot,
        inputs: SlotInputs,
        allocate: BufferFactory,
        *,
        allow_non_finite: bool = False,
    ) -> None:
        """``inputs``: ``slot``'s LoRA inputs; ``allocate(name)`` makes the buffer of one."""
        need = blend_needs(blend)
        if not slot.holds(need):
            raise InvalidArgumentError(
                f"adapters of summed rank {need.rank} ({need.targets}) do not fit LoRA slot {slot}")
        self.slot = slot
        self.nbytes = sum(spec.nbytes for spec in inputs.values())
        by_key = {
            parsed.key: (parsed, spec)
            for name, spec in inputs.items()
            for parsed in [parse_lora_input_name(name)]
        }
        # Every long-lived buffer first, then the short-lived arrays that fill them: so the
        # allocator does not leave the temporaries' holes between resident buffers.
        buffers = {name: allocate(name) for name in inputs}
        for (layer, projection), dims in sorted(model_geometry(inputs).items()):
            a, b, scale = self._fill(blend, (layer, projection), dims, slot.rank, allow_non_finite)
            arrays = (("a", a), ("b", b), (DORA_SIDE, scale)) if (layer, projection, DORA_SIDE) in by_key \
                else (("a", a), ("b", b))
            for side, graph_array in arrays:
                parsed, spec = by_key[(layer, projection, side)]
                stored = from_graph_layout(parsed.convention, side, graph_array)
                if stored.shape != spec.shape:
                    raise InvalidArgumentError(
                        f"LoRA input {spec.describe()}: built shape {list(stored.shape)}"
                    )
                buffers[spec.name].write(np.ascontiguousarray(stored, dtype=spec.dtype))
        self.buffers = buffers

    @staticmethod
    def _fill(
        blend: Sequence[tuple[AdapterPlan, float]],
        key: tuple[int, str],
        dims: _Geometry,
        slot_rank: int,
        allow_non_finite: bool,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``a``, ``b`` and the DoRA scale input (``g - 1``; zeros unless a DoRA adapter covers
        ``key``) of one projection, in graph layout."""
        a = np.zeros((dims.fan_in, slot_rank), np.float32)
        b = np.zeros((slot_rank, dims.fan_out), np.float32)
        dora_scale = np.zeros(dims.fan_out, np.float32)
        offset = 0
        for plan, scale in blend:
            pair = plan.pairs.get(key)
            if pair is not None:
                a_part = to_graph_layout(pair.a.convention, "a", plan.data.read_tensor(pair.a_name))
                b_part = to_graph_layout(pair.b.convention, "b", plan.data.read_tensor(pair.b_name))
                block = slice(offset, offset + pair.rank)
                with np.errstate(over="ignore", invalid="ignore"):  # non-finite: refused below
                    a[:, block] = a_part.astype(np.float32) * np.float32(scale)
                b[block, :] = b_part
                if not allow_non_finite:
                    _check_finite(plan, pair, a[:, block], b[block, :])
                if plan.dora is not None and key in plan.dora:
                    g = plan.dora.output_scale(key, a_part, b_part, scale)
                    b[block, :] = b_part * g[None, :]
                    dora_scale = (g - 1.0).astype(np.float32)
            offset += plan.rank
        return a, b, dora_scale


def _check_finite(plan: AdapterPlan, pair: ProjectionPair, a: np.ndarray, b: np.ndarray) -> None:
    for name, array in ((pair.a_name, a), (pair.b_name, b)):
        if not np.isfinite(array).all():
            raise InvalidArgumentError(
                f"{plan.source_name}: tensor {name!r} holds NaN or Inf values "
                "(pass allow_non_finite=True to load it anyway)"
            )
