"""The decode-attention kernel alone on cold caches, against a plain read of the same bytes,
for work on the kernel itself: this checkout's source and, beside it, another version.

    python3 -m benchmarks.experiments.kernel_probe.kernel_bench [--baseline REV] [--span 4096] \
        [--positions 1000,2000,3000,4095] [--rounds 5] [--flags=-mavx2,-mfma,-mf16c] [--dtype f32,f16] \
        [--out PATH]

Builds ``kernel_bench.c`` around ``runtime/executor/kernels/decode_attention.c`` (and around
the file as it is at git revision ``--baseline``, e.g. ``HEAD``) with the compiler and flags
the runtime builds the kernel with for this CPU, its tuning included (or the flags ``--flags``
gives, comma-separated: ``--flags=-mavx2,-mfma,-mf16c`` measures the AVX2 build on an AVX-512
machine, ``--flags=-mavx2,-mfma,-mf16c,-DK_STREAMS_f32=4`` the AVX2 box's; ``--flags=`` the plain
one), then runs each build on caches of each ``--dtype`` (f32, f16 or both) in
alternating rounds per position
(each run: best of 15 calls of 30 layers at SmolLM2-135M's shapes, 1 GiB read before each).
Prints ms per 30 layers, the read loop's GB/s over that cache type's bytes and each build's
time as a share of the read loop's (100%: the kernel reads as fast as a loop that only reads),
and the same against a loop reading the bytes as four interleaved streams (each group's K span
in four stretches, V four rows at once: the most one core reads on the AVX2 box, ~1.9x one
stream).
``--out PATH`` also writes the table as ``PATH.md`` and every round as ``PATH.json``; the
report (``benchmarks/report.py``) judges issue 53's ">= 70% of the machine's read bandwidth from
1k to 4k positions" from ``kernel_bench_smollm2.json`` (this checkout's build, the runtime's
flags), against the faster of the two loops.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import date_and_cpu, write_result
from runtime.executor import kernels

ROOT = Path(__file__).resolve().parents[3]
HARNESS = Path(__file__).with_name("kernel_bench.c")
SOURCE = ROOT / "runtime" / "executor" / "kernels" / "decode_attention.c"
LAYERS, GROUPS, HEAD_DIM = 30, 3, 64
BYTES = {"f32": 4, "f16": 2}  # a cache element's


def build(source: Path, out: Path, flags: tuple[str, ...]) -> Path:
    """The harness around ``source``, built as the runtime builds the kernel, with ``flags``."""
    cc = kernels.compiler()
    if cc is None:
        raise SystemExit("no C compiler (cc or gcc; $CC)")
    subprocess.run([cc, "-O3", "-fno-math-errno", *flags, f'-DKERNEL="{source}"', str(HARNESS), "-o", str(out), "-lm"],
                   check=True)
    return out


def revision_file(revision: str, path: Path, missing_ok: bool = False) -> bytes:
    """``path`` as it is at git ``revision`` (b"" when it is not there and ``missing_ok``)."""
    done = subprocess.run(["git", "show", f"{revision}:{path.relative_to(ROOT)}"], cwd=ROOT, capture_output=True)
    if done.returncode and not missing_ok:
        raise SystemExit(f"--baseline {revision}: {done.stderr.decode().strip()}")
    return done.stdout if done.returncode == 0 else b""


def run(binary: Path, span: int, position: int, dtype: str) -> tuple[float, float, float]:
    """(kernel ms, read-loop ms, four-stream read-loop ms) of one run on caches of ``dtype``."""
    done = subprocess.run([str(binary), str(span), str(position), "15", dtype], capture_output=True, text=True,
                          check=True)
    kernel_ms, read_ms, read4_ms = (float(x) for x in done.stdout.split())
    return kernel_ms, read_ms, read4_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="a git revision whose kernel source runs beside this checkout's")
    parser.add_argument("--span", type=int, default=4096, help="positions in each cache")
    parser.add_argument("--positions", default="1000,2000,3000,4095")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--flags", help="compiler flags, comma-separated, instead of the runtime's for this CPU "
                        "(kernels.isa_flags() and kernels.tuning_flags())")
    parser.add_argument("--dtype", default="f32", help="the caches' element type: f32, f16 or both, comma-separated")
    parser.add_argument("--out", type=Path, help="also write the table as PATH.md and the rounds as PATH.json")
    args = parser.parse_args()
    dtypes = args.dtype.split(",")
    if not dtypes or not set(dtypes) <= set(BYTES):
        parser.error(f"--dtype {args.dtype}: expected f32, f16 or f32,f16")
    flags = (*kernels.isa_flags(), *kernels.tuning_flags()) if args.flags is None else \
        tuple(f for f in args.flags.split(",") if f)
    with tempfile.TemporaryDirectory() as scratch:
        builds = {"this checkout": build(SOURCE, Path(scratch) / "current", flags)}
        if args.baseline:
            old = Path(scratch) / "baseline.c"
            old.write_bytes(revision_file(args.baseline, SOURCE))
            header = SOURCE.with_name("kernel_api.h")  # the header the source includes (none before it existed)
            if text := revision_file(args.baseline, header, missing_ok=True):
                (Path(scratch) / header.name).write_bytes(text)
            builds[args.baseline] = build(old, Path(scratch) / "baseline", flags)
        lines = [f"flags {' '.join(flags) or '(none)'}; {args.rounds} alternating rounds; medians", "",
                 "| position | caches | MB read | read loop ms (GB/s) | four streams ms (GB/s) | "
                 + " | ".join(f"{name} ms (share of the read loop's rate / of four streams')" for name in builds)
                 + " |", "|---:|---|---:|---:|---:|" + "---:|" * len(builds)]
        rows = []
        runs = [(name, dtype) for dtype in dtypes for name in builds]
        for position in (int(p) for p in args.positions.split(",")):
            kernel_ms: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
            read_ms: dict[str, list[float]] = {dtype: [] for dtype in dtypes}
            read4_ms: dict[str, list[float]] = {dtype: [] for dtype in dtypes}
            for round_ in range(args.rounds):
                for name, dtype in (runs if round_ % 2 == 0 else list(reversed(runs))):
                    k, r, r4 = run(builds[name], args.span, position, dtype)
                    kernel_ms[name, dtype].append(k)
                    read_ms[dtype].append(r)
                    read4_ms[dtype].append(r4)
            for dtype in dtypes:
                mb = 2 * LAYERS * GROUPS * HEAD_DIM * BYTES[dtype] * (position + 1) / 1e6
                read, read4 = statistics.median(read_ms[dtype]), statistics.median(read4_ms[dtype])
                medians = {name: statistics.median(kernel_ms[name, dtype]) for name in builds}
                cells = " | ".join(f"{ms:.2f} ({100 * read / ms:.0f}% / {100 * read4 / ms:.0f}%)"
                                   for ms in medians.values())
                lines.append(f"| {position} | {dtype} | {mb:.1f} | {read:.2f} ({mb / read:.1f}) | {read4:.2f} "
                             f"({mb / read4:.1f}) | {cells} |")
                print(f"position {position}, {dtype}: done", file=sys.stderr, flush=True)
                rows.append({"position": position, "dtype": dtype, "mb": mb, "read_ms": read_ms[dtype],
                             "read4_ms": read4_ms[dtype], "kernel_ms": {name: kernel_ms[name, dtype] for name in builds}})
    if args.out:
        lines += ["", "Command: `python3 -m benchmarks.experiments.kernel_probe.kernel_bench "
                  + " ".join(sys.argv[1:]) + "`"]
        write_result(args.out, lines, {"flags": list(flags), "span": args.span, "rounds": args.rounds, "rows": rows,
                                       **date_and_cpu()})
    else:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
