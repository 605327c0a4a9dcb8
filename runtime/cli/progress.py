"""Progress for long command-line work: a bar on a terminal; off one, nothing, or a line
per step for work long enough that its log should show where it is."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TextIO


def progress_bar(description: str, unit: str = "it", *, lines_off_terminal: bool = False
                 ) -> Callable[[Iterable], Iterable]:
    """A wrapper that shows a tqdm bar on stderr when it is a terminal. Off a terminal the
    items pass through untouched, or, with ``lines_off_terminal``, each is announced on a
    line of its own as it comes (``description: item (n done, s seconds)``). The stream is
    the ``sys.stderr`` of the moment of wrapping."""
    def wrap(items: Iterable) -> Iterable:
        stream = sys.stderr
        if not stream.isatty():
            return _lines(items, description, stream) if lines_off_terminal else items
        from tqdm import tqdm

        return tqdm(items, desc=description, unit=unit, leave=False, file=stream)

    return wrap


def _lines(items: Iterable, description: str, stream: TextIO) -> Iterator:
    """``items``, each announced on ``stream`` before it is handed on."""
    start = time.monotonic()
    for count, item in enumerate(items, 1):
        print(f"{description}: {item} ({count} done, {time.monotonic() - start:.0f} s)", file=stream, flush=True)
        yield item
