"""The ASGI application: OpenAI's completion and chat endpoints, models, adapter loading,
health and metrics, over one engine and its adapter catalog.

Every generation runs in a worker thread of the server's own pool (never on the event
loop); the loop only parses, admits, and relays text as it comes. Safe by default: an
API key (if set) guards every endpoint but ``/health``, compared in constant time; the
request body is capped; more than ``max_concurrent`` running requests get 429; every
error is OpenAI-shaped JSON and leaves the server serving.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime import Engine, SamplerConfig
from runtime.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError, StatusError
from runtime.serve.catalog import AdapterCatalog, CatalogEntry
from runtime.serve.errors import ApiError, bad_request
from runtime.serve.generation import GenerationJob, GenerationRequest, Outcome
from runtime.serve.metrics import CONTENT_TYPE, ServerMetrics
from runtime.serve.protocol import (
    ChatBody,
    CompletionBody,
    LoadAdapterBody,
    LoraWeight,
    Reply,
    UnloadAdapterBody,
    sse,
    validation_error,
)

log = logging.getLogger("runtime.serve")

ADAPTER_SEPARATOR = "::"  # "base::adapter" in a request's model field
OPEN_PATHS = frozenset({"/health"})  # answered without the API key
_ENDPOINTS = frozenset({"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
                        "/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


@dataclass(frozen=True)
class ServeSettings:
    """What the server answers to, and its limits (each with a safe default).

    ``model_name``: the base model's id in requests and ``/v1/models``. ``api_key``: if
    set, every endpoint but ``/health`` needs ``Authorization: Bearer <api_key>``.
    ``max_concurrent``: running requests beyond it get 429. ``max_body_bytes``: larger
    request bodies get 413.
    """

    model_name: str
    api_key: str | None = None
    max_concurrent: int = 16
    max_body_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if not self.model_name or ADAPTER_SEPARATOR in self.model_name:
            raise InvalidArgumentError(f"model name {self.model_name!r}: must be non-empty, without '::'")
        if self.api_key is not None and not self.api_key:
            raise InvalidArgumentError("the API key must not be empty")
        if type(self.max_concurrent) is not int or self.max_concurrent < 1:
            raise InvalidArgumentError(f"max_concurrent={self.max_concurrent!r}, expected an integer >= 1")
        if type(self.max_body_bytes) is not int or self.max_body_bytes < 1024:
            raise InvalidArgumentError(f"max_body_bytes={self.max_body_bytes!r}, expected an integer >= 1024")


class Admission:
    """The running jobs; past the limit, a new one is refused with 429. Thread-safe."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._jobs: set[GenerationJob] = set()
        self._lock = threading.Lock()

    @property
    def running(self) -> int:
        """How many jobs run now."""
        return len(self._jobs)

    def admit(self, job: GenerationJob) -> int:
        """Counts ``job`` in; returns how many run now (it included)."""
        with self._lock:
            if len(self._jobs) >= self._limit:
                raise ApiError(429, f"{self._limit} requests are running, the server's --max-concurrent; "
                               "retry later", "rate_limit_error", "too_many_requests")
            self._jobs.add(job)
            return len(self._jobs)

    def finish(self, job: GenerationJob) -> None:
        """Counts ``job`` out."""
        with self._lock:
            self._jobs.discard(job)

    def cancel_all(self) -> None:
        """Asks every running job to stop (at shutdown)."""
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.cancel()


