"""What every request passes before its route: the API key, the body size cap; and the
count of every answer by endpoint and status."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.serve.error_handlers import error_response
from runtime.serve.errors import ApiError
from runtime.serve.metrics import ServerMetrics

OPEN_PATHS = frozenset({"/health"})  # answered without the API key
_ENDPOINTS = frozenset({"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
                        "/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


class Gate:
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
                await error_response(error, {"WWW-Authenticate": "Bearer"})(scope, receive, counting)
                return
            body = await self._read_body(scope, receive)
            if body is None:
                error = ApiError(413, f"the request body exceeds the server's limit of {self._max_body:,} bytes",
                                 "invalid_request_error", "request_too_large")
                await error_response(error)(scope, receive, counting)
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
