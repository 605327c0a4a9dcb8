"""The directory where the runtime keeps files between runs."""

from __future__ import annotations

import os
from pathlib import Path


def runtime_cache_dir() -> Path:
    """``$RUNTIME_CACHE``, else ``$XDG_CACHE_HOME/runtime``, else ``~/.cache/runtime``
    (an unset or empty variable counts as absent, and so does a relative
    ``$XDG_CACHE_HOME``, which the XDG Base Directory specification says to ignore: the
    cache would move with the working directory, the kernels built again in each one)."""
    if os.environ.get("RUNTIME_CACHE"):
        return Path(os.environ["RUNTIME_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "runtime"
