"""Tests for runtime.util.native_logs."""

from __future__ import annotations

import os
import sys
import threading

from runtime.util.native_logs import muted_native_logs, print_to_stderr


def test_a_line_printed_while_another_thread_mutes_the_library_waits_and_is_not_lost(capfd, monkeypatch):
    muted, release = threading.Event(), threading.Event()

    def mute() -> None:
        with muted_native_logs():
            os.write(2, b"a native INFO line\n")
            muted.set()
            release.wait(30)

    # Python's stderr writing to fd 2, as outside pytest (whose own stderr bypasses it).
    with open(2, "w", closefd=False) as fd2, monkeypatch.context() as patched:
        patched.setattr(sys, "stderr", fd2)
        muting = threading.Thread(target=mute)
        muting.start()
        assert muted.wait(30)
        printer = threading.Thread(target=print_to_stderr, args=("warning: kept",))
        printer.start()
        printer.join(0.5)  # a bound, not a timing: printed before the mute ends, the line would be lost
        release.set()
        muting.join(30)
        printer.join(30)
    assert capfd.readouterr().err == "warning: kept\n"


def test_a_stderr_swapped_by_another_thread_during_a_mute_is_left_open_and_in_place(monkeypatch):
    """A test runner (or any caller) replacing ``sys.stderr`` while an engine compiles muted
    in the background keeps its stream: the mute used to close whatever ``sys.stderr`` was
    when it ended, and pytest's next write failed with "I/O operation on closed file"."""
    import io

    muted, swapped = threading.Event(), threading.Event()

    def mute() -> None:
        with muted_native_logs():
            muted.set()
            swapped.wait(30)

    muting = threading.Thread(target=mute)
    muting.start()
    assert muted.wait(30)
    theirs = io.StringIO()
    monkeypatch.setattr(sys, "stderr", theirs)
    swapped.set()
    muting.join(30)
    assert sys.stderr is theirs and not theirs.closed
    print("still writable", file=sys.stderr)
    assert theirs.getvalue() == "still writable\n"
