"""Host names with an optional port, as ``--allowed-hosts`` and ``--allow-download-from``
take them and as HTTP ``Host`` and ``Origin`` headers carry them."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from runtime.errors import InvalidArgumentError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class HostPort:
    """A host (lower case; an IPv6 address without brackets) and a port (``None``: any)."""

    host: str
    port: int | None = None

    @classmethod
    def parse(cls, text: str, what: str) -> HostPort:
        """``HOST``, ``HOST:PORT``, ``[IPv6]`` or ``[IPv6]:PORT``; ``InvalidArgumentError``
        naming ``what`` for anything else."""
        host, port = text.strip().lower(), None
        if host.startswith("["):
            host, bracket, rest = host[1:].partition("]")
            if not bracket or (rest and not rest.startswith(":")):
                raise InvalidArgumentError(f"{what} {text!r:.100}: expected HOST[:PORT] or [IPv6][:PORT]")
            port_text = rest[1:] if rest else None
        elif host.count(":") == 1:
            host, _, port_text = host.partition(":")
        else:
            port_text = None  # a bare IPv6 address, or a name
        if port_text is not None:
            if not port_text.isdigit() or not 0 < int(port_text) < 65536:
                raise InvalidArgumentError(f"{what} {text!r:.100}: the port must be 1-65535")
            port = int(port_text)
        if not host or any(c.isspace() or c in "/?#@" for c in host):
            raise InvalidArgumentError(f"{what} {text!r:.100}: expected HOST[:PORT] or [IPv6][:PORT]")
        return cls(host, port)

    def matches(self, other: HostPort) -> bool:
        """Whether ``other`` (a concrete host and port) is what this pattern allows."""
        return self.host == other.host and (self.port is None or self.port == other.port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) names this machine's loopback."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host.lower() == "localhost"
