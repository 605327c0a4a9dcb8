"""Custom-op kernels of ours that run inside a LiteRT graph: compiled on this machine from
the C source shipped beside this file, registered on a compiled model through LiteRT's C
API (``LiteRtAddCustomOpKernelOption``), every node of theirs checked before the model
compiles.

Three ops, compiled into one library: ``odml_runtime.decode_attention``
(``decode_attention.c``), which ``runtime export`` (or ``tools/attention_kernel.py`` on an
existing export) puts beside each layer's decode attention in standard ops
(``--attention-kernel auto``, the default: :func:`attention_form_here` decides at open which
form runs) or in its place (``native``) (:mod:`runtime.util.attention_rewrite`);
``odml_runtime.lora_delta`` (``lora_delta.c``), which the same pass puts in the op form in
place of each decode LoRA delta's two matmuls; and ``odml_runtime.linear_rows``
(``linear_rows.c``), in place of the decode signatures' float32 linear layers. The
library is built at first use with the system C compiler (``$CC``, else ``cc``, else ``gcc``) into the runtime's cache directory,
named by the sources' hash, the compiler's version and the flags, written under a
temporary name and renamed (processes building at once each write their own and one
rename wins); later opens load it. No binary is shipped.

What LiteRT does with a custom op (2.3; benchmarks/experiments/kernel_probe/README.md):
``Init`` per node at compile, ``GetOutputLayouts`` at a signature's first run, ``Run``
per invoke on the thread that invoked, with buffer handles for the node's tensors; the
status ``Run`` returns is ignored, so a failure is written to an error word in the
context ``user_data`` points to (one per compiled model) and read after each run. A
model whose op has no kernel opens and fails only at its signature's first run, so
:func:`attach` refuses it at open instead, as it does a node whose shapes the kernel
would misread.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from runtime.errors import FailedPreconditionError, InternalError, InvalidArgumentError
from runtime.util.attention_rewrite import DECODE_ATTENTION, LINEAR_ROWS, LORA_DELTA, OUR_OPS, custom_codes
from runtime.util.cache_dir import foreign_writer, runtime_cache_dir

log = logging.getLogger(__name__)

_P = ctypes.c_void_p
# LiteRtElementType: the KV caches' and LoRA factors' types the kernels read (the rest: float32).
_FLOAT32, _FLOAT16 = 1, 10
# Compiled together into one library (one build, one load, one cache entry for both ops),
# with the header both include (the LiteRT types, the context, the failure protocol).
_SOURCES = ("decode_attention.c", "lora_delta.c", "linear_rows.c")
_HEADERS = ("kernel_api.h",)
# -O3 and the vector extensions this CPU has (never -march=native: the file is keyed by
# these flags, so a cache directory shared by machines of other CPUs keeps one per set).
_BASE_FLAGS = ("-O3", "-fno-math-errno", "-fPIC", "-shared", "-Wno-psabi")
# OpenMP for linear_rows's threads where the compiler has it (GCC's libgomp); the library is
# built without it where it does not, and runs the op on one thread.
_OPENMP = "-fopenmp"
# How often libgomp's threads look for work before they sleep (its default: 300,000).
_OPENMP_SPIN_COUNT = "1000"
# The error word's codes (kernel_api.h's), per op.
_FAILURES = {1: "the op's inputs and outputs are not the 5 and 1 it takes",
             2: "LiteRT gave no host memory or type for a tensor buffer",
             3: "the tensors' shapes do not fit q [1, G, H, D], mask [T], K [1, G, T, D], V [1, G, D, T]",
             4: "a tensor is not float32 (K and V: both float32 or both float16)", 5: "no memory for the scores"}
_LORA_FAILURES = {1: "the op's inputs and outputs are not the 3 and 1 it takes",
                  2: "LiteRT gave no host memory or type for a tensor buffer",
                  3: "the tensors' shapes do not fit x [..., in] by A [in, r] and B [r, out] "
                     "(or x [N, M, in] by A [N, in, r] and B [N, r, out])",
                  4: "x or the output is not float32, or A and B are not both float32 or both float16 (a "
                     "compiler without _Float16 builds a float32 kernel alone)"}
_LINEAR_FAILURES = {1: "the op's inputs and outputs are not the 2 and 1 it takes",
                    2: "LiteRT gave no host memory or type for a tensor buffer",
                    3: "the tensors' shapes do not fit x [..., K] by W [N, K] into [..., N]",
                    4: "a tensor is not float32"}
# Per op: the prefix of its callbacks in the library, and what its error codes mean.
_KERNELS = {DECODE_ATTENTION: ("attention", _FAILURES), LORA_DELTA: ("lora", _LORA_FAILURES),
            LINEAR_ROWS: ("linear", _LINEAR_FAILURES)}
RE_EXPORT = ("re-export with --attention-kernel auto (the default: both forms, the standard one run where the kernel "
             "cannot be) or xnnpack")
# Each op's callbacks in the library: {prefix}_{part}.
_PARTS = ("init", "layouts", "run", "destroy")
_SYMBOLS = tuple(f"{prefix}_{part}" for prefix, _ in _KERNELS.values() for part in _PARTS)


class _Context(ctypes.Structure):
    """What ``user_data`` points to (``Context`` in kernel_api.h)."""

    _fields_ = [("error", ctypes.c_int64), ("host_memory", _P), ("tensor_type", _P), ("size", _P),
                ("threads", ctypes.c_int64)]


class _KernelStruct(ctypes.Structure):
    """``LiteRtCustomOpKernel``: four function pointers, copied by the library."""

    _fields_ = [("init", _P), ("get_output_layouts", _P), ("run", _P), ("destroy", _P)]


@dataclass(frozen=True)
class CustomNode:
    """A CUSTOM op of a model: where it is, its code, and its inputs' and outputs' element
    types and shapes as the library reads them (None: unranked)."""

    subgraph: int
    index: int
    code: str
    inputs: tuple
    outputs: tuple


def _first_cpu() -> dict[str, str]:
    """The first processor's fields in Linux's /proc/cpuinfo (``flags``, ``vendor_id``, ``cpu
    family``, ...); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def isa_flags() -> tuple[str, ...]:
    """The vector-extension flags for this CPU (Linux's /proc/cpuinfo; none elsewhere):
    AVX-512 or AVX2, with FMA, and F16C where listed beside them (every AVX2 CPU has it: its
    vcvtph2ps reads float16 caches 8 at a time; without it they take integer steps)."""
    have = set(_first_cpu().get("flags", "").split())
    if {"avx512f", "avx2", "fma"} <= have:
        vector = ("-mavx512f", "-mavx2", "-mfma")
    elif {"avx2", "fma"} <= have:
        vector = ("-mavx2", "-mfma")
    else:
        return ()
    return (*vector, "-mf16c") if "f16c" in have else vector


