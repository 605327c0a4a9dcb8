"""Progress bars for long command-line work, shown only on a terminal."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable


def progress_bar(description: str, unit: str = "it") -> Callable[[Iterable], Iterable]:
    """A wrapper that shows a tqdm bar on stderr when it is a terminal, else passes through."""
    def wrap(items: Iterable) -> Iterable:
        if not sys.stderr.isatty():
            return items
        from tqdm import tqdm

        return tqdm(items, desc=description, unit=unit, leave=False, file=sys.stderr)

    return wrap
