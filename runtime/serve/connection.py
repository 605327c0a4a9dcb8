"""Connection time limits uvicorn lacks: a request's head must arrive within the header
timeout, on a new connection as on a kept-alive one (else the connection is closed), so
that half-sent requests do not hold connections open forever; the app told when uvicorn's
graceful shutdown begins (so that running generations end with an error, not cut off when
the grace period ends); and the uvicorn settings that go with them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from runtime.serve.settings import ServeSettings


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose next request's head has not
    arrived ``header_timeout_s`` after the connection opened or the last answer ended."""

    header_timeout_s: float = 10.0
    on_shutdown: Callable[[], None] | None = None  # the app's: uvicorn begins to shut down
    _header_timer: asyncio.TimerHandle | None = None

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown begins: tells the app (whose running requests then
        end with an answer), then lets uvicorn close the connection once its request is
        answered."""
        if self.on_shutdown is not None:
            self.on_shutdown()
        super().shutdown()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Starts the clock for the first request's head."""
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        """Stops the clock once a request's head is complete."""
        super().data_received(data)
        if self._request_started():
            self._disarm()

    def on_response_complete(self) -> None:
        """Starts the clock again for the next request on this connection."""
        super().on_response_complete()
        if not self._request_started():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        """Stops the clock."""
        self._disarm()
        super().connection_lost(exc)

    def _request_started(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if not self._request_started():
            self.transport.close()


def uvicorn_config(app: FastAPI, settings: ServeSettings, **options: object) -> uvicorn.Config:
    """uvicorn's settings for ``app`` (made by :func:`~runtime.serve.app.create_app`): the
    header timeout protocol, which drains the app when a graceful shutdown begins, the idle
    (keep-alive) timeout; ``options`` go to ``uvicorn.Config`` as they are."""
    protocol = type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,),
                    {"header_timeout_s": settings.header_timeout_s, "on_shutdown": staticmethod(app.state.drain)})
    return uvicorn.Config(app, http=protocol, timeout_keep_alive=settings.idle_timeout_s, **options)
