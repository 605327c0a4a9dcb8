"""PrefixCache: the KV rows of recent prompts, per adapter blend, for prompts that begin alike.

Requests on one adapter often share a head: a chat template's system prompt, a few-shot
preamble, the earlier turns of a conversation. A context that starts a prompt at position 0
looks up the cached prompt of its blend that shares the longest head with its own, starts
its KV cache from that many cached rows, and prefills only the rest. Any head of a cached
prompt is exact: attention is causal, so the row of position i depends on tokens 0..i alone
(and on the adapters, hence one cache per blend). The prompt's own rows are cached after
its prefill; the least recently used prompts go first when the byte budget is exceeded.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import count

import numpy as np

from runtime.components.lora_manager import Blend
from runtime.errors import InvalidArgumentError
from runtime.executor.litert_executor import KvPrefix


@dataclass(frozen=True)
class PrefixHit:
    """What a prompt takes from the cache: the first ``length`` positions of ``prefix``."""

    length: int
    prefix: KvPrefix


@dataclass(frozen=True)
class PrefixCacheStats:
    """The prefix cache's counters: prompts that started from a cached head (``hits``) or
    not (``misses``), the positions taken from it instead of prefilled, what it holds."""

    hits: int
    misses: int
    reused_tokens: int
    entries: int
    bytes: int
    capacity_bytes: int


@dataclass(frozen=True)
class _Entry:
    blend: Blend
    tokens: np.ndarray  # int64 ids of the cached prompt
    prefix: KvPrefix


class PrefixCache:
    """Cached prompt heads within ``capacity_bytes``; a head shorter than ``min_tokens`` is
    neither taken nor kept (copying rows costs more than prefilling a few). Thread-safe."""

    def __init__(self, capacity_bytes: int, min_tokens: int = 8) -> None:
        if capacity_bytes < 0 or min_tokens < 1:
            raise InvalidArgumentError(f"a prefix cache of {capacity_bytes} bytes and heads of at least {min_tokens} "
                                       "tokens, expected bytes >= 0 and tokens >= 1")
        self.capacity_bytes = capacity_bytes
        self.min_tokens = min_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._keys = count()
        self._bytes = 0
        self._hits = self._misses = self._reused = 0
        self._lock = threading.Lock()

    def lookup(self, blend: Blend, tokens: Sequence[int], usable: Callable[[int], bool] = lambda length: True
               ) -> PrefixHit | None:
        """The longest head of ``tokens`` that a cached prompt of ``blend`` begins with, at
        most all but the last token (which must run for its logits); ``None`` below
        ``min_tokens`` or where ``usable(its length)`` is false (asked outside the lock).
        Counts a hit or a miss."""
        ids = np.asarray(tokens, np.int64)
        with self._lock:
            best, found = 0, None
            for key, entry in self._entries.items():
                if entry.blend == blend:
                    shared = _shared_head(entry.tokens, ids[:-1])
                    if shared > best:
                        best, found = shared, (key, entry)
        taken = found is not None and best >= self.min_tokens and usable(best)
        with self._lock:
            if not taken:
                self._misses += 1
                return None
            key, entry = found
            if key in self._entries:  # (another thread may have replaced it meanwhile)
                self._entries.move_to_end(key)
            self._hits += 1
            self._reused += best
        return PrefixHit(best, entry.prefix)

    def wants(self, blend: Blend, tokens: Sequence[int], bytes_per_position: int) -> bool:
        """Whether :meth:`store` would keep ``tokens``: at least ``min_tokens`` of it not
        cached for ``blend`` yet, and within the budget."""
        if len(tokens) * bytes_per_position > self.capacity_bytes:
            return False
        ids = np.asarray(tokens, np.int64)
        with self._lock:
            covered = max((_shared_head(e.tokens, ids) for e in self._entries.values() if e.blend == blend), default=0)
        return len(tokens) - covered >= self.min_tokens

    def store(self, blend: Blend, tokens: Sequence[int], prefix: KvPrefix) -> None:
        """Keeps ``prefix`` (the rows of ``tokens`` run with ``blend``) as the most recently
        used entry; cached prompts of the blend that it begins with are dropped (it holds
        their rows too), then the least recently used until the budget holds."""
        if prefix.length != len(tokens):
            raise InvalidArgumentError(f"a KV prefix of {prefix.length} positions for {len(tokens)} tokens")
        if prefix.nbytes > self.capacity_bytes:
            return
        ids = np.asarray(tokens, np.int64)
        with self._lock:
            for key in [k for k, e in self._entries.items()
                        if e.blend == blend and _shared_head(e.tokens, ids) == len(e.tokens)]:
                self._bytes -= self._entries.pop(key).prefix.nbytes
            self._entries[next(self._keys)] = _Entry(blend, ids, prefix)
            self._bytes += prefix.nbytes
            while self._bytes > self.capacity_bytes:
                self._bytes -= self._entries.popitem(last=False)[1].prefix.nbytes

    def drop_adapter(self, lora_id: int) -> None:
        """Forgets every prompt run with adapter ``lora_id`` (it was unloaded)."""
        with self._lock:
            for key in [k for k, e in self._entries.items() if any(i == lora_id for i, _ in e.blend)]:
                self._bytes -= self._entries.pop(key).prefix.nbytes

    def stats(self) -> PrefixCacheStats:
        """The counters so far and what the cache holds now."""
        with self._lock:
            return PrefixCacheStats(self._hits, self._misses, self._reused, len(self._entries), self._bytes,
                                    self.capacity_bytes)


def _shared_head(cached: np.ndarray, tokens: np.ndarray) -> int:
    """How many leading tokens ``cached`` and ``tokens`` have in common."""
    n = min(len(cached), len(tokens))
    differ = np.flatnonzero(cached[:n] != tokens[:n])
    return int(differ[0]) if len(differ) else n
