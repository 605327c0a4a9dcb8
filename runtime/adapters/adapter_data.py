"""AdapterData: the one interface every adapter source presents, and computed implementations.

The ``.tflite`` reader (:class:`runtime.adapters.lora_data.LoraData`) serves stored bytes.
PEFT and GGUF adapters are presented the same way by :class:`DerivedLoraData`: tensors
named in the litert-torch convention, in graph layout (``a`` ``[in, r]``, ``b``
``[r, out]``), with the adapter's scale already folded into ``a``, each computed from
the source only when it is read.

A registered adapter is a :class:`LazyLoraData`: the readers build the
:class:`DerivedLoraData` once to check the source, keep only its :class:`PairTable` (a few
KiB, where the per-tensor objects took hundreds) and build it again at first use, until
:meth:`LazyLoraData.release_memory`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, Self

import numpy as np

from runtime.errors import DataLossError, InternalError, InvalidArgumentError, NotFoundError
from runtime.adapters.draft_heads import DraftHeads
from runtime.adapters.lora_data import TensorInfo
from runtime.adapters.lora_util import (
    PROJECTIONS, SIDES, Convention, is_lora_input_name, lora_input_name, parse_lora_input_name, rank_axis,
)
from runtime.util.scoped_file import FileWatch


MAX_LISTED = 12


def refuse_unappliable(source: str, refused: Sequence[str], separator: str = ", ") -> None:
    """``InvalidArgumentError`` listing the tensors (up to ``MAX_LISTED``) that no LoRA input
    of the model can take; nothing when ``refused`` is empty."""
    if not refused:
        return
    listed = separator.join(refused[:MAX_LISTED])
    if len(refused) > MAX_LISTED:
        listed += f"{separator}and {len(refused) - MAX_LISTED} more"
    raise InvalidArgumentError(
        f"{source}: cannot apply {len(refused)} tensor(s) (LoRA applies to the attention's q/k/v/o and the "
        f"MLP's gate/up/down only): {listed}"
    )


class AdapterData(Protocol):
    """What the LoRA component needs from an adapter, whatever its file format."""

    source_name: str
    format_name: str
    draft_heads: DraftHeads | None  # Turbo LoRA's heads, when read with the adapter (PEFT only)

    def get_all_tensor_names(self) -> list[str]:
        """Every tensor name, in a stable order."""

    def has_tensor(self, name: str) -> bool:
        """Whether the adapter has a tensor named ``name`` (LiteRT-LM's ``HasTensor``)."""

    def tensor_info(self, name: str) -> TensorInfo:
        """Shape, dtype and size of ``name`` (read from metadata only)."""

    def read_tensor(self, name: str) -> np.ndarray:
        """Tensor ``name``, read-only."""

    def get_lora_rank(self) -> int:
        """The adapter's (largest) rank."""

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors."""

    def release_memory(self) -> None:
        """Drops mapped pages of the source from this process, where possible."""

    def close(self) -> None:
        """Releases the source."""


@dataclass(frozen=True)
class DerivedTensor:
    """A tensor computed on demand: its shape and dtype, and how to compute it."""

    shape: tuple[int, ...]
    dtype: np.dtype
    compute: Callable[[], np.ndarray]


class DerivedLoraData:
    """An adapter whose tensors are computed from another source when read."""

    draft_heads: DraftHeads | None = None  # derived adapters carry none

    def __init__(
        self,
        tensors: Mapping[str, DerivedTensor],
        *,
        source_name: str,
        close: Callable[[], None] | None = None,
        format_name: str = "derived",
        watches: Sequence[FileWatch] = (),
        release: Callable[[], None] | None = None,
    ) -> None:
        """``watches``: files checked for changes before any tensor is computed;
        ``release``: drops mapped pages of the source (see :meth:`release_memory`)."""
        self.source_name = source_name
        self.format_name = format_name
        self._tensors = dict(tensors)
        self._close = close
        self._watches = tuple(watches)
        self._release = release

    def get_all_tensor_names(self) -> list[str]:
        """Every tensor name, in a stable order."""
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        """Whether ``name`` is one of the tensors (nothing is computed)."""
        return name in self._tensors

    def tensor_info(self, name: str) -> TensorInfo:
        """Shape, dtype and size of ``name``; ``NotFoundError`` if absent."""
        tensor = self._require(name)
        nbytes = int(np.prod(tensor.shape)) * tensor.dtype.itemsize
        return TensorInfo(name, tensor.shape, tensor.dtype, 0, nbytes, "computed")

    def read_tensor(self, name: str) -> np.ndarray:
        """Computes tensor ``name``; a read-only array of the announced shape and dtype."""
        tensor = self._require(name)
        for watch in self._watches:
            watch.check(f"tensor {name!r}")
        array = np.asarray(tensor.compute(), dtype=tensor.dtype)
        if array.shape != tensor.shape:
            raise InternalError(
                f"{self.source_name}: tensor {name!r} came out as {list(array.shape)}, "
                f"announced {list(tensor.shape)}"
            )
        array = array.view()  # read-only for our callers, without freezing the producer's array
        array.flags.writeable = False
        return array

    def get_lora_rank(self) -> int:
        """The largest rank over the ``a`` tensors."""
        ranks = []
        for name, tensor in self._tensors.items():
            if not is_lora_input_name(name):
                continue
            parsed = parse_lora_input_name(name)
            if parsed.side != "a":
                continue
            if len(tensor.shape) != 2:
                raise InvalidArgumentError(
                    f"{self.source_name}: tensor {name!r} has shape {list(tensor.shape)}, expected 2-D"
                )
            ranks.append(tensor.shape[rank_axis(parsed.convention, "a")])
        if not ranks:
            raise NotFoundError(f"{self.source_name}: no LoRA tensors")
        return max(ranks)

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors once computed."""
        return sum(self.tensor_info(name).nbytes for name in self._tensors)

    def release_memory(self) -> None:
        """Drops the source's mapped pages from this process, where the source allows it."""
        if self._release is not None:
            self._release()

    def close(self) -> None:
        """Releases the underlying source."""
        if self._close is not None:
            close, self._close = self._close, None
            close()

    def __enter__(self) -> DerivedLoraData:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _require(self, name: str) -> DerivedTensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise NotFoundError(f"{self.source_name}: no tensor named {name!r}") from None


MAX_LAYERS = 1 << 24  # what a PairTable holds: its int32 keys are layer * len(PROJECTIONS) + projection
# The columns of a PairTable row.
_LAYER, _PROJECTION, _FAN_IN, _RANK, _FAN_OUT = range(5)
_F32 = np.dtype(np.float32)


@functools.lru_cache(maxsize=1 << 14)  # one string per name, shared by every registered adapter
def _pair_name(layer: int, projection: str, side: str) -> str:
    return lora_input_name(Convention.LITERT_TORCH, layer, projection, side)


@dataclass(frozen=True, eq=False)
class PairTable:
    """The LoRA pairs of a derived adapter, compactly: what a registered adapter keeps of
    its tensors' metadata.

    ``rows`` (int32, read-only) holds one row per (layer, projection) pair, in the
    adapter's tensor order: layer, projection (an index into ``PROJECTIONS``), fan-in,
    rank and fan-out. Its tensors are the pair's ``a`` ``[in, r]`` and ``b`` ``[r, out]``,
    float32, named in the litert-torch convention. ``keys`` (sorted) and ``order`` find a
    pair's row: ``rows[order[i]]`` is the pair whose ``layer * len(PROJECTIONS) + projection``
    is ``keys[i]``.
    """

    rows: np.ndarray
    keys: np.ndarray
    order: np.ndarray

    @classmethod
    def of(cls, data: DerivedLoraData) -> PairTable:
        """The table of ``data``, whose tensors must be ``a``, ``b`` pairs in that order
        (what the PEFT and GGUF readers derive); ``InternalError`` otherwise."""
        names = data.get_all_tensor_names()
        if len(names) % 2:
            raise InternalError(f"{data.source_name}: tensor {names[-1]!r} has no other half")
        rows = []
        for a_name, b_name in zip(names[0::2], names[1::2], strict=True):
            a = parse_lora_input_name(a_name)
            if a.layer >= MAX_LAYERS:
                raise InvalidArgumentError(f"{data.source_name}: tensor {a_name!r} targets layer {a.layer}, beyond the "
                                           f"{MAX_LAYERS} layers of any model")
            (fan_in, rank), (b_rank, fan_out) = data.tensor_info(a_name).shape, data.tensor_info(b_name).shape
            if (a_name, b_name, b_rank) != (_pair_name(a.layer, a.projection, "a"),
                                            _pair_name(a.layer, a.projection, "b"), rank):
                raise InternalError(f"{data.source_name}: tensors {a_name!r} and {b_name!r} are not a derived pair")
            rows.append((a.layer, PROJECTIONS.index(a.projection), fan_in, rank, fan_out))
        table = np.array(rows, dtype=np.int32).reshape(-1, 5)
        keys = table[:, _LAYER] * len(PROJECTIONS) + table[:, _PROJECTION]
        order = np.argsort(keys, kind="stable").astype(np.int32)
        keys = keys[order]
        for array in (table, keys, order):
            array.flags.writeable = False
        return cls(table, keys, order)

    def names(self) -> list[str]:
        """Every tensor name, ``a`` then ``b`` of each pair."""
        return [_pair_name(int(layer), PROJECTIONS[projection], side)
                for layer, projection in self.rows[:, :2].tolist() for side in SIDES]

    def shape(self, name: str) -> tuple[int, int] | None:
        """The shape of tensor ``name``, ``None`` when the table has no such tensor."""
        try:
            parsed = parse_lora_input_name(name)
        except InvalidArgumentError:
            return None
        row = self._row(parsed.layer, parsed.projection)
        if parsed.convention is not Convention.LITERT_TORCH or parsed.side not in SIDES or row is None:
            return None
        _, _, fan_in, rank, fan_out = self.rows[row].tolist()
        return (fan_in, rank) if parsed.side == "a" else (rank, fan_out)

    def __contains__(self, pair: object) -> bool:
        """Whether ``(layer, projection)`` is one of the pairs."""
        return (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], int)
                and self._row(pair[0], pair[1]) is not None)

    def _row(self, layer: int, projection: object) -> int | None:
        if projection not in PROJECTIONS:
            return None
        key = layer * len(PROJECTIONS) + PROJECTIONS.index(projection)
        found = int(np.searchsorted(self.keys, key))
        return int(self.order[found]) if found < len(self.keys) and self.keys[found] == key else None

    @property
    def rank(self) -> int:
        """The largest rank of the pairs."""
        return int(self.rows[:, _RANK].max())

    @property
    def out_features(self) -> int:
        """The pairs' summed fan-out."""
        return int(self.rows[:, _FAN_OUT].sum())

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors (float32)."""
        rows = self.rows.astype(np.int64)
        return int((rows[:, _RANK] * (rows[:, _FAN_IN] + rows[:, _FAN_OUT])).sum()) * _F32.itemsize


class LazyLoraData:
    """A registered adapter of derived tensors: its :class:`PairTable` and how to build its
    :class:`DerivedLoraData` again, which the first read does and :meth:`release_memory`
    drops. Thread-safe."""

    draft_heads: DraftHeads | None = None  # set by a reader that read them with the adapter

    def __init__(self, table: PairTable, build: Callable[[], DerivedLoraData], *, source_name: str,
                 format_name: str, watches: Sequence[FileWatch] = ()) -> None:
        """``build`` reads the source again (it must derive ``table`` again);
        ``watches``: the files as they were registered, checked before any read."""
        self.source_name = source_name
        self.format_name = format_name
        self._table = table
        self._build = build
        self._watches = tuple(watches)
        self._built: DerivedLoraData | None = None
        self._lock = threading.Lock()

    @classmethod
    def of(cls, build: Callable[[], DerivedLoraData], watches: Sequence[FileWatch] = ()) -> Self:
        """Builds (and so checks) an adapter once, keeping its table and ``build``."""
        derived = build()
        return cls(PairTable.of(derived), build, source_name=derived.source_name, format_name=derived.format_name,
                   watches=watches)

    def get_all_tensor_names(self) -> list[str]:
        """Every tensor name, in a stable order (the one the source was derived in)."""
        return self._table.names()

    def has_tensor(self, name: str) -> bool:
        """Whether ``name`` is one of the tensors (read from the table; nothing is built)."""
        return self._table.shape(name) is not None

    def tensor_info(self, name: str) -> TensorInfo:
        """Shape, dtype and size of ``name``; ``NotFoundError`` if absent."""
        shape = self._table.shape(name)
        if shape is None:
            raise NotFoundError(f"{self.source_name}: no tensor named {name!r}")
        return TensorInfo(name, shape, _F32, 0, shape[0] * shape[1] * _F32.itemsize, "computed")

    def read_tensor(self, name: str) -> np.ndarray:
        """Computes tensor ``name`` (building the adapter's tensors first if they were
        released); a read-only array."""
        self.tensor_info(name)
        return self._derived(f"tensor {name!r}").read_tensor(name)

    def get_lora_rank(self) -> int:
        """The largest rank over the pairs."""
        return self._table.rank

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors once computed."""
        return self._table.nbytes

    def release_memory(self) -> None:
        """Drops the built tensors (and with them the source's handles and mapped pages)."""
        with self._lock:
            built, self._built = self._built, None
        if built is not None:
            built.release_memory()
            built.close()

    def close(self) -> None:
        """Releases what the first read built; a later read builds it again."""
        self.release_memory()

    def __enter__(self) -> LazyLoraData:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _derived(self, what: str) -> DerivedLoraData:
        """The built tensors, building them on first use; ``DataLossError`` (naming ``what``
        was to be read) when the source changed since it was registered."""
        for watch in self._watches:
            watch.check(what)
        with self._lock:
            if self._built is None:
                built = self._build()
                if not np.array_equal(PairTable.of(built).rows, self._table.rows):
                    raise DataLossError(f"{self.source_name}: its tensors are not the ones registered any more "
                                        "(the source changed)")
                self._built = built
            return self._built
