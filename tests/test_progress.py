"""Tests for runtime.cli.progress."""

from __future__ import annotations

import io
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


def test_off_a_terminal_tqdm_is_not_needed(monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal(tty=False))
    monkeypatch.setitem(sys.modules, "tqdm", None)  # "import tqdm" would now fail
    assert list(progress_bar("x")(iter("abc"))) == ["a", "b", "c"]


def test_on_a_terminal_a_tqdm_bar_wraps_the_items(monkeypatch):
    tqdm = pytest.importorskip("tqdm").tqdm
    stream = Terminal(tty=True)
    monkeypatch.setattr(sys, "stderr", stream)
    items = ["q", "k", "v", "o"]
    wrapped = progress_bar("converting", unit="projection")(items)
    assert isinstance(wrapped, tqdm)
    assert wrapped.desc == "converting"
    assert wrapped.unit == "projection"
    assert wrapped.leave is False
    assert wrapped.total == len(items)
    assert list(wrapped) == items  # same items, same order
    output = stream.getvalue()  # the bar went to stderr: its first frame names what and how many
    assert "converting:" in output and "0/4" in output and "projection/s" in output


def test_the_default_unit_is_it(monkeypatch):
    pytest.importorskip("tqdm")
    stream = Terminal(tty=True)
    monkeypatch.setattr(sys, "stderr", stream)
    wrapped = progress_bar("loading")(range(2))
    assert wrapped.unit == "it"
    assert list(wrapped) == [0, 1]
    assert "it" in stream.getvalue()


def test_the_terminal_check_happens_when_wrapping_not_when_made(monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.setattr(sys, "stderr", Terminal(tty=False))
    wrap = progress_bar("later")
    stream = Terminal(tty=True)
    monkeypatch.setattr(sys, "stderr", stream)  # e.g. pytest's capture, or a redirected stderr
    items = [1, 2]
    wrapped = wrap(items)
    assert wrapped is not items
    assert list(wrapped) == [1, 2]
    assert "later" in stream.getvalue()


def test_a_bar_leaves_nothing_behind_when_done(monkeypatch):
    pytest.importorskip("tqdm")
    stream = Terminal(tty=True)
    monkeypatch.setattr(sys, "stderr", stream)
    for _ in progress_bar("work")(range(5)):
        pass
    # leave=False: tqdm clears its line on close, so the last thing written is a cleared line.
    assert stream.getvalue().endswith("\r")


def test_each_wrap_makes_its_own_bar(monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.setattr(sys, "stderr", Terminal(tty=True))
    wrap = progress_bar("twice")
    first, second = wrap([1]), wrap([2, 3])
    assert first is not second
    assert list(first) == [1] and list(second) == [2, 3]
