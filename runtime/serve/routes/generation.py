"""``POST /v1/completions`` and ``POST /v1/chat/completions``: admission, one
:class:`~runtime.serve.generation.GenerationJob` per choice of each prompt
(:mod:`runtime.serve.choices`) in the worker pool, and the answer whole or as server-sent
events (the choices' chunks by index)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from runtime.errors import InvalidArgumentError, ResourceExhaustedError
from runtime.serve.catalog import Lease
from runtime.serve.error_handlers import as_api_error
from runtime.serve.errors import ApiError, bad_request
from runtime.serve.choices import ChoiceJobs
from runtime.serve.generation import EmptyPromptError, GenerationJob, Outcome, PromptTooLongError
from runtime.serve.protocol import ChatBody, CompletionBody, LoraWeight, Reply, sse
from runtime.serve.sampling import NonFiniteLogits
from runtime.serve.server import Server

log = logging.getLogger("runtime.serve")


def routes(server: Server) -> APIRouter:
    """The completion and chat endpoints over ``server``."""
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Response:
        return await generate(server, body, request)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request) -> Response:
        return await generate(server, body, request)

    return router


async def generate(server: Server, body: CompletionBody | ChatBody, request: Request) -> Response:
    """Answers a completion or chat request, whole or as a stream of events: one job per
    choice (``n``, ``best_of``) of each prompt, each its own session on the same
    adapters, all admitted or none. An error before the first generated token is
    answered with its status, streaming or not."""
    body.check()
    chat = isinstance(body, ChatBody)
    prompts = [await server.chat_prompt(body.messages)] if chat else body.prompt_values(server.settings.max_prompts)
    weights = _blend(server, body.model, body.lora or [])
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[object] = asyncio.Queue()

    def put(item: object) -> None:
        loop.call_soon_threadsafe(events.put_nowait, item)

    jobs = ChoiceJobs.admit(server, body, weights, prompts, put if body.stream else None, _STARTED,
                            lambda lease, weights: _check_slot(server, lease, weights, body))
    server.metrics.admitted_with.observe(server.admission.running)
    runs = [_Run(server, job, body, weights) for job in jobs.jobs]
    prepared = await asyncio.gather(*(loop.run_in_executor(server.pool, job.prepare) for job in jobs.jobs),
                                    return_exceptions=True)
    failed = next(((run, result) for run, result in zip(runs, prepared) if isinstance(result, BaseException)), None)
    if failed is not None:
        for job in jobs.jobs:
            server.pool.submit(job.close)  # off the loop: closing a session may wait for it
        run, error = failed
        raise run.error(error) from None
    reply = Reply(chat=chat, model=body.model)
    if not body.stream:
        outcomes = await _watching(server, runs, jobs, request)
        answers, counted = jobs.answers(outcomes)
        return JSONResponse(reply.whole(answers, counted))

    def work(index: int, run: _Run) -> None:
        try:
            put((index, run()))
        except BaseException as exc:  # answered as the status, or reported in the stream
            put((index, run.error(exc)))

    for index, run in enumerate(runs):
        server.pool.submit(work, index, run)
    first = await _first_events(events, request, jobs)
    if isinstance(first, BaseException):
        raise first
    return _EventStream(_stream(first, events, reply, body.include_usage, jobs), jobs)


async def _watching(server: Server, runs: list[_Run], jobs: ChoiceJobs, request: Request) -> list[Outcome]:
    """Runs every job in the pool; if the client disconnects first, cancels them at once.
    One job's error cancels the others at once and is the answer."""
    loop = asyncio.get_running_loop()

    def cancel_on_error(future: asyncio.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            jobs.cancel()

    futures = [loop.run_in_executor(server.pool, run) for run in runs]
    for future in futures:
        future.add_done_callback(cancel_on_error)
    running = asyncio.gather(*futures, return_exceptions=True)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({running, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if running not in done:
            jobs.cancel()
        results = await running
    except BaseException:
        jobs.cancel()
        raise
    finally:
        watcher.cancel()
    for run, result in zip(runs, results):
        if isinstance(result, BaseException):
            raise run.error(result) from None
    return results


_STARTED = object()  # in a stream's queue: the first token was generated


class _Run:
    """Running one admitted job: its outcome recorded in the metrics, its errors mapped
    to answers that name the request's field or adapter."""

    def __init__(self, server: Server, job: GenerationJob, body: CompletionBody | ChatBody,
                 weights: list[tuple[str, float]]) -> None:
        self._server = server
        self._job = job
        self._body = body
        self._weights = weights
        self._adapters = [name for name, _ in weights]

    def __call__(self) -> Outcome:
        """The job's outcome; a job the server stopped because it shuts down ends with the
        server's refusal (503) instead."""
        outcome = self._job.run()
        self._server.metrics.record(self._adapters, outcome)
        refusal = self._server.admission.refusal() if outcome.finish_reason == "cancelled" else None
        if refusal is not None:
            raise refusal
        return outcome

    def error(self, exc: BaseException) -> BaseException:
        """The answer to ``exc``: an empty prompt, or one the context cannot hold, names its
        field (``prompt``, ``prompt.N``, ``messages``); another context overflow names the
        token limit the request gave (else the prompt); non-finite logits name the
        adapters (and mark a lone one unhealthy)."""
        prompt = self._body.prompt_param(self._job.request.prompt_index)
        if isinstance(exc, (EmptyPromptError, PromptTooLongError)):
            return ApiError.from_status(exc, param=prompt)
        if isinstance(exc, ResourceExhaustedError):
            return ApiError.from_status(exc, param=self._body.token_limit_param or prompt)
        if isinstance(exc, NonFiniteLogits):
            return self._non_finite()
        return exc

    def _non_finite(self) -> ApiError:
        names = ", ".join(f"{name!r} (scale {scale:g})" for name, scale in self._weights)
        if not self._weights:
            log.error("the base model produced non-finite logits")
            return ApiError(500, "the base model produced non-finite logits (NaN or Inf)", "server_error",
                            "non_finite_logits")
        if len(self._weights) == 1:
            name, scale = self._weights[0]
            self._server.catalog.mark_unhealthy(name, f"non-finite logits at scale {scale:g}")
        log.warning("adapters %s produced non-finite logits", names)
        param = "lora" if self._body.lora else "model"
        return bad_request(f"the model with adapter(s) {names} produced non-finite logits (NaN or Inf): the "
                           "adapter's weights are too large or broken", code="non_finite_logits", param=param)


def _check_slot(server: Server, lease: Lease, weights: list[tuple[str, float]], body: CompletionBody | ChatBody
                ) -> None:
    """The engine's rule (:meth:`Engine.slot_for`) decides whether the request's adapters
    run together in one of the model's LoRA slots; a 400 naming them and why, if not."""
    if not weights:
        return
    adapters = lease.adapters(weights)
    names = {lease.entries[name].lora_id: name for name, _ in weights}
    try:
        server.engine.slot_for(adapters, names=names)
    except InvalidArgumentError as exc:
        raise bad_request(exc.args[0], code="no_lora_slot", param="lora" if body.lora else "model") from None


async def _first_events(events: asyncio.Queue, request: Request, jobs: ChoiceJobs) -> object:
    """What the jobs of a stream report until each has generated its first token (or
    ended): the events so far in order, or the first error (so that it is answered with
    its status, every job cancelled). If the client goes away first, the jobs are
    cancelled."""
    pending, started = [], set()
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        while len(started) < len(jobs.jobs):
            waiting = asyncio.ensure_future(events.get())
            await asyncio.wait({waiting, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not waiting.done():
                waiting.cancel()
                jobs.cancel()
                return ApiError(499, "the client closed the request", "invalid_request_error",
                                "client_closed_request")
            index, item = waiting.result()
            if isinstance(item, BaseException):
                jobs.cancel()
                return item
            started.add(index)
            if item is not _STARTED:
                pending.append((index, item))
    finally:
        watcher.cancel()
    return pending


def _blend(server: Server, model: str, lora: Sequence[LoraWeight]) -> list[tuple[str, float]]:
    """The adapters and scales a request names: ``model`` (the base, an adapter, or
    ``base::adapter``) at scale 1, then ``lora``."""
    adapter = server.adapter_of(model)
    weights = [(adapter, 1.0)] if adapter is not None else []
    weights += [(entry.name, entry.scale) for entry in lora]
    names = [name for name, _ in weights]
    for name in names:
        if names.count(name) > 1:
            raise bad_request(f"adapter {name!r:.100} appears twice in the request (model and lora)",
                              param="lora")
    return weights


async def _stream(first: list, events: asyncio.Queue, reply: Reply, include_usage: bool,
                  jobs: ChoiceJobs) -> AsyncIterator[bytes]:
    """The server-sent events of one streaming request, as the workers produce them, from
    the ``first`` events on: each choice's text by its index, its closing chunk, then
    the usage (if asked) and ``[DONE]``; an error ends the stream with its event."""
    for index in range(len(jobs.jobs)):
        opening = reply.opening(index)
        if opening is not None:
            yield sse(opening)
        echo = jobs.echo_text(index)
        if echo:
            yield sse(reply.delta(echo, index))
    pending, outcomes = list(first), {}
    while True:
        while not events.empty():  # what came meanwhile leaves in one write, each its own event
            pending.append(events.get_nowait())
        chunks = []
        for index, item in pending:
            if isinstance(item, str):
                chunks.append(sse(reply.delta(item, index)))
            elif isinstance(item, Outcome):
                outcomes[index] = item
                chunks.append(sse(reply.closing(item.finish_reason, index, jobs.logprobs(index, item))))
            elif isinstance(item, BaseException):
                jobs.cancel()
                yield b"".join(chunks) + sse(as_api_error(item).body())
                yield sse("[DONE]")
                return
        if chunks:
            yield b"".join(chunks)
        if len(outcomes) == len(jobs.jobs):
            if include_usage:
                yield sse(reply.usage_chunk([outcomes[i] for i in sorted(outcomes)]))
            yield sse("[DONE]")
            return
        pending = [await events.get()]


class _EventStream(StreamingResponse):
    """Server-sent events whose generation is cancelled however the response ends: sent
    whole, or abandoned because the client went away (even before the first event)."""

    def __init__(self, events: AsyncIterator[bytes], job: ChoiceJobs) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._job.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the request body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
