"""DoRA adapters: each projection's magnitude, and the output scale it gives at any scale.

PEFT's DoRA (``use_dora: true``) trains, beside LoRA's A and B, a magnitude ``m`` ``[out]``
per projection and applies ``y = g * (W x) + b + g * (s B A x)`` with
``g = m / ||W + s B A||_row`` (the norm over ``in``, the bias not scaled). ``W`` is the base
model's own weight, read from the model file (:mod:`runtime.util.model_weights`: exact in
float32, dequantized in int8 and float16). A session's scale ``u`` multiplies ``s``, so ``g``
depends on it; with ``D = s B A`` the row norm is

    ||W_i + u D_i||^2 = ||W_i||^2 + 2 u <W_i, D_i> + u^2 ||D_i||^2,

and the three terms, computed once per projection on first use (one read of ``W``, one
``W @ (s A)^T``), give ``g`` for any ``u`` in O(out). The runtime writes ``g`` folded into
``b`` and ``g - 1`` into the DoRA slot's scale input (:mod:`runtime.components.lora`).

A registered DoRA adapter (:class:`DoraLoraData`) keeps no magnitude: they are read again,
with its LoRA tensors, when first needed (:class:`DerivedDoraData` is what reading gives).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from typing import cast

import numpy as np

from runtime.errors import InvalidArgumentError
from runtime.adapters.adapter_data import DerivedLoraData, DerivedTensor, LazyLoraData, PairTable
from runtime.util.scoped_file import FileWatch

# A projection: (layer, projection name), as LoraInputName.pair spells it.
ProjectionKey = tuple[int, str]


@dataclass(frozen=True)
class DoraProjection:
    """One projection of a DoRA adapter: its magnitude (as read, checked finite and of the
    projection's output size) and how to read the base weight ``W`` ``[out, in]``."""

    magnitude_name: str  # the adapter's tensor, for messages
    magnitude: np.ndarray  # float64 [out]
    weight: Callable[[], np.ndarray]


class DoraMagnitudes:
    """The DoRA part of one adapter: the output scale ``g`` of each of its projections for a
    session's scale. Thread-safe; each projection's norm terms are computed once."""

    def __init__(self, keys: Container[ProjectionKey], nbytes: int,
                 read: Callable[[], Mapping[ProjectionKey, DoraProjection]], source: str) -> None:
        """The magnitudes of the projections ``keys`` (``nbytes`` as float32), which
        ``read`` gives when they are needed; use :meth:`of` or :meth:`deferred`."""
        self._source = source
        self._keys = keys
        self._nbytes = nbytes
        self._projections = read
        self._terms: dict[ProjectionKey, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    @classmethod
    def of(cls, projections: Mapping[ProjectionKey, DoraProjection], source: str) -> DoraMagnitudes:
        """The magnitudes of ``projections``, read."""
        read = dict(projections)
        return cls(read, sum(p.magnitude.size * 4 for p in read.values()), lambda: read, source)

    @classmethod
    def deferred(cls, keys: Container[ProjectionKey], nbytes: int,
                 read: Callable[[], DoraMagnitudes], source: str) -> DoraMagnitudes:
        """Magnitudes of the projections ``keys`` (``nbytes`` as float32) that ``read``
        gives when they are needed: what a registered adapter keeps instead of them."""
        return cls(keys, nbytes, lambda: read().projections(), source)

    def projections(self) -> Mapping[ProjectionKey, DoraProjection]:
        """Each projection's magnitude and base weight (read now if they were deferred)."""
        return self._projections()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    @property
    def nbytes(self) -> int:
        """Bytes of the magnitude vectors (as float32, what the adapter stores)."""
        return self._nbytes

    def output_scale(self, key: ProjectionKey, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
        """``g`` ``[out]`` float64 of projection ``key`` at the session's ``scale``, where
        ``a`` ``[in, r]`` and ``b`` ``[r, out]`` are the adapter's tensors in graph layout (its
        own scale ``s`` folded into ``a``). ``InvalidArgumentError`` when a row norm is zero
        or not finite (``g`` would be too)."""
        projection = self._projections()[key]
        weight_sq, cross, delta_sq = self._norm_terms(key, a, b)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # refused below
            norm = np.sqrt(np.maximum(weight_sq + 2.0 * scale * cross + scale * scale * delta_sq, 0.0))
            g = projection.magnitude / norm
        if not np.isfinite(g).all():
            raise InvalidArgumentError(
                f"{self._source}: DoRA magnitude {projection.magnitude_name!r}: the adapted weight ||W + s B A|| has "
                f"a zero or non-finite row norm at scale {scale}, so its output scale m / norm is not finite")
        return g

    def _norm_terms(self, key: ProjectionKey, a: np.ndarray, b: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(||W_i||^2, <W_i, D_i>, ||D_i||^2)`` per row, float64, for ``D = (a b)^T``."""
        with self._lock:
            terms = self._terms.get(key)
        if terms is not None:
            return terms
        weight = self._projections()[key].weight().astype(np.float64)
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        weight_a = weight @ a64  # [out, r]
        terms = (np.einsum("ij,ij->i", weight, weight),
                 np.einsum("ir,ri->i", weight_a, b64),
                 np.einsum("ir,ir->i", b64.T @ (a64.T @ a64), b64.T))
        with self._lock:
            return self._terms.setdefault(key, terms)


class DerivedDoraData(DerivedLoraData):
    """A DoRA adapter as its source reads: its LoRA tensors as :class:`DerivedLoraData`
    presents them, and ``dora``, its magnitudes (read)."""

    def __init__(self, tensors: Mapping[str, DerivedTensor], dora: DoraMagnitudes, *, source_name: str,
                 format_name: str, watches: tuple[FileWatch, ...] = ()) -> None:
        super().__init__(tensors, source_name=source_name, format_name=format_name, watches=watches)
        self.dora = dora


class DoraLoraData(LazyLoraData):
    """A registered DoRA adapter: its LoRA tensors as :class:`LazyLoraData` presents them,
    and ``dora``, the magnitudes that rescale its projections' outputs (every pair has
    one), read again with the tensors when first needed."""

    def __init__(self, table: PairTable, build: Callable[[], DerivedDoraData], *, source_name: str,
                 format_name: str, watches: tuple[FileWatch, ...] = ()) -> None:
        """``build`` reads the adapter again, as :class:`LazyLoraData` takes it."""
        super().__init__(table, build, source_name=source_name, format_name=format_name, watches=watches)
        self.dora = DoraMagnitudes.deferred(table, table.out_features * 4, self._read_magnitudes, source_name)

    def _read_magnitudes(self) -> DoraMagnitudes:
        return cast(DerivedDoraData, self._derived("DoRA magnitudes")).dora  # what build gives

    @property
    def nbytes(self) -> int:
        """Bytes of the LoRA tensors and the magnitude vectors."""
        return super().nbytes + self.dora.nbytes