# Defines that tune the kernels to a core, by (vendor_id, cpu family). The attention kernel's
# (decode_attention.c), measured with kernel_bench --baseline at SmolLM2's shapes, 128 to 4,095
# positions:
# - K_STREAMS_f32, how many stretches of a span the K pass over float32 caches reads at once (1
#   unless given): AMD Zen 2 (family 23), four 0.91-0.93x the time of one; AMD Zen 4 (family 25)
#   keeps one (two 1.06-1.14x its time, four 1.28-1.35x).
# The linear layers' op (linear_rows.c), with AVX-512:
# - ONE_ROW_OUTS_16=4, four rows of W at a time for one row of x (3 unless given): AMD Zen 4,
#   0.87-0.99x the time over SmolLM2's 151 linears (linear_rows_bench).
# Both:
# - AHEAD_INTO_L2=1, the streams' lines asked into the second-level cache, not the first: AMD
#   Zen 4, the 151 linears over 8 rows 0.64-0.78x the time (one row keeps the first level), the
#   attention op over float32 caches 0.65x at 128 positions to 0.94x at 4,095 (against no
#   prefetches, which beat the first level's there), over float16 ones 0.78-0.86x (kernel_api.h).
# Zen 3, AMD family 25 too, is not measured.
# The Intel Xeon AVX-512 box's figures (docs/kernels.md) were measured with the defaults.
_TUNING_BY_CPU = {
    ("AuthenticAMD", "23"): ("-DK_STREAMS_f32=4",),
    ("AuthenticAMD", "25"): ("-DONE_ROW_OUTS_16=4", "-DAHEAD_INTO_L2=1"),
}


