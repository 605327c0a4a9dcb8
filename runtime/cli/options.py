"""Command-line options that several commands share, spelled and explained once."""

from __future__ import annotations

import argparse
from pathlib import Path

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
