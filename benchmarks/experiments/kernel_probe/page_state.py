"""Runs a benchmark module with a model's files first put in the page cache in 4 KB pages, the
state a file written by XNNPACK or `runtime export` or read in scattered order is left in, with
the runtime's re-reading in 2 MB pages at open (``on``) or without it (``off``).

    python3 -m benchmarks.experiments.kernel_probe.page_state on|off MODEL.tflite MODULE [ARGS...]

e.g. ``page_state off ~/.cache/runtime/models/s72/b8-int8.tflite benchmarks.experiments.batch_cost
~/.cache/runtime/models/s72/b8-int8.tflite --positions 0,128 --rounds 3 --on-threads``, then the
same with ``on``, alternating. The model file and its XNNPACK weight-cache files
(``$RUNTIME_CACHE/xnnpack/<model's stem>.*.xnnpack``) have their cached pages dropped
(``posix_fadvise(DONTNEED)``) and read back one 4 KB page at a time in random order; ``off``
replaces ``runtime.util.page_advice``'s two entry points, as the executor and the weight cache
call them, with ones that do nothing. The runtime's INFO log (what it read again) is printed.
"""

from __future__ import annotations

import logging
import os
import random
import runpy
import sys
from pathlib import Path

from runtime.util.cache_dir import runtime_cache_dir


def in_small_pages(path: Path) -> None:
    """``path``'s cached pages dropped and read back one page at a time, out of order."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        offsets = list(range(0, os.fstat(fd).st_size, os.sysconf("SC_PAGE_SIZE")))
        random.Random(0).shuffle(offsets)
        for offset in offsets:
            os.pread(fd, 1, offset)
    finally:
        os.close(fd)


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[1] not in ("on", "off"):
        raise SystemExit(__doc__)
    mode, model, module, *args = sys.argv[1:]
    model_path = Path(model).expanduser()
    files = [model_path, *sorted((runtime_cache_dir() / "xnnpack").glob(f"{model_path.stem}.*.xnnpack"))]
    for path in files:
        in_small_pages(path)
    print(f"in 4 KB pages: {', '.join(str(path) for path in files)}; re-reading at open {mode}", flush=True)
    if mode == "off":
        from runtime.executor import litert_executor, weight_cache
        litert_executor.read_again_in_huge_pages = lambda path: None
        weight_cache.read_again_in_huge_pages = lambda path: None
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__")


if __name__ == "__main__":
    main()
