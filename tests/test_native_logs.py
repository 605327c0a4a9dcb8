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
