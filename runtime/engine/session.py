"""Session: one conversation's context over the shared engine, with its own adapters."""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from runtime.components.sampler import Sampler, SamplerConfig
from runtime.components.tokenizer import Tokenizer
from runtime.engine.config import check_adapters, check_flag, check_sources
from runtime.engine.speculative import Speculation, SpeculationCounters, SpeculativeDecoder
from runtime.engine.stats import SessionStats
from runtime.errors import FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError
from runtime.executor.litert_executor import KV_LENGTH_HINT
from runtime.framework.lora_source import LoraSource
from runtime.framework.resource_management.context_handler import ContextHandler
from runtime.framework.resource_management.decode_batcher import DecodeBatcher
from runtime.framework.resource_management.resource_manager import ResourceManager


class SessionRegistry:
    """The live sessions of one engine, so that closing the engine closes them, and the
    engine's :class:`Speculation` they share."""

    def __init__(self, speculation: Speculation) -> None:
        self.speculation = speculation
        self._sessions: set[Session] = set()
        self._next_id = 1
        self._closed = False
        self._lock = threading.Lock()

    def add(self, session: Session) -> int:
        """Records a new session; returns its id. ``FailedPreconditionError`` once
        :meth:`close` was called (a session made while its engine closes)."""
        with self._lock:
            if self._closed:
                raise FailedPreconditionError("the engine is closed")
            self._sessions.add(session)
            self._next_id += 1
            return self._next_id - 1

    def close(self) -> list[Session]:
        """Takes no session from now on; the live sessions, for their engine to close."""
        with self._lock:
            self._closed = True
            return list(self._sessions)

    def discard(self, session: Session) -> None:
        """Forgets a closed session."""
        with self._lock:
            self._sessions.discard(session)

    def __contains__(self, session: object) -> bool:
        with self._lock:
            return session in self._sessions

    def snapshot(self) -> list[Session]:
        """The live sessions now."""
        with self._lock:
            return list(self._sessions)


@dataclass
class _Counters:
    prompt_tokens: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    time_to_first_token_s: float | None = None


@dataclass(frozen=True)
class GenerationResult:
    """What :meth:`Session.generate` produced, and how long it took."""

    tokens: list[int]
    prompt_tokens: int
    stop_reason: str  # "max_new_tokens" or "stop_token"
    prefill_seconds: float
    time_to_first_token_seconds: float
    decode_seconds: float
    text: str | None = None  # the generated tokens decoded (stop token left out), with a tokenizer

    @property
    def decode_tokens_per_second(self) -> float:
        """Generated tokens after the first, per second of decoding."""
        steps = len(self.tokens) - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0