def tuning_flags() -> tuple[str, ...]:
    """Defines that tune the kernels to this CPU's cores (``_TUNING_BY_CPU``); none where the
    sources' defaults are the faster or nothing was measured."""
    cpu = _first_cpu()
    return _TUNING_BY_CPU.get((cpu.get("vendor_id", ""), cpu.get("cpu family", "")), ())


def compiler() -> str | None:
    """``$CC`` if set (a name on PATH or a path), else ``cc``, else ``gcc``, else None."""
    chosen = os.environ.get("CC")
    if chosen:
        return shutil.which(chosen)
    return shutil.which("cc") or shutil.which("gcc")


_loaded: dict[str, ctypes.CDLL] = {}
_versions: dict[str, str] = {}
_build_lock = threading.Lock()


def build_library() -> ctypes.CDLL:
    """The kernels' library, built with this CPU's vector-extension flags (:func:`isa_flags`)
    and tuning (:func:`tuning_flags`) into the cache directory if it is not there yet.
    ``FailedPreconditionError`` saying why when it cannot be built or loaded."""
    cc = compiler()
    if cc is None:
        chosen = os.environ.get("CC")
        raise FailedPreconditionError(f"no C compiler: $CC is {chosen!r}, neither a program on PATH nor a path to one"
                                      if chosen else "no C compiler (cc or gcc; $CC) on PATH to build it")
    sources = [resources.files(__package__).joinpath(name).read_bytes() for name in (*_SOURCES, *_HEADERS)]
    flags = (*_BASE_FLAGS, *isa_flags(), *tuning_flags())
    with _build_lock:
        if cc not in _versions:
            try:
                done = subprocess.run([cc, "--version"], capture_output=True, text=True, errors="replace", timeout=60)
            except (OSError, subprocess.SubprocessError) as exc:
                raise FailedPreconditionError(f"the C compiler {cc} does not run ({exc})") from None
            _versions[cc] = (done.stdout or done.stderr).strip().splitlines()[0] if done.returncode == 0 else ""
            if not _versions[cc]:
                del _versions[cc]
                raise FailedPreconditionError(f"the C compiler {cc} does not run ({cc} --version failed)")
        key = hashlib.sha256(b"\0".join([*sources, _versions[cc].encode(), " ".join(flags).encode(),
                                          _OPENMP.encode()])).hexdigest()[:16]
        folder = runtime_cache_dir() / "kernels"
        path = folder / f"kernels-{key}.so"
        if str(path) in _loaded:
            return _loaded[str(path)]
        _refuse_if_others_can_write(folder)
        if not _intact(path):  # not built yet, or not the bytes its build wrote (cut short by a crash, a full disk)
            log.warning("building the native kernels for this CPU into %s (once per compiler and runtime version, "
                        "~10 s)", folder)
            try:
                _compile(cc, (*flags, _OPENMP), sources, folder, path)
            except _CompileError as exc:
                if not _refuses_openmp(exc.stderr):  # room, time, the sources: the same without OpenMP
                    raise
                _compile(cc, flags, sources, folder, path)  # no OpenMP with this compiler: one thread
        _refuse_if_others_can_write(folder, path)
        try:
            with _briefly_spinning_openmp_threads():
                library = ctypes.CDLL(str(path))
        except OSError as exc:
            raise FailedPreconditionError(f"{path} does not load ({exc}); delete it to rebuild") from None
        missing = [symbol for symbol in _SYMBOLS if not hasattr(library, symbol)]
        if missing:
            raise FailedPreconditionError(f"{path} lacks the kernel function {missing[0]} (the compiler {cc} did not "
                                          "build these sources into it); delete it to rebuild")
        _loaded[str(path)] = library
        return library


def _refuse_if_others_can_write(*paths: Path) -> None:
    """``FailedPreconditionError`` if another user could have put their own library at these
    paths (the kernels' folder, the library itself; :func:`foreign_writer`): loading a library
    runs its code in this process. Paths that do not exist yet pass: this user's build makes them."""
    for path in paths:
        why = foreign_writer(path)
        if why is not None:
            raise FailedPreconditionError(f"{why}: its kernel library is not loaded; set RUNTIME_CACHE to a "
                                          "directory only you can write")


def _digest_path(library: Path) -> Path:
    """Where the SHA-256 of the library's bytes, written by its build, lies."""
    return library.with_name(library.name + ".sha256")


