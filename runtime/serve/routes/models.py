"""``GET /v1/models``: the base model and every adapter, with its ``parent``."""

from __future__ import annotations

from fastapi import APIRouter

from runtime.serve.catalog import CatalogEntry
from runtime.serve.server import Server


def routes(server: Server) -> APIRouter:
    """The model listing over ``server``."""
    router = APIRouter()

    @router.get("/v1/models")
    async def models() -> dict:
        base = {"id": server.settings.model_name, "object": "model", "created": server.started,
                "owned_by": "runtime", "root": str(server.engine.model_path), "parent": None}
        return {"object": "list", "data": [base, *(card(server, entry) for entry in server.catalog.entries())]}

    return router


def card(server: Server, entry: CatalogEntry) -> dict:
    """One adapter as a ``model`` object."""
    return {"id": entry.name, "object": "model", "created": entry.created, "owned_by": "runtime",
            "root": str(entry.path), "parent": server.settings.model_name}
