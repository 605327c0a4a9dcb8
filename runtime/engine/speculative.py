"""Speculative decoding with an adapter's draft heads (Turbo LoRA), lossless for greedy
decoding and for sampling alike.

One step, as data: the trunk's last token ``t`` (not yet in the KV cache) and the K drafts
the heads made from the previous step's hidden state go through one ``verify{L}`` run at
the session's position. The logits at index i are the trunk's own prediction after
``t, d_0 .. d_{i-1}``; the session's sampler picks the trunk's token from them, index by
index, exactly as a plain decode step would; draft ``d_i`` is kept while it equals that
pick, and the first pick that differs (or the pick after the last draft) is the next
token. The KV rows of the rejected drafts stay in the cache past the new position: the
cache is a static array indexed by position and the mask hides what lies past it, so
they are overwritten later. The heads then draft from the hidden state at the last kept
index.

Why this is speculative sampling (Leviathan et al. 2023, Chen et al. 2023) and which
variant: the heads draft deterministically (each head's argmax), so the draft
distribution ``q_i`` is a point mass on ``d_i`` and the rejection rule ``accept with
probability min(1, p_i(d_i) / q_i(d_i))``, else sample from ``norm(max(0, p_i - q_i))``,
becomes: accept ``d_i`` with probability ``p_i(d_i)``, else sample from ``p_i`` without
``d_i``, renormalised; after K kept drafts the bonus token comes from ``p_K``. Here
``p_i`` is the sampler's own distribution (temperature, top-k, top-p: one place decides
the transform, :class:`~runtime.components.sampler.Sampler`) over the verify logits at
index i. Drawing ``x ~ p_i`` and keeping ``d_i`` exactly when ``x == d_i`` realises both
branches with one draw: ``P(x == d_i) = p_i(d_i)``, and given ``x != d_i``, ``x`` is
distributed as ``p_i`` without ``d_i``, renormalised. So every generated token is one
sample of the trunk's distribution at its context: the output distribution is plain
sampling's. It is also the cheapest variant: no softmax over the heads' logits, no draw to
make a draft, one draw per generated token as in plain decoding. Drafts sampled from the
heads' softmax ``q_i`` (the general rule) would be kept with probability
``1 - TV(p_i, q_i)`` instead of ``p_i(d_i)``: more where ``q_i`` is close to ``p_i``
as a whole, not just in its top token (what Medusa heads are trained for), at the cost of
a softmax and a draw per draft. Because the sampler is called once per generated token in
the same order, a seeded generation gives the same tokens whether the heads run or pause
(up to the verify logits' float rounding against a decode step's), and a sampler that
keeps state (the server's repetition penalty and ``min_tokens``) sees what plain decoding
shows it. With greedy decoding (temperature 0 or top_k 1) the pick is the argmax and the
output is plain greedy decoding's, token for token. The session's position ends where
plain decoding's would (every generated token in the context; the last one pending, as
plain decoding leaves it: see :class:`ContextHandler`).

A session whose drafts are rarely accepted (free text, or a high temperature) switches
the heads off for a while (:class:`SpeculationPolicy`). A speculating session runs its
verify steps by itself, outside decode batches (a verify is already several tokens in one
pass over the weights).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from runtime.errors import InvalidArgumentError
from runtime.framework.resource_management.context_handler import ContextHandler
from runtime.framework.resource_management.resource_manager import ResourceManager
from runtime.adapters.draft_heads import DraftHeads


@dataclass(frozen=True)
class SpeculationPolicy:
    """When an adapter's draft heads switch themselves off.

    After ``probe_verifies`` verify runs with drafts, if fewer than
    ``min_accepted_per_verify`` drafts were kept per run on average, the adapter's sessions
    decode plainly for ``pause_tokens`` tokens, then probe again; each probe that fails
    again doubles the pause, up to ``max_pause_tokens`` (one that passes resets it), so
    that heads which never help cost a few percent at most: a verify run that keeps
    nothing costs more than a decode step, so heads that do not predict this text would
    only slow it down. The count is per adapter, across generations and sessions (short
    answers would otherwise spend their whole length probing).
    """

    probe_verifies: int = 8
    min_accepted_per_verify: float = 0.5
    pause_tokens: int = 64
    max_pause_tokens: int = 1024

    def __post_init__(self) -> None:
        for name in ("probe_verifies", "pause_tokens", "max_pause_tokens"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise InvalidArgumentError(f"{name}={value!r:.40}, expected an integer >= 1")
        rate = self.min_accepted_per_verify
        if type(rate) not in (int, float) or not (math.isfinite(rate) and rate >= 0):
            raise InvalidArgumentError(f"min_accepted_per_verify={rate!r:.40}, expected a finite number >= 0")


@dataclass(frozen=True)
class SpeculationStats:
    """Draft heads at work: ``drafted`` tokens proposed, ``accepted`` per head (head k's
    draft kept), ``verifies`` runs, ``tokens`` produced by them (accepted drafts plus the
    trunk's own token per run, but for a run the generation ended in on a kept draft:
    a stop token, ``max_new_tokens`` or ``on_token`` raising; the drafts past that end are
    not counted as drafted), ``plain_steps`` decode steps taken while the heads were off
    (rare acceptance, the end of the cache), and ``blends_without_heads``:
    generations whose blend of several adapters, some with heads, used none."""

    drafted: int = 0
    accepted: tuple[int, ...] = ()
    verifies: int = 0
    tokens: int = 0
    plain_steps: int = 0
    blends_without_heads: int = 0

    @property
    def tokens_per_verify(self) -> float:
        """Tokens per verify forward (1.0: no draft kept; up to K + 1)."""
        return self.tokens / self.verifies if self.verifies else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Kept drafts over proposed drafts."""
        return sum(self.accepted) / self.drafted if self.drafted else 0.0


