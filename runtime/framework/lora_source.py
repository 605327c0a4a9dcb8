"""LoraSource: where one adapter comes from, and how strongly it is applied."""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass

from runtime.errors import InvalidArgumentError

AdapterBuffer = bytes | bytearray | memoryview | mmap.mmap


@dataclass(frozen=True)
class LoraSource:
    """One adapter for a session: a file ``path`` or an in-memory ``buffer``, and a ``scale``.

    ``scale`` multiplies the adapter's delta (``W + scale * B @ A``); 0 turns it off.
    """

    path: str | os.PathLike[str] | None = None
    buffer: AdapterBuffer | None = None
    scale: float = 1.0

    def __post_init__(self) -> None:
        if (self.path is None) == (self.buffer is None):
            raise InvalidArgumentError("LoraSource takes exactly one of path= or buffer=")
        if not isinstance(self.scale, int | float) or not math.isfinite(self.scale):
            raise InvalidArgumentError(f"LoraSource scale={self.scale!r}, expected a finite number")

    @property
    def label(self) -> str:
        """The path, or a short description of the buffer, for messages."""
        if self.path is not None:
            return os.fspath(self.path)
        return f"<in-memory buffer of {len(self.buffer)} bytes>"
