"""Tests for runtime.util.cache_dir: where the runtime keeps files between runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.errors import FailedPreconditionError
from runtime.util.cache_dir import runtime_cache_dir


@pytest.mark.parametrize("runtime_cache, xdg, expected", [
    ("/srv/cache", "/xdg", "/srv/cache"),
    ("", "/xdg", "/xdg/runtime"),
    (None, None, "~/.cache/runtime"),
    # A relative $XDG_CACHE_HOME is to be ignored (XDG Base Directory specification): it put
    # the cache, the kernels' builds and packed weights, under each working directory.
    (None, "relative/cache", "~/.cache/runtime"),
])
def test_the_cache_directory_comes_from_the_environment(runtime_cache, xdg, expected, monkeypatch):
    for name, value in (("RUNTIME_CACHE", runtime_cache), ("XDG_CACHE_HOME", xdg)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert runtime_cache_dir() == Path(expected).expanduser()


def test_without_a_home_the_cache_directory_is_refused_saying_what_to_set(without_home):
    with pytest.raises(FailedPreconditionError, match=r"no cache directory .* set RUNTIME_CACHE"):
        runtime_cache_dir()