@dataclass
class SpeculationCounters:
    """Running totals behind :class:`SpeculationStats`; thread-safe."""

    drafted: int = 0
    accepted: list[int] = field(default_factory=list)
    verifies: int = 0
    tokens: int = 0
    plain_steps: int = 0
    blends_without_heads: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, other: SpeculationCounters) -> None:
        """Adds another set of counters (one generation's) to these."""
        with self._lock:
            self.drafted += other.drafted
            self.verifies += other.verifies
            self.tokens += other.tokens
            self.plain_steps += other.plain_steps
            self.blends_without_heads += other.blends_without_heads
            if len(self.accepted) < len(other.accepted):
                self.accepted += [0] * (len(other.accepted) - len(self.accepted))
            for k, count in enumerate(other.accepted):
                self.accepted[k] += count

    def snapshot(self) -> SpeculationStats:
        """The totals now."""
        with self._lock:
            return SpeculationStats(self.drafted, tuple(self.accepted), self.verifies, self.tokens,
                                    self.plain_steps, self.blends_without_heads)


class AcceptanceGate:
    """Whether one adapter's heads are on, from its recent verify runs (see
    :class:`SpeculationPolicy`); shared by every session of the adapter, thread-safe."""

    def __init__(self, policy: SpeculationPolicy) -> None:
        self._policy = policy
        self._plain_left = 0  # plain steps before the next probe
        self._pause = policy.pause_tokens  # the next failed probe's pause
        self._runs = 0  # verify runs with drafts in the current probe, and the drafts they kept
        self._kept = 0
        self._lock = threading.Lock()

    def heads_on(self) -> bool:
        """Whether the next step may speculate."""
        return self._plain_left == 0

    def plain_step(self) -> None:
        """Counts one step decoded plainly while the heads were off."""
        with self._lock:
            self._plain_left = max(0, self._plain_left - 1)

    def verified(self, kept: int) -> None:
        """Counts one verify run with drafts that kept ``kept`` of them."""
        policy = self._policy
        with self._lock:
            self._runs += 1
            self._kept += kept
            if self._runs >= policy.probe_verifies:
                if self._kept < policy.min_accepted_per_verify * self._runs:
                    self._plain_left = self._pause
                    self._pause = min(2 * self._pause, max(policy.max_pause_tokens, policy.pause_tokens))
                else:
                    self._pause = policy.pause_tokens
                self._runs = self._kept = 0


