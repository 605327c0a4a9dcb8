"""LoRA: one adapter (or a weighted blend of several) materialized for one rank slot.

A model exported with LoRA slots takes, per layer and attention projection, an ``a``
and a ``b`` input whose rank dimension is the slot's rank R. Materializing fills one
buffer per such input from the adapters' tensors:

* names are matched by meaning (layer, projection, side), whatever the convention;
* layouts are converted (LiteRT-LM stores ``a`` as ``[r, in]``, the graph may take
  ``[in, r]``) and dtypes cast to the input's dtype;
* each adapter's scale is folded into its ``a``; adapters of a blend are concatenated
  along the rank, which is exact: ``sum_i s_i * x A_i B_i = x [s_1 A_1 .. s_n A_n] [B_1; ..; B_n]``;
* rank left over in the slot, and inputs no adapter covers, are zero (also exact).

:func:`plan_adapter` checks an adapter against the model's slots from tensor metadata
alone, before a single weight byte is read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from runtime.errors import InvalidArgumentError
from runtime.util.adapter_data import AdapterData
from runtime.util.lora_util import (
    LoraInputName,
    from_graph_layout,
    is_lora_input_name,
    lora_input_name,
    parse_lora_input_name,
    rank_axis,
    to_graph_layout,
)
from runtime.util.tensor_spec import TensorSpec

# A rank slot's LoRA inputs, by input name.
SlotInputs = Mapping[str, TensorSpec]


class WritableBuffer(Protocol):
    """What the executor hands out for a LoRA input: something an array is written into."""

    def write(self, data_array: np.ndarray) -> None:
        """Copies ``data_array`` (of the input's shape and dtype) into the buffer."""


# Creates the (empty) buffer for one LoRA input name of the slot being materialized.
BufferFactory = Callable[[str], WritableBuffer]


@dataclass(frozen=True)
class ProjectionPair:
    """Where one adapter keeps the ``a`` and ``b`` tensors of one (layer, projection)."""

    a: LoraInputName
    a_name: str
    b: LoraInputName
    b_name: str
    rank: int


@dataclass(frozen=True)
class AdapterPlan:
    """An adapter checked against a model: its pairs, and the rank it needs."""

    data: AdapterData
    pairs: Mapping[tuple[int, str], ProjectionPair]
    rank: int

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
        graph_shape = to_graph_layout(parsed.convention, parsed.side, np.empty(spec.shape, np.int8)).shape
        entry = dims.setdefault((parsed.layer, parsed.projection), {})
        if parsed.side == "a":
            entry["in"] = graph_shape[0]
        else:
            entry["out"] = graph_shape[1]
    return {key: _Geometry(d["in"], d["out"]) for key, d in dims.items() if len(d) == 2}


def plan_adapter(data: AdapterData, slots: Mapping[int, SlotInputs]) -> AdapterPlan:
    """Checks that ``data`` fits the model's LoRA inputs; reads metadata only.

    Raises ``InvalidArgumentError`` naming the adapter, the first tensor that does not
    fit, what it has and what the model expects.
    """
    source = data.source_name
    if not slots:
        raise InvalidArgumentError(f"{source}: the model takes no LoRA inputs (exported without lora_ranks)")
    largest = max(slots)
    geometry = model_geometry(slots[largest])
    layers = sorted({layer for layer, _ in geometry})
    example = next(iter(slots[largest]))
    halves: dict[tuple[int, str], dict[str, tuple[LoraInputName, str]]] = {}
    names = data.get_all_tensor_names()
    if not names:
        raise InvalidArgumentError(f"{source}: the adapter holds no tensors")
    for name in names:
        if not is_lora_input_name(name):
            raise InvalidArgumentError(
                f"{source}: tensor {name!r} is not a LoRA input name; the model takes inputs "
                f"named like {example!r}"
            )
        parsed = parse_lora_input_name(name)
        key = (parsed.layer, parsed.projection)
        if key not in geometry:
            raise InvalidArgumentError(
                f"{source}: tensor {name!r} targets layer {parsed.layer} projection "
                f"{parsed.projection!r}, which the model has no LoRA input for (layers "
                f"{layers[0]}-{layers[-1]}, projections q/k/v/o)"
            )
        halves.setdefault(key, {})[parsed.side] = (parsed, name)

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
    rank = max(pair.rank for pair in pairs.values())
    if rank > largest:
        raise InvalidArgumentError(
            f"{source}: rank {rank} exceeds every LoRA slot of the model (slots: "
            f"{', '.join(map(str, sorted(slots)))})"
        )
    return AdapterPlan(data, pairs, rank)


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


class LoRA:
    """A blend of adapters written into one rank slot's input buffers.

    ``buffers`` maps every LoRA input of the slot to its filled buffer, ready to be
    bound to both the slot's prefill and decode signatures.
    """

    def __init__(
        self,
        blend: Sequence[tuple[AdapterPlan, float]],
        slot_rank: int,
        slot: SlotInputs,
        allocate: BufferFactory,
        *,
        allow_non_finite: bool = False,
    ) -> None:
        total = sum(plan.rank for plan, _ in blend)
        if total > slot_rank:
            raise InvalidArgumentError(
                f"adapters of summed rank {total} do not fit rank slot {slot_rank}"
            )
        self.slot_rank = slot_rank
        self.nbytes = sum(spec.nbytes for spec in slot.values())
        by_key = {
            parsed.key: (parsed, spec)
            for name, spec in slot.items()
            for parsed in [parse_lora_input_name(name)]
        }
        # Every long-lived buffer first, then the short-lived arrays that fill them: so the
        # allocator does not leave the temporaries' holes between resident buffers.
        buffers = {name: allocate(name) for name in slot}
        for (layer, projection), dims in sorted(model_geometry(slot).items()):
            a, b = self._fill(blend, (layer, projection), dims, slot_rank, allow_non_finite)
            for side, graph_array in (("a", a), ("b", b)):
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
    ) -> tuple[np.ndarray, np.ndarray]:
        a = np.zeros((dims.fan_in, slot_rank), np.float32)
        b = np.zeros((slot_rank, dims.fan_out), np.float32)
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
            offset += plan.rank
        return a, b


def _check_finite(plan: AdapterPlan, pair: ProjectionPair, a: np.ndarray, b: np.ndarray) -> None:
    for name, array in ((pair.a_name, a), (pair.b_name, b)):
        if not np.isfinite(array).all():
            raise InvalidArgumentError(
                f"{plan.source_name}: tensor {name!r} holds NaN or Inf values "
                "(pass allow_non_finite=True to load it anyway)"
            )
