"""Tests for runtime.serve.sampling: vLLM's repetition penalty and min_tokens before the
core's sampler, and non-finite logits reported before sampling."""

from __future__ import annotations

import numpy as np
import pytest

from runtime import SamplerConfig
from runtime.serve.sampling import NonFiniteLogits, RequestSampler


def test_the_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    sampler = RequestSampler(SamplerConfig(), prompt=[0, 3], stop_tokens=(), repetition_penalty=2.0)
    # token 0 (seen): 5 -> 2.5, below token 1's 4; token 3 (seen): -1 -> -2
    assert sampler.sample(np.array([5.0, 4.0, 0.0, -1.0])) == 1
    # token 1 is now seen too: 4 -> 2, below token 2's 3
    assert sampler.sample(np.array([1.0, 4.0, 3.0, -1.0])) == 2
    plain = RequestSampler(SamplerConfig(), prompt=[0, 3], stop_tokens=())
    assert plain.sample(np.array([5.0, 4.0, 0.0, -1.0])) == 0


def test_min_tokens_keeps_stop_tokens_from_being_chosen_until_then():
    sampler = RequestSampler(SamplerConfig(), prompt=[1], stop_tokens={2, 3}, min_tokens=2)
    logits = np.array([0.0, 1.0, 9.0, 8.0])
    assert [sampler.sample(logits) for _ in range(3)] == [1, 1, 2]


def test_non_finite_logits_are_reported_before_sampling():
    sampler = RequestSampler(SamplerConfig(), prompt=[1], stop_tokens=())
    for bad in (np.inf, -np.inf, np.nan):
        with pytest.raises(NonFiniteLogits):
            sampler.sample(np.array([0.0, bad]))


def test_the_callers_float32_logits_are_read_not_changed():
    logits = np.array([5.0, 4.0, 9.0, -1.0], dtype=np.float32)
    before = logits.copy()
    sampler = RequestSampler(SamplerConfig(), prompt=[0, 3], stop_tokens={2}, min_tokens=1, repetition_penalty=2.0)
    assert sampler.sample(logits) == 1  # 2 held back (min_tokens), 0 penalized to 2.5
    assert sampler.sample(logits) == 2  # 1 is seen now too
    np.testing.assert_array_equal(logits, before)
    assert RequestSampler(SamplerConfig(), prompt=[], stop_tokens=()).sample(logits) == 2