def _intact(library: Path) -> bool:
    """Whether ``library`` holds the bytes its build wrote (a library cut short would crash
    the process that maps it)."""
    try:
        return hashlib.sha256(library.read_bytes()).hexdigest() == _digest_path(library).read_text().strip()
    except OSError:
        return False


@contextlib.contextmanager
def _briefly_spinning_openmp_threads() -> Iterator[None]:
    """``OMP_WAIT_POLICY=passive`` and ``GOMP_SPINCOUNT=1000`` while the library (and with it
    its OpenMP runtime, which reads them once, when it loads) is loaded, unless the user set
    either; the process's environment is as it was afterwards. Why: at 2 threads
    ``linear_rows``'s OpenMP thread and XNNPACK's thread pool take turns on the same cores.
    libgomp's default, spinning 300,000 times after each op, left one session's f32 step of
    SmolLM2-135M at 21-29 ms from one process to the next where XNNPACK's own linears take 21
    (the AVX2 box, 2 cores); sleeping at once (passive) 1.05-1.07x XNNPACK's step every time,
    the thread woken for each of the 151 linears; spinning 1,000 times first (tens of
    microseconds, about the gap between two linears) 1.00-1.01x (docs/kernels.md, Threads).
    libgomp takes the count over the policy; LLVM's libomp, which ignores ``GOMP_SPINCOUNT``,
    takes passive. Where an OpenMP runtime was loaded before (by another library), its own
    setting stands."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        yield
        return
    os.environ["OMP_WAIT_POLICY"] = "passive"
    os.environ["GOMP_SPINCOUNT"] = _OPENMP_SPIN_COUNT
    try:
        yield
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)
        os.environ.pop("GOMP_SPINCOUNT", None)


_STALE_BUILD_S = 3600  # a scratch folder this old is a build whose process was killed
# What a compiler says when it cannot build with OpenMP: the flag refused, or its header or
# runtime library (GCC's libgomp, LLVM's libomp, Intel's libiomp) missing.
_NO_OPENMP = re.compile(r"openmp|\bomp\.h\b|-l[gi]?omp\b", re.IGNORECASE)


class _CompileError(FailedPreconditionError):
    """The compiler failed on the sources; ``stderr``: all it said."""

    def __init__(self, message: str, stderr: str) -> None:
        super().__init__(message)
        self.stderr = stderr


def _refuses_openmp(stderr: str) -> bool:
    """Whether a failed build's ``stderr`` says that the compiler cannot build with
    :data:`_OPENMP` (then the library is built without it) rather than anything else."""
    return _OPENMP in stderr or _NO_OPENMP.search(stderr) is not None


def _compile(cc: str, flags: tuple[str, ...], sources: list[bytes], folder: Path, path: Path) -> None:
    try:
        folder.mkdir(mode=0o755, parents=True, exist_ok=True)  # whatever the umask: only this user writes it
        _remove_stale_builds(folder)
        with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as scratch:
            for name, source in zip((*_SOURCES, *_HEADERS), sources):
                (Path(scratch) / name).write_bytes(source)
            c_files = [Path(scratch) / name for name in _SOURCES]
            built = Path(scratch) / path.name
            command = [cc, *flags, *map(str, c_files), "-o", str(built), "-lm"]
            done = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=300)
            if done.returncode:
                first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip())
                raise _CompileError(f"{' '.join(command[:1 + len(flags)])} failed: {first.strip()}", done.stderr)
            built.chmod(0o755)  # the compiler's output follows the umask; no other user may write a library we load
            with open(built, "rb+") as file:  # on the disk before it is published
                digest = hashlib.sha256(file.read()).hexdigest()
                os.fsync(file.fileno())
            digest_file = Path(scratch) / _digest_path(path).name
            digest_file.write_text(digest + "\n")
            # Each replace is atomic; a reader between the two finds the digest and the library
            # disagree and builds again.
            os.replace(digest_file, _digest_path(path))
            os.replace(built, path)
    except OSError as exc:
        raise FailedPreconditionError(f"cannot write the kernel library into {folder} ({exc})") from None
    except subprocess.TimeoutExpired:
        raise FailedPreconditionError(f"{cc} took more than 300 s to build the kernel") from None


def _remove_stale_builds(folder: Path) -> None:
    """Removes the scratch folders of builds whose process was killed (an hour old)."""
    now = time.time()
    for scratch in folder.glob(".build-*"):
        try:
            if now - scratch.stat().st_mtime > _STALE_BUILD_S:
                shutil.rmtree(scratch, ignore_errors=True)
        except OSError:
            continue  # removed by another process meanwhile


# What the standard form costs where the kernel would run (SmolLM2-135M's shapes, 1 thread;
# benchmarks/experiments/kernel_probe/RESULTS.md section 6): the attention's time over the
# kernel's at 128 / 1,024 / 4,096 positions (0.50x / 0.34x / 0.38x the other way round), and a
# whole int8 step at position 10 of a 4,096-position cache (44.8 ms against 7.8 ms; docs/kernels.md).
# With float16 caches the standard form also converts the whole cache to float32 at every step:
# SmolLM2-135M f32 at 4,096 positions, 113 ms a step against 69 with float32 caches (docs/kernels.md);
# float16 LoRA factors likewise: 8 int8 rows with distinct rank-8 adapters 1.10x the step with float32 ones.
STANDARD_FORM_COST = ("its attention takes 2-3x the kernel's time and reads the whole cache at every step "
                      "(a short session in a 4,096-position cache: ~5x a whole int8 step of SmolLM2-135M; "
                      "float16 caches are converted whole at every step, ~1.6x a float32 cache's step; "
                      "float16 LoRA factors too, ~1.1x)")


def refuse_unknown_ops(model: bytes | memoryview, name: str) -> None:
    """``InvalidArgumentError`` naming the custom ops the model ``name`` names (its operator
    table: cheap) that this runtime has no kernel for: no signature running one could run
    here, and a model compiling its signature groups on demand would meet it only at the
    first session needing that group."""
    unknown = sorted(custom_codes(model) - set(OUR_OPS))
    if unknown:
        raise InvalidArgumentError(f"{name}: custom op {', '.join(map(repr, unknown))}: this runtime has no kernel "
                                   f"for it (it has {', '.join(map(repr, OUR_OPS))})")


def load_for_this_cpu() -> tuple[ctypes.CDLL | None, str]:
    """The kernels' library, built or loaded, where running it pays: this CPU has AVX2 and
    FMA (without them its plain build is slower than XNNPACK at short caches) and it
    builds and loads. Else ``None`` and why, as a clause."""
    if not {"-mavx2", "-mfma"} <= set(isa_flags()):
        return None, "this CPU lacks AVX2 and FMA, without which the kernel is slower than XNNPACK at short caches"
    try:
        return build_library(), ""
    except FailedPreconditionError as exc:
        return None, f"the kernel cannot be built here: {exc.args[0]}"


def attention_form_here(name: str) -> tuple[bool, str | None]:
    """For the model ``name`` carrying both forms of decode attention: whether this machine
    runs its op form (:func:`load_for_this_cpu`), and otherwise the one line saying that
    the standard form runs, why, and what that costs."""
    library, why = load_for_this_cpu()
    if library is not None:
        return True, None
    return False, (f"{name}: decode attention runs in its standard form (XNNPACK), not in {DECODE_ATTENTION}: "
                   f"{why}; {STANDARD_FORM_COST}")


class Registration:
    """The kernels registered on one compiled model: the structures the library was given
    and, per op, the error word its runs write (:meth:`check` after each run)."""

    def __init__(self, library: ctypes.CDLL, litert: ctypes.CDLL, threads: int = 1) -> None:
        address = lambda function: ctypes.cast(function, _P).value  # noqa: E731
        accessors = (address(litert.LiteRtGetTensorBufferHostMemory), address(litert.LiteRtGetTensorBufferTensorType),
                     address(litert.LiteRtGetTensorBufferSize))
        # One context per op, so a failure names the op whose run wrote it; ``threads`` the ops
        # may run on (linear_rows's product), the engine's num_threads.
        self.ops = [(name, _Context(0, *accessors, threads), _KernelStruct(*(address(getattr(library, f"{prefix}_{part}"))
                                                                   for part in _PARTS)))
                    for name, (prefix, _) in _KERNELS.items()]
        self.library = library  # the code the addresses point into stays loaded

    def add_to(self, litert: ctypes.CDLL, options: int) -> int:
        """``LiteRtAddCustomOpKernelOption`` on ``options`` for each op; the first failing status."""
        for name, context, kernel in self.ops:
            status = litert.LiteRtAddCustomOpKernelOption(options, name.encode(), 1, ctypes.byref(kernel),
                                                          ctypes.addressof(context))
            if status:
                return status
        return 0

    def check(self) -> None:
        """``InternalError`` naming the op when a run's kernel failed (its output was NaN)."""
        for name, context, _ in self.ops:
            code = context.error
            if code:
                context.error = 0
                failures = _KERNELS[name][1]
                raise InternalError(f"custom op {name!r} failed in this run: "
                                    f"{failures.get(code, f'code {code}')} (its output was NaN, never used)")


