"""``POST /v1/completions`` and ``POST /v1/chat/completions``: admission, one
:class:`~runtime.serve.generation.GenerationJob` per request in the worker pool, and the
answer whole or as server-sent events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from runtime import SamplerConfig
from runtime.errors import NotFoundError
from runtime.serve.error_handlers import as_api_error
from runtime.serve.errors import ApiError, bad_request
from runtime.serve.generation import GenerationJob, GenerationRequest, Outcome
from runtime.serve.protocol import ChatBody, CompletionBody, LoraWeight, Reply, sse
from runtime.serve.server import Server
from runtime.serve.settings import ADAPTER_SEPARATOR


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
    """Answers a completion or chat request, whole or as a stream of events."""
    body.check_supported()
    chat = isinstance(body, ChatBody)
    if chat:
        prompt = await _chat_prompt(server, body)
        max_tokens = body.token_limit
    else:
        prompt, max_tokens = body.prompt_value(), body.max_tokens
    weights = _blend(server, body.model, body.lora or [])
    sampler = SamplerConfig(temperature=1.0 if body.temperature is None else body.temperature,
                            top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed)
    try:
        lease = server.catalog.lease(name for name, _ in weights)
    except NotFoundError as exc:
        raise ApiError.from_status(exc, code="model_not_found", param="model") from None
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[str | Outcome | BaseException] = asyncio.Queue()

    def put(item: str | Outcome | BaseException) -> None:
        loop.call_soon_threadsafe(events.put_nowait, item)

    def release() -> None:
        lease.release()
        server.admission.finish(job)

    try:
        job = GenerationJob(
            server.engine,
            GenerationRequest(prompt, max_tokens, sampler, body.stop_strings(), lease.adapters(weights)),
            on_text=put if body.stream else None,
            on_close=release,
        )
        running = server.admission.admit(job)
    except BaseException:
        lease.release()
        raise
    server.metrics.admitted_with.observe(running)
    models = [name for name, _ in weights] or [server.settings.model_name]
    try:
        await loop.run_in_executor(server.pool, job.prepare)
    except BaseException:
        server.pool.submit(job.close)  # off the loop: closing a session may wait for it
        raise
    reply = Reply(chat=chat, model=body.model)
    if not body.stream:
        outcome = await _run_watching(server, job, models, request)
        return JSONResponse(reply.whole(outcome))

    def work() -> None:
        try:
            put(_run(server, job, models))
        except BaseException as exc:  # reported in the stream
            put(exc)

    server.pool.submit(work)
    return _EventStream(_stream(events, reply, body.include_usage), job)


async def _chat_prompt(server: Server, body: ChatBody) -> str:
    template = server.engine.chat_template
    if template is None:
        raise bad_request(
            f"model {server.settings.model_name!r} has no chat template: start the server with "
            "--chat-template FILE (a Jinja2 template), or use /v1/completions", code="no_chat_template",
            param="messages")
    messages = [message.as_template_input(i) for i, message in enumerate(body.messages)]
    return await run_in_threadpool(template.render, messages)


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
            raise ApiError(404, f"model {prefix!r:.100} is not served here; the base model is {base!r}",
                           "not_found_error", "model_not_found", "model")
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


def _run(server: Server, job: GenerationJob, models: list[str]) -> Outcome:
    outcome = job.run()
    server.metrics.record(models, outcome)
    return outcome


async def _run_watching(server: Server, job: GenerationJob, models: list[str], request: Request) -> Outcome:
    """Runs ``job`` in the pool; if the client disconnects first, cancels it at once."""
    loop = asyncio.get_running_loop()
    running = loop.run_in_executor(server.pool, _run, server, job, models)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({running, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if running not in done:
            job.cancel()
        return await running
    except BaseException:
        job.cancel()
        raise
    finally:
        watcher.cancel()


async def _stream(events: asyncio.Queue, reply: Reply, include_usage: bool) -> AsyncIterator[bytes]:
    """The server-sent events of one streaming request, as the worker produces them."""
    opening = reply.opening()
    if opening is not None:
        yield sse(opening)
    while True:
        pending = [await events.get()]
        while not events.empty():  # what came meanwhile leaves in one write, each its own event
            pending.append(events.get_nowait())
        texts = [item for item in pending if isinstance(item, str)]
        if texts:
            yield b"".join(sse(reply.delta(text)) for text in texts)
        end = pending[-1]
        if isinstance(end, str):
            continue
        if isinstance(end, Outcome):
            yield sse(reply.closing(end.finish_reason))
            if include_usage:
                yield sse(reply.usage_chunk(end))
        else:
            yield sse(as_api_error(end).body())
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
