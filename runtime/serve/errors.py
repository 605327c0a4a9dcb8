"""Errors as OpenAI clients expect them: a status code and ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.errors import (
    AlreadyExistsError,
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    StatusError,
    UnavailableError,
    UnimplementedError,
)

# The runtime's status errors as HTTP answers: (status, OpenAI error type, code).
_STATUS_OF = (
    (InvalidArgumentError, 400, "invalid_request_error", "invalid_value"),
    (ResourceExhaustedError, 400, "invalid_request_error", "limit_exceeded"),
    (UnimplementedError, 400, "invalid_request_error", "unsupported"),
    (DataLossError, 400, "invalid_request_error", "integrity_check_failed"),
    (PermissionDeniedError, 403, "permission_error", "forbidden"),
    (NotFoundError, 404, "not_found_error", "not_found"),
    (AlreadyExistsError, 409, "conflict_error", "already_exists"),
    (FailedPreconditionError, 409, "conflict_error", "conflict"),
    (UnavailableError, 503, "server_error", "unavailable"),
)


@dataclass(eq=False)  # compared and hashed by identity, like any exception
class ApiError(Exception):
    """An error answer; raised anywhere in a request, turned into JSON by the application."""

    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)  # sent with the answer (Retry-After...)

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        """The OpenAI-shaped JSON body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_status(cls, error: StatusError, *, code: str | None = None, param: str | None = None) -> ApiError:
        """The HTTP answer for one of the runtime's errors (500 for an unexpected kind),
        naming ``param`` (default: the error's own ``field``)."""
        message = " ".join(str(error.args[0] if error.args else error.code).split())
        param = param if param is not None else error.field
        for kind, status, error_type, default_code in _STATUS_OF:
            if isinstance(error, kind):
                return cls(status, message, error_type, code or default_code, param)
        return cls(500, message, "server_error", code or "internal_error", param)


def bad_request(message: str, *, code: str = "invalid_value", param: str | None = None) -> ApiError:
    """A 400 answer."""
    return ApiError(400, message, "invalid_request_error", code, param)


def model_not_found(message: str) -> ApiError:
    """A 404 for a ``model`` that is not served here."""
    return ApiError(404, message, "not_found_error", "model_not_found", "model")
