"""Command-line options that several commands share, spelled and explained once."""

from __future__ import annotations

import argparse
import importlib
import os
from pathlib import Path
from types import ModuleType
from typing import Any

from runtime.errors import FailedPreconditionError, InvalidArgumentError
from runtime.executor.weight_cache import MAX_SIZE_ENV, WeightCacheDir, parse_size


def add_weight_cache_dir(parser: argparse.ArgumentParser) -> None:
    """``--weight-cache-dir DIR`` / ``--no-weight-cache``: ``EngineSettings.weight_cache_dir``;
    ``--weight-cache-max-size SIZE``: ``EngineSettings.weight_cache_max_bytes``."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--weight-cache-dir", type=Path, metavar="DIR", default=WeightCacheDir.USER,
                       help="keep the model's packed weights in DIR between runs: the first run writes about the "
                       "model's size there, later runs open the model faster and decode faster where the file "
                       "system maps large pages (default: ~/.cache/runtime/xnnpack, or $RUNTIME_CACHE/xnnpack, "
                       "where a file can be written there)")
    where.add_argument("--no-weight-cache", dest="weight_cache_dir", action="store_const", const=None,
                       help="pack the model's weights in memory at every start, writing no file")
    parser.add_argument("--weight-cache-max-size", type=_size, metavar="SIZE", dest="weight_cache_max_bytes",
                        default=argparse.SUPPRESS,
                        help="the most the weight cache directory keeps (500M, 5G or 'unlimited'): files of deleted "
                        "models go, then the least recently used files no process has open (default: "
                        f"${MAX_SIZE_ENV}, else 5G)")


def add_compile_mode(parser: argparse.ArgumentParser) -> None:
    """``--compile on-demand|all``: ``EngineSettings.compile``."""
    parser.add_argument("--compile", choices=("on-demand", "all"), default="on-demand",
                        help="on-demand (default): compile at start only the signatures of a short prompt without "
                        "an adapter (decode, the shortest prefill), and each other group (a longer prefill's, a LoRA "
                        "rank slot's, verify, score, a batch size's) when a session first needs it; all: compile "
                        "every signature at start (a slower start, no first-use pause)")


def weight_cache_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineSettings`` fields that :func:`add_weight_cache_dir`'s options set."""
    given = {"weight_cache_dir": args.weight_cache_dir}
    if hasattr(args, "weight_cache_max_bytes"):  # else EngineSettings' default: the environment's, or 5 GiB
        given["weight_cache_max_bytes"] = args.weight_cache_max_bytes
    return given


def _size(text: str) -> int | None:
    try:
        return parse_size(text, "--weight-cache-max-size")
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def import_export_module(name: str, command: str, needs: str) -> ModuleType:
    """``runtime.export.<name>``, imported when ``command`` needs it (it pulls in torch);
    without the export extra a FailedPreconditionError naming ``needs`` and the install line."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # sources are local; never wait on the hub
    try:
        return importlib.import_module(f"runtime.export.{name}")
    except ImportError as exc:
        raise FailedPreconditionError(
            f"{command} needs the export extra ({needs}): pip install -e \".[export]\" ({exc})") from None
