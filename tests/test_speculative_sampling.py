"""Speculative sampling with Turbo LoRA's draft heads: the output distribution is plain
sampling's (runtime.engine.speculative's module notes give the rule and its proof).

The fixtures are the tiny Turbo model and its trained heads (see tests/test_speculative.py).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

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
# the distribution well. Two runs of plain sampling with other seeds differ by a total
# variation of 0.045 on average (0.083 at most in 5,000 simulated pairs); accepting every
# draft gives 0.87, and resampling after a rejection without removing the draft 0.18.
SAMPLING = {"temperature": 1.0, "top_k": 2}
MAX_TOTAL_VARIATION = 0.11


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


def _total_variation(a: list[tuple[int, ...]], b: list[tuple[int, ...]]) -> float:
    """Total-variation distance between the empirical distributions of two equal-sized samples."""
    counts_a, counts_b = Counter(a), Counter(b)
    return sum(abs(counts_a[x] - counts_b[x]) for x in counts_a.keys() | counts_b.keys()) / (2 * len(a))


def test_speculative_sampling_has_plain_samplings_distribution(engine):
    plain, plain_stats = _generations(engine, False, range(GENERATIONS), PROMPT, SAMPLING)
    turbo, turbo_stats = _generations(engine, True, range(10**6, 10**6 + GENERATIONS), PROMPT, SAMPLING)
    distance = _total_variation(plain, turbo)
    assert distance < MAX_TOTAL_VARIATION, distance
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
