"""LoRA-XS's frozen factors, rebuilt from the base model's own weights.

LoRA-XS trains only an ``r x r`` matrix ``R`` between two frozen factors of the base
weight ``W`` ``[out, in]``: ``delta = s * B R A``. Its reference builds them with
scikit-learn, ``TruncatedSVD(n_components=r, n_iter=n_iter, random_state=random_state)
.fit(W)`` on ``W`` in float32: ``B = transform(W)`` (``U_r S_r``, ``[out, r]``) and
``A = components_`` (``V_r^T``, ``[r, in]``). An R-only adapter (the layout shipped to
devices: ~100x smaller than LoRA) carries ``R`` alone; this module rebuilds ``A`` and ``B``
the same way from the model file's weights (:mod:`runtime.util.model_weights`), once per
projection, rank and SVD settings, for every adapter of the model. The randomized SVD is
not the exact one: rebuilt any other way, the factors would not be the trained ones.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from runtime.errors import FailedPreconditionError, InvalidArgumentError
from runtime.util.model_weights import ModelWeights

DEFAULT_N_ITER = 10  # LoRA-XS's reference settings, unless the adapter's config says otherwise
DEFAULT_RANDOM_STATE = 42


class LoraXsFactors:
    """A and B of one model's projections, rebuilt on first use and cached. Thread-safe."""

    def __init__(self, weights: Callable[[], ModelWeights]) -> None:
        """``weights`` reads the model's weights map; called once, when first needed."""
        self._open_weights = weights
        self._weights: ModelWeights | None = None
        self._cache: dict[tuple[int, str, int, int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.RLock()

    def shape(self, layer: int, projection: str) -> tuple[int, int]:
        """``(out, in)`` of the projection's base weight (metadata only)."""
        return self.model_weights().shape(layer, projection)

    def factors(self, layer: int, projection: str, rank: int, n_iter: int = DEFAULT_N_ITER,
                random_state: int = DEFAULT_RANDOM_STATE) -> tuple[np.ndarray, np.ndarray]:
        """``(A [rank, in], B [out, rank])`` float32 of the projection, read-only."""
        key = (layer, projection, rank, n_iter, random_state)
        with self._lock:  # one rebuild at a time: each is seconds of two cores at real size
            if key not in self._cache:
                weights = self.model_weights()
                weight = weights.weight(layer, projection)
                if not 0 < rank < min(weight.shape):
                    raise InvalidArgumentError(
                        f"LoRA-XS rank {rank} does not fit a base weight of shape {list(weight.shape)}")
                try:
                    with np.errstate(all="ignore"):  # an overflow is refused below
                        a, b = _truncated_svd(weight, rank, n_iter, random_state)
                    finite = np.isfinite(a).all() and np.isfinite(b).all()
                except ValueError:  # scipy's check of its own steps' results
                    finite = False
                if not finite:
                    raise InvalidArgumentError(
                        f"{weights.source}: the SVD of the base weight of layer {layer} projection {projection!r}, "
                        "which R-only LoRA-XS adapters are rebuilt from, overflows (its largest magnitude is "
                        f"{np.abs(weight).max():.3g})")
                self._cache[key] = a, b
            return self._cache[key]

    def model_weights(self) -> ModelWeights:
        """The model's weights map (opened on first use), which DoRA adapters read too."""
        with self._lock:
            if self._weights is None:
                self._weights = self._open_weights()
            return self._weights


def _truncated_svd(weight: np.ndarray, rank: int, n_iter: int, random_state: int) -> tuple[np.ndarray, np.ndarray]:
    try:
        from sklearn.decomposition import TruncatedSVD
    except ImportError:
        raise FailedPreconditionError(
            "R-only LoRA-XS adapters need scikit-learn, whose TruncatedSVD rebuilds their A and B as LoRA-XS does: "
            "pip install scikit-learn") from None
    svd = TruncatedSVD(n_components=rank, n_iter=n_iter, random_state=random_state).fit(weight)
    a = np.ascontiguousarray(svd.components_, dtype=np.float32)  # may come Fortran-ordered
    b = np.ascontiguousarray(svd.transform(weight), dtype=np.float32)
    a.setflags(write=False)
    b.setflags(write=False)
    return a, b
