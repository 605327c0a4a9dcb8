"""``GET /``: the chat page, and its script and style under ``/ui/``, served from the
package's files (plain HTML, JavaScript and CSS; no CDN, works offline). The page calls
the same endpoints as any client, with the API key the user types."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

WEB = resources.files("runtime.serve") / "web"
# The page loads only its own files and talks only to its own server; no site may frame it.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def routes() -> APIRouter:
    """The page at ``/``."""
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(str(WEB / "index.html"), media_type="text/html", headers=PAGE_HEADERS)

    return router


def files() -> StaticFiles:
    """The page's script and style, to mount at ``/ui``."""
    return StaticFiles(directory=str(WEB))
