"""One request's generation on its own Session, in a worker thread, as text deltas.

:class:`GenerationJob` is built on the event loop from a validated request and then runs
in a worker thread: :meth:`~GenerationJob.prepare` (tokenize, create the session with
the adapters registered at load, by id) and :meth:`~GenerationJob.run`
(``Session.generate``, which checks that the prompt and ``max_tokens`` fit the context,
with each token turned into text as it comes). :meth:`~GenerationJob.cancel` may be called from any thread: the
generation stops before its next decode step and the session is closed at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from runtime import Engine, SamplerConfig, Session, SessionConfig
from runtime.components.tokenizer import TextStream
from runtime.errors import FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError
from runtime.executor.litert_executor import KV_LENGTH_HINT
from runtime.serve.logprobs import TokenLogprob, token_logprobs
from runtime.serve.sampling import RequestSampler


class TextAssembler:
    """Generated tokens -> the text deltas that are safe to send now.

    Holds back an incomplete multi-byte character (:class:`TextStream`, which decodes a
    few tokens at a time, not the whole answer at every token) and any tail that could be
    the start of a stop string; once a stop string appears, the text ends just before it.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        """``decode``: the tokenizer's ids -> text; ``stop``: strings that end the text."""
        self._stream = TextStream(decode)
        self._stop = tuple(s for s in stop if s)
        self._longest_stop = max(map(len, self._stop), default=0)
        self._text = ""
        self._sent = 0
        self.stopped = False

    @property
    def text(self) -> str:
        """The whole text so far (up to the stop string, once one appeared)."""
        return self._text

    def add(self, token: int) -> str:
        """Takes one generated token; returns the text that may be sent now (maybe '')."""
        if self.stopped:
            raise FailedPreconditionError("the text already ended at a stop string")
        return self._extend(self._stream.add(token))

    def finish(self) -> str:
        """The rest of the text, when no more tokens come."""
        delta = "" if self.stopped else self._extend(self._stream.finish())
        return delta + self._flush(len(self._text))

    def _extend(self, piece: str) -> str:
        """Appends ``piece`` to the text, ending it at a stop string; the text to send now."""
        if not piece:
            return ""
        text = self._text = self._text + piece
        if self._stop:
            start = max(0, self._sent - self._longest_stop + 1)
            hits = [i for i in (text.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                self.stopped = True
                self._text = text[: min(hits)]
                return self._flush(len(self._text))
        return self._flush(len(text) - self._stop_prefix_length(text))

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins some stop string."""
        for length in range(min(self._longest_stop - 1, len(text)), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self._stop):
                return length
        return 0

    def _flush(self, end: int) -> str:
        delta = self._text[self._sent : end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return delta


@dataclass(frozen=True)
class GenerationRequest:
    """What one HTTP request asks the engine for, already validated."""

    prompt: str | tuple[int, ...]
    max_tokens: int | None  # None: as many as the context has room for
    sampler: SamplerConfig
    stop: tuple[str, ...]
    adapters: Mapping[int, float]  # registered adapter id -> scale
    stop_tokens: frozenset[int]  # tokens that end the generation (not part of the text)
    min_tokens: int = 0  # stop tokens cannot come before this many tokens
    repetition_penalty: float = 1.0
    echo: bool = False  # score the prompt: its tokens' logprobs (then max_tokens may be 0)
    logprobs: int | None = None  # record each token's logprob and this many top ones (None: no logprobs)
    score_by_decode: bool = False  # echo on a model whose prefill returns no logits: a decode step per token
    prompt_index: int = 0  # which of the request's prompts this is


@dataclass(frozen=True)
class Outcome:
    """How a generation ended."""

    text: str
    finish_reason: str  # "stop", "length" or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    queue_wait_s: float  # from admission to the worker taking the request
    time_to_first_token_s: float | None  # from admission to the first token
    decode_tokens_per_s: float  # tokens after the first, per second
    tokens: tuple[int, ...] = ()  # the generated tokens (a stop token included)
    logprobs: tuple[TokenLogprob, ...] = ()  # of the generated tokens, when asked for
    prompt: tuple[int, ...] = ()  # the prompt's tokens, when echoed
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()  # of the echoed prompt's tokens (the first: None)
    prompt_seconds: float = 0.0  # the prompt's prefill (or scoring) and the first token
    prompt_index: int = 0  # which of the request's prompts it answers

    @property
    def cumulative_logprob(self) -> float:
        """The sum of the generated tokens' logprobs (what ``best_of`` ranks by)."""
        return sum(entry.logprob for entry in self.logprobs)


class EmptyPromptError(InvalidArgumentError):
    """The prompt holds no token (an empty text or list, or a text that encodes to none)."""


class PromptTooLongError(ResourceExhaustedError):
    """The prompt alone leaves no room in the context: for a new token or, with echo, for
    itself (a context overflow where the prompt, not ``max_tokens``, is the field to fix)."""


class _Cancelled(Exception):
    """Raised from the token callback when the client went away."""


class _StopString(Exception):
    """Raised from the token callback when a stop string ended the text."""


class GenerationJob:
    """One request on one session: prepare, run, close (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        request: GenerationRequest,
        *,
        on_text: Callable[[str], None] | None = None,
        on_start: Callable[[], None] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        """``on_text`` gets each text delta as it is produced and ``on_start`` is called at
        the first generated token (both from the worker thread); ``on_close`` runs once
        when the job is closed (releasing what it held)."""
        self._engine = engine
        self.request = request
        self._on_text = on_text
        self._on_start = on_start
        self._on_close = on_close
        self._admitted = time.perf_counter()
        self._cancelled = threading.Event()
        self._state = threading.Lock()  # guards _session and _closed
        self._closed = False
        self._session: Session | None = None
        self._prompt: list[int] = []
        self._max_tokens = 0
        self._queue_wait = 0.0
        self._token_times: list[float] = []
        self._tokens: list[int] = []
        self._prompt_logprobs: list[TokenLogprob | None] = []
        self._started = 0.0  # when run() began
        self._assembler = TextAssembler(self._decode, request.stop)
        self._sampler: RequestSampler | None = None

    def prepare(self) -> None:
        """Tokenizes the prompt and creates the session (registering nothing new: the
        adapters are the catalog's, by id)."""
        self._queue_wait = time.perf_counter() - self._admitted
        prompt = self.request.prompt
        self._prompt = self._engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not self._prompt:
            raise EmptyPromptError("the prompt is empty: it needs at least one token")
        max_tokens = self.request.max_tokens
        # None: the rest of the context (at least 1, so that a prompt filling it is refused
        # by Session.generate's own check, like any prompt too long for max_tokens).
        self._max_tokens = max(1, self._engine.spec.kv_length - len(self._prompt)) if max_tokens is None else max_tokens
        request = self.request
        if self._max_tokens < 1 and not request.echo:
            raise InvalidArgumentError("max_tokens=0 generates nothing: it needs echo")
        self._sampler = RequestSampler(request.sampler, prompt=self._prompt, stop_tokens=request.stop_tokens,
                                       min_tokens=request.min_tokens, repetition_penalty=request.repetition_penalty,
                                       logprobs=request.logprobs)
        session = self._engine.create_session(SessionConfig(adapters=self.request.adapters))
        with self._state:
            if not self._closed:
                self._session = session
                return
        session.close()
        raise FailedPreconditionError("the request ended before it ran")

    def run(self) -> Outcome:
        """Generates on the prepared session, sending text as it comes; closes the job. A
        prompt and ``max_tokens`` the context cannot hold: ``ResourceExhaustedError``
        (:class:`PromptTooLongError` when the prompt alone leaves no room). A job cancelled
        before it runs ends at once, cancelled, with no token."""
        self._started = time.perf_counter()
        try:
            if self._session is None:
                raise FailedPreconditionError("run() before prepare()")
            try:
                if self._cancelled.is_set():  # before it ran: not even the prompt's prefill
                    raise _Cancelled
                if self.request.echo:
                    finish_reason = self._echo(self._session)
                else:
                    result = self._session.generate(self._prompt, self._max_tokens, sampler=self._sampler,
                                                    stop_tokens=sorted(self.request.stop_tokens),
                                                    on_token=self._on_token)
                    finish_reason = "stop" if result.stop_reason == "stop_token" else "length"
            except _StopString:
                finish_reason = "stop"
            except _Cancelled:
                finish_reason = "cancelled"
            except ResourceExhaustedError as exc:  # the context check's; whose fault it is:
                if len(self._prompt) + (0 if self.request.echo else 1) > self._engine.spec.kv_length:
                    raise PromptTooLongError(*exc.args) from None
                raise
        finally:
            self.close()
        if finish_reason != "cancelled":
            self._send(self._assembler.finish())
        times = self._token_times
        return Outcome(
            text=self._assembler.text,
            finish_reason=finish_reason,
            prompt_tokens=len(self._prompt),
            completion_tokens=len(times),
            queue_wait_s=self._queue_wait,
            time_to_first_token_s=times[0] - self._admitted if times else None,
            decode_tokens_per_s=(len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0]
            else 0.0,
            tokens=tuple(self._tokens),
            logprobs=tuple(self._sampler.logprobs) if self._sampler is not None else (),
            prompt=tuple(self._prompt) if self.request.echo else (),
            prompt_logprobs=tuple(self._prompt_logprobs),
            prompt_seconds=(times[0] if times else time.perf_counter()) - self._started,
            prompt_index=self.request.prompt_index,
        )

    def _echo(self, session: Session) -> str:
        """Scores the prompt (every position's logits: its tokens' logprobs), then
        generates from the last position's logits as a generation would; the finish
        reason. ``max_tokens`` 0: the prompt alone."""
        prompt, max_tokens = self._prompt, self._max_tokens
        if len(prompt) + max_tokens > session.kv_length:
            raise ResourceExhaustedError(f"{len(prompt)} prompt tokens + {max_tokens} new tokens exceed the KV cache "
                                         f"of {session.kv_length} positions {KV_LENGTH_HINT}")
        logits = session.score(prompt, decode_steps=self.request.score_by_decode)
        self._prompt_logprobs = [None, *token_logprobs(logits[:-1], prompt[1:], self.request.logprobs or 0)]
        if max_tokens == 0:
            return "length"
        stops = self.request.stop_tokens
        first = self._sampler.sample(logits[-1])  # type: ignore[union-attr]
        self._on_token(first)
        if first in stops:
            return "stop"
        if max_tokens == 1:
            return "length"
        result = session.generate([first], max_tokens - 1, sampler=self._sampler, stop_tokens=sorted(stops),
                                  on_token=self._on_token)
        return "stop" if result.stop_reason == "stop_token" else "length"

    def cancel(self) -> None:
        """Stops the generation before its next step (any thread; harmless when done)."""
        self._cancelled.set()

    def close(self) -> None:
        """Closes the session and releases what the job held; closing twice is harmless."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            session = self._session
        if session is not None:
            session.close()
        if self._on_close is not None:
            self._on_close()

    def _on_token(self, token: int) -> None:
        self._token_times.append(time.perf_counter())
        self._tokens.append(token)
        if len(self._token_times) == 1 and self._on_start is not None:
            self._on_start()
        if self._cancelled.is_set():
            raise _Cancelled
        if token in self.request.stop_tokens:
            return  # generate() ends after it; it is not part of the text
        self._send(self._assembler.add(token))
        if self._assembler.stopped:
            raise _StopString

    def _send(self, delta: str) -> None:
        if delta and self._on_text is not None:
            self._on_text(delta)

    def _decode(self, tokens: Sequence[int]) -> str:
        return self._engine.tokenizer.decode(tokens)
