"""``POST /v1/load_lora_adapter``, ``POST /v1/unload_lora_adapter``, and
``GET /v1/adapter_files`` (what the adapters directory holds, for the web page)."""

from __future__ import annotations

import logging

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from runtime.serve.protocol import LoadAdapterBody, UnloadAdapterBody
from runtime.serve.routes.models import card
from runtime.serve.server import Server

log = logging.getLogger("runtime.serve")


def routes(server: Server) -> APIRouter:
    """Adapter loading and unloading over ``server``."""
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadAdapterBody) -> dict:
        body.check()
        catalog = server.catalog
        if body.url is not None:
            entry = await run_in_threadpool(catalog.load_url, body.lora_name, body.url, body.sha256)
        else:
            entry = await run_in_threadpool(catalog.load_path, body.lora_name, body.lora_path, body.sha256)
        log.info("loaded adapter %s from %s", entry.name, entry.path)
        return card(server, entry)

    @router.get("/v1/adapter_files")
    async def adapter_files() -> dict:
        files = await run_in_threadpool(server.catalog.files)
        return {"object": "list", "data": [{"file": f.file, "name": f.name, "loaded": f.loaded} for f in files]}

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadAdapterBody) -> dict:
        entry = await run_in_threadpool(server.catalog.unload, body.lora_name)
        server.metrics.forget(entry.name)
        log.info("unloaded adapter %s", entry.name)
        return {"id": entry.name, "object": "model", "deleted": True}

    return router
