"""The directory where the runtime keeps files between runs."""

from __future__ import annotations

import os
from pathlib import Path

from runtime.errors import FailedPreconditionError


def runtime_cache_dir() -> Path:
    """``$RUNTIME_CACHE``, else ``$XDG_CACHE_HOME/runtime``, else ``~/.cache/runtime``
    (an unset or empty variable counts as absent, and so does a relative
    ``$XDG_CACHE_HOME``, which the XDG Base Directory specification says to ignore: the
    cache would move with the working directory, the kernels built again in each one).
    ``FailedPreconditionError`` when neither variable is set and this user has no home
    directory (no ``$HOME`` and no passwd entry: a container run under an arbitrary uid)."""
    if os.environ.get("RUNTIME_CACHE"):
        return Path(os.environ["RUNTIME_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "runtime"
    try:
        home = Path.home()
    except RuntimeError:  # what Python raises where "~" does not expand
        raise FailedPreconditionError("no cache directory for the runtime: $RUNTIME_CACHE and $XDG_CACHE_HOME are "
                                      "unset and this user has no home directory ($HOME unset, no passwd entry); "
                                      "set RUNTIME_CACHE to a directory") from None
    return home / ".cache" / "runtime"


def foreign_writer(path: Path, status: os.stat_result | None = None) -> str | None:
    """Why another user could have written ``path`` (its ``status``, else stat'ed here): owned
    by another user (root aside), or writable by everyone; ``None`` when only this user (or
    root) could have, where ``path`` cannot be stat'ed (absent: nothing to trust), and where
    files have no POSIX owners.
    What the cache holds is loaded as code (the kernels) or read by XNNPACK as its own packed
    weights, so a cache directory other users write into, as one under ``/tmp`` may be, is
    not trusted."""
    if not hasattr(os, "geteuid"):
        return None
    try:
        status = status or path.stat()
    except OSError:  # absent or not reachable: nothing there to trust, and its use says why it fails
        return None
    me = os.geteuid()
    if status.st_uid not in (me, 0):
        return f"{path} belongs to user id {status.st_uid}, not to this user ({me})"
    if status.st_mode & 0o002:
        return f"{path} is writable by every user (mode {status.st_mode & 0o7777:o})"
    return None