def check_node(node: CustomNode) -> str | None:
    """Why the kernel of the node's op would misread this node, or None."""
    if node.code == LORA_DELTA:
        return _check_lora_node(node)
    if node.code == LINEAR_ROWS:
        return _check_linear_node(node)
    if len(node.inputs) != 5 or len(node.outputs) != 1:
        return f"{len(node.inputs)} inputs and {len(node.outputs)} outputs (expected 5: q, mask, params, K, V; and 1)"
    if any(t is None for t in (*node.inputs, *node.outputs)):
        return "an unranked tensor (expected every shape known)"
    (q_type, mask_type, params_type, k_type, v_type), (out_type,) = [e for e, _ in node.inputs], \
        [e for e, _ in node.outputs]
    if any(element != _FLOAT32 for element in (q_type, mask_type, params_type, out_type)):
        return "q, mask, params or the output not float32"
    if k_type != v_type or k_type not in (_FLOAT32, _FLOAT16):
        return "K and V not both float32 or both float16"
    (q, mask, params, k, v), (out,) = [s for _, s in node.inputs], [s for _, s in node.outputs]
    if len(q) != 4 or q[0] != 1:
        return f"q {list(q)} (expected [1, G, H, D])"
    _, g, h, d = q
    t = k[2] if len(k) == 4 else -1
    # V transposed or grouped: which one, params[2] tells the kernel, which refuses a V not shaped so
    if tuple(k) != (1, g, t, d) or tuple(v) not in ((1, g, d, t), (1, g, t, d)):
        return (f"K {list(k)}, V {list(v)} for q {list(q)} (expected K [1, {g}, T, {d}] and V [1, {g}, {d}, T] or "
                f"[1, {g}, T, {d}])")
    size = 1
    for dim in mask:
        size *= dim
    if size != t or not mask or mask[-1] != t:
        return f"mask {list(mask)} (expected {t} positions, the last axis)"
    if tuple(params) != (4,):
        return f"params {list(params)} (expected [4])"
    if tuple(out) != tuple(q):
        return f"output {list(out)} (expected q's shape {list(q)})"
    return None