class Session:
    """A sequence of tokens processed so far (its KV cache) and the adapters it runs with.

    Sessions of one engine may be used from different threads at the same time; one
    session is used by one thread at a time (a concurrent second call raises
    ``FailedPreconditionError`` instead of interleaving two token streams).
    """

    def __init__(
        self,
        resources: ResourceManager,
        batcher: DecodeBatcher,
        context: ContextHandler,
        sampler: SamplerConfig,
        registry: SessionRegistry,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        """Sessions are made by :meth:`Engine.create_session` and :meth:`clone`."""
        self._resources = resources
        self._batcher = batcher
        self._tokenizer = tokenizer
        self._context: ContextHandler | None = context
        self._sampler_config = sampler
        self._registry = registry
        self._lock = threading.Lock()
        self._holder: int | None = None  # the thread inside a call of this session (holding _lock)
        self._vocab = resources.spec.vocab_size
        self._counters = _Counters()
        self._speculation = SpeculationCounters()
        try:
            self.session_id = registry.add(self)
        except BaseException:  # the engine closed meanwhile: the context is ours to give back
            resources.release_context(context)
            raise

    # -- state ---------------------------------------------------------------------

    @property
    def position(self) -> int:
        """How many tokens the session's context holds."""
        return self._require_open().length

    @property
    def kv_length(self) -> int:
        """How many tokens the session's context can hold (the model's KV cache length)."""
        return self._resources.spec.kv_length

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (or the engine closed)."""
        return self._context is None

    @property
    def held_by_this_thread(self) -> bool:
        """Whether the calling thread is inside one of this session's calls (in its
        ``on_token`` callback, say), where closing the session or its engine is refused."""
        return self._holder == threading.get_ident()

    @property
    def lora_ids(self) -> list[int]:
        """Ids of the adapters this session runs with (empty: the base model)."""
        return self._require_open().lora_ids

    @property
    def blend(self) -> tuple[tuple[int, float], ...]:
        """``((lora_id, scale), ...)`` this session runs with."""
        return self._require_open().blend

    # -- running -------------------------------------------------------------------

    def run_prefill(self, tokens: Sequence[int]) -> np.ndarray:
        """Appends ``tokens`` to the context; returns float32 logits ``(vocab,)`` for the next."""
        tokens = self._check_tokens(tokens)
        if not tokens:
            raise InvalidArgumentError("run_prefill needs at least one token")
        with self.reserve() as context:
            return self._prefill(context, tokens)

    def score(self, tokens: str | Sequence[int], *, decode_steps: bool = False) -> np.ndarray:
        """Appends ``tokens`` (ids, or text when the engine has a tokenizer) to the context
        and returns the float32 logits after each of them, ``(len(tokens), vocab)``: row
        i holds the logits for the token after ``tokens[i]``, exactly as decoding them one
        at a time would give (what a prompt's logprobs are read from). Needs a model with
        score signatures (``runtime export --score-lengths``) or prefill signatures that
        return logits (``--prefill-logits``); with ``decode_steps`` any model, at one
        decode step per token. Else ``FailedPreconditionError`` naming the export flags,
        before anything runs."""
        decode_steps = check_flag(decode_steps, "decode_steps")
        if isinstance(tokens, str):
            if self._tokenizer is None:
                raise FailedPreconditionError("a text prompt needs an engine with a tokenizer")
            tokens = self._tokenizer.encode(tokens)
        tokens = self._check_tokens(tokens)
        if not tokens:
            raise InvalidArgumentError("score needs at least one token")
        with self.reserve() as context:
            run = tokens if context.pending is None else [context.pending, *tokens]
            needed = context.length + len(tokens)
            if needed > self.kv_length:
                raise ResourceExhaustedError(f"{context.length} tokens in context + {len(tokens)} to score = {needed} "
                                             f"exceeds the KV cache of {self.kv_length} positions {KV_LENGTH_HINT}")
            logits = self._resources.score(context, run, decode_steps)
            context.position += len(run)
            context.pending = None
            self._counters.prompt_tokens += len(tokens)
        return logits[len(run) - len(tokens):]

    def run_decode(self, token: int) -> np.ndarray:
        """Appends one token; returns float32 logits ``(vocab,)`` for the next."""
        if type(token) is not int or not 0 <= token < self._vocab:  # the fast check first
            (token,) = self._check_tokens([token])
        if not self._lock.acquire(blocking=False):
            raise self._busy()
        self._holder = threading.get_ident()
        try:
            context = self._require_open()
            self.write_pending(context)
            return self._decode(context, token)
        finally:
            self._holder = None
            self._lock.release()

    def hidden_states(self, tokens: Sequence[int]) -> np.ndarray:
        """Appends ``tokens`` through the model's ``verify{L}`` signatures (L at a time);
        returns the final hidden state after each, float32 ``(len(tokens), width)``: the
        lm_head's input, what an adapter's draft heads read (``train-turbo --trunk`` trains
        them on these). ``FailedPreconditionError`` when the model has no verify
        signatures for the session's adapters, ``ResourceExhaustedError`` when the tokens
        (with a verify run's padding) would not fit the KV cache."""
        tokens = self._check_tokens(tokens)
        with self.reserve() as context:
            lengths = self._resources.spec.verify_lengths(self._resources.slot_for(context.blend))
            if not lengths:
                raise FailedPreconditionError("hidden states need verify signatures: export the model with "
                                              "--verify-lengths")
            length = lengths[-1]
            self.write_pending(context)
            last_run = context.position + (max(len(tokens) - 1, 0) // length) * length
            if tokens and last_run + length > self.kv_length:
                raise ResourceExhaustedError(f"{len(tokens)} tokens after {context.position} do not fit the KV "
                                             f"cache of {self.kv_length} in verify{length} runs {KV_LENGTH_HINT}")
            rows = []
            for start in range(0, len(tokens), length):
                chunk = tokens[start:start + length]
                rows.append(self._resources.verify(context, chunk)[1])
                context.position += len(chunk)
            return np.concatenate(rows) if rows else np.zeros((0, self._resources.spec.hidden_size or 0), np.float32)

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 32,
        sampler: Sampler | SamplerConfig | None = None,
        stop_tokens: Sequence[int] | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> GenerationResult:
        """Prefills ``prompt`` (token ids, or text when the engine has a tokenizer) and
        samples up to ``max_new_tokens`` tokens, calling ``on_token`` with each as it
        comes.

        Stops after a token of ``stop_tokens`` (default: the tokenizer's stop tokens).
        Every generated token is appended to the context, so the session can go on (the
        last one is written to the KV cache by the session's next call: no step computes
        the logits after it, which nobody reads).
        Raises ``ResourceExhaustedError`` before doing anything when the prompt plus
        ``max_new_tokens`` would not fit the KV cache.
        """
        if on_token is not None and not callable(on_token):
            raise InvalidArgumentError(f"on_token={on_token!r:.60}, expected a callable or None")
        if isinstance(prompt, str):
            if self._tokenizer is None:
                raise FailedPreconditionError("a text prompt needs an engine with a tokenizer")
            prompt = self._tokenizer.encode(prompt)
        if stop_tokens is None:
            stop_tokens = self._tokenizer.stop_token_ids if self._tokenizer is not None else ()
        prompt = self._check_tokens(prompt, "prompt")
        if not prompt:
            raise InvalidArgumentError("generate needs a prompt of at least one token")
        try:
            count = 0 if isinstance(max_new_tokens, bool) else operator.index(max_new_tokens)
        except TypeError:
            count = 0
        if count < 1:
            raise InvalidArgumentError(f"max_new_tokens={max_new_tokens!r:.40}, expected an integer >= 1")
        max_new_tokens = count
        if not isinstance(sampler, Sampler):
            sampler = Sampler(self._sampler_config if sampler is None else sampler)
        stops = set(self._check_tokens(stop_tokens, "stop_tokens"))
        kv_length = self.kv_length
        with self.reserve() as context:
            needed = context.length + len(prompt) + max_new_tokens
            if needed > kv_length:
                raise ResourceExhaustedError(
                    f"{context.length} tokens in context + {len(prompt)} prompt + "
                    f"{max_new_tokens} new tokens = {needed} exceeds the KV cache of "
                    f"{kv_length} positions {KV_LENGTH_HINT}"
                )
            start = time.perf_counter()
            sample = self._checked(sampler)
            speculation = self._registry.speculation
            drafting = speculation.heads_for(context.blend, self._speculation)
            decoder = None
            if drafting is not None:
                heads, gate = drafting
                decoder = SpeculativeDecoder(self._resources, context, heads, speculation.lm_head(), self._decode,
                                             gate)
            logits = self._prefill(context, prompt, decoder)
            prefill_done = time.perf_counter()
            generated = [sample(logits)]
            first_token = time.perf_counter()
            if decoder is not None:
                before = self._counters.decode_seconds
                try:
                    generated, stop_reason = decoder.run(generated[0], sample, max_new_tokens, stops, on_token)
                finally:
                    self._counters.decode_tokens += decoder.counters.tokens
                    self._counters.decode_seconds = before + time.perf_counter() - first_token
                    self._speculation.add(decoder.counters)
                    self._registry.speculation.counters.add(decoder.counters)
            else:
                stop_reason = self._plain_loop(context, generated, sample, max_new_tokens, stops, on_token)
            end = time.perf_counter()
            self._counters.time_to_first_token_s = first_token - start
        text = None
        if self._tokenizer is not None:
            text = self._tokenizer.decode(generated[:-1] if stop_reason == "stop_token" else generated)
        return GenerationResult(
            tokens=generated,
            prompt_tokens=len(prompt),
            stop_reason=stop_reason,
            prefill_seconds=prefill_done - start,
            time_to_first_token_seconds=first_token - start,
            decode_seconds=end - first_token,
            text=text,
        )

    def _plain_loop(self, context: ContextHandler, generated: list[int], sample: Callable[[np.ndarray], int],
                    max_new_tokens: int, stops: set[int], on_token: Callable[[int], None] | None) -> str:
        """Plain decoding from ``generated[0]``: one decode step per token, appended to
        ``generated``; returns the stop reason."""
        with self._batcher.streaming():  # decode batches being formed wait for this session's steps
            while True:
                if on_token is not None:
                    on_token(generated[-1])
                if generated[-1] in stops or len(generated) == max_new_tokens:
                    context.pending = generated[-1]  # no step for logits nobody reads
                    return "stop_token" if generated[-1] in stops else "max_new_tokens"
                generated.append(sample(self._decode(context, generated[-1])))

    def _checked(self, sampler: Sampler) -> Callable[[np.ndarray], int]:
        """``sampler.sample``, refusing a pick that is not a token id of the vocabulary (a
        Sampler subclass's mistake) before it reaches the model, where it would fail the
        decode batch of every session in it: ``InvalidArgumentError`` naming the sampler."""
        vocab = self._vocab

        def sample(logits: np.ndarray) -> int:
            token = sampler.sample(logits)
            if type(token) is int and 0 <= token < vocab:  # the fast check first
                return token
            try:
                (token,) = check_token_ids([token], vocab)
            except InvalidArgumentError:
                raise InvalidArgumentError(f"sampler ({type(sampler).__name__}) returned {token!r:.40}, expected a "
                                           f"token id in [0, {vocab})") from None
            return token

        return sample

    # -- context management --------------------------------------------------------

    def clone(self) -> Session:
        """A new session with a copy of this one's context and the same adapters."""
        with self.reserve() as context:
            copy = self._resources.clone_context_handler(context)
        return Session(self._resources, self._batcher, copy, self._sampler_config, self._registry, self._tokenizer)

    def reset(self) -> None:
        """Empties the context (position 0); the adapters stay.

        KV rows past the position are masked by the model until they are overwritten,
        so nothing needs clearing.
        """
        with self.reserve() as context:
            context.position, context.pending = 0, None

    def set_adapters(self, loras: Sequence[LoraSource] = (), *, adapters: Mapping[int, float] | None = None,
                     reset: bool = False) -> None:
        """Runs the session with other adapters (or scales): ``loras`` and the registered
        ``adapters`` (id -> scale), as in :class:`SessionConfig`; none means the base model.

        The KV cache was computed with the old adapters, so a session holding context
        must be reset: pass ``reset=True``, or get ``FailedPreconditionError``. On any
        error the session keeps its old adapters.
        """
        reset = check_flag(reset, "reset")
        with self.reserve() as context:
            if context.length and not reset:
                raise FailedPreconditionError(
                    f"the session holds {context.length} tokens computed with its current "
                    "adapters; pass reset=True to clear them and switch"
                )
            self._resources.set_adapters(context, check_sources(loras),
                                         check_adapters({} if adapters is None else adapters).items())
            context.position, context.pending = 0, None

    def close(self) -> None:
        """Releases the context and unpins the adapters; closing twice is harmless. Waits
        for a call another thread is making to end; from inside one of the session's own
        calls (its ``on_token`` callback) ``FailedPreconditionError``: close it after the
        call returns."""
        if self.held_by_this_thread:
            raise FailedPreconditionError(f"session {self.session_id} cannot close inside its own call (from its "
                                          "on_token callback?): close it after the call returns")
        with self._lock:
            context, self._context = self._context, None
        if context is not None:
            self._resources.release_context(context)
            self._registry.discard(self)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------

    def stats(self) -> SessionStats:
        """This session's counters: tokens, time to first token, decode speed."""
        context = self._require_open()
        counters = self._counters
        return SessionStats(
            session_id=self.session_id,
            lora_ids=tuple(context.lora_ids),
            position=context.length,
            prompt_tokens=counters.prompt_tokens,
            decode_tokens=counters.decode_tokens,
            time_to_first_token_s=counters.time_to_first_token_s,
            decode_tokens_per_s=(
                counters.decode_tokens / counters.decode_seconds if counters.decode_seconds else 0.0
            ),
            speculation=self._speculation.snapshot(),
        )

    def _prefill(self, context: ContextHandler, tokens: list[int], decoder: SpeculativeDecoder | None = None
                 ) -> np.ndarray:
        """Appends ``tokens`` to ``context`` after its pending token and advances its
        position (a speculating generation's ``decoder`` verifies the last of them: see its
        ``prefill``); the logits after the last."""
        def plain(chunk: list[int]) -> np.ndarray:
            logits = self._resources.prefill(context, chunk)
            context.position += len(chunk)
            context.pending = None  # the first chunk held it
            return logits

        run = tokens if context.pending is None else [context.pending, *tokens]
        logits = plain(run) if decoder is None else decoder.prefill(run, plain)
        context.pending = None
        self._counters.prompt_tokens += len(tokens)
        return logits

    def _decode(self, context: ContextHandler, token: int) -> np.ndarray:
        start = time.perf_counter()
        logits = self._batcher.decode(context, token)
        self.record_decode(context, time.perf_counter() - start)
        return logits

    def write_pending(self, context: ContextHandler) -> None:
        """Writes the reserved ``context``'s pending token (the last one a generation
        ended with) to its KV cache, if any; for calls that step it one token at a time."""
        if context.pending is not None:
            self._decode(context, context.pending)
            context.pending = None

    def record_decode(self, context: ContextHandler, seconds: float) -> None:
        """Counts one decode step of the reserved ``context`` that took ``seconds``: its
        position advances by one. For the engine's steps of many sessions together."""
        context.position += 1
        self._counters.decode_tokens += 1
        self._counters.decode_seconds += seconds

    @contextmanager
    def reserve(self) -> Iterator[ContextHandler]:
        """``with session.reserve() as context:`` the session's context, held against
        other calls for the block (a concurrent call raises ``FailedPreconditionError``).
        For the engine, which steps many reserved sessions together."""
        if not self._lock.acquire(blocking=False):
            raise self._busy()
        self._holder = threading.get_ident()
        try:
            yield self._require_open()
        finally:
            self._holder = None
            self._lock.release()

    def _busy(self) -> FailedPreconditionError:
        """The error for a call that finds the session held: by another thread's call, or
        by the caller's own (a call from its ``on_token`` callback, which no waiting ends)."""
        if self.held_by_this_thread:
            return FailedPreconditionError(f"session {self.session_id} is inside its own call (from its on_token "
                                           "callback?): make this call after that one returns")
        return FailedPreconditionError("the session is being used by another call")

    def _require_open(self) -> ContextHandler:
        context = self._context
        if context is None:
            raise FailedPreconditionError("the session is closed")
        return context

    def _check_tokens(self, tokens: Sequence[int], field: str | None = None) -> list[int]:
        return check_token_ids(tokens, self._vocab, field)


def check_token_ids(tokens: Sequence[int], vocab_size: int, field: str | None = None) -> list[int]:
    """``tokens`` as a list of ints, or ``InvalidArgumentError`` naming the first that is
    not an integer id of the vocabulary (and ``field``, the argument that held them)."""
    try:
        tokens = list(tokens)  # read twice below: a generator only once
        ids = [int(t) for t in tokens]
        exact = all(int(t) == t for t in tokens)
    except (TypeError, ValueError, OverflowError):
        exact = False
    if not exact:
        raise InvalidArgumentError(f"{field or 'token ids'} must be integers, got {tokens!r:.80}")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgumentError(f"{field + ': ' if field else ''}token id {bad[0]} is outside the vocabulary "
                                   f"[0, {vocab_size})")
    return ids
