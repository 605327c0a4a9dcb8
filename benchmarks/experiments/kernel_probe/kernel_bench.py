"""The decode-attention kernel alone on cold caches, against a plain read of the same bytes,
for work on the kernel itself: this checkout's source and, beside it, another version.

    python3 -m benchmarks.experiments.kernel_probe.kernel_bench [--baseline REV] [--span 4096] \
        [--positions 1000,2000,3000,4095] [--rounds 5] [--flags=-mavx2,-mfma]

Builds ``kernel_bench.c`` around ``runtime/executor/kernels/decode_attention.c`` (and around
the file as it is at git revision ``--baseline``, e.g. ``HEAD``) with the compiler and flags
the runtime builds the kernel with (or the ISA flags ``--flags`` gives, comma-separated:
``--flags=-mavx2,-mfma`` measures the AVX2 build on an AVX-512 machine; ``--flags=`` the plain
one), then runs each build in alternating rounds per position
(each run: best of 15 calls of 30 layers at SmolLM2-135M's shapes, 1 GiB read before each).
Prints ms per 30 layers, the read loop's GB/s and each build's time as a share of the read
loop's (100%: the kernel reads as fast as a loop that only reads).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

from runtime.executor import kernels

ROOT = Path(__file__).resolve().parents[3]
HARNESS = Path(__file__).with_name("kernel_bench.c")
SOURCE = ROOT / "runtime" / "executor" / "kernels" / "decode_attention.c"
LAYERS, GROUPS, HEAD_DIM = 30, 3, 64


def build(source: Path, out: Path, flags: tuple[str, ...]) -> Path:
    """The harness around ``source``, built as the runtime builds the kernel, with ``flags``."""
    cc = kernels.compiler()
    if cc is None:
        raise SystemExit("no C compiler (cc or gcc; $CC)")
    subprocess.run([cc, "-O3", "-fno-math-errno", *flags, f'-DKERNEL="{source}"', str(HARNESS), "-o", str(out), "-lm"],
                   check=True)
    return out


def run(binary: Path, span: int, position: int) -> tuple[float, float]:
    """(kernel ms, read-loop ms) of one run."""
    done = subprocess.run([str(binary), str(span), str(position)], capture_output=True, text=True, check=True)
    kernel_ms, read_ms = (float(x) for x in done.stdout.split())
    return kernel_ms, read_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="a git revision whose kernel source runs beside this checkout's")
    parser.add_argument("--span", type=int, default=4096, help="positions in each cache")
    parser.add_argument("--positions", default="1000,2000,3000,4095")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--flags", help="ISA flags, comma-separated, instead of this CPU's (kernels.isa_flags())")
    args = parser.parse_args()
    flags = kernels.isa_flags() if args.flags is None else tuple(f for f in args.flags.split(",") if f)
    with tempfile.TemporaryDirectory() as scratch:
        builds = {"this checkout": build(SOURCE, Path(scratch) / "current", flags)}
        if args.baseline:
            old = Path(scratch) / "baseline.c"
            old.write_bytes(subprocess.run(["git", "show", f"{args.baseline}:{SOURCE.relative_to(ROOT)}"], cwd=ROOT,
                                           capture_output=True, check=True).stdout)
            builds[args.baseline] = build(old, Path(scratch) / "baseline", flags)
        print(f"flags {' '.join(flags) or '(none)'}; {args.rounds} alternating rounds; medians")
        print("| position | MB read | read loop ms (GB/s) | " + " | ".join(f"{name} ms (share of read rate)"
                                                                    for name in builds) + " |")
        print("|---:|---:|---:|" + "---:|" * len(builds))
        for position in (int(p) for p in args.positions.split(",")):
            kernel_ms: dict[str, list[float]] = {name: [] for name in builds}
            read_ms: list[float] = []
            for round_ in range(args.rounds):
                for name in (list(builds) if round_ % 2 == 0 else list(reversed(builds))):
                    k, r = run(builds[name], args.span, position)
                    kernel_ms[name].append(k)
                    read_ms.append(r)
            mb = 2 * LAYERS * GROUPS * HEAD_DIM * 4 * (position + 1) / 1e6
            read = statistics.median(read_ms)
            cells = " | ".join(f"{statistics.median(ms):.2f} ({100 * read / statistics.median(ms):.0f}%)"
                               for ms in kernel_ms.values())
            print(f"| {position} | {mb:.1f} | {read:.2f} ({mb / read:.1f}) | {cells} |")


if __name__ == "__main__":
    main()
