"""What every benchmark script shares: where results go, when and on which CPU a run was
measured, and the alternation of our side and llama.cpp's within a round.

The suite (``run.py``, ``report.py`` and the scripts whose results the report reads) and
the finished studies in ``experiments/`` import these from here, never from each other's
entry points, so that no script imports the one that imports it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from runtime.executor.weight_cache import survey, user_directory

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
RESULTS = BENCHMARKS / "results"

# CPU flags that decide which matrix kernels XNNPACK and llama.cpp run (one CPU model name
# covers boxes with and without AVX-512), in the order they are printed.
VECTOR_FLAGS = {"avx512f": "AVX-512", "avx512_vnni": "AVX-512 VNNI", "avx_vnni": "AVX-VNNI", "avx2": "AVX2",
                "fma": "FMA", "asimddp": "NEON dot product", "i8mm": "I8MM", "sve": "SVE"}


def cpu_name(cpuinfo: str) -> str:
    """The CPU's model name with the vector extensions its kernels are chosen by, e.g.
    ``AMD EPYC (AVX2, FMA)``, from the text of ``/proc/cpuinfo``."""
    fields = dict(line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    vector = [label for flag, label in VECTOR_FLAGS.items() if flag in flags]
    return f"{name} ({', '.join(vector)})" if vector else name


def date_and_cpu() -> dict[str, str]:
    """When and where a benchmark runs: ``date`` (``2026-12-04 11:30 UTC``) and ``cpu``
    (:func:`cpu_name`), as every result file records them."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": cpu_name(Path("/proc/cpuinfo").read_text())}


def both(ours: Callable[[], Any], theirs: Callable[[], Any], round_index: int) -> tuple[Any, Any]:
    """Runs our measurement and llama.cpp's, ours first in even rounds and second in odd ones."""
    if round_index % 2 == 0:
        mine = ours()
        return mine, theirs()
    other = theirs()
    return ours(), other


def write_result(out: Path, lines: list[str], data: dict[str, Any]) -> None:
    """Writes a result as ``out.md`` (``lines``, a Markdown table and its command) and
    ``out.json`` (``data``), making the folder, and prints the Markdown."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    print("\n".join(lines))


def drop_cached_pages(paths: Iterable[Path]) -> list[Path]:
    """Drops each file's pages from the kernel's page cache (those no process maps), so that a
    run comparing two files reads both afresh, laid out as the kernel lays out a file it reads
    (2 MB folios on Linux 6.18 with ext4), not as hours of other work left one of them: a float32
    step from a model file held in 4 KB pages took 16% longer than from the same file read
    again (docs/kernels.md). Returns the files it dropped; a no-op without ``posix_fadvise``."""
    if not hasattr(os, "posix_fadvise"):
        return []
    dropped = []
    for path in paths:
        with open(path, "rb") as file:
            os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        dropped.append(Path(path))
    return dropped


def model_files(model: Path) -> list[Path]:
    """Our model file and the XNNPACK weight cache files packed from it in the user's directory
    (where an ``Engine`` opened with the default settings reads its packed weights)."""
    directory, source = user_directory(), os.path.realpath(model)
    return [model, *(directory / entry.name for entry in survey(directory).entries if entry.model == source)]