class Speculation:
    """An engine's speculation: which draft heads a session drafts with, each adapter's
    :class:`AcceptanceGate`, the lm_head the heads end in, and every generation's
    counters (closed sessions' too). Thread-safe.

    The rule, decided here only: a session speculates with the heads of its adapter when it
    runs exactly one adapter and that adapter carries heads; a blend of several adapters
    speculates with none (each head was trained on one adapter's hidden states), and such a
    generation is counted in ``blends_without_heads``.
    """

    def __init__(self, policy: SpeculationPolicy, heads_of: Callable[[int], DraftHeads | None],
                 lm_head: Callable[[], np.ndarray]) -> None:
        """``heads_of(lora_id)``: the heads registered with an adapter (``None``: none);
        ``lm_head()``: reads the model's output projection ``[vocab, hidden]`` (called once,
        when a session first speculates)."""
        self._policy = policy
        self._heads_of = heads_of
        self._read_lm_head = lm_head
        self._lm_head: np.ndarray | None = None
        self._gates: dict[int, AcceptanceGate] = {}
        self._lock = threading.Lock()
        self.counters = SpeculationCounters()

    def heads_for(self, blend: Sequence[tuple[int, float]], counters: SpeculationCounters
                  ) -> tuple[DraftHeads, AcceptanceGate] | None:
        """The heads a generation of ``blend`` drafts with and its adapter's gate (``None``:
        plain decoding); a blend whose adapters carry heads it cannot use is counted in
        ``counters`` (the session's) and the engine's."""
        if len(blend) == 1:
            lora_id = blend[0][0]
            heads = self._heads_of(lora_id)
            return (heads, self._gate(lora_id)) if heads is not None else None
        if any(self._heads_of(lora_id) is not None for lora_id, _ in blend):
            blended = SpeculationCounters(blends_without_heads=1)
            counters.add(blended)
            self.counters.add(blended)
        return None

    def lm_head(self) -> np.ndarray:
        """The model's output projection ``[vocab, hidden]`` float32 (read once)."""
        with self._lock:
            if self._lm_head is None:
                self._lm_head = self._read_lm_head()
            return self._lm_head

    def forget(self, lora_id: int) -> None:
        """Drops the gate of an adapter that was unloaded."""
        with self._lock:
            self._gates.pop(lora_id, None)

    def _gate(self, lora_id: int) -> AcceptanceGate:
        with self._lock:
            if lora_id not in self._gates:
                self._gates[lora_id] = AcceptanceGate(self._policy)
            return self._gates[lora_id]


