"""Speculative sampling with Turbo LoRA's draft heads: the output distribution is plain
sampling's (runtime.engine.speculative's module notes give the rule and its proof).

The fixtures are the tiny Turbo model and its trained heads (see tests/test_speculative.py).
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from scipy.stats import chi2_contingency  # the test extra has scipy: scikit-learn (lora-xs extra) needs it

from conftest import MODELS
from runtime import Engine, EngineSettings, LoraSource, SessionConfig
from runtime.components.sampler import Sampler, SamplerConfig
from runtime.engine.speculative import SpeculationPolicy

TURBO = MODELS / "turbo"
PROMPT = json.loads((TURBO / "trained_heads" / "training.json").read_text())["prompts"][0]
ALWAYS = SpeculationPolicy(probe_verifies=10_000)  # heads never switch themselves off
GENERATIONS = 2_000
# The first 4 tokens: the 1st comes from prefill, the 2nd from a verify run without drafts,
# the 3rd and 4th may be drafts kept (heads 0 and 1).
NEW_TOKENS = 4
# Temperature 1 with top-k 2: at most 2**4 outcomes, so 2,000 generations each estimate
# the distribution well. The two histograms (plain sampling, speculative sampling; seeds apart)
# go through a chi-square test of homogeneity, outcomes too rare for it pooled into one cell.
# Under the null (the same distribution) the p-value is uniform, so a fixed set of seeds fails
# a correct rule with probability ALPHA; a wrong rule gives p-values far below it (see the test).
SAMPLING = {"temperature": 1.0, "top_k": 2}
ALPHA = 1e-3
# Expected count per cell (half an outcome's total: the samples are equal-sized) at least 5,
# the textbook condition for the chi-square approximation.
MIN_EXPECTED = 5


@pytest.fixture(scope="module")
def engine():
    with Engine(TURBO / "default.tflite", EngineSettings(speculation=ALWAYS)) as engine:
        yield engine


def _generations(engine: Engine, heads: bool, seeds: range, prompt: list[int], sampling: dict,
                 max_new_tokens: int = NEW_TOKENS):
    """One seeded generation per seed from the same empty context; the token tuples and the
    session's speculation stats."""
    source = LoraSource(path=TURBO / "trained_heads", heads=heads)
    outputs = []
    with engine.create_session(SessionConfig(loras=[source])) as session:
        for seed in seeds:
            session.reset()
            sampler = SamplerConfig(seed=seed, **sampling)
            outputs.append(tuple(session.generate(prompt, max_new_tokens=max_new_tokens, sampler=sampler).tokens))
        return outputs, session.stats().speculation


def _histograms(a: list[tuple[int, ...]], b: list[tuple[int, ...]]) -> np.ndarray:
    """A ``2 x outcomes`` table of how often each outcome occurs in ``a`` and in ``b``, the
    outcomes whose expected count per sample is below MIN_EXPECTED pooled into one last
    column (left out if even the pool is that rare)."""
    counts_a, counts_b = Counter(a), Counter(b)
    common, rare = [], np.zeros(2, dtype=np.int64)
    for outcome in sorted(counts_a.keys() | counts_b.keys()):
        row = np.array([counts_a[outcome], counts_b[outcome]])
        if row.sum() / 2 >= MIN_EXPECTED:
            common.append(row)
        else:
            rare += row
    if rare.sum() / 2 >= MIN_EXPECTED:
        common.append(rare)
    return np.array(common).T


def test_speculative_sampling_has_plain_samplings_distribution(engine):
    plain, plain_stats = _generations(engine, False, range(GENERATIONS), PROMPT, SAMPLING)
    turbo, turbo_stats = _generations(engine, True, range(10**6, 10**6 + GENERATIONS), PROMPT, SAMPLING)
    table = _histograms(plain, turbo)
    assert table.shape[1] >= 4  # outcomes enough for the test to see a distribution
    result = chi2_contingency(table, correction=False)
    # Measured with these seeds: chi2 = 23.3 on 15 degrees of freedom, p = 0.079. A wrong accept
    # rule in SpeculativeDecoder.run fails by far: keeping every draft gives chi2 = 3087 (16 dof,
    # p below 1e-300), resampling from p after a rejection without removing the draft chi2 = 487
    # (15 dof, p = 3e-94).
    assert result.pvalue > ALPHA, (result.statistic, result.dof, result.pvalue, table)
    assert plain_stats.verifies == 0
    assert turbo_stats.drafted > 0 and turbo_stats.accepted[0] > 0  # the distribution was tested with drafts kept
    assert turbo_stats.acceptance_rate < 0.9  # and with drafts rejected


def test_trained_heads_keep_drafts_at_a_moderate_temperature(engine):
    _, stats = _generations(engine, True, range(20), PROMPT, {"temperature": 0.3, "top_p": 0.9}, max_new_tokens=24)
    assert stats.verifies > 0 and stats.drafted > 0
    assert stats.accepted[0] > 0 and stats.tokens_per_verify > 1


def test_a_seed_gives_the_same_tokens_with_heads_on_or_off(engine):
    # One draw per generated token, in order, as in plain decoding; the fixture's verify and
    # decode logits are bit-identical, so the tokens are too.
    sampling = {"temperature": 0.7, "top_k": 8, "top_p": 0.95}
    seeds = range(40)
    plain, _ = _generations(engine, False, seeds, PROMPT, sampling, max_new_tokens=16)
    turbo, stats = _generations(engine, True, seeds, PROMPT, sampling, max_new_tokens=16)
    again, _ = _generations(engine, True, seeds, PROMPT, sampling, max_new_tokens=16)
    assert stats.accepted[0] > 0
    assert turbo == plain == again


class CountingSampler(Sampler):
    """A sampler that counts its calls, like a sampler that keeps state per token (the
    server's repetition penalty and min_tokens)."""

    def __init__(self, config: SamplerConfig) -> None:
        super().__init__(config)
        self.calls = 0

    def sample(self, logits) -> int:
        self.calls += 1
        return super().sample(logits)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_the_sampler_is_called_once_per_generated_token(engine, temperature):
    with engine.create_session(SessionConfig(loras=[LoraSource(path=TURBO / "random_heads")])) as session:
        sampler = CountingSampler(SamplerConfig(temperature=temperature, seed=5))
        tokens = session.generate(PROMPT, max_new_tokens=24, sampler=sampler).tokens
        stats = session.stats().speculation
    assert stats.drafted > sum(stats.accepted)  # drafts were rejected
    assert sampler.calls == len(tokens)
