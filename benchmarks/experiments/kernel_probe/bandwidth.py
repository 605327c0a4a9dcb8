#!/usr/bin/env python3
"""This machine's read bandwidth on one thread: numpy's sum and a C loop (gcc -O3
-march=native, 4 independent vector sums) over arrays of several sizes, each timed as the
best of a few passes after a warm-up pass (the largest is past any cache; the others are
the sizes of SmolLM2-135M's 30 layers of caches at 128, 1,024 and 4,096 positions).

    python3 -m benchmarks.experiments.kernel_probe.bandwidth [--sizes-mb 5.9,47.2,188.7,1024] [--passes 5]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

C = r"""
#include <stddef.h>
typedef float v16 __attribute__((vector_size(64), aligned(64)));
float read_all(const float *p, size_t n) {
  v16 a = {0}, b = {0}, c = {0}, d = {0};
  for (size_t i = 0; i + 64 <= n; i += 64) {
    a += *(const v16 *)(p + i); b += *(const v16 *)(p + i + 16);
    c += *(const v16 *)(p + i + 32); d += *(const v16 *)(p + i + 48);
  }
  v16 s = a + b + c + d; float t = 0; for (int i = 0; i < 16; i++) t += s[i]; return t;
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="5.9,47.2,188.7,1024")
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bandwidth_"))
    (folder / "read.c").write_text(C)
    subprocess.run(["gcc", "-O3", "-march=native", "-shared", "-fPIC", str(folder / "read.c"), "-o",
                    str(folder / "read.so")], check=True)
    read_all = ctypes.CDLL(str(folder / "read.so")).read_all
    read_all.restype, read_all.argtypes = ctypes.c_float, [ctypes.c_void_p, ctypes.c_size_t]
    print("| MB | numpy sum GB/s (best / median) | C loop GB/s (best / median) |")
    print("|---:|---:|---:|")
    for mb in (float(x) for x in args.sizes_mb.split(",")):
        raw = np.ones(int(mb * 1e6) // 4 + 64, np.float32)
        a = raw[(-raw.ctypes.data % 64) // 4:][: int(mb * 1e6) // 4 // 64 * 64]
        rows = []
        for how in ("numpy", "c"):
            rates = []
            for p in range(args.passes + 1):
                start = time.perf_counter()
                a.sum() if how == "numpy" else read_all(a.ctypes.data, a.size)
                took = time.perf_counter() - start
                if p:
                    rates.append(a.nbytes / took / 1e9)
            rates.sort()
            rows.append(f"{rates[-1]:.1f} / {rates[len(rates) // 2]:.1f}")
        print(f"| {mb:g} | {rows[0]} | {rows[1]} |", flush=True)


if __name__ == "__main__":
    main()
