"""Tests for runtime.adapters.lora_xs: LoRA-XS's A and B rebuilt from base weights, once."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from runtime.errors import InvalidArgumentError
from runtime.adapters.lora_xs import LoraXsFactors


class CountingWeights:
    """A model's weights map over fixed random weights, counting reads."""

    def __init__(self) -> None:
        self.reads: list[tuple[int, str]] = []
        self.weights = {(0, "q"): np.random.default_rng(0).standard_normal((48, 32)).astype(np.float32)}

    def shape(self, layer: int, projection: str) -> tuple[int, int]:
        return self.weights[layer, projection].shape

    def weight(self, layer: int, projection: str) -> np.ndarray:
        self.reads.append((layer, projection))
        return self.weights[layer, projection].copy()


def test_factors_are_the_truncated_svd_of_the_weight_and_built_once():
    weights = CountingWeights()
    opened = []
    factors = LoraXsFactors(lambda: opened.append(1) or weights)
    assert opened == []  # nothing read until an R-only adapter needs it
    assert factors.shape(0, "q") == (48, 32)
    a, b = factors.factors(0, "q", 4)
    assert a.shape == (4, 32) and b.shape == (48, 4) and not a.flags.writeable
    np.testing.assert_allclose(a @ a.T, np.eye(4), atol=1e-5)  # V_r^T: orthonormal rows
    np.testing.assert_allclose(b, weights.weights[0, "q"] @ a.T, rtol=1e-4, atol=1e-4)  # U_r S_r = W V_r
    exact = np.linalg.svd(weights.weights[0, "q"].astype(np.float64), compute_uv=False)[:4]
    np.testing.assert_allclose(np.linalg.norm(b, axis=0), exact, rtol=1e-3)  # the leading singular values
    again = [factors.factors(0, "q", 4) for _ in range(3)]
    assert all(x[0] is a and x[1] is b for x in again) and weights.reads == [(0, "q")] and opened == [1]
    assert factors.factors(0, "q", 4, n_iter=3)[0] is not a  # other SVD settings: other factors


def test_factors_are_built_once_under_concurrent_first_use():
    weights = CountingWeights()
    factors = LoraXsFactors(lambda: weights)
    results = []
    threads = [threading.Thread(target=lambda: results.append(factors.factors(0, "q", 4))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(results) == 4 and all(r[0] is results[0][0] for r in results) and weights.reads == [(0, "q")]


def test_a_rank_the_weight_cannot_hold_is_refused():
    factors = LoraXsFactors(CountingWeights)
    with pytest.raises(InvalidArgumentError, match=r"LoRA-XS rank 32 does not fit a base weight of shape \[48, 32\]"):
        factors.factors(0, "q", 32)
