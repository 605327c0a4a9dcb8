"""Tests for runtime.components.sampler."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.components.sampler import Sampler, SamplerConfig, greedy, top_ids
from runtime.errors import InternalError, InvalidArgumentError

LOGITS = np.array([0.1, 3.0, 2.9, -1.0, 0.0], np.float32)


def test_greedy_picks_argmax():
    assert greedy().sample(LOGITS) == 1
    assert Sampler(SamplerConfig(temperature=5.0, top_k=1)).sample(LOGITS) == 1


def test_top_k_restricts_choices():
    sampler = Sampler(SamplerConfig(temperature=10.0, top_k=2, seed=0))
    picks = {sampler.sample(LOGITS) for _ in range(200)}
    assert picks == {1, 2}


def test_top_p_restricts_choices():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    sampler = Sampler(SamplerConfig(temperature=1.0, top_p=0.7, seed=0))
    picks = [sampler.sample(logits) for _ in range(500)]
    assert set(picks) == {0, 1}
    # Renormalised over the kept tokens: 0.5 / 0.8 of the picks are token 0.
    assert abs(picks.count(0) / len(picks) - 0.625) < 0.08


def test_temperature_sampling_follows_softmax():
    logits = np.log(np.array([0.7, 0.2, 0.1]))
    sampler = Sampler(SamplerConfig(temperature=1.0, seed=1))
    counts = np.bincount([sampler.sample(logits) for _ in range(3000)], minlength=3) / 3000
    np.testing.assert_allclose(counts, [0.7, 0.2, 0.1], atol=0.03)


def test_seed_reproduces():
    config = SamplerConfig(temperature=1.0, seed=42)
    first, second = Sampler(config), Sampler(config)
    picks = [first.sample(LOGITS) for _ in range(50)]
    assert picks == [second.sample(LOGITS) for _ in range(50)]
    assert len(set(picks)) > 1


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1.0}, {"temperature": float("nan")}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5},
               {"seed": -1}, {"seed": 1.5},
               # not numbers of the field's kind: refused naming it, not a TypeError or a filter silently off
               {"temperature": None}, {"temperature": "0.5"}, {"top_k": float("nan")}, {"top_k": 2.5},
               {"top_k": None}, {"top_k": True}, {"top_p": None}, {"seed": True}, {"presence_penalty": "1"},
               {"frequency_penalty": None}, {"logit_bias": ((1, 2, 3),)}, {"logit_bias": (1, 2)},
               {"logit_bias": {1: "2"}}, {"logit_bias": None}, {"logit_bias": "12"}, {"logit_bias": [[1, 2.0]]},
               {"logit_bias": {"5": 1.0, 3: 2.0}}]
)
def test_bad_config(kwargs):
    with pytest.raises(InvalidArgumentError, match=f"^INVALID_ARGUMENT: {next(iter(kwargs))}[=:[]"):
        SamplerConfig(**kwargs)


def test_a_tiny_temperature_samples_the_best_token_instead_of_failing():
    """Any finite temperature > 0 is documented as valid: dividing the logits by 1e-310 (or
    large logits by 0.5) overflows to infinity, and inf - inf made NaN probabilities."""
    for temperature, logits in ((1e-310, LOGITS), (1e-300, np.array([1e10, 2e10], np.float32)),
                                (0.5, np.array([1e308, -1e308]))):
        sampler = Sampler(SamplerConfig(temperature=temperature, seed=0))
        assert {sampler.sample(logits) for _ in range(5)} == {int(np.argmax(logits))}
    sampler = Sampler(SamplerConfig(temperature=1e-310, top_p=0.5, top_k=3, seed=0))
    assert sampler.sample(LOGITS) == 1


def test_a_token_biased_twice_is_refused():
    """Pairs hold one bias per token: a second one was silently dropped (only the last applied)."""
    with pytest.raises(InvalidArgumentError, match=r"logit_bias: token 1 is given twice"):
        SamplerConfig(logit_bias=((1, 50.0), (1, 50.0)))


def test_logits_of_more_than_one_row_are_refused():
    """Two rows of logits (a score result's) were flattened into one vocabulary of twice the
    size: a token id past the model's came out."""
    rows = np.stack([LOGITS, LOGITS[::-1]])
    with pytest.raises(InvalidArgumentError, match=r"logits have shape \(2, 5\), expected one row"):
        greedy().sample(rows)
    assert greedy().sample(LOGITS[None]) == 1


def test_non_finite_logits():
    with pytest.raises(InternalError, match="non-finite"):
        greedy().sample(np.array([0.0, np.nan]))
    with pytest.raises(InvalidArgumentError):
        greedy().sample(np.array([]))


def test_logit_bias_moves_the_greedy_choice():
    assert Sampler(SamplerConfig(logit_bias={2: 0.2})).sample(LOGITS) == 2
    assert Sampler(SamplerConfig(logit_bias=((1, -100.0),))).sample(LOGITS) == 2
    assert SamplerConfig(logit_bias={3: 1.0, 0: 2.0}).logit_bias == ((0, 2.0), (3, 1.0))
    assert SamplerConfig(logit_bias=[(3, 1.0)]).logit_bias == ((3, 1.0),)  # kept as a tuple: the config is frozen


def test_presence_and_frequency_penalties_count_the_sampler_s_own_choices():
    logits = np.array([1.0, 0.5, 0.0], np.float32)
    # presence: once chosen, token 0 loses 0.6 and token 1 wins; then both are down by 0.6 once
    sampler = Sampler(SamplerConfig(presence_penalty=0.6))
    assert [sampler.sample(logits) for _ in range(3)] == [0, 1, 0]
    # frequency: token 0 loses 0.3 per choice: 1.0, 0.7 (still first), 0.4 (token 1 now)
    sampler = Sampler(SamplerConfig(frequency_penalty=0.3))
    assert [sampler.sample(logits) for _ in range(3)] == [0, 0, 1]
    # the caller's logits are never changed
    np.testing.assert_array_equal(logits, [1.0, 0.5, 0.0])


@pytest.mark.parametrize("config", [dict(presence_penalty=2.5), dict(frequency_penalty=-3.0),
                                    dict(logit_bias={1: 101.0}), dict(logit_bias={-1: 1.0})])
def test_bad_penalties_and_biases_are_refused(config):
    with pytest.raises(InvalidArgumentError):
        SamplerConfig(**config)


def test_a_bias_outside_the_vocabulary_is_refused_when_sampling():
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        Sampler(SamplerConfig(logit_bias={5: 1.0})).sample(LOGITS)


@pytest.mark.parametrize("k", [1, 3, 7, 50, 99, 100, 150])
def test_top_ids_are_a_stable_sort_s_first_k(k):
    values = np.random.default_rng(k).integers(0, 20, size=100).astype(np.float64)  # many equal values
    np.testing.assert_array_equal(top_ids(values, k), np.argsort(-values, kind="stable")[:k])


def test_top_p_over_a_large_vocabulary_keeps_the_best_first_prefix():
    # 300 equally likely tokens hold almost all the mass; top-p 0.5 keeps the first 150 of
    # them in id order (ties as a stable sort orders them), more than the 64 ordered first.
    logits = np.full(8192, -30.0)
    logits[1000:1300] = 0.0
    sampler = Sampler(SamplerConfig(temperature=0.7, top_p=0.5, seed=3))
    picks = np.array([sampler.sample(logits) for _ in range(1500)])
    assert picks.min() >= 1000 and picks.max() < 1150
    assert len(set(picks.tolist())) > 135


def test_sampling_without_filters_follows_the_softmax_of_a_large_vocabulary():
    logits = np.where(np.arange(49_152) % 1000 == 7, 0.0, -50.0)  # 50 likely tokens among SmolLM2's 49,152
    logits[7] = np.log(10.0) * 0.7  # token 7: 10 times the others' probability at temperature 0.7
    sampler = Sampler(SamplerConfig(temperature=0.7, seed=4))
    picks = np.array([sampler.sample(logits) for _ in range(2000)])
    assert set(picks.tolist()) <= {i for i in range(49_152) if i % 1000 == 7}
    assert abs(np.mean(picks == 7) - 10 / 59) < 0.035  # 4 standard deviations


def test_a_sampler_config_of_another_kind_is_refused_naming_it():
    """A dict of settings where a SamplerConfig goes (generate's ``sampler=``,
    SessionConfig's) failed at the first sample with an AttributeError."""
    from runtime import SessionConfig

    with pytest.raises(InvalidArgumentError, match=r"^INVALID_ARGUMENT: sampler=\{'temperature': 0.7\}, expected a "
                                                   "SamplerConfig"):
        Sampler({"temperature": 0.7})
    with pytest.raises(InvalidArgumentError, match=r"sampler=\{'temperature': 0.7\}, expected a SamplerConfig"):
        SessionConfig(sampler={"temperature": 0.7})
