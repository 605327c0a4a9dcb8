"""Fetching an adapter file over HTTP(S), only from the hosts the operator listed.

Safe against a request that names an address it should not reach (SSRF): the URL's
host and port must be on the allow list; every address it resolves to that is not a
public one (loopback, private, link-local...) must be listed itself, as an address; the
connection goes to the address that was checked (no second lookup), and redirects are
not followed. The whole download has one time limit and a size cap. Errors name the
URL and what went wrong, never the body's content or the connection's details (those
are logged).
"""

from __future__ import annotations

import http.client
import ipaddress
import logging
import os
import socket
import ssl
import tempfile
import time
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import InvalidArgumentError, PermissionDeniedError, ResourceExhaustedError, StatusError
from runtime.serve.hosts import HostPort

log = logging.getLogger("runtime.serve")

_CHUNK = 1 << 20


@dataclass(frozen=True)
class DownloadPolicy:
    """Where downloads may come from, how large they may be and how long they may take.

    ``allowed``: ``HOST[:PORT]`` patterns (none: no download at all). ``max_bytes``: the
    size cap. ``timeout_s``: the time limit of the whole download, connecting included.
    """

    allowed: tuple[HostPort, ...] = ()
    max_bytes: int = 256 << 20
    timeout_s: float = 60.0

    @classmethod
    def of(cls, allowed: Iterable[str] = (), max_bytes: int = 256 << 20, timeout_s: float = 60.0) -> DownloadPolicy:
        """A policy from the command line's ``HOST[:PORT]`` strings."""
        if type(max_bytes) is not int or max_bytes < 1:
            raise InvalidArgumentError(f"max_download_bytes={max_bytes!r}, expected an integer >= 1")
        if not 0 < timeout_s <= 3600:
            raise InvalidArgumentError(f"download_timeout_s={timeout_s!r}, expected seconds in (0, 3600]")
        return cls(tuple(HostPort.parse(entry, "--allow-download-from") for entry in allowed), max_bytes, timeout_s)

    def address_for(self, url: str) -> tuple[urllib.parse.SplitResult, HostPort, str]:
        """The URL split, its host and port, and the address to connect to; refuses
        (``PermissionDeniedError``) what the policy does not allow."""
        parts = urllib.parse.urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise InvalidArgumentError(f"url {url!r:.200}: only http:// and https:// URLs can be loaded")
        try:
            target = HostPort(parts.hostname or "", parts.port or (443 if scheme == "https" else 80))
        except ValueError:
            raise InvalidArgumentError(f"url {url!r:.200}: the port is not a number in 0-65535") from None
        if not target.host or parts.username is not None:
            raise InvalidArgumentError(f"url {url!r:.200}: expected http(s)://HOST[:PORT]/PATH without credentials")
        if not any(pattern.matches(target) for pattern in self.allowed):
            raise PermissionDeniedError(
                f"url {url!r:.200}: downloads from {_shown(target)} are not allowed; the server's "
                "--allow-download-from lists the hosts it may download from (none by default)")
        try:
            addresses = {info[4][0] for info in socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)}
        except (OSError, UnicodeError):
            raise InvalidArgumentError(f"url {url!r:.200}: the host name does not resolve") from None
        for address in sorted(addresses):
            if ipaddress.ip_address(address.split("%")[0]).is_global or any(
                    pattern.matches(HostPort(address, target.port)) for pattern in self.allowed):
                return parts, target, address
        raise PermissionDeniedError(
            f"url {url!r:.200}: {target.host} resolves to a loopback or private address that "
            "--allow-download-from does not list (list the address itself to allow it)")


def download(url: str, directory: Path, *, prefix: str, policy: DownloadPolicy) -> Path:
    """Downloads ``url`` into a new hidden file in ``directory`` (so that renaming it into
    place is atomic) and returns its path; on any error nothing is left behind."""
    parts, target, address = policy.address_for(url)
    handle, name = tempfile.mkstemp(dir=directory, prefix=f".{prefix}.", suffix=".download")
    path = Path(name)
    try:
        with os.fdopen(handle, "wb") as out:
            _copy(parts, target, address, out, url, policy)
        return path
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def _copy(parts: urllib.parse.SplitResult, target: HostPort, address: str, out, url: str,
          policy: DownloadPolicy) -> None:
    deadline = time.monotonic() + policy.timeout_s

    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ResourceExhaustedError(
                f"url {url!r:.200}: the download took longer than its limit of {policy.timeout_s:g} s")
        return left

    kind = _PinnedHTTPS if parts.scheme.lower() == "https" else _PinnedHTTP
    connection = kind(target.host, target.port, address, remaining())
    received = 0
    try:
        connection.request("GET", urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, "")),
                           headers={"User-Agent": "runtime-serve"})
        response = connection.getresponse()
        if response.status != 200:
            moved = " (redirects are not followed)" if 300 <= response.status < 400 else ""
            raise InvalidArgumentError(f"url {url!r:.200}: the server answered HTTP {response.status}{moved}")
        declared = response.getheader("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > policy.max_bytes:
            raise ResourceExhaustedError(f"url {url!r:.200}: larger than the download cap of {policy.max_bytes:,} bytes")
        while True:
            connection.socket.settimeout(remaining())
            chunk = response.read1(_CHUNK)
            if not chunk:
                break
            received += len(chunk)
            if received > policy.max_bytes:
                raise ResourceExhaustedError(
                    f"url {url!r:.200}: larger than the download cap of {policy.max_bytes:,} bytes")
            out.write(chunk)
        remaining()
    except StatusError:
        raise
    except (OSError, http.client.HTTPException, ValueError) as exc:
        log.warning("download of %s failed: %r", url, exc)
        if time.monotonic() >= deadline:
            raise ResourceExhaustedError(
                f"url {url!r:.200}: the download took longer than its limit of {policy.timeout_s:g} s") from None
        raise InvalidArgumentError(f"url {url!r:.200}: the download failed (see the server's log)") from None
    finally:
        connection.close()


class _PinnedHTTP(http.client.HTTPConnection):
    """An HTTP connection to ``host`` that connects to the address already checked."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._address = address
        self.socket: socket.socket | None = None  # kept after http.client lets go of it

    def connect(self) -> None:
        self.sock = self.socket = socket.create_connection((self._address, self.port), self.timeout)


class _PinnedHTTPS(_PinnedHTTP):
    """The same over TLS, the certificate checked against ``host``."""

    default_port = http.client.HTTPS_PORT

    def connect(self) -> None:
        super().connect()
        self.sock = self.socket = ssl.create_default_context().wrap_socket(self.sock, server_hostname=self.host)


def _shown(target: HostPort) -> str:
    host = f"[{target.host}]" if ":" in target.host else target.host
    return f"{host}:{target.port}"
