"""Tests for the prefix cache of prompt heads: which head a prompt takes, what is kept and
dropped, and that a prompt started from cached rows computes what a full prefill does."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from conftest import MODEL_FILES, adapter_path
from reference_model import reference_logits
from runtime import Engine, EngineSettings, LoraSource, SessionConfig
from runtime.errors import InvalidArgumentError, ResourceExhaustedError
from runtime.executor.litert_executor import KvPrefix
from runtime.framework.resource_management.prefix_cache import PrefixCache

HEAD = [5, 17, 42, 200, 3, 99, 250, 7, 1, 64, 128, 33]  # 12 tokens shared by the prompts below
BASE: tuple = ()  # the base model's blend: no adapter
A, B = ((1, 1.0),), ((2, 1.0),)


def rows(length: int, bytes_per_position: int = 16) -> KvPrefix:
    return KvPrefix(length, {"kv_cache_k_0": np.zeros((1, length, bytes_per_position // 4), np.float32)})


class TestPrefixCache:
    def test_takes_the_longest_shared_head_of_the_same_blend(self):
        cache = PrefixCache(1 << 20)
        cache.store(A, HEAD + [1, 2, 3, 4, 5, 6, 7, 8], rows(20))
        cache.store(A, HEAD[:9] + [9] * 11, rows(20))
        cache.store(B, HEAD + [1, 2, 3, 4, 5, 6, 7, 8, 9], rows(21))
        hit = cache.lookup(A, HEAD + [1, 2, 3, 99])
        assert hit is not None and hit.length == 15 and hit.prefix.length == 20
        assert cache.lookup(BASE, HEAD + [1]) is None  # no prompt of the base model cached
        stats = cache.stats()
        assert (stats.hits, stats.misses, stats.reused_tokens, stats.entries) == (1, 1, 15, 3)

    def test_leaves_the_last_token_to_run_and_skips_short_heads(self):
        cache = PrefixCache(1 << 20, min_tokens=8)
        cache.store(A, HEAD, rows(12))
        assert cache.lookup(A, HEAD).length == 11  # the same prompt: all but its last token
        assert cache.lookup(A, HEAD[:7] + [0] * 5) is None  # 7 shared tokens: not worth a copy
        assert cache.lookup(A, HEAD[:8] + [0]).length == 8

    def test_a_longer_prompt_replaces_those_it_begins_with(self):
        cache = PrefixCache(1 << 20)
        cache.store(A, HEAD, rows(12))
        assert not cache.wants(A, HEAD[:10], 16)  # nothing new
        assert not cache.wants(A, HEAD + [1] * 7, 16)  # 7 new tokens: below min_tokens
        assert cache.wants(A, HEAD + [1] * 8, 16)
        assert cache.wants(B, HEAD, 16)  # another blend caches its own rows
        cache.store(A, HEAD + [1] * 8, rows(20))
        assert cache.stats().entries == 1 and cache.stats().bytes == rows(20).nbytes

    def test_evicts_the_least_recently_used_within_its_budget(self):
        size = rows(10).nbytes
        cache = PrefixCache(2 * size)
        first, second, third = ([t] * 10 for t in (1, 2, 3))
        cache.store(A, first, rows(10))
        cache.store(A, second, rows(10))
        assert cache.lookup(A, first + [0]) is not None  # first is now the most recently used
        cache.store(A, third, rows(10))
        assert cache.lookup(A, second + [0]) is None
        assert cache.lookup(A, first + [0]) is not None and cache.lookup(A, third + [0]) is not None
        assert cache.stats().bytes == 2 * size
        assert not cache.wants(A, [4] * 200, 16)  # larger than the whole budget
        cache.store(A, [4] * 200, rows(200))
        assert cache.stats().entries == 2

    def test_drops_what_an_unloaded_adapter_computed(self):
        cache = PrefixCache(1 << 20)
        cache.store(A, HEAD, rows(12))
        cache.store(((1, 0.5), (2, 0.5)), HEAD, rows(12))
        cache.store(B, HEAD, rows(12))
        cache.drop_adapter(1)
        assert cache.lookup(A, HEAD + [0]) is None and cache.lookup(B, HEAD + [0]) is not None
        assert cache.stats().entries == 1

    def test_refuses_rows_of_another_length_and_bad_budgets(self):
        with pytest.raises(InvalidArgumentError, match="12 positions for 11 tokens"):
            PrefixCache(1 << 20).store(A, HEAD[:11], rows(12))
        with pytest.raises(InvalidArgumentError, match="-1 bytes"):
            PrefixCache(-1)
        with pytest.raises(InvalidArgumentError, match="prefix_cache_bytes=-5"):
            EngineSettings(prefix_cache_bytes=-5)


@pytest.fixture(scope="module", params=["default", "transposed", "grouped"])
def layout(request):
    return request.param


@pytest.fixture(scope="module")
def plain(layout):
    with Engine(MODEL_FILES[layout]) as engine:
        yield engine


@pytest.fixture
def engines(layout, plain):
    """An engine without a prefix cache (shared) and one with an empty cache (per test)."""
    with Engine(MODEL_FILES[layout], EngineSettings(prefix_cache_bytes=1 << 20)) as cached:
        yield plain, cached


def logits_and_tokens(engine: Engine, prompt: list[int], config: SessionConfig | None = None):
    with engine.create_session(config) as session:
        first = session.run_prefill(prompt)
        rows = [first]
        token = int(np.argmax(first))
        for _ in range(6):
            rows.append(session.run_decode(token))
            token = int(np.argmax(rows[-1]))
        return np.stack(rows), session.generate([token], 4).tokens


@pytest.mark.parametrize("config", [None, SessionConfig(lora_path=adapter_path("torch_r4"))], ids=["base", "r4"])
def test_prompts_started_from_cached_rows_compute_what_a_full_prefill_does(engines, weights, config):
    plain, cached = engines
    prompts = [HEAD + [9, 8, 7], HEAD + [11, 12], HEAD + [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 20], HEAD[:10] + [77]]
    for prompt in prompts:
        got, got_tokens = logits_and_tokens(cached, prompt, config)
        want, want_tokens = logits_and_tokens(plain, prompt, config)
        np.testing.assert_array_equal(got, want)
        assert got_tokens == want_tokens
    if config is None:  # and both equal the float64 reference
        np.testing.assert_allclose(got[0], reference_logits(weights, prompts[-1])[-1], atol=1e-4)
    # The first is cached (less its last token where the model decodes it: a decode step's
    # rows are not a prefill's); the second takes HEAD, the third the first's cached tokens
    # (and replaces it), the last HEAD's first 10.
    first = len(prompts[0]) - (0 if cached.spec.prefill_has_logits else 1)
    stats = cached.stats().prefix_cache
    assert (stats.hits, stats.misses, stats.reused_tokens, stats.entries) == (3, 1, 12 + first + 10, 1)


def test_sessions_of_other_adapters_do_not_take_each_others_rows(engines):
    plain, cached = engines
    base = SessionConfig()
    adapter = SessionConfig(lora_path=adapter_path("torch_r16"))
    logits_and_tokens(cached, HEAD + [1, 2, 3], base)  # cached for the base model only
    hits = cached.stats().prefix_cache.hits
    got, _ = logits_and_tokens(cached, HEAD + [1, 2, 4], adapter)
    assert cached.stats().prefix_cache.hits == hits
    np.testing.assert_array_equal(got, logits_and_tokens(plain, HEAD + [1, 2, 4], adapter)[0])


def test_unloading_an_adapter_forgets_its_prompts(engines):
    _, cached = engines
    lora_id = cached.register_adapter(LoraSource(path=adapter_path("litertlm_r4")))
    logits_and_tokens(cached, HEAD + [5, 5], SessionConfig(adapters={lora_id: 1.0}))
    assert cached.stats().prefix_cache.entries == 1
    cached.unload_adapter(lora_id)
    assert cached.stats().prefix_cache.entries == 0


def test_sessions_on_many_threads_share_the_cache_exactly(engines):
    plain, cached = engines
    prompts = [HEAD + [t, t + 1, t + 2] for t in range(20, 28)]
    want = [logits_and_tokens(plain, p)[0] for p in prompts]
    got: list[np.ndarray | None] = [None] * len(prompts)

    def run(i: int) -> None:
        got[i] = logits_and_tokens(cached, prompts[i])[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_a_prompt_too_long_for_the_cache_is_refused_as_without_a_prefix_cache(engines):
    """A prompt one token longer than the KV cache, beginning with a cached one, took the
    cached rows (a hit, its positions counted as reused) before its prefill was refused
    as '1 token(s) at position 64'; it is refused as without a cache, taking nothing."""
    plain, cached = engines
    prompt = [t % 250 + 1 for t in range(cached.spec.kv_length + 1)]
    with cached.create_session() as session:
        session.run_prefill(prompt[:-1])
    before = cached.stats().prefix_cache
    errors = []
    for engine in (plain, cached):
        with engine.create_session() as session:
            with pytest.raises(ResourceExhaustedError) as caught:
                session.run_prefill(prompt)
            errors.append(str(caught.value))
            assert session.position == 0
    assert errors[0] == errors[1]
    assert errors[0].startswith(f"RESOURCE_EXHAUSTED: {len(prompt)} token(s) at position 0 would exceed the KV cache "
                                f"of {cached.spec.kv_length} positions")
    after = cached.stats().prefix_cache
    assert (after.hits, after.reused_tokens) == (before.hits, before.reused_tokens)