def _check_lora_node(node: CustomNode) -> str | None:
    """Why the LoRA-delta kernel would misread this node (lora_delta.c's shapes), or None."""
    if len(node.inputs) != 3 or len(node.outputs) != 1:
        return f"{len(node.inputs)} inputs and {len(node.outputs)} outputs (expected 3: x, A, B; and 1)"
    if any(t is None for t in (*node.inputs, *node.outputs)):
        return "an unranked tensor (expected every shape known)"
    (x_type, a_type, b_type), (out_type,) = [e for e, _ in node.inputs], [e for e, _ in node.outputs]
    if x_type != _FLOAT32 or out_type != _FLOAT32:
        return "x or the output not float32"
    if a_type != b_type or a_type not in (_FLOAT32, _FLOAT16):
        return "A and B not both float32 or both float16"
    (x, a, b), (out,) = [s for _, s in node.inputs], [s for _, s in node.outputs]
    expected = "x [..., in], A [in, r], B [r, out]; or x [N, M, in], A [N, in, r], B [N, r, out]"
    if not x or len(a) not in (2, 3) or len(b) != len(a) or a[-2] != x[-1] or b[-2] != a[-1] \
            or (len(a) == 3 and (len(x) != 3 or a[0] != x[0] or b[0] != x[0])):
        return f"x {list(x)}, A {list(a)}, B {list(b)} (expected {expected})"
    if tuple(out) != (*x[:-1], b[-1]):
        return f"output {list(out)} (expected {[*x[:-1], b[-1]]})"
    return None


