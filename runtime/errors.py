"""One exception hierarchy for the whole runtime, shaped like status codes.

Every layer raises only these. Each class also subclasses the built-in exception that
matches it where that is natural, so ``except ValueError`` keeps working for callers
who do not know this module.
"""

from __future__ import annotations


class StatusError(Exception):
    """Base of every error the runtime raises on purpose. ``field``: the argument it is
    about, when the layer that knows has said so (an API answer's ``param``)."""

    code: str = "UNKNOWN"
    field: str | None = None

    def __str__(self) -> str:
        message = super().__str__()
        return f"{self.code}: {message}" if message else self.code


class InvalidArgumentError(StatusError, ValueError):
    """The caller passed something malformed or unusable (bad file, wrong shape...)."""

    code = "INVALID_ARGUMENT"


class NotFoundError(StatusError, LookupError):
    """A named thing (file, tensor, adapter id, signature) does not exist."""

    code = "NOT_FOUND"


class AlreadyExistsError(StatusError):
    """A thing with that name or id is already registered."""

    code = "ALREADY_EXISTS"


class FailedPreconditionError(StatusError, RuntimeError):
    """The system is not in a state that allows the operation (closed, in use...)."""

    code = "FAILED_PRECONDITION"


class ResourceExhaustedError(StatusError):
    """A fixed capacity would be exceeded (KV-cache length, memory budget...)."""

    code = "RESOURCE_EXHAUSTED"


class UnimplementedError(StatusError, NotImplementedError):
    """A recognised but unsupported feature (DoRA, an unknown dtype...)."""

    code = "UNIMPLEMENTED"


class DataLossError(StatusError):
    """Data is truncated or does not match its declared digest."""

    code = "DATA_LOSS"


class UnavailableError(StatusError, ConnectionError):
    """A service the operation needs cannot be reached now (a replica, a cluster); retrying may work."""

    code = "UNAVAILABLE"


class InternalError(StatusError, RuntimeError):
    """A bug or an unexpected failure of an underlying library."""

    code = "INTERNAL"


class PermissionDeniedError(StatusError, PermissionError):
    """The process may not read a file it was asked to read."""

    code = "PERMISSION_DENIED"
