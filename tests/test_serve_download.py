"""Tests for runtime.serve.download: only listed hosts, no private address unless listed,
no redirect, one time limit for the whole download; servers on loopback only."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import pytest

from runtime.errors import InvalidArgumentError, PermissionDeniedError, ResourceExhaustedError
from runtime.serve.download import DownloadPolicy, download
from runtime.serve.hosts import HostPort


@contextmanager
def loopback_server(answer):
    """A one-connection-at-a-time HTTP server on 127.0.0.1: ``answer(connection)`` writes
    the response after the request was read."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.05)  # so that the loop sees stop soon
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            connection.settimeout(5)
            with connection:
                connection.recv(65536)
                try:
                    answer(connection)
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def ok(connection) -> None:
    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello")


def test_nothing_is_downloaded_unless_its_host_is_listed(tmp_path):
    with loopback_server(ok) as port:
        url = f"http://127.0.0.1:{port}/a"
        for policy in (DownloadPolicy(), DownloadPolicy.of(["127.0.0.1:1"]), DownloadPolicy.of(["example.org"])):
            with pytest.raises(PermissionDeniedError, match="--allow-download-from"):
                download(url, tmp_path, prefix="a", policy=policy)
        for allowed in (["127.0.0.1"], [f"127.0.0.1:{port}"]):
            path = download(url, tmp_path, prefix="a", policy=DownloadPolicy.of(allowed))
            assert path.read_bytes() == b"hello"
            path.unlink()
    assert list(tmp_path.iterdir()) == []


def test_a_listed_name_that_resolves_to_loopback_is_refused_unless_the_address_is_listed(tmp_path):
    with loopback_server(ok) as port:
        with pytest.raises(PermissionDeniedError, match="loopback or private address"):
            download(f"http://localhost:{port}/a", tmp_path, prefix="a", policy=DownloadPolicy.of(["localhost"]))
        policy = DownloadPolicy.of(["localhost", "127.0.0.1"])
        assert download(f"http://localhost:{port}/a", tmp_path, prefix="a", policy=policy).read_bytes() == b"hello"


def test_redirects_are_not_followed(tmp_path):
    def redirect(connection) -> None:
        connection.sendall(b"HTTP/1.1 302 Found\r\nLocation: http://10.0.0.1/x\r\nContent-Length: 0\r\n\r\n")

    with loopback_server(redirect) as port:
        with pytest.raises(InvalidArgumentError, match="HTTP 302 \\(redirects are not followed\\)"):
            download(f"http://127.0.0.1:{port}/a", tmp_path, prefix="a", policy=DownloadPolicy.of(["127.0.0.1"]))
    assert list(tmp_path.iterdir()) == []


def test_the_time_limit_is_for_the_whole_download(tmp_path):
    def trickle(connection) -> None:  # a byte every 50 ms: no single read ever waits long
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
        for _ in range(1000):
            connection.sendall(b"x")
            time.sleep(0.05)

    with loopback_server(trickle) as port:
        started = time.monotonic()
        with pytest.raises(ResourceExhaustedError, match="longer than its limit of 0.5 s"):
            download(f"http://127.0.0.1:{port}/a", tmp_path, prefix="a",
                     policy=DownloadPolicy.of(["127.0.0.1"], timeout_s=0.5))
        assert time.monotonic() - started < 2
    assert list(tmp_path.iterdir()) == []


def test_failures_say_nothing_of_the_connection(tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # nothing listens there: connection refused
    with pytest.raises(InvalidArgumentError) as error:
        download(f"http://127.0.0.1:{port}/a", tmp_path, prefix="a", policy=DownloadPolicy.of(["127.0.0.1"]))
    assert "the download failed (see the server's log)" in str(error.value)
    assert "refused" not in str(error.value).lower() and "errno" not in str(error.value).lower()


@pytest.mark.parametrize("text,expected", [
    ("Example.org", HostPort("example.org")), ("example.org:8080", HostPort("example.org", 8080)),
    ("[::1]:8000", HostPort("::1", 8000)), ("::1", HostPort("::1")), ("127.0.0.1", HostPort("127.0.0.1")),
])
def test_host_patterns_parse(text, expected):
    assert HostPort.parse(text, "--allow-download-from") == expected


@pytest.mark.parametrize("text", ["", "host:0", "host:99999", "host:x", "[::1", "a/b", "user@host"])
def test_bad_host_patterns_are_refused(text):
    with pytest.raises(InvalidArgumentError, match="--allow-download-from"):
        HostPort.parse(text, "--allow-download-from")
