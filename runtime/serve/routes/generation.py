"""``POST /v1/completions`` and ``POST /v1/chat/completions``: admission, one
:class:`~runtime.serve.generation.GenerationJob` per request in the worker pool, and the
answer whole or as server-sent events."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from runtime.errors import NotFoundError, ResourceExhaustedError
from runtime.serve.catalog import Lease
from runtime.serve.error_handlers import as_api_error
from runtime.serve.errors import ApiError, bad_request, model_not_found
from runtime.serve.generation import GenerationJob, GenerationRequest, Outcome
from runtime.serve.protocol import ChatBody, CompletionBody, LoraWeight, Reply, sse
from runtime.serve.sampling import NonFiniteLogits
from runtime.serve.server import Server
from runtime.serve.settings import ADAPTER_SEPARATOR
from runtime.util.signature_names import ALL_LINEAR, ATTENTION, LoraSlot

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
    """Answers a completion or chat request, whole or as a stream of events. An error
    before the first generated token is answered with its status, streaming or not."""
    body.check()
    chat = isinstance(body, ChatBody)
    prompt = await server.chat_prompt(body.messages) if chat else body.prompt_value()
    weights = _blend(server, body.model, body.lora or [])
    try:
        lease = server.catalog.lease(name for name, _ in weights)
    except NotFoundError as exc:
        raise ApiError.from_status(exc, code="model_not_found", param="model") from None
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[object] = asyncio.Queue()

    def put(item: object) -> None:
        loop.call_soon_threadsafe(events.put_nowait, item)

    def release() -> None:
        lease.release()
        server.admission.finish(job)

    try:
        _check_rank(server, lease, weights, body)
        job = server.job_class(
            server.engine,
            GenerationRequest(prompt, body.token_limit, body.sampler_config(), body.stop_strings(),
                              lease.adapters(weights), body.stop_tokens(server.engine.tokenizer.stop_token_ids),
                              body.min_tokens or 0, body.repetition_penalty or 1.0),
            on_text=put if body.stream else None,
            on_start=(lambda: put(_STARTED)) if body.stream else None,
            on_close=release,
        )
        running = server.admission.admit(job)
    except BaseException:
        lease.release()
        raise
    server.metrics.admitted_with.observe(running)
    run = _Run(server, job, body, weights)
    try:
        await loop.run_in_executor(server.pool, job.prepare)
    except BaseException as exc:
        server.pool.submit(job.close)  # off the loop: closing a session may wait for it
        raise run.error(exc) from None
    reply = Reply(chat=chat, model=body.model)
    if not body.stream:
        outcome = await run.watching(request)
        return JSONResponse(reply.whole(outcome))

    def work() -> None:
        try:
            put(run())
        except BaseException as exc:  # answered as the status, or reported in the stream
            put(run.error(exc))

    server.pool.submit(work)
    first = await _first_event(events, request, job)
    if isinstance(first, BaseException):
        raise first
    return _EventStream(_stream(first, events, reply, body.include_usage), job)


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
        self._models = [name for name, _ in weights] or [server.settings.model_name]

    def __call__(self) -> Outcome:
        outcome = self._job.run()
        self._server.metrics.record(self._models, outcome)
        return outcome

    async def watching(self, request: Request) -> Outcome:
        """Runs the job in the pool; if the client disconnects first, cancels it at once."""
        loop = asyncio.get_running_loop()
        running = loop.run_in_executor(self._server.pool, self)
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({running, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if running not in done:
                self._job.cancel()
            return await running
        except BaseException as exc:
            self._job.cancel()
            raise self.error(exc) from None
        finally:
            watcher.cancel()

    def error(self, exc: BaseException) -> BaseException:
        """The answer to ``exc``: the context check names ``max_tokens`` (or the prompt);
        non-finite logits name the adapters (and mark a lone one unhealthy)."""
        if isinstance(exc, ResourceExhaustedError):
            body = self._body
            param = "max_tokens" if body.max_tokens is not None else (
                "messages" if isinstance(body, ChatBody) else "prompt")
            return ApiError.from_status(exc, param=param)
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


def _check_rank(server: Server, lease: Lease, weights: list[tuple[str, float]], body: CompletionBody | ChatBody) -> None:
    """A blend must fit one of the model's LoRA slots; the error names the adapters."""
    if not weights:
        return
    ranks = {name: lease.entries[name].rank for name, _ in weights}
    targets = ALL_LINEAR if any(lease.entries[name].targets == ALL_LINEAR for name, _ in weights) else ATTENTION
    if server.engine.spec.slot_for(LoraSlot(sum(ranks.values()), targets)) is None:
        slots = ", ".join(map(str, server.engine.spec.slots)) or "none"
        named = ", ".join(f"{name!r} (rank {rank})" for name, rank in ranks.items())
        raise bad_request(f"adapters {named} need rank {sum(ranks.values())} together, more than any LoRA slot of "
                          f"the model (slots: {slots})", code="rank_exceeded",
                          param="lora" if body.lora else "model")


async def _first_event(events: asyncio.Queue, request: Request, job: GenerationJob) -> object:
    """The first thing a streaming job reports: its first token, or its error (so that it
    is answered with its status). If the client goes away first, the job is cancelled."""
    waiting = asyncio.ensure_future(events.get())
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({waiting, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not waiting.done():
        waiting.cancel()
        job.cancel()
        return ApiError(499, "the client closed the request", "invalid_request_error", "client_closed_request")
    return waiting.result()


def _blend(server: Server, model: str, lora: Sequence[LoraWeight]) -> list[tuple[str, float]]:
    """The adapters and scales a request names: ``model`` (the base, an adapter, or
    ``base::adapter``) at scale 1, then ``lora``."""
    base = server.settings.model_name
    adapter: str | None = model
    if model == base:
        adapter = None
    elif ADAPTER_SEPARATOR in model:
        prefix, _, adapter = model.partition(ADAPTER_SEPARATOR)
        if prefix != base:
            raise model_not_found(f"model {prefix!r:.100} is not served here; the base model is {base!r}")
        if not adapter:
            raise bad_request(f"model {model!r:.100}: name an adapter after '::'", param="model")
    weights = [(adapter, 1.0)] if adapter is not None else []
    weights += [(entry.name, entry.scale) for entry in lora]
    names = [name for name, _ in weights]
    for name in names:
        if names.count(name) > 1:
            raise bad_request(f"adapter {name!r:.100} appears twice in the request (model and lora)",
                              param="lora")
    return weights


async def _stream(first: object, events: asyncio.Queue, reply: Reply, include_usage: bool) -> AsyncIterator[bytes]:
    """The server-sent events of one streaming request, as the worker produces them,
    from the ``first`` event on."""
    opening = reply.opening()
    if opening is not None:
        yield sse(opening)
    pending = [first]
    while True:
        while not events.empty():  # what came meanwhile leaves in one write, each its own event
            pending.append(events.get_nowait())
        texts = [item for item in pending if isinstance(item, str)]
        if texts:
            yield b"".join(sse(reply.delta(text)) for text in texts)
        end = pending[-1]
        if isinstance(end, Outcome):
            yield sse(reply.closing(end.finish_reason))
            if include_usage:
                yield sse(reply.usage_chunk(end))
        elif isinstance(end, BaseException):
            yield sse(as_api_error(end).body())
        else:
            pending = [await events.get()]
            continue
        yield sse("[DONE]")
        return


class _EventStream(StreamingResponse):
    """Server-sent events whose generation is cancelled however the response ends: sent
    whole, or abandoned because the client went away (even before the first event)."""

    def __init__(self, events: AsyncIterator[bytes], job: GenerationJob) -> None:
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
