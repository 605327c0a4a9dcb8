"""Tests for runtime.cli.progress."""

from __future__ import annotations

import io
import re
import sys

import pytest

from runtime.cli.progress import progress_bar


class Terminal(io.StringIO):
    """A stderr stand-in that says it is (or is not) a terminal and records what is written."""

    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_off_a_terminal_the_items_pass_through_untouched(monkeypatch):
    stream = Terminal(tty=False)
    monkeypatch.setattr(sys, "stderr", stream)
    items = [3, 1, 2]
    assert progress_bar("converting")(items) is items
    generator = (i for i in range(3))
    assert progress_bar("converting", unit="projection")(generator) is generator
    assert stream.getvalue() == ""


def test_off_a_terminal_long_work_can_announce_each_step_on_a_line(monkeypatch):
    stream = Terminal(tty=False)  # a log file, or a pipe to one
    monkeypatch.setattr(sys, "stderr", stream)
    steps = progress_bar("export", unit="step", lines_off_terminal=True)(iter(["load the weights", "lower decode"]))
    monkeypatch.setattr(sys, "stderr", Terminal(tty=False))  # the work itself runs with stderr elsewhere
    assert list(steps) == ["load the weights", "lower decode"]
    lines = stream.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["export: load the weights", "export: lower decode"]
    assert re.fullmatch(r".* \(1 done, \d+ s\)", lines[0]) and re.fullmatch(r".* \(2 done, \d+ s\)", lines[1])


def test_a_step_is_announced_before_it_is_handed_on(monkeypatch):
    stream = Terminal(tty=False)
    monkeypatch.setattr(sys, "stderr", stream)
    seen = []
    for step in progress_bar("export", lines_off_terminal=True)(["merge"]):
        seen.append((step, stream.getvalue()))  # the exporter yields a step when it is done
    assert len(seen) == 1 and seen[0][0] == "merge" and seen[0][1].startswith("export: merge (1 done")


def test_off_a_terminal_tqdm_is_not_needed(monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal(tty=False))
    monkeypatch.setitem(sys.modules, "tqdm", None)  # "import tqdm" would now fail
    assert list(progress_bar("x")(iter("abc"))) == ["a", "b", "c"]


def test_on_a_terminal_the_items_pass_through_a_bar_drawn_on_stderr(monkeypatch):
    pytest.importorskip("tqdm")
    stream = Terminal(tty=True)
    monkeypatch.setattr(sys, "stderr", stream)
    items = ["q", "k", "v", "o"]
    assert list(progress_bar("converting", unit="projection")(items)) == items  # same items, same order
    output = stream.getvalue()  # the bar names the work, counts the items in the unit given
    assert "converting:" in output and "0/4" in output and "projection" in output


def test_the_terminal_check_happens_when_wrapping_not_when_made(monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.setattr(sys, "stderr", Terminal(tty=False))
    wrap = progress_bar("later")
    stream = Terminal(tty=True)
    monkeypatch.setattr(sys, "stderr", stream)  # e.g. pytest's capture, or a redirected stderr
    assert list(wrap([1, 2])) == [1, 2]
    assert "later" in stream.getvalue()
