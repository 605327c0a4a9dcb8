"""The directory where the runtime keeps files between runs."""

from __future__ import annotations

import os
from pathlib import Path


def runtime_cache_dir() -> Path:
    """``$RUNTIME_CACHE``, else ``$XDG_CACHE_HOME/runtime``, else ``~/.cache/runtime``
    (an unset or empty variable counts as absent)."""
    if os.environ.get("RUNTIME_CACHE"):
        return Path(os.environ["RUNTIME_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "runtime"
