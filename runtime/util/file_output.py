"""Files written whole or not at all: under a temporary name beside the target, then renamed."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_whole(path: Path, data: bytes | memoryview) -> int:
    """Writes ``data`` to ``path`` under a temporary name beside it, then renamed: a failure
    (a full disk, an interruption) leaves ``path`` as it was and no temporary file behind.
    The file gets the permissions the umask gives a new file. Returns the bytes written."""
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as file:
        temporary = Path(file.name)
        try:
            file.write(data)
        except BaseException:
            temporary.unlink()
            raise
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # a temporary file is private; the output is not
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return len(data)
