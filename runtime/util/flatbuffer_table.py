"""A minimal, bounds-checked reader for flatbuffer tables whose schema we know by heart.

For formats whose generated Python schema the runtime does not depend on (the
``.litertlm`` header). Every position is checked against the buffer, so corrupt input
raises ``DataLossError`` (or ``InvalidArgumentError``) naming the source, never loops or
reads outside.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from runtime.errors import DataLossError, InvalidArgumentError

_UOFFSET = 4
MAX_VECTOR = 1 << 20


@dataclass(frozen=True)
class FlatTable:
    """One table at ``pos`` of ``buf``; fields are addressed by their index in the schema."""

    buf: bytes | memoryview
    pos: int
    source: str

    @classmethod
    def root(cls, buf: bytes | memoryview, source: str) -> FlatTable:
        """The root table of a finished flatbuffer."""
        return cls(buf, 0, source)._table_at(0, "root")

    def _read(self, fmt: str, at: int, what: str) -> int:
        size = struct.calcsize(fmt)
        if at < 0 or at + size > len(self.buf):
            raise DataLossError(f"{self.source}: {what} at byte {at} is outside the {len(self.buf)}-byte header")
        return struct.unpack_from("<" + fmt, self.buf, at)[0]

    def _table_at(self, slot_position: int, what: str) -> FlatTable:
        target = slot_position + self._read("I", slot_position, what)
        table = FlatTable(self.buf, target, self.source)
        vtable = target - table._read("i", target, what)
        table._read("H", vtable, f"{what} vtable")
        return table

    def _field(self, index: int) -> int:
        """Absolute position of field ``index``, or 0 when absent."""
        vtable = self.pos - self._read("i", self.pos, "table")
        vtable_size = self._read("H", vtable, "vtable")
        slot = 4 + 2 * index
        if slot + 2 > vtable_size:
            return 0
        offset = self._read("H", vtable + slot, "vtable entry")
        return self.pos + offset if offset else 0

    def scalar(self, index: int, fmt: str, default: int | float = 0) -> int | float:
        """A scalar field (``fmt`` in struct notation, e.g. ``"Q"``, ``"B"``)."""
        at = self._field(index)
        return self._read(fmt, at, f"field {index}") if at else default

    def table(self, index: int) -> FlatTable | None:
        """A sub-table field."""
        at = self._field(index)
        return self._table_at(at, f"field {index}") if at else None

    def string(self, index: int) -> str | None:
        """A string field (UTF-8)."""
        at = self._field(index)
        if not at:
            return None
        start = at + self._read("I", at, f"field {index}")
        length = self._read("I", start, f"field {index} length")
        if start + _UOFFSET + length > len(self.buf):
            raise DataLossError(f"{self.source}: string field {index} runs past the end of the header")
        try:
            return bytes(self.buf[start + _UOFFSET : start + _UOFFSET + length]).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgumentError(f"{self.source}: string field {index} is not UTF-8") from None

    def tables(self, index: int) -> list[FlatTable]:
        """A vector-of-tables field."""
        at = self._field(index)
        if not at:
            return []
        start = at + self._read("I", at, f"field {index}")
        count = self._read("I", start, f"field {index} length")
        if count > MAX_VECTOR or start + _UOFFSET * (1 + count) > len(self.buf):
            raise DataLossError(f"{self.source}: vector field {index} of {count} items runs past the end")
        return [self._table_at(start + _UOFFSET * (1 + i), f"field {index}[{i}]") for i in range(count)]
