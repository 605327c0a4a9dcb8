#!/usr/bin/env python3
"""Two compiled models of one file built at once against one weight cache file that does
not exist yet (route b's worst case: two signature groups compiled concurrently, cold).

    python3 -m benchmarks.experiments.open_probe.concurrent --model M.tflite --group prefill_32,decode \\
        --group prefill_128

Each group opens on its own thread over its own view, both naming the same fresh cache
path; then a third open of the whole model maps the file. Prints each open's time and
status, the file's size, and whether the third open's decode logits equal those of a
model packed in memory (a torn or mixed file would show there).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.experiments.open_probe import steps, views


def decode_logits(model_bytes: np.ndarray | memoryview, cache: str) -> np.ndarray:
    """Logits of one decode step (token 42 at position 0, zero caches) of ``model_bytes``."""
    from runtime.executor.native import HostBuffer, NativeModel

    model = NativeModel(model_bytes, num_threads=1, weight_cache=cache, name="probe")
    sig = model.signatures["decode"]
    ins = {k: HostBuffer(i) for k, i in sig.inputs.items()}
    outs = {k: HostBuffer(i) for k, i in sig.outputs.items()}
    ins["tokens"].write(np.full(ins["tokens"].info.shape, 42))
    run = model.prepare(sig.index, list(ins.values()), list(outs.values()))
    model.run(run)
    logits = outs["logits"].array.copy()
    model.close()
    return logits


def main() -> None:
    """Builds concurrently, then checks the file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--group", action="append", required=True)
    parser.add_argument("--scratch", default=os.path.expanduser("~/.cache/runtime/models/open_probe"))
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="open_probe_concurrent_", dir=args.scratch))
    cache = str(folder / "shared.xnnpack")
    results: dict[str, str] = {}

    def build(keys: list[str]) -> None:
        start = time.perf_counter()
        try:
            view = views.subset_view(args.model, keys)
            opened = steps.open_model(view.array, cache)
            results[",".join(keys)] = f"opened in {(time.perf_counter() - start) * 1e3:.0f} ms"
            opened.close()
        except Exception as exc:  # noqa: BLE001 - reported, not raised: the probe's finding
            results[",".join(keys)] = f"failed after {(time.perf_counter() - start) * 1e3:.0f} ms: {exc}"

    threads = [threading.Thread(target=build, args=(g.split(","),)) for g in args.group]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for group, text in results.items():
        print(f"group {group}: {text}")
    size = os.path.getsize(cache) if os.path.exists(cache) else 0
    print(f"cache file after: {size / 1e6:.1f} MB; files in the folder: {sorted(p.name for p in folder.iterdir())}")
    whole = memoryview(steps.map_file(args.model))
    try:
        shared = decode_logits(whole, cache)
        packed = decode_logits(whole, ":memory:")
        print(f"whole model on the shared file: decode logits max |diff| vs in-memory packing "
              f"{float(np.abs(shared - packed).max()):.3g}")
    except Exception as exc:  # noqa: BLE001
        print(f"whole model on the shared file failed: {exc}")
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()


if __name__ == "__main__":
    main()
