"""``python -m runtime serve`` as a child process, for the examples that talk to a server.

Not an example itself: ``serve_client.py`` and ``evaluate.py`` import it (run as
``python examples/X.py``, this folder is on the import path).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def runtime_serve(*arguments: str, timeout_s: float = 30.0) -> Iterator[str]:
    """Starts ``python -m runtime serve ARGUMENTS --port 0`` (a free loopback port), waits for
    ``/health``; yields its ``/v1`` URL and stops it (Ctrl-C, as a user would) at the end."""
    command = [sys.executable, "-m", "runtime", "serve", *arguments, "--port", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:\d+/v1", line)
        if not found:
            raise SystemExit(f"error: the server did not start: {line!r}")
        url = found.group(0)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        print(f"started: {' '.join(['python', *command[1:]])}\n  -> {line.strip()}")
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
