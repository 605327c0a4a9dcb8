"""kernels.c compiled with gcc at run time into a temporary shared library (linked
against the wheel's libLiteRt.so, so it calls the library's tensor-buffer functions),
and its functions as :class:`custom_ops.Kernel` s."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import tempfile
from pathlib import Path

from .custom_ops import Kernel, litert_path

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-shared", "-fPIC"]


class Counters(ctypes.Structure):
    _fields_ = [("inits", ctypes.c_int64), ("layouts", ctypes.c_int64), ("runs", ctypes.c_int64),
                ("destroys", ctypes.c_int64)]


def compile_library(folder: str | None = None) -> ctypes.CDLL:
    """Builds kernels.c; ``RuntimeError`` with gcc's message when it fails or is missing."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise RuntimeError("no C compiler on PATH")
    lib_dir = str(Path(litert_path()).parent)
    out = Path(folder or tempfile.mkdtemp(prefix="kernel_probe_")) / "kernels.so"
    command = [gcc, *FLAGS, str(SOURCE), "-o", str(out), f"-L{lib_dir}", "-l:libLiteRt.so", f"-Wl,-rpath,{lib_dir}", "-lm"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")
    return ctypes.CDLL(str(out))


def kernel(library: ctypes.CDLL, name: str, run: str, counters: Counters | None = None) -> Kernel:
    """The op ``name`` whose Run is ``run`` of the library, with the probes' other callbacks."""
    address = lambda symbol: ctypes.cast(getattr(library, symbol), ctypes.c_void_p).value  # noqa: E731
    return Kernel(name, address("probe_init"), address("probe_layouts"), address(run), address("probe_destroy"),
                  ctypes.addressof(counters) if counters is not None else 0, keep=(library, counters))
