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
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from runtime.errors import InvalidArgumentError
from runtime.util.adapter_data import DerivedLoraData, DerivedTensor
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

    def __init__(self, projections: Mapping[ProjectionKey, DoraProjection], source: str) -> None:
        self._projections = dict(projections)
        self._source = source
        self._terms: dict[ProjectionKey, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    def __contains__(self, key: object) -> bool:
        return key in self._projections

    @property
    def nbytes(self) -> int:
        """Bytes of the magnitude vectors (as float32, what the adapter stores)."""
        return sum(p.magnitude.size * 4 for p in self._projections.values())

    def output_scale(self, key: ProjectionKey, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
        """``g`` ``[out]`` float64 of projection ``key`` at the session's ``scale``, where
        ``a`` ``[in, r]`` and ``b`` ``[r, out]`` are the adapter's tensors in graph layout (its
        own scale ``s`` folded into ``a``). ``InvalidArgumentError`` when a row norm is zero
        or not finite (``g`` would be too)."""
        projection = self._projections[key]
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
        weight = self._projections[key].weight().astype(np.float64)
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        weight_a = weight @ a64  # [out, r]
        terms = (np.einsum("ij,ij->i", weight, weight),
                 np.einsum("ir,ri->i", weight_a, b64),
                 np.einsum("ir,ir->i", b64.T @ (a64.T @ a64), b64.T))
        with self._lock:
            return self._terms.setdefault(key, terms)


class DoraLoraData(DerivedLoraData):
    """A DoRA adapter: its LoRA tensors as :class:`DerivedLoraData` presents them, and
    ``dora``, the magnitudes that rescale its projections' outputs."""

    def __init__(self, tensors: Mapping[str, DerivedTensor], dora: DoraMagnitudes, *, source_name: str,
                 format_name: str, watches: tuple[FileWatch, ...] = ()) -> None:
        super().__init__(tensors, source_name=source_name, format_name=format_name, watches=watches)
        self.dora = dora

    @property
    def nbytes(self) -> int:
        """Bytes of the LoRA tensors and the magnitude vectors."""
        return super().nbytes + self.dora.nbytes