class Server:
    """The state behind the routes: engine, catalog, settings, worker pool, metrics."""

    def __init__(self, engine: Engine, catalog: AdapterCatalog, settings: ServeSettings) -> None:
        if engine.tokenizer is None:
            raise FailedPreconditionError(
                "serving needs a tokenizer: a .litertlm bundle's, --tokenizer FILE, or --byte-tokens"
            )
        self.engine = engine
        self.catalog = catalog
        self.settings = settings
        self.started = int(time.time())
        self.admission = Admission(settings.max_concurrent)
        # One thread per admitted request (prepare, then run) and one for closing jobs
        # whose request went away before they ran.
        self.pool = ThreadPoolExecutor(settings.max_concurrent + 1, thread_name_prefix="serve-request")
        self.metrics = ServerMetrics(engine, catalog, lambda: self.admission.running)

    # -- generation ----------------------------------------------------------------

    async def generate(self, body: CompletionBody | ChatBody, request: Request) -> Response:
        """Answers a completion or chat request, whole or as a stream of events."""
        body.check_supported()
        chat = isinstance(body, ChatBody)
        if chat:
            prompt = await self._chat_prompt(body)
            max_tokens = body.token_limit
        else:
            prompt, max_tokens = body.prompt_value(), body.max_tokens
        weights = self._blend(body.model, body.lora or [])
        sampler = SamplerConfig(temperature=1.0 if body.temperature is None else body.temperature,
                                top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed)
        try:
            lease = self.catalog.lease(name for name, _ in weights)
        except NotFoundError as exc:
            raise ApiError.from_status(exc, code="model_not_found", param="model") from None
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[str | Outcome | BaseException] = asyncio.Queue()

        def put(item: str | Outcome | BaseException) -> None:
            loop.call_soon_threadsafe(events.put_nowait, item)

        def release() -> None:
            lease.release()
            self.admission.finish(job)

        try:
            job = GenerationJob(
                self.engine,
                GenerationRequest(prompt, max_tokens, sampler, body.stop_strings(),
                                  tuple(lease.source(name, scale) for name, scale in weights)),
                on_text=put if body.stream else None,
                on_close=release,
            )
            running = self.admission.admit(job)
        except BaseException:
            lease.release()
            raise
        self.metrics.admitted_with.observe(running)
        models = [name for name, _ in weights] or [self.settings.model_name]
        try:
            await loop.run_in_executor(self.pool, job.prepare)
        except BaseException:
            self.pool.submit(job.close)  # off the loop: closing a session may wait for it
            raise
        reply = Reply(chat=chat, model=body.model)
        if not body.stream:
            outcome = await self._run_watching(job, models, request)
            return JSONResponse(reply.whole(outcome))

        def work() -> None:
            try:
                put(self._run(job, models))
            except BaseException as exc:  # reported in the stream
                put(exc)

        self.pool.submit(work)
        return _EventStream(self._stream(events, reply, body.include_usage), job)

    async def _chat_prompt(self, body: ChatBody) -> str:
        template = self.engine.chat_template
        if template is None:
            raise bad_request(
                f"model {self.settings.model_name!r} has no chat template: start the server with "
                "--chat-template FILE (a Jinja2 template), or use /v1/completions", code="no_chat_template",
                param="messages")
        messages = [message.as_template_input(i) for i, message in enumerate(body.messages)]
        return await run_in_threadpool(template.render, messages)

    def _blend(self, model: str, lora: Sequence[LoraWeight]) -> list[tuple[str, float]]:
        """The adapters and scales a request names: ``model`` (the base, an adapter, or
        ``base::adapter``) at scale 1, then ``lora``."""
        base = self.settings.model_name
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

    def _run(self, job: GenerationJob, models: list[str]) -> Outcome:
        outcome = job.run()
        self.metrics.record(models, outcome)
        return outcome

    async def _run_watching(self, job: GenerationJob, models: list[str], request: Request) -> Outcome:
        """Runs ``job`` in the pool; if the client disconnects first, cancels it at once."""
        loop = asyncio.get_running_loop()
        running = loop.run_in_executor(self.pool, self._run, job, models)
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

    @staticmethod
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
                yield sse(_as_api_error(end).body())
            yield sse("[DONE]")
            return

    # -- models and adapters -------------------------------------------------------

    def models(self) -> dict:
        """``GET /v1/models``: the base model and every adapter (with its ``parent``)."""
        base = {"id": self.settings.model_name, "object": "model", "created": self.started, "owned_by": "runtime",
                "root": str(self.engine.model_path), "parent": None}
        return {"object": "list", "data": [base, *(self._card(entry) for entry in self.catalog.entries())]}

    def _card(self, entry: CatalogEntry) -> dict:
        return {"id": entry.name, "object": "model", "created": entry.created, "owned_by": "runtime",
                "root": str(entry.path), "parent": self.settings.model_name}

    async def load_adapter(self, body: LoadAdapterBody) -> dict:
        """``POST /v1/load_lora_adapter``."""
        body.check()
        if body.url is not None:
            entry = await run_in_threadpool(self.catalog.load_url, body.lora_name, body.url, body.sha256)
        else:
            entry = await run_in_threadpool(self.catalog.load_path, body.lora_name, body.lora_path, body.sha256)
        log.info("loaded adapter %s from %s", entry.name, entry.path)
        return self._card(entry)

    async def unload_adapter(self, body: UnloadAdapterBody) -> dict:
        """``POST /v1/unload_lora_adapter``."""
        entry = await run_in_threadpool(self.catalog.unload, body.lora_name)
        self.metrics.forget(entry.name)
        log.info("unloaded adapter %s", entry.name)
        return {"id": entry.name, "object": "model", "deleted": True}

    def shutdown(self) -> None:
        """Cancels running generations and waits for the workers to finish."""
        self.admission.cancel_all()
        self.pool.shutdown(wait=True)


