"""What every request passes before its route: the ``Host`` and ``Origin`` checks
(against DNS rebinding and cross-site requests), the API key, the body size cap and the
time the body may take; and the count of every answer by endpoint and status."""

from __future__ import annotations

import asyncio
import hmac
import time
import urllib.parse

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.errors import InvalidArgumentError
from runtime.serve.error_handlers import error_response
from runtime.serve.errors import ApiError
from runtime.serve.hosts import HostPort
from runtime.serve.metrics import ServerMetrics
from runtime.serve.settings import ServeSettings

OPEN_PATHS = frozenset({"/health", "/"})  # answered without the API key (and the page's files under /ui/)
_ENDPOINTS = frozenset({"/", "/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
                        "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/adapter_files", "/tokenize",
                        "/detokenize", "/tokenizer_info"})


class Gate:
    """What every request passes first: the host and origin checks, the API key check,
    then the body (read here within the cap and the time limit, and handed on); and the
    count of every answer by endpoint and status."""

    def __init__(self, app: ASGIApp, settings: ServeSettings, metrics: ServerMetrics) -> None:
        self._app = app
        self._key = settings.api_key.encode() if settings.api_key is not None else None
        self._hosts = settings.allowed_hosts
        self._max_body = settings.max_body_bytes
        self._body_timeout_s = settings.header_timeout_s
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
            refusal = self._refusal(scope)
            if refusal is None:
                body = await self._read_body(scope, receive)
                if isinstance(body, ApiError):
                    refusal = body
            if refusal is not None:
                await error_response(refusal)(scope, receive, counting)
                return
            await self._app(scope, _replay(body, receive), counting)
        except Exception:
            status = status or 500  # answered by the outermost error handler
            raise
        finally:
            self._metrics.requests.labels(_endpoint(scope["path"]), str(status)).inc()

    def _refusal(self, scope: Scope) -> ApiError | None:
        """Why the request is refused before its body is read, or ``None``."""
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope.get("headers", ())}
        host = _host_port(headers.get("host", ""))
        if self._hosts is not None and not (host and any(pattern.matches(host) for pattern in self._hosts)):
            return ApiError(403, f"Host {headers.get('host', '')!r:.100} is not served here; the server's "
                            "--allowed-hosts lists the names it answers to", "permission_error", "host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self._same_site(origin, host):
            return ApiError(403, f"requests from the web page at {origin!r:.100} are not allowed (a page of "
                            "another site); --allowed-hosts lists the hosts whose pages may call",
                            "permission_error", "origin_not_allowed")
        open_path = scope["path"] in OPEN_PATHS or scope["path"].startswith("/ui/")
        if not open_path and not self._authorized(headers.get("authorization", "")):
            return ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                            "authentication_error", "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return None

    def _same_site(self, origin: str, host: HostPort | None) -> bool:
        """Whether a page at ``origin`` may call: it is this server's own page (the same
        host and port as the request's), or an allowed host's."""
        parts = urllib.parse.urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False  # "null" (a sandboxed page, a file), or garbage
        page = _host_port(parts.netloc)
        if page is None:
            return False
        if page.port is None:
            page = HostPort(page.host, 443 if parts.scheme == "https" else 80)
        if host is not None and page == HostPort(host.host, host.port or page.port):
            return True
        return self._hosts is not None and any(pattern.matches(page) for pattern in self._hosts)

    def _authorized(self, header: str) -> bool:
        if self._key is None:
            return True
        scheme, _, token = header.encode("latin-1").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | ApiError:
        """The whole body, or the error past the cap (declared or sent) or the time limit."""
        too_large = ApiError(413, f"the request body exceeds the server's limit of {self._max_body:,} bytes",
                             "invalid_request_error", "request_too_large")
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self._max_body:
                return too_large
        chunks, size = [], 0
        deadline = time.monotonic() + self._body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return ApiError(408, f"the request body did not arrive within {self._body_timeout_s:g} s",
                                "invalid_request_error", "request_timeout", headers={"Connection": "close"})
            if message["type"] != "http.request":
                break  # the client went away; the app sees an empty body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self._max_body:
                return too_large
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


def _endpoint(path: str) -> str:
    """The ``endpoint`` label of a path: one of a fixed few, whatever clients send."""
    if path in _ENDPOINTS:
        return path
    for prefix in ("/v1/models/", "/ui/"):
        if path.startswith(prefix):
            return prefix + "*"
    return "other"


def _host_port(text: str) -> HostPort | None:
    """A ``Host`` header's (or an origin's) host and port, or ``None`` if it is malformed."""
    try:
        return HostPort.parse(text, "Host")
    except InvalidArgumentError:
        return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that first gives ``body`` whole, then whatever the client sends (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