def _check_linear_node(node: CustomNode) -> str | None:
    """Why the linear kernel would misread this node (linear_rows.c's shapes), or None."""
    if len(node.inputs) != 2 or len(node.outputs) != 1:
        return f"{len(node.inputs)} inputs and {len(node.outputs)} outputs (expected 2: x, W; and 1)"
    if any(t is None for t in (*node.inputs, *node.outputs)):
        return "an unranked tensor (expected every shape known)"
    if any(element != _FLOAT32 for element, _ in (*node.inputs, *node.outputs)):
        return "x, W or the output not float32"
    (x, w), (out,) = [s for _, s in node.inputs], [s for _, s in node.outputs]
    if not x or len(w) != 2 or w[1] != x[-1] or tuple(out) != (*x[:-1], w[0]):
        return f"x {list(x)}, W {list(w)}, output {list(out)} (expected x [..., K], W [N, K], output [..., N])"
    return None


def custom_nodes(litert: ctypes.CDLL, model: int) -> list[CustomNode]:
    """Every CUSTOM op of a ``LiteRtModel`` handle, read through the C API."""
    size, handle, text = ctypes.c_size_t(), _P(), ctypes.c_char_p()
    raw = ctypes.create_string_buffer(256)

    def tensor(op: int, index: int, getter) -> tuple | None:  # noqa: ANN001
        getter(op, index, ctypes.byref(handle))
        if litert.LiteRtGetRankedTensorType(handle, raw):
            return None
        element, rank = int.from_bytes(raw.raw[0:4], "little", signed=True), raw.raw[4] & 0x7F
        return element, tuple(int.from_bytes(raw.raw[8 + 4 * k:12 + 4 * k], "little", signed=True)
                              for k in range(min(rank, 8)))

    nodes = []
    litert.LiteRtGetNumModelSubgraphs(model, ctypes.byref(size))
    for g in range(size.value):
        subgraph, ops = _P(), ctypes.c_size_t()
        litert.LiteRtGetModelSubgraph(model, g, ctypes.byref(subgraph))
        litert.LiteRtGetNumSubgraphOps(subgraph, ctypes.byref(ops))
        for i in range(ops.value):
            op = _P()
            litert.LiteRtGetSubgraphOp(subgraph, i, ctypes.byref(op))
            if litert.LiteRtGetCustomCode(op, ctypes.byref(text)):  # a status: not a custom op
                continue
            counts = ctypes.c_size_t(), ctypes.c_size_t()
            litert.LiteRtGetNumOpInputs(op, ctypes.byref(counts[0]))
            litert.LiteRtGetNumOpOutputs(op, ctypes.byref(counts[1]))
            nodes.append(CustomNode(g, i, text.value.decode(errors="replace"),
                                    tuple(tensor(op, j, litert.LiteRtGetOpInput) for j in range(counts[0].value)),
                                    tuple(tensor(op, j, litert.LiteRtGetOpOutput) for j in range(counts[1].value))))
    return nodes


def attach(litert: ctypes.CDLL, model: int, options: int, name: str, num_threads: int = 1) -> Registration:
    """Checks every custom node of ``model`` (refusing, naming the op, subgraph and node
    and what was expected, one the kernel would misread or an op it does not know),
    builds or loads the kernel and registers it on ``options``, its ops to run on
    ``num_threads`` threads as XNNPACK does (0: as many as this process may use)."""
    nodes = custom_nodes(litert, model)
    for node in nodes:
        where = f"{name}: custom op {node.code!r} (subgraph {node.subgraph}, node {node.index})"
        if node.code not in OUR_OPS:
            raise InvalidArgumentError(f"{where}: this runtime has no kernel for it (it has "
                                       f"{', '.join(map(repr, OUR_OPS))})")
        problem = check_node(node)
        if problem:
            raise InvalidArgumentError(f"{where}: {problem}; the kernel would misread it")
    try:
        library = build_library()
    except FailedPreconditionError as exc:
        raise FailedPreconditionError(
            f"{name}: the model runs its decode attention in the custom op {DECODE_ATTENTION!r} "
            f"(--attention-kernel native), whose kernel cannot be built here: {exc}; install a C compiler, "
            f"or {RE_EXPORT}") from None
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    registration = Registration(library, litert, num_threads or usable)
    status = registration.add_to(litert, options)
    if status:
        raise InternalError(f"{name}: registering the kernel of {DECODE_ATTENTION!r} failed (LiteRT status {status})")
    return registration
