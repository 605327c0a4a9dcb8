"""Command-line options that several commands share, spelled and explained once."""

from __future__ import annotations

import argparse
import importlib
import os
from pathlib import Path
from types import ModuleType

from runtime.errors import FailedPreconditionError
from runtime.executor.weight_cache import WeightCacheDir


def add_weight_cache_dir(parser: argparse.ArgumentParser) -> None:
    """``--weight-cache-dir DIR`` / ``--no-weight-cache``: ``EngineSettings.weight_cache_dir``."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--weight-cache-dir", type=Path, metavar="DIR", default=WeightCacheDir.USER,
                       help="keep the model's packed weights in DIR between runs: the first run writes about the "
                       "model's size there, later runs open the model faster and decode faster where the file "
                       "system maps large pages (default: ~/.cache/runtime/xnnpack, or $RUNTIME_CACHE/xnnpack, "
                       "where a file can be written there)")
    where.add_argument("--no-weight-cache", dest="weight_cache_dir", action="store_const", const=None,
                       help="pack the model's weights in memory at every start, writing no file")


def import_export_module(name: str, command: str, needs: str) -> ModuleType:
    """``runtime.export.<name>``, imported when ``command`` needs it (it pulls in torch);
    without the export extra a FailedPreconditionError naming ``needs`` and the install line."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # sources are local; never wait on the hub
    try:
        return importlib.import_module(f"runtime.export.{name}")
    except ImportError as exc:
        raise FailedPreconditionError(
            f"{command} needs the export extra ({needs}): pip install -e \".[export]\" ({exc})") from None