class SpeculativeDecoder:
    """Runs one generation's decode loop with draft heads, greedy or sampled (see the module
    notes)."""

    def __init__(self, resources: ResourceManager, context: ContextHandler, heads: DraftHeads, lm_head: np.ndarray,
                 decode: Callable[[ContextHandler, int], np.ndarray], gate: AcceptanceGate) -> None:
        """``lm_head``: the model's output projection the heads end in; ``decode(context,
        token)``: a plain decode step that advances the position (for when the heads are
        off, or the cache has no room for a verify run); ``gate``: the adapter's switch."""
        self._resources = resources
        self._context = context
        self._heads = heads
        self._decode = decode
        self._gate = gate
        self._lm_head = lm_head if heads.vocab is None else np.ascontiguousarray(lm_head[heads.vocab])
        self._length = max(resources.spec.verify_lengths(resources.slot_for(context.blend)), default=0)
        self.counters = SpeculationCounters(accepted=[0] * heads.count)
        self._drafts: list[int] = []  # the first step's drafts, from the prompt's last hidden state

    def prefill(self, prompt: list[int], prefill: Callable[[list[int]], np.ndarray]) -> np.ndarray:
        """Appends ``prompt`` to the context and advances its position; returns the logits
        after it. ``prefill(tokens)``: the plain way (a prefill that advances the position).
        While the heads are on, the prompt's last tokens (up to the longest verify length)
        go through one verify run instead: its final hidden state drafts the first step,
        which a prefill (no hidden states) would leave without drafts; the logits are the
        same step's, as every later step's are."""
        context = self._context
        tail = min(len(prompt), self._length)
        head = prompt[: len(prompt) - tail]
        if not tail or not self._gate.heads_on() or (
                context.position + len(head) + self._length > self._resources.spec.kv_length):
            return prefill(prompt)
        if head:
            prefill(head)
        logits, hidden = self._resources.verify(context, prompt[len(head):])
        context.position += tail
        self._drafts = self._heads.draft(hidden[-1], self._project)
        return logits[-1]

    def _project(self, rows: np.ndarray) -> np.ndarray:
        """The heads' rows through the lm_head (or its draft-vocabulary rows): einsum for a
        draft vocabulary (small; a multi-threaded BLAS waits for its threads on a busy
        machine), BLAS for the whole vocabulary."""
        if self._heads.vocab is not None:
            return np.einsum("kj,vj->kv", rows, self._lm_head)
        return rows @ self._lm_head.T

    def run(self, first: int, sample: Callable[[np.ndarray], int], max_new_tokens: int, stops: set[int],
            on_token: Callable[[int], None] | None) -> tuple[list[int], str]:
        """Generates from ``first`` (the token prefill's logits gave, not yet in the cache)
        until a stop token or ``max_new_tokens``, ``sample(logits)`` picking each token (the
        session's sampler); returns the tokens and why it stopped."""
        context, counters, gate = self._context, self.counters, self._gate
        kv_length = self._resources.spec.kv_length
        generated = [first]
        drafts = self._drafts
        while True:
            last = generated[-1]
            if on_token is not None:
                on_token(last)
            if last in stops or len(generated) == max_new_tokens:
                context.pending = last  # no step for logits nobody reads
                return generated, "stop_token" if last in stops else "max_new_tokens"
            heads_on = gate.heads_on()
            if not heads_on or self._length == 0 or context.position + self._length > kv_length:
                logits = self._decode(context, last)
                counters.plain_steps += 1
                if not heads_on:
                    gate.plain_step()
                generated.append(sample(logits))
                drafts = []
                continue
            drafts = drafts[: min(self._length - 1, max_new_tokens - len(generated))]
            logits, hidden = self._resources.verify(context, [last, *drafts])
            start = context.position
            counters.verifies += 1
            kept = 0
            stopped = None
            ended = True  # until the trunk's own token is picked: the generation ends inside this run
            try:
                while True:
                    choice = sample(logits[kept])  # the trunk's token after t, d_0 .. d_{kept-1}
                    if kept == len(drafts) or choice != drafts[kept]:
                        ended = False
                        break
                    kept += 1
                    generated.append(choice)
                    # The context plain decoding holds while on_token sees this draft (t and the
                    # drafts before it), so that a caller stopping here by raising leaves that.
                    context.position = start + kept
                    if on_token is not None:
                        on_token(choice)
                    if choice in stops or len(generated) == max_new_tokens:
                        stopped = "stop_token" if choice in stops else "max_new_tokens"
                        break
            finally:
                self._count_run(len(drafts), kept, ended)
            context.position = start + 1 + kept  # the trunk's token and the kept drafts
            if stopped is not None:
                return generated, stopped  # its last token (kept) is in the cache
            generated.append(choice)  # the first choice unlike its draft, or the one after every draft
            drafts = self._heads.draft(hidden[kept], self._project)

    def _count_run(self, drafts: int, kept: int, ended: bool) -> None:
        """Counts one verify run of ``drafts`` drafts that gave the first ``kept`` of them,
        then the trunk's own token unless the generation ``ended`` on a kept draft (a stop
        token, ``max_new_tokens``, ``on_token`` raising): the drafts past that end were never
        judged, so they count as neither proposed nor rejected, in the stats and the gate."""
        counters = self.counters
        counters.drafted += kept if ended else drafts
        for k in range(kept):
            counters.accepted[k] += 1
        counters.tokens += kept if ended else kept + 1
        if drafts:
            self._gate.verified(kept)
