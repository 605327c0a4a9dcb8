"""Tests for runtime.util.scoped_file."""

from __future__ import annotations

import os

import pytest

from runtime.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
)
from runtime.util.scoped_file import ScopedFile


def test_open_read_close(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"hello")
    with ScopedFile(path) as f:
        assert not f.closed
        assert f.size() == 5
        with f.memory_map() as mapped:
            assert mapped[:] == b"hello"
    assert f.closed
    with pytest.raises(FailedPreconditionError):
        f.fileno()
    f.close()  # twice is harmless


def test_missing_file(tmp_path):
    with pytest.raises(NotFoundError, match="no such file"):
        ScopedFile(tmp_path / "missing")


def test_directory(tmp_path):
    with pytest.raises(InvalidArgumentError, match="is a directory"):
        ScopedFile(tmp_path)


def test_a_fifo_is_refused_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(InvalidArgumentError, match="fifo: is not a regular file, expected a file"):
        ScopedFile(tmp_path / "fifo")


def test_empty_file_cannot_be_mapped(tmp_path):
    path = tmp_path / "empty"
    path.write_bytes(b"")
    with ScopedFile(path) as f, pytest.raises(InvalidArgumentError, match="empty"):
        f.memory_map()


def test_permission_denied(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    path.write_bytes(b"x")
    path.chmod(0)
    if os.geteuid() == 0:  # root reads any file, so let the OS say no the way it would

        def deny(*args, **kwargs):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(os, "open", deny)
    with pytest.raises(PermissionDeniedError, match="secret"):
        ScopedFile(path)
