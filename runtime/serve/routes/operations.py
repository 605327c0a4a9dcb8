"""``GET /health`` and ``HEAD /health`` (liveness) and ``GET /metrics`` (Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from runtime.serve.metrics import CONTENT_TYPE
from runtime.serve.server import Server


def routes(server: Server) -> APIRouter:
    """Health and metrics over ``server``."""
    router = APIRouter()

    @router.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict:
        return {"status": "ok"}

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(await run_in_threadpool(server.metrics.render), media_type=CONTENT_TYPE)

    return router
