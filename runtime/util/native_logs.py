"""Keeping ai-edge-litert's native INFO lines off the terminal.

The library prints INFO lines to file descriptor 2 when it creates or destroys its
environment (loading a model, freeing it, process exit) and offers no switch for them;
its failures reach us as exceptions anyway. Loading and closing are wrapped in
:func:`muted_native_logs`; at exit, the descriptor is muted once Python is done with it.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_mute_lock = threading.Lock()
_exit_hook_registered = False


@contextmanager
def muted_native_logs(*, keep_python_stderr: bool = False) -> Iterator[None]:
    """Points file descriptor 2 at /dev/null while the block runs (Python's own writes to
    ``sys.stderr`` made before are flushed first). ``keep_python_stderr``: Python's
    ``sys.stderr`` keeps writing to where descriptor 2 went before (for long work whose
    progress bars and errors must still show, such as an export)."""
    with _mute_lock:
        sys.stderr.flush()
        saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        python_stderr = sys.stderr
        ours = None  # the stream this block gave sys.stderr, if any: only it is closed here
        try:
            os.dup2(devnull, 2)
            if keep_python_stderr:
                ours = sys.stderr = os.fdopen(os.dup(saved), "w", buffering=1)
            yield
        finally:
            # sys.stderr may have been swapped meanwhile by another thread (a test runner
            # capturing output while an engine compiles in the background): that stream is
            # theirs, left as it is; closing it broke their next write.
            if ours is not None:
                if sys.stderr is ours:
                    sys.stderr = python_stderr
                ours.close()
            os.dup2(saved, 2)
            os.close(saved)
            os.close(devnull)


def print_to_stderr(text: str) -> None:
    """Prints the line ``text`` to ``sys.stderr`` once no :func:`muted_native_logs` block
    runs in any thread (one points file descriptor 2 at /dev/null meanwhile, and a line
    written then is lost: an engine compiles a registered adapter's signature group in the
    background, muted, while the command goes on)."""
    with _mute_lock:
        print(text, file=sys.stderr, flush=True)


def mute_native_logs_at_exit() -> None:
    """Mutes file descriptor 2 when the interpreter exits, after ``atexit`` handlers
    registered later (pytest's summary, for one) have run. Idempotent."""
    global _exit_hook_registered
    with _mute_lock:
        if not _exit_hook_registered:
            atexit.register(_mute_for_good)
            _exit_hook_registered = True


def _mute_for_good() -> None:
    try:
        sys.stderr.flush()
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
