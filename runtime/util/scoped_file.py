"""ScopedFile: an open, read-only file handle that is closed exactly once."""

from __future__ import annotations

import mmap
import os
import stat
from pathlib import Path
from types import TracebackType

from runtime.errors import (
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
)


def refuse_unless_regular(fd: int, path: Path, expected: str) -> None:
    """``InvalidArgumentError`` naming ``path`` and ``expected`` unless the open ``fd`` is a
    regular file: a directory, a FIFO or a device cannot be read as a model or adapter
    (mmap fails on them, a FIFO's reads wait for a writer)."""
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        kind = "is a directory" if stat.S_ISDIR(mode) else "is not a regular file"
        raise InvalidArgumentError(f"{path}: {kind}, expected {expected}")


class ScopedFile:
    """Owns an open file descriptor for reading; usable as a context manager.

    Opening maps the usual OS failures onto the runtime's status errors, each naming
    the path: a missing file is ``NotFoundError``, a directory or another file that is not
    a regular one (a FIFO, a device) ``InvalidArgumentError``, an unreadable file
    ``PermissionDeniedError``.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        try:
            # (non-blocking: a FIFO is refused below rather than waited on for a writer)
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise NotFoundError(f"{self.path}: no such file") from None
        except IsADirectoryError:
            raise InvalidArgumentError(f"{self.path}: is a directory, expected a file") from None
        except PermissionError:
            raise PermissionDeniedError(f"{self.path}: permission denied") from None
        except OSError as exc:
            raise InvalidArgumentError(f"{self.path}: cannot open: {exc.strerror}") from None
        try:
            refuse_unless_regular(self._fd, self.path, "a file")
        except InvalidArgumentError:
            self.close()
            raise

    @property
    def closed(self) -> bool:
        """Whether the descriptor has been closed."""
        return self._fd is None

    def fileno(self) -> int:
        """The open descriptor; ``FailedPreconditionError`` once closed."""
        if self._fd is None:
            raise FailedPreconditionError(f"{self.path}: file already closed")
        return self._fd

    def size(self) -> int:
        """The file's current size in bytes (asks the OS each time)."""
        return os.fstat(self.fileno()).st_size

    def memory_map(self) -> mmap.mmap:
        """Maps the whole file read-only. An empty file cannot be mapped and is refused."""
        if self.size() == 0:
            raise InvalidArgumentError(f"{self.path}: file is empty")
        try:
            return mmap.mmap(self.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise InvalidArgumentError(f"{self.path}: cannot memory-map: {exc}") from None

    def close(self) -> None:
        """Closes the descriptor; closing twice is harmless."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> ScopedFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"ScopedFile({str(self.path)!r}, {state})"


class FileWatch:
    """Remembers a file's size, modification and change time, to refuse reading it once changed.

    Memory-mapped files that shrink turn the next read of a lost page into SIGBUS, which
    kills the process; a file rewritten in place would silently change a registered
    adapter. The change time (``st_ctime_ns``) is what catches a rewrite that keeps the
    size and sets the old modification time back (``cp -p``, ``rsync --inplace -t``): the
    kernel sets it on every write and no call sets it back. It also moves on a metadata
    change (``chmod``, a new hard link), which is then refused as a change: a false alarm
    costs registering the adapter again, a missed rewrite served other weights. Readers
    call :meth:`check` before touching mapped bytes. (A change racing the few
    microseconds between the check and the read is not covered.)
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise NotFoundError(f"{self.path}: no such file") from None
        except OSError as exc:
            raise InvalidArgumentError(f"{self.path}: cannot stat: {exc.strerror}") from None
        self._size, self._times = st.st_size, (st.st_mtime_ns, st.st_ctime_ns)

    def _stat(self) -> tuple[int, tuple[int, int]]:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise DataLossError(f"{self.path}: cannot be read any more: {exc.strerror}") from None
        return st.st_size, (st.st_mtime_ns, st.st_ctime_ns)

    def check(self, what: str = "") -> None:
        """``DataLossError`` if the file is gone, smaller, or modified since it was opened."""
        size, times = self._stat()
        where = f"{self.path}: {what}: " if what else f"{self.path}: "
        if size < self._size:
            raise DataLossError(f"{where}file shrank from {self._size} to {size} bytes after it was opened")
        if (size, times) != (self._size, self._times):
            raise DataLossError(f"{where}file was modified after it was opened (its size, modification or change "
                                "time differ)")
