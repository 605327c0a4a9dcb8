"""``GET /metrics``: the server's and the engine's numbers as Prometheus text.

Per request: counts by endpoint and status, queue wait, time to first token, decode
speed, tokens per model (a blend counts for each of its adapters; ``rate()`` of the
token counters is tokens/s), how generations ended. Per adapter, read from
:meth:`Engine.stats` at scrape time: residency, resident and tensor bytes, sessions, and
how long registering it took, whether it is healthy; engine-wide: switch, materialize and register latency
percentiles, residency hits, misses and evictions, and batched decode: batches by rows
(sessions' steps run as one pass over the weights) and the steps' wait for their batch;
speculative decoding with Turbo adapters' draft heads: drafted, accepted per head, verify
forwards, tokens per forward; the prefix cache of prompt heads: hits, misses, positions
taken from it, what it holds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from runtime import Engine
from runtime.engine.stats import PrefixCacheStats, SpeculationStats
from runtime.serve.catalog import AdapterCatalog
from runtime.serve.generation import Outcome

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TOKENS_PER_S = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128)


class ServerMetrics:
    """The instruments requests update, and the page they are read from."""

    def __init__(self, engine: Engine, catalog: AdapterCatalog, base_name: str, running: Callable[[], int]) -> None:
        """``base_name``: the model's name, counted for requests without adapters;
        ``running``: how many requests are running now."""
        self._catalog = catalog
        self._base_name = base_name
        self._series = threading.Lock()  # an adapter's series are counted or forgotten, never both at once
        self.registry = CollectorRegistry()
        self.requests = Counter("runtime_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=self.registry)
        running_gauge = Gauge("runtime_running_requests", "Requests admitted and not yet finished",
                              registry=self.registry)
        running_gauge.set_function(running)
        self.admitted_with = Histogram(
            "runtime_running_requests_at_admission",
            "Requests running (this one included) when one is admitted: the sessions that share the engine's "
            "executors step by step, and the most one decode batch could hold",
            buckets=_CONCURRENCY, registry=self.registry)
        self.queue_wait = Histogram("runtime_queue_wait_seconds", "From admission to a worker taking the request",
                                    buckets=_SECONDS, registry=self.registry)
        self.first_token = Histogram("runtime_time_to_first_token_seconds",
                                     "From admission to the first generated token",
                                     buckets=_SECONDS, registry=self.registry)
        self.decode_speed = Histogram("runtime_decode_tokens_per_second",
                                      "Per request: generated tokens after the first, per second",
                                      buckets=_TOKENS_PER_S, registry=self.registry)
        self.prompt_tokens = Counter("runtime_prompt_tokens", "Prompt tokens processed, by model or adapter",
                                     ["model"], registry=self.registry)
        self.generated_tokens = Counter("runtime_generated_tokens", "Tokens generated, by model or adapter "
                                        "(rate() of it is tokens/s)", ["model"], registry=self.registry)
        self.generations = Counter("runtime_generations", "Generations by model or adapter and how they ended "
                                   "(stop, length, cancelled: the client went away)",
                                   ["model", "finish_reason"], registry=self.registry)
        self.registry.register(_EngineCollector(engine, catalog))

    def record(self, adapters: Sequence[str], outcome: Outcome) -> None:
        """Counts one finished generation for each of ``adapters`` (their names; none: for
        the base model's name). An adapter unloaded since the request let it go is not
        counted: its series were forgotten and stay so (a request records its outcome
        after its job released the adapters, and an unload may come in between)."""
        self.queue_wait.observe(outcome.queue_wait_s)
        if outcome.time_to_first_token_s is not None:
            self.first_token.observe(outcome.time_to_first_token_s)
        if outcome.decode_tokens_per_s > 0:
            self.decode_speed.observe(outcome.decode_tokens_per_s)
        with self._series:
            if adapters:
                models = [name for name in adapters if self._catalog.find(name) is not None]
            else:
                models = [self._base_name]
            for model in models:
                self.prompt_tokens.labels(model).inc(outcome.prompt_tokens)
                self.generated_tokens.labels(model).inc(outcome.completion_tokens)
                self.generations.labels(model, outcome.finish_reason).inc()

    def forget(self, model: str) -> None:
        """Drops the series of an adapter the catalog has unloaded."""
        with self._series:
            for counter in (self.prompt_tokens, self.generated_tokens):
                try:
                    counter.remove(model)
                except KeyError:
                    pass
            for reason in ("stop", "length", "cancelled"):
                try:
                    self.generations.remove(model, reason)
                except KeyError:
                    pass

    def render(self) -> bytes:
        """The Prometheus text page (reads the engine's stats; call it off the event loop)."""
        return generate_latest(self.registry)


class _EngineCollector:
    """Reads :meth:`Engine.stats` and the catalog when scraped."""

    def __init__(self, engine: Engine, catalog: AdapterCatalog) -> None:
        self._engine = engine
        self._catalog = catalog

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.stats()
        names = {entry.lora_id: entry for entry in self._catalog.entries()}
        per_adapter = {
            "resident": GaugeMetricFamily("runtime_adapter_resident",
                                          "1 if the adapter's slot buffers are materialized", labels=["adapter"]),
            "resident_bytes": GaugeMetricFamily("runtime_adapter_resident_bytes",
                                                "Bytes of the resident buffers that include the adapter",
                                                labels=["adapter"]),
            "tensor_bytes": GaugeMetricFamily("runtime_adapter_tensor_bytes", "The adapter's weights as stored",
                                              labels=["adapter"]),
            "sessions": GaugeMetricFamily("runtime_adapter_sessions", "Live sessions using the adapter",
                                          labels=["adapter"]),
            "load": GaugeMetricFamily("runtime_adapter_load_seconds", "How long registering the adapter took",
                                      labels=["adapter"]),
            "healthy": GaugeMetricFamily("runtime_adapter_healthy", "0 once the adapter failed at run time "
                                         "(non-finite logits), until it is unloaded", labels=["adapter"]),
        }
        for adapter in stats.adapters:
            entry = names.get(adapter.lora_id)
            if entry is None:
                continue
            per_adapter["resident"].add_metric([entry.name], 1.0 if adapter.resident_bytes else 0.0)
            per_adapter["resident_bytes"].add_metric([entry.name], adapter.resident_bytes)
            per_adapter["tensor_bytes"].add_metric([entry.name], adapter.tensor_bytes)
            per_adapter["sessions"].add_metric([entry.name], adapter.sessions)
            per_adapter["load"].add_metric([entry.name], entry.load_seconds)
            per_adapter["healthy"].add_metric([entry.name], 0.0 if self._catalog.problem(entry.name) else 1.0)
        yield from per_adapter.values()
        yield GaugeMetricFamily("runtime_resident_bytes", "Bytes of all materialized adapter buffers",
                                value=stats.resident_bytes)
        yield GaugeMetricFamily("runtime_sessions", "Live sessions", value=len(stats.sessions))
        for name, what, summary in (
            ("switch", "runtime work when a run's session or adapter differs from the last", stats.switch),
            ("materialize", "building an adapter's slot buffers", stats.materialize),
            ("register", "registering an adapter (parse and check)", stats.load),
        ):
            quantiles = GaugeMetricFamily(f"runtime_adapter_{name}_seconds", f"Recent percentiles of {what}",
                                          labels=["quantile"])
            quantiles.add_metric(["0.5"], summary.p50_ms / 1e3)
            quantiles.add_metric(["0.99"], summary.p99_ms / 1e3)
            yield quantiles
            yield CounterMetricFamily(f"runtime_adapter_{name}", f"Count of {what}", value=summary.count)
        yield CounterMetricFamily("runtime_residency_hits", "Runs whose adapter buffers were resident",
                                  value=stats.residency_hits)
        yield CounterMetricFamily("runtime_residency_misses", "Runs that had to materialize adapter buffers",
                                  value=stats.residency_misses)
        yield CounterMetricFamily("runtime_residency_evictions", "Adapter buffers evicted by the residency policy",
                                  value=stats.evictions)
        batches = CounterMetricFamily("runtime_decode_batches", "Decode batches by rows: sessions' steps that ran "
                                      "together (1: a step alone)", labels=["rows"])
        for rows, count in stats.decode_batches:
            batches.add_metric([str(rows)], count)
        yield batches
        wait = GaugeMetricFamily("runtime_decode_batch_wait_seconds",
                                 "Recent percentiles of a decode step's wait for its batch", labels=["quantile"])
        wait.add_metric(["0.5"], stats.queue_wait.p50_ms / 1e3)
        wait.add_metric(["0.99"], stats.queue_wait.p99_ms / 1e3)
        yield wait
        yield from _speculation(stats.speculation)
        if stats.prefix_cache is not None:
            yield from _prefix_cache(stats.prefix_cache)


def _prefix_cache(cache: PrefixCacheStats) -> Iterator[Metric]:
    """The prefix cache: prompts that started from a cached head, positions taken from it, what it holds."""
    yield CounterMetricFamily("runtime_prefix_cache_hits", "Prompts that started from the cached KV rows of a "
                              "prompt beginning the same way (same adapters)", value=cache.hits)
    yield CounterMetricFamily("runtime_prefix_cache_misses", "Prompts from position 0 that found no cached head",
                              value=cache.misses)
    yield CounterMetricFamily("runtime_prefix_cache_reused_tokens", "Prompt positions taken from the cache "
                              "instead of prefilled", value=cache.reused_tokens)
    yield GaugeMetricFamily("runtime_prefix_cache_bytes", "Bytes of KV rows the prefix cache holds",
                            value=cache.bytes)
    yield GaugeMetricFamily("runtime_prefix_cache_entries", "Prompts the prefix cache holds", value=cache.entries)


def _speculation(spec: SpeculationStats) -> Iterator[Metric]:
    """Turbo LoRA's draft heads: drafted, accepted per head, verify forwards and the tokens they gave."""
    yield CounterMetricFamily("runtime_speculative_drafted", "Draft tokens the adapters' heads proposed",
                              value=spec.drafted)
    accepted = CounterMetricFamily("runtime_speculative_accepted", "Drafts kept (equal to the token the trunk picked: "
                                   "its greedy token, or its sample), by head (0: the token after the trunk's next "
                                   "one)", labels=["head"])
    for head, count in enumerate(spec.accepted):
        accepted.add_metric([str(head)], count)
    yield accepted
    yield CounterMetricFamily("runtime_speculative_verifies", "Verify forwards (the trunk's token and its drafts "
                              "in one run)", value=spec.verifies)
    yield CounterMetricFamily("runtime_speculative_tokens", "Tokens the verify forwards produced",
                              value=spec.tokens)
    yield GaugeMetricFamily("runtime_speculative_tokens_per_forward", "Tokens per verify forward so far (1: no "
                            "draft kept)", value=spec.tokens_per_verify)
    yield CounterMetricFamily("runtime_speculative_plain_steps", "Decode steps of speculating sessions taken with "
                              "the heads off (rarely right, or the end of the cache)", value=spec.plain_steps)
    yield CounterMetricFamily("runtime_speculative_blends_without_heads", "Generations whose blend of several "
                              "adapters, some with draft heads, used none", value=spec.blends_without_heads)
