"""The ASGI application: the routes of every endpoint family over one :class:`Server`,
the error mapping, and the gate every request passes first.

Every generation runs in a worker thread of the server's own pool (never on the event
loop); the loop only parses, admits, and relays text as it comes. Safe by default: an
API key (if set) guards every endpoint but ``/health``, compared in constant time; the
request body is capped; more than ``max_concurrent`` running requests get 429; every
error is OpenAI-shaped JSON and leaves the server serving. At shutdown, new requests get
503 and running generations end with a 503 error (a stream with its error event).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from runtime import Engine
from runtime.serve.catalog import AdapterCatalog
from runtime.serve.error_handlers import install_error_handlers
from runtime.serve.middleware import Gate
from runtime.serve.routes import adapters, generation, models, operations, page, tokenize
from runtime.serve.server import Server
from runtime.serve.settings import ServeSettings

__all__ = ["ServeSettings", "create_app"]


def create_app(engine: Engine, catalog: AdapterCatalog, settings: ServeSettings, *,
               extend: Callable[[FastAPI, Server], None] | None = None) -> FastAPI:
    """The ASGI application serving ``engine`` with the adapters of ``catalog``;
    ``extend`` changes the app and its server last (``--replicas`` makes it the ingress)."""
    server = Server(engine, catalog, settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await run_in_threadpool(server.shutdown)

    app = FastAPI(title="runtime", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.drain = server.drain  # what uvicorn_config's protocol calls when uvicorn begins to shut down
    for family in (operations, models, generation, adapters, tokenize):
        app.include_router(family.routes(server))
    app.include_router(page.routes())
    app.mount("/ui", page.files(), name="ui")
    install_error_handlers(app)
    app.add_middleware(Gate, settings=settings, metrics=server.metrics)
    if extend is not None:
        extend(app, server)
    return app
