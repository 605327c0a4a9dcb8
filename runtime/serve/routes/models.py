"""``GET /v1/models`` and ``GET /v1/models/{id}``: the base model and every adapter, with
its ``parent``, the context length, and whether the adapter is healthy; the list also
names what the start-up scan skipped, and why."""

from __future__ import annotations

from fastapi import APIRouter

from runtime.serve.catalog import CatalogEntry
from runtime.serve.server import Server


def routes(server: Server) -> APIRouter:
    """The model listing over ``server``."""
    router = APIRouter()

    @router.get("/v1/models")
    async def models() -> dict:
        skipped = [{"file": s.file, "reason": s.reason} for s in server.catalog.skipped]
        return {"object": "list", "data": [base_card(server), *(card(server, e) for e in server.catalog.entries())],
                "skipped": skipped}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        entry = server.model_entry(model_id)
        return base_card(server) if entry is None else card(server, entry)

    return router


def base_card(server: Server) -> dict:
    """The base model as a ``model`` object (``chat_template``: whether chat works)."""
    return {"id": server.settings.model_name, "object": "model", "created": server.started, "owned_by": "runtime",
            "root": str(server.engine.model_path), "parent": None, "max_model_len": server.engine.spec.kv_length,
            "chat_template": server.engine.chat_template is not None}


def card(server: Server, entry: CatalogEntry) -> dict:
    """One adapter as a ``model`` object: ``healthy`` is false (with the ``problem``) once
    it failed at run time, until it is unloaded."""
    problem = server.catalog.problem(entry.name)
    return {"id": entry.name, "object": "model", "created": entry.created, "owned_by": "runtime",
            "root": str(entry.path), "parent": server.settings.model_name,
            "max_model_len": server.engine.spec.kv_length, "healthy": problem is None, "problem": problem}
