"""Command-line options that several commands share, spelled and explained once."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_weight_cache_dir(parser: argparse.ArgumentParser) -> None:
    """``--weight-cache-dir DIR``: ``EngineSettings.weight_cache_dir``."""
    parser.add_argument("--weight-cache-dir", type=Path, metavar="DIR",
                        help="keep the model's packed weights in DIR between runs: the first run writes about the "
                        "model's size there, later runs open the model faster (default: packed at every start)")
