"""Error mapping: every exception a request can raise, as an OpenAI-shaped JSON answer."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from runtime.errors import StatusError
from runtime.serve.errors import ApiError
from runtime.serve.protocol import validation_error

log = logging.getLogger("runtime.serve")


def install_error_handlers(app: FastAPI) -> None:
    """Makes ``app`` answer every error as ``{"error": {message, type, param, code}}``."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StatusError)
    async def status_error(_: Request, exc: StatusError) -> JSONResponse:
        return error_response(ApiError.from_status(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(list(exc.errors()), request.headers.get("content-type")))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return error_response(_http_error(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error while answering a request")
        return error_response(as_api_error(exc))


def error_response(error: ApiError) -> JSONResponse:
    """``error`` as a JSON response with its status code and headers."""
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers or None)


def as_api_error(exc: BaseException) -> ApiError:
    """Any exception as an answer: its own, a status error's, or an anonymous 500."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, StatusError):
        return ApiError.from_status(exc)
    return ApiError(500, f"internal error: {type(exc).__name__}", "server_error", "internal_error")


def _http_error(status: int, detail: str) -> ApiError:
    if status == 404:
        return ApiError(404, f"no such endpoint ({detail})", "not_found_error", "unknown_url")
    if status == 405:
        return ApiError(405, f"method not allowed ({detail})", "invalid_request_error", "method_not_allowed")
    if status == 413:
        return ApiError(413, f"the request body exceeds the server's limit ({detail})", "invalid_request_error",
                        "request_too_large")
    if status == 400:  # FastAPI's answer to a body it cannot decode (not UTF-8...)
        return ApiError(400, f"the request body cannot be read: {detail}", "invalid_request_error", "invalid_body")
    return ApiError(status, detail, "invalid_request_error" if status < 500 else "server_error", f"http_{status}")
