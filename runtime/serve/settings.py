"""What the server answers to, and its limits: :class:`ServeSettings`."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.errors import InvalidArgumentError
from runtime.serve.hosts import LOOPBACK_NAMES, HostPort

ADAPTER_SEPARATOR = "::"  # "base::adapter" in a request's model field


@dataclass(frozen=True)
class ServeSettings:
    """What the server answers to, and its limits (each with a safe default).

    ``model_name``: the base model's id in requests and ``/v1/models``. ``api_key``: if
    set, every endpoint but ``/health`` needs ``Authorization: Bearer <api_key>``.
    ``max_concurrent``: generations running at once (each prompt x choice of a request); a
    request past it gets 429, one asking more on its own 400. ``max_body_bytes``: larger
    request bodies get 413. ``allowed_hosts``: the ``Host`` headers (and ``Origin``
    hosts) answered, as ``HOST[:PORT]`` patterns (default: the loopback names, any port;
    ``None``: any host, but an ``Origin`` must still be the request's own host): against
    DNS rebinding. ``header_timeout_s``: a request's head and body must arrive within it
    (else the connection is closed, or 408). ``idle_timeout_s``: an idle keep-alive
    connection is closed after it.
    """

    model_name: str
    api_key: str | None = None
    max_concurrent: int = 16
    max_body_bytes: int = 1 << 20
    allowed_hosts: tuple[HostPort, ...] | None = tuple(HostPort(name) for name in LOOPBACK_NAMES)
    header_timeout_s: float = 10.0
    idle_timeout_s: float = 5.0
    max_prompts: int = 64  # prompts in one /v1/completions request's list
    score_by_decode: bool = False  # echo on a model whose prefill returns no logits: one decode step per token

    def __post_init__(self) -> None:
        if not self.model_name or ADAPTER_SEPARATOR in self.model_name:
            raise InvalidArgumentError(f"model name {self.model_name!r}: must be non-empty, without '::'")
        if self.api_key is not None and not self.api_key:
            raise InvalidArgumentError("the API key must not be empty")
        if type(self.max_concurrent) is not int or self.max_concurrent < 1:
            raise InvalidArgumentError(f"max_concurrent={self.max_concurrent!r}, expected an integer >= 1")
        if type(self.max_prompts) is not int or self.max_prompts < 1:
            raise InvalidArgumentError(f"max_prompts={self.max_prompts!r}, expected an integer >= 1")
        if type(self.max_body_bytes) is not int or self.max_body_bytes < 1024:
            raise InvalidArgumentError(f"max_body_bytes={self.max_body_bytes!r}, expected an integer >= 1024")
        for name in ("header_timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            if type(value) not in (int, float) or not 0 < value <= 3600:
                raise InvalidArgumentError(f"{name}={value!r}, expected seconds in (0, 3600]")