def create_app(engine: Engine, catalog: AdapterCatalog, settings: ServeSettings) -> FastAPI:
    """The ASGI application serving ``engine`` with the adapters of ``catalog``."""
    server = Server(engine, catalog, settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await run_in_threadpool(server.shutdown)

    app = FastAPI(title="runtime", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await run_in_threadpool(server.metrics.render), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        return server.models()

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Response:
        return await server.generate(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request) -> Response:
        return await server.generate(body, request)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadAdapterBody) -> dict:
        return await server.load_adapter(body)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadAdapterBody) -> dict:
        return await server.unload_adapter(body)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StatusError)
    async def status_error(_: Request, exc: StatusError) -> JSONResponse:
        return _error_response(ApiError.from_status(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(validation_error(list(exc.errors())))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return _error_response(_http_error(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error while answering a request")
        return _error_response(_as_api_error(exc))

    app.add_middleware(_Gate, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes,
                       metrics=server.metrics)
    return app


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


class _Gate:
    """What every request passes first: the API key check, then the body size cap (the
    body is read here, at most ``max_body_bytes`` of it, and handed on); and the count of
    every answer by endpoint and status."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, metrics: ServerMetrics) -> None:
        self._app = app
        self._key = api_key.encode() if api_key is not None else None
        self._max_body = max_body_bytes
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        status = 0

        async def counting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if scope["path"] not in OPEN_PATHS and not self._authorized(scope):
                error = ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                                 "authentication_error", "invalid_api_key")
                await _error_response(error, {"WWW-Authenticate": "Bearer"})(scope, receive, counting)
                return
            body = await self._read_body(scope, receive)
            if body is None:
                error = ApiError(413, f"the request body exceeds the server's limit of {self._max_body:,} bytes",
                                 "invalid_request_error", "request_too_large")
                await _error_response(error)(scope, receive, counting)
                return
            await self._app(scope, _replay(body, receive), counting)
        except Exception:
            status = status or 500  # answered by the outermost error handler
            raise
        finally:
            endpoint = scope["path"] if scope["path"] in _ENDPOINTS else "other"
            self._metrics.requests.labels(endpoint, str(status)).inc()

    def _authorized(self, scope: Scope) -> bool:
        if self._key is None:
            return True
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        return False

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body, or None past the cap (declared or sent)."""
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self._max_body:
                return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client went away; the app sees an empty body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self._max_body:
                return None
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that first gives ``body`` whole, then whatever the client sends (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the request body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _error_response(error: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _http_error(status: int, detail: str) -> ApiError:
    if status == 404:
        return ApiError(404, f"no such endpoint ({detail})", "not_found_error", "unknown_url")
    if status == 405:
        return ApiError(405, f"method not allowed ({detail})", "invalid_request_error", "method_not_allowed")
    if status == 413:
        return ApiError(413, f"the request body exceeds the server's limit ({detail})", "invalid_request_error",
                        "request_too_large")
    return ApiError(status, detail, "invalid_request_error" if status < 500 else "server_error")


def _as_api_error(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, StatusError):
        return ApiError.from_status(exc)
    return ApiError(500, f"internal error: {type(exc).__name__}", "server_error", "internal_error")
