"""LiteRT's C API, the ``libLiteRt.so`` that ships in the ai-edge-litert wheel, through ctypes.

Why not the wheel's Python classes: ``CompiledModel.run_by_index`` holds the GIL for the
whole run, so while a model ran no other Python thread did: an engine's executors never
ran in parallel, and a server's threads stood still during every step. A ctypes call
releases the GIL for as long as the library works. Its arguments are prepared once per
binding, so a run is one foreign call.

Buffers are host memory this module allocates (numpy arrays, 64-byte aligned, zeroed)
and wraps as tensor buffers: writing or reading one is a numpy copy, not a library call,
and a part of a buffer (one row of a stacked input) can be written alone. The library
locks a buffer while a run uses it, so each compiled model binds its own handle of a
buffer (:meth:`HostBuffer.handle_for`): an adapter's buffers can serve runs of several
executors at once.

Declared against ai-edge-litert 2.3 (the version ``pyproject.toml`` allows); the tensor
types read back are checked, so a library whose structures differ is refused at open
with an error naming it, never misread.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
import threading
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.errors import InternalError, InvalidArgumentError, UnimplementedError
from runtime.executor import kernels
from runtime.util.attention_rewrite import attention_forms, custom_codes
from runtime.util.model_view import advise_weights_read_in_place, select_attention_form
from runtime.util.page_advice import advise

_P = ctypes.c_void_p
_SIZE = ctypes.c_size_t
_STATUS = ctypes.c_int
_OUT_P = ctypes.POINTER(_P)
_OUT_SIZE = ctypes.POINTER(_SIZE)
_OUT_STR = ctypes.POINTER(ctypes.c_char_p)

_CPU = 1  # kLiteRtHwAcceleratorCpu
_CPU_OPTIONS = b"xnnpack"  # the identifier of the CPU accelerator's options (a TOML payload)
_MADV_COLLAPSE = 25  # Linux's madvise(2) advice (6.1 and later); Python's mmap module does not name it
_ALIGNMENT = 64  # bytes; XNNPACK may also read a little past a tensor's end: as much again is allocated
_HUGE_PAGE = 2 << 20  # bytes in a transparent huge page (x86-64, and arm64 with 4 KB pages)
_MAX_RANK = 8  # LITERT_TENSOR_MAX_RANK
_TENSOR_TYPE_BYTES = 256  # room for LiteRtRankedTensorType (72 bytes in 2.3), read back as raw bytes

# LiteRtElementType (the TfLiteType numbering) -> numpy dtype, for the types an LLM export uses.
_DTYPES = {1: np.float32, 2: np.int32, 3: np.uint8, 4: np.int64, 6: np.bool_, 7: np.int16, 9: np.int8,
           10: np.float16}
# LiteRtStatus values worth a name in a message.
_STATUS_NAMES = {1: "invalid argument", 2: "memory allocation failure", 3: "runtime failure",
                 4: "missing input tensor", 5: "unsupported", 6: "not found", 500: "file I/O error",
                 501: "invalid flatbuffer"}

_FUNCTIONS: dict[str, tuple[type | None, list]] = {
    "LiteRtCreateEnvironment": (_STATUS, [ctypes.c_int, _P, _OUT_P]),
    "LiteRtDestroyEnvironment": (None, [_P]),
    "LiteRtCreateModelFromBuffer": (_STATUS, [_P, _P, _SIZE, _OUT_P]),
    "LiteRtDestroyModel": (None, [_P]),
    "LiteRtCreateOptions": (_STATUS, [_OUT_P]),
    "LiteRtDestroyOptions": (None, [_P]),
    "LiteRtSetOptionsHardwareAccelerators": (_STATUS, [_P, ctypes.c_int]),
    "LiteRtCreateOpaqueOptions": (_STATUS, [ctypes.c_char_p, _P, _P, _OUT_P]),
    "LiteRtAddOpaqueOptions": (_STATUS, [_P, _P]),
    "LiteRtCreateCompiledModel": (_STATUS, [_P, _P, _P, _OUT_P]),
    "LiteRtDestroyCompiledModel": (None, [_P]),
    "LiteRtGetNumModelSignatures": (_STATUS, [_P, _OUT_SIZE]),
    "LiteRtGetModelSignature": (_STATUS, [_P, _SIZE, _OUT_P]),
    "LiteRtGetSignatureKey": (_STATUS, [_P, _OUT_STR]),
    "LiteRtGetNumSignatureInputs": (_STATUS, [_P, _OUT_SIZE]),
    "LiteRtGetNumSignatureOutputs": (_STATUS, [_P, _OUT_SIZE]),
    "LiteRtGetSignatureInputName": (_STATUS, [_P, _SIZE, _OUT_STR]),
    "LiteRtGetSignatureOutputName": (_STATUS, [_P, _SIZE, _OUT_STR]),
    "LiteRtGetSignatureInputTensorByIndex": (_STATUS, [_P, _SIZE, _OUT_P]),
    "LiteRtGetSignatureOutputTensorByIndex": (_STATUS, [_P, _SIZE, _OUT_P]),
    "LiteRtGetRankedTensorType": (_STATUS, [_P, _P]),
    "LiteRtCreateTensorBufferFromHostMemory": (_STATUS, [_P, _P, _SIZE, _P, _OUT_P]),
    "LiteRtDestroyTensorBuffer": (None, [_P]),
    "LiteRtRunCompiledModel": (_STATUS, [_P, _SIZE, _SIZE, _P, _SIZE, _P]),
    "LiteRtCompiledModelGetProfiler": (_STATUS, [_P, _OUT_P]),
    "LiteRtStartProfiler": (_STATUS, [_P]),
    "LiteRtStopProfiler": (_STATUS, [_P]),
    "LiteRtResetProfiler": (_STATUS, [_P]),
    "LiteRtGetNumProfilerEvents": (_STATUS, [_P, ctypes.POINTER(ctypes.c_int)]),
    "LiteRtGetProfilerEvents": (_STATUS, [_P, ctypes.c_int, _P]),
    # A model's custom ops, read before it compiles, and their kernels (runtime.executor.kernels).
    "LiteRtGetNumModelSubgraphs": (_STATUS, [_P, _OUT_SIZE]),
    "LiteRtGetModelSubgraph": (_STATUS, [_P, _SIZE, _OUT_P]),
    "LiteRtGetNumSubgraphOps": (_STATUS, [_P, _OUT_SIZE]),
    "LiteRtGetSubgraphOp": (_STATUS, [_P, _SIZE, _OUT_P]),
    "LiteRtGetCustomCode": (_STATUS, [_P, _OUT_STR]),
    "LiteRtGetNumOpInputs": (_STATUS, [_P, _OUT_SIZE]),
    "LiteRtGetOpInput": (_STATUS, [_P, _SIZE, _OUT_P]),
    "LiteRtGetNumOpOutputs": (_STATUS, [_P, _OUT_SIZE]),
    "LiteRtGetOpOutput": (_STATUS, [_P, _SIZE, _OUT_P]),
    "LiteRtAddCustomOpKernelOption": (_STATUS, [_P, ctypes.c_char_p, ctypes.c_int, _P, _P]),
    "LiteRtGetTensorBufferHostMemory": (_STATUS, [_P, _OUT_P]),
    "LiteRtGetTensorBufferTensorType": (_STATUS, [_P, _P]),
    "LiteRtGetTensorBufferSize": (_STATUS, [_P, _OUT_SIZE]),
}

# LiteRT's runtime options (a TOML payload) and the one this module sets: attaching its
# profiler to the compiled model's interpreter, which then records each op's run while started.
_RUNTIME_OPTIONS = b"runtime_options_string"
_PROFILING = b"enable_profiling = true\n"


class _MemoryUsage(ctypes.Structure):
    _fields_ = [("total_allocated_bytes", _SIZE), ("in_use_allocated_bytes", _SIZE),
                ("private_footprint_bytes", _SIZE)]


class _ProfiledEvent(ctypes.Structure):
    """``ProfiledEventData`` of ``litert_profiler_event.h``."""

    _fields_ = [("tag", ctypes.c_char_p), ("event_type", ctypes.c_int), ("start_timestamp_us", ctypes.c_uint64),
                ("elapsed_time_us", ctypes.c_uint64), ("begin_mem_usage", _MemoryUsage),
                ("end_mem_usage", _MemoryUsage), ("event_metadata1", ctypes.c_uint64),
                ("event_metadata2", ctypes.c_uint64), ("event_source", ctypes.c_int)]


# LiteRtProfilerEventType values of the events :meth:`NativeModel.stop_profiling` returns:
# a signature's run (DEFAULT events tagged "Invoke"), an op the interpreter's own kernels
# ran, and an op inside a delegate's (XNNPACK's) partition, profiled either way.
RUN_EVENT, INTERPRETER_OP_EVENT, DELEGATE_OP_EVENTS = 1, 2, (4, 8)


@dataclass(frozen=True)
class ProfiledEvent:
    """One event the profiler recorded: its tag (an op's name, or ``Invoke`` for a whole
    signature run), its LiteRtProfilerEventType and how long it took."""

    tag: str
    event_type: int
    microseconds: int


class _Library:
    """``libLiteRt.so`` with the functions this module calls declared, and libc's
    ``strdup`` / ``free`` for the options payload the library takes ownership of, and
    ``malloc_trim`` where it exists."""

    def __init__(self) -> None:
        import ai_edge_litert  # the wheel that ships the library

        path = Path(ai_edge_litert.__file__).parent / "libLiteRt.so"
        try:
            self.lib = ctypes.CDLL(str(path))
            for name, (restype, argtypes) in _FUNCTIONS.items():
                function = getattr(self.lib, name)
                function.restype, function.argtypes = restype, argtypes
        except (OSError, AttributeError) as exc:
            raise UnimplementedError(f"{path}: not LiteRT's C API as this runtime knows it: {exc}") from None
        libc = ctypes.CDLL(None)
        self.strdup = libc.strdup
        self.strdup.restype, self.strdup.argtypes = _P, [ctypes.c_char_p]
        self.free = ctypes.cast(libc.free, _P)
        self._malloc_trim = getattr(libc, "malloc_trim", None)  # glibc's; other C libraries may lack it

    def return_freed_memory(self) -> None:
        """Gives the C heap's free pages back to the system (the library frees a model's
        many small objects, which the heap would otherwise keep)."""
        if self._malloc_trim is not None:
            self._malloc_trim(0)

    def check(self, status: int, what: str) -> None:
        """``InternalError`` naming ``what`` and the status, unless the call succeeded."""
        if status:
            raise InternalError(f"{what} failed: {_status_text(status)}")


_library: _Library | None = None
_library_lock = threading.Lock()


def _lib() -> _Library:
    global _library
    with _library_lock:
        if _library is None:
            _library = _Library()
        return _library


@dataclass(frozen=True)
class TensorInfo:
    """One input or output of a signature: its name, shape and dtype, and the library's
    own description of it (``LiteRtRankedTensorType``, kept as bytes to create buffers)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    tensor_type: bytes

    @property
    def nbytes(self) -> int:
        """Bytes the tensor holds."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class SignatureInfo:
    """A signature of the model: its index, and its inputs and outputs in the order a run takes them."""

    index: int
    inputs: Mapping[str, TensorInfo]
    outputs: Mapping[str, TensorInfo]


class HostBuffer:
    """A tensor's memory (``array``, zeroed at creation) and the tensor buffer handles
    that let runs bind it. Thread-safe; the handles are destroyed with the object, which
    every :class:`PreparedRun` that binds it keeps alive."""

    def __init__(self, info: TensorInfo, *, memory: np.ndarray | None = None) -> None:
        """``memory``: zeroed bytes to lie in (aligned, ``info.nbytes`` and as much again as
        the alignment: a :class:`PageBlock`'s); by default the buffer allocates its own."""
        self.info = info
        if memory is None:
            raw = np.zeros(info.nbytes + 2 * _ALIGNMENT, np.uint8)
            memory = raw[-raw.ctypes.data % _ALIGNMENT:]
        self.array = memory[:info.nbytes].view(info.dtype).reshape(info.shape)
        self._handles: dict[int, int] = {}  # by the compiled model that binds it
        self._lock = threading.Lock()

    def handle_for(self, model: NativeModel) -> int:
        """The handle ``model``'s runs bind (one per model: the library locks a handle
        for the length of a run)."""
        handle = self._handles.get(id(model))
        if handle is not None:
            return handle
        with self._lock:
            if id(model) not in self._handles:
                lib = _lib()
                created = _P()
                lib.check(lib.lib.LiteRtCreateTensorBufferFromHostMemory(
                    self.info.tensor_type, self.array.ctypes.data, self.info.nbytes, None, ctypes.byref(created)),
                    f"a tensor buffer for {self.info.name!r}")
                self._handles[id(model)] = created.value
            return self._handles[id(model)]

    def write(self, data: np.ndarray) -> None:
        """Copies ``data`` (the tensor's shape, or as many elements) into the buffer."""
        self.array[...] = np.asarray(data).reshape(self.info.shape)

    def __del__(self) -> None:
        library = _library
        if library is not None:
            for handle in self._handles.values():
                library.lib.LiteRtDestroyTensorBuffer(handle)
        self._handles = {}


class PageBlock:
    """Several tensors' buffers (``buffers``, by name) in one private anonymous mapping
    whose pages :meth:`release` gives back to the system together (a KV cache of one
    length: its buffers are left and taken again as a session's steps change window).

    The block starts in the system's small pages, so a context that fills a few of its
    positions takes memory for the pages it writes only; :meth:`use_huge_pages` moves it
    to transparent huge pages (2 MB), which the caller asks for once the context fills
    much of the block: a step then reads it faster (SmolLM2-135M's f32 decode 3,000
    positions deep: 3-4% on an AMD EPYC), and pages given back and written again come
    back faster (a cache of 768 positions, 24 MB: ~4 ms where 4 KB pages took ~22 ms).
    Huge pages from the start made a session pay for the whole block at its first write:
    the 36 positions of a prompt, moved into a 4,096-position cache whose rows hold
    positions innermost, touched every 2 MB page of its 188 MB (100-220 ms on a VM that
    backs fresh memory lazily; 9 ms in small pages).

    Except ``whole_pages``: buffers of which the first position written touches every
    small page anyway (rows of positions no longer than a page: a V cache of 1,024 float32
    positions). They lie first, their whole 2 MB stretches in huge pages from the start:
    the same memory, and a short context's step reads their scattered rows with fewer TLB
    misses (SmolLM2-135M int8, 1,024 positions, at position 8: one session's step 0.975x,
    8 rows' 0.97-0.98x on an AMD EPYC).
    """

    def __init__(self, infos: Sequence[TensorInfo], whole_pages: Collection[str] = ()) -> None:
        sizes = {info.name: -(-(info.nbytes + _ALIGNMENT) // _ALIGNMENT) * _ALIGNMENT for info in infos}
        whole = [info for info in infos if info.name in whole_pages]
        small = [info for info in infos if info.name not in whole_pages]
        whole_bytes = sum(sizes[info.name] for info in whole)
        huge = whole_bytes // _HUGE_PAGE * _HUGE_PAGE  # the huge pages they fill; the rest stays small
        slack = _HUGE_PAGE if huge else 0  # room to start them on a 2 MB boundary
        # Private pages (a shared mapping would keep its pages when released), page-aligned and zeroed.
        self._pages = mmap.mmap(-1, max(sum(sizes.values()) + slack, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.huge_pages = False  # whether use_huge_pages was called since the last release
        raw = np.frombuffer(self._pages, np.uint8)
        start = -raw.ctypes.data % _HUGE_PAGE if huge else 0
        self._huge_range = (start, huge)  # in huge pages from the start
        self._advise_small()
        memory = {}
        for group, begin in ((whole, start), (small, start + whole_bytes)):
            offsets = begin + np.cumsum([0, *(sizes[info.name] for info in group)])
            memory |= {info.name: raw[first:end] for info, first, end in zip(group, offsets[:-1], offsets[1:])}
        self.buffers = {info.name: HostBuffer(info, memory=memory[info.name]) for info in infos}

    def _advise(self, advice: int | None, start: int = 0, length: int | None = None) -> bool:
        """Advises the block (or ``length`` bytes of it from ``start``): :func:`advise`."""
        return advise(self._pages, advice, start, length)

    def _advise_small(self) -> None:
        """Small pages for the block (even where the system's default is huge), huge ones
        for its whole_pages buffers."""
        self._advise(getattr(mmap, "MADV_NOHUGEPAGE", None))
        start, length = self._huge_range
        if length:
            self._advise(getattr(mmap, "MADV_HUGEPAGE", None), start, length)

    def use_huge_pages(self) -> None:
        """Puts the block in huge pages: pages written from now on come in 2 MB, and
        those written already are gathered into 2 MB pages now (``MADV_COLLAPSE``, Linux
        6.1 and later: a copy, ~30 ms for 188 MB; older kernels leave them small). Until
        :meth:`release`."""
        self.huge_pages = True
        if self._advise(getattr(mmap, "MADV_HUGEPAGE", None)):
            self._advise(_MADV_COLLAPSE)

    def release(self) -> None:
        """Gives the block's memory back to the system while every buffer keeps its
        address (and every handle stays valid): the contents become zeros, on Linux;
        where the system keeps them instead, they stay as they were. Small pages again
        (huge for the whole_pages buffers)."""
        self._advise(getattr(mmap, "MADV_DONTNEED", None))
        if self.huge_pages:
            self._advise_small()
            self.huge_pages = False

    def clear(self) -> None:
        """Zeros every buffer: the pages are given back where the system fills them with
        zeros again (Linux), so only the pages written later take memory; else written."""
        self.release()
        if not sys.platform.startswith("linux"):
            for buffer in self.buffers.values():
                buffer.array[...] = 0


@dataclass(frozen=True)
class PreparedRun:
    """A signature's index and its buffers' handles, as one run passes them; holding the
    buffers keeps their handles alive as long as the run can be made."""

    index: int
    inputs: ctypes.Array
    outputs: ctypes.Array
    buffers: tuple[HostBuffer, ...]


class NativeModel:
    """A compiled model on the CPU (XNNPACK), its signatures, buffers for them, and runs
    that release the GIL. ``run`` may be called from any thread, one run at a time."""

    def __init__(self, model: str | os.PathLike[str] | bytes | memoryview, *, num_threads: int, weight_cache: str,
                 name: str, profiling: bool = False, custom_ops: bool | None = None) -> None:
        """``model``: a ``.tflite`` path (mapped read-only), or the model's bytes or a
        read-only view of them; kept while the model is open, as the library reads it in
        place. ``num_threads``: XNNPACK's threads (0: the library's default).
        ``weight_cache``: XNNPACK's packed-weight cache (a file, or ``":memory:"``).
        ``profiling``: attach LiteRT's profiler (:meth:`start_profiling`).
        ``custom_ops``: whether the model runs its custom ops (their kernels attached), for
        bytes whose form the caller already chose (a view: a model carrying both forms of
        decode attention lists the op in its operator table either way); ``None``: the
        model's bytes tell, and a model carrying both forms is shown to LiteRT in the form
        this machine runs.
        ``InvalidArgumentError`` naming ``name`` when the library cannot load it."""
        lib = _lib()
        self._lib = lib
        self._buffer = _model_bytes(model, name)
        self._env, self._model, self._options, self._compiled = _P(), _P(), _P(), _P()
        self._profiler = _P()
        self._kernels: kernels.Registration | None = None
        # Whether decode attention runs in the runtime's custom op; and, for a model carrying
        # both forms that runs the standard one here, the one line saying why and what it costs.
        self.attention_kernel = False
        self.notice: str | None = None
        if custom_ops is None:  # the model's own bytes tell
            try:
                forms = attention_forms(self._buffer)
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(f"{name}: {exc.args[0]}") from None
            if forms:  # both forms in the file: LiteRT is shown, and compiles, the one this machine runs
                custom_ops, self.notice = kernels.attention_form_here(name)
                self._buffer = _model_bytes(model, name, writable=True)
                try:
                    select_attention_form(self._buffer, forms, op_form=custom_ops)
                except InvalidArgumentError as exc:
                    raise InvalidArgumentError(f"{name}: {exc.args[0]}") from None
        try:
            lib.check(lib.lib.LiteRtCreateEnvironment(0, None, ctypes.byref(self._env)), "creating an environment")
            status = lib.lib.LiteRtCreateModelFromBuffer(self._env, self._buffer.ctypes.data, self._buffer.size,
                                                         ctypes.byref(self._model))
            if status:
                raise InvalidArgumentError(f"{name}: cannot load the model ({_status_text(status)})")
            mapping = getattr(self._buffer.base, "obj", None)  # the mmap under a file's bytes (_model_bytes)
            if custom_ops is not False and isinstance(mapping, mmap.mmap):
                advise_weights_read_in_place(mapping, self._buffer)
            lib.check(lib.lib.LiteRtCreateOptions(ctypes.byref(self._options)), "creating options")
            lib.check(lib.lib.LiteRtSetOptionsHardwareAccelerators(self._options, _CPU), "choosing the CPU")
            payload = (f"num_threads = {num_threads}\n" if num_threads else "") \
                + f"weight_cache_file_path = \"{weight_cache}\"\n"
            cpu = _P()
            copy = lib.strdup(payload.encode())  # the library frees it with the options
            lib.check(lib.lib.LiteRtCreateOpaqueOptions(_CPU_OPTIONS, copy, lib.free, ctypes.byref(cpu)),
                      "creating CPU options")
            lib.check(lib.lib.LiteRtAddOpaqueOptions(self._options, cpu), "adding CPU options")
            # A model running custom ops (its op form, or --attention-kernel native) gets their
            # kernels, every node checked first; the operator table of a model of one form tells
            # cheaply whether it has any (read once LiteRT has accepted the bytes as a model).
            if custom_ops or (custom_ops is None and custom_codes(self._buffer)):
                self._kernels = kernels.attach(lib.lib, self._model, self._options, name, num_threads)
                self.attention_kernel = True
            if profiling:
                runtime = _P()
                lib.check(lib.lib.LiteRtCreateOpaqueOptions(_RUNTIME_OPTIONS, lib.strdup(_PROFILING), lib.free,
                                                            ctypes.byref(runtime)), "creating runtime options")
                lib.check(lib.lib.LiteRtAddOpaqueOptions(self._options, runtime), "adding runtime options")
            status = lib.lib.LiteRtCreateCompiledModel(self._env, self._model, self._options,
                                                       ctypes.byref(self._compiled))
            if status:
                raise InvalidArgumentError(f"{name}: cannot compile the model for the CPU ({_status_text(status)})")
            if profiling:
                lib.check(lib.lib.LiteRtCompiledModelGetProfiler(self._compiled, ctypes.byref(self._profiler)),
                          "getting the profiler")
                if not self._profiler.value:
                    raise UnimplementedError(f"{name}: the library attached no profiler (it does not read the "
                                             "runtime option enable_profiling)")
            self.signatures = self._read_signatures(name)
            # Runs read the buffer through the compiled model's own interpreter, never the model
            # built from it: its IR of every signature (~140 MiB for SmolLM2's 56) can go. (A model
            # created from a file could not: the compiled model reads that model's mapping.)
            lib.lib.LiteRtDestroyModel(self._model)
            self._model.value = None
            lib.return_freed_memory()
        except BaseException:
            self.close()
            raise
        self._run = lib.lib.LiteRtRunCompiledModel

    def _read_signatures(self, name: str) -> dict[str, SignatureInfo]:
        lib = self._lib
        count = _SIZE()
        lib.check(lib.lib.LiteRtGetNumModelSignatures(self._model, ctypes.byref(count)), "counting signatures")
        signatures = {}
        known: dict[bytes, TensorInfo] = {}  # signatures share most tensors' names and types: one object each
        for index in range(count.value):
            signature, key = _P(), ctypes.c_char_p()
            lib.check(lib.lib.LiteRtGetModelSignature(self._model, index, ctypes.byref(signature)),
                      "reading a signature")
            lib.check(lib.lib.LiteRtGetSignatureKey(signature, ctypes.byref(key)), "reading a signature's key")
            signatures[_text(key.value, f"signature {index}'s key", name)] = SignatureInfo(
                index, self._tensors(signature, "Input", name, known), self._tensors(signature, "Output", name, known))
        return signatures

    def _tensors(self, signature: int, kind: str, name: str, known: dict[bytes, TensorInfo]) -> dict[str, TensorInfo]:
        """The inputs (``kind`` ``"Input"``) or outputs (``"Output"``) of a signature, in
        order; a tensor whose name and type are in ``known`` is that object."""
        lib, check = self._lib.lib, self._lib.check
        count_of = getattr(lib, f"LiteRtGetNumSignature{kind}s")
        name_of = getattr(lib, f"LiteRtGetSignature{kind}Name")
        tensor_of = getattr(lib, f"LiteRtGetSignature{kind}TensorByIndex")
        type_of = lib.LiteRtGetRankedTensorType
        count, tensor_name, tensor = _SIZE(), ctypes.c_char_p(), _P()
        raw = ctypes.create_string_buffer(_TENSOR_TYPE_BYTES)
        check(count_of(signature, ctypes.byref(count)), "counting tensors")
        tensors = {}
        for index in range(count.value):
            check(name_of(signature, index, ctypes.byref(tensor_name)), "reading a tensor's name")
            check(tensor_of(signature, index, ctypes.byref(tensor)), "reading a tensor")
            check(type_of(tensor, raw), "reading a tensor's type")
            identity = tensor_name.value + b"\0" + raw.raw
            info = known.get(identity)
            if info is None:
                what = f"the name of {kind.lower()} {index} of a signature"
                info = known[identity] = _tensor_info(_text(tensor_name.value, what, name), raw.raw, name)
            tensors[info.name] = info
        return tensors

    def signature_details(self) -> dict[str, tuple[dict[str, dict], dict[str, dict]]]:
        """``{key: (inputs, outputs)}``, each ``{name: {"shape": ..., "dtype": ...}}``: what
        :meth:`~runtime.executor.model_spec.ModelSpec.from_details` reads."""
        def described(tensors: Mapping[str, TensorInfo]) -> dict[str, dict]:
            return {name: {"shape": t.shape, "dtype": t.dtype} for name, t in tensors.items()}
        return {key: (described(s.inputs), described(s.outputs)) for key, s in self.signatures.items()}

    def prepare(self, index: int, inputs: Sequence[HostBuffer], outputs: Sequence[HostBuffer]) -> PreparedRun:
        """What :meth:`run` takes to run signature ``index`` on these buffers, in the
        signature's order."""
        buffers = (*inputs, *outputs)
        handles = [buffer.handle_for(self) for buffer in buffers]
        return PreparedRun(index, (_P * len(inputs))(*handles[:len(inputs)]),
                           (_P * len(outputs))(*handles[len(inputs):]), buffers)

    def run(self, prepared: PreparedRun) -> None:
        """Runs a prepared signature; other Python threads run meanwhile.
        ``InternalError`` with the library's status if it reports a failure (its log says more)."""
        status = self._run(self._compiled, prepared.index, len(prepared.inputs), prepared.inputs,
                           len(prepared.outputs), prepared.outputs)
        if status:
            raise InternalError(_status_text(status))
        if self._kernels is not None:
            self._kernels.check()

    def start_profiling(self) -> None:
        """Drops the events recorded so far and records every op of the runs from now on
        (a model opened with ``profiling``; runs are slower while recording)."""
        lib = self._lib
        lib.check(lib.lib.LiteRtResetProfiler(self._profiler), "resetting the profiler")
        lib.check(lib.lib.LiteRtStartProfiler(self._profiler), "starting the profiler")

    def stop_profiling(self) -> list[ProfiledEvent]:
        """Stops recording; the runs' events since :meth:`start_profiling` (signature runs
        and ops; the library's other events left out), in the order they ended."""
        lib = self._lib
        lib.check(lib.lib.LiteRtStopProfiler(self._profiler), "stopping the profiler")
        count = ctypes.c_int()
        lib.check(lib.lib.LiteRtGetNumProfilerEvents(self._profiler, ctypes.byref(count)), "counting events")
        events = (_ProfiledEvent * count.value)()
        lib.check(lib.lib.LiteRtGetProfilerEvents(self._profiler, count.value, events), "reading events")
        kept = (RUN_EVENT, INTERPRETER_OP_EVENT, *DELEGATE_OP_EVENTS)
        return [ProfiledEvent(event.tag.decode(errors="replace"), event.event_type, event.elapsed_time_us)
                for event in events if event.tag and event.event_type in kept]

    def close(self) -> None:
        """Frees the compiled model, the model and its environment (buffers stay valid)."""
        lib = self._lib.lib
        for handle, destroy in ((self._compiled, lib.LiteRtDestroyCompiledModel),
                                (self._options, lib.LiteRtDestroyOptions),
                                (self._model, lib.LiteRtDestroyModel),
                                (self._env, lib.LiteRtDestroyEnvironment)):
            if handle.value:
                destroy(handle)
                handle.value = None
        self._buffer = None


def _model_bytes(model: str | os.PathLike[str] | bytes | memoryview, name: str, *,
                 writable: bool = False) -> np.ndarray:
    """The model's bytes as the library reads them; a file is mapped, so only the pages
    read are loaded. ``writable``: a file is mapped copy-on-write (a page written is the
    process's own copy; the file and the others stay shared), bytes in memory are copied
    (64-byte aligned, as a custom op's constants must be)."""
    if isinstance(model, (bytes, memoryview)):
        if not writable:
            return np.frombuffer(model, np.uint8)
        source = np.frombuffer(model, np.uint8)
        raw = np.empty(source.size + _ALIGNMENT, np.uint8)
        copy = raw[-raw.ctypes.data % _ALIGNMENT:][:source.size]
        copy[...] = source
        return copy
    try:
        with open(model, "rb") as file:
            access = mmap.ACCESS_COPY if writable else mmap.ACCESS_READ
            mapping = mmap.mmap(file.fileno(), 0, access=access)
    except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
        raise InvalidArgumentError(f"{name}: cannot load the model ({exc})") from None
    return np.frombuffer(mapping, np.uint8)


def _status_text(status: int) -> str:
    return f"LiteRT status {status}: {_STATUS_NAMES.get(status, 'see its log')}"


def _text(raw: bytes | None, what: str, name: str) -> str:
    """A name the library read from model ``name``'s bytes, as text; ``InvalidArgumentError``
    naming ``what`` when it is missing or not UTF-8."""
    if raw is None:
        raise InvalidArgumentError(f"{name}: {what} is missing")
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise InvalidArgumentError(f"{name}: {what} is not UTF-8 text ({raw[:40]!r})") from None


def tensor_info(name: str, shape: Sequence[int], dtype: np.dtype) -> TensorInfo:
    """A tensor's :class:`TensorInfo` made without the library (its ``LiteRtRankedTensorType``
    written as :func:`_tensor_info` reads it: element type, rank, dimensions, no strides):
    buffers for signatures of a model not compiled yet, bound once it is."""
    elements = {np.dtype(v): k for k, v in _DTYPES.items()}
    dtype = np.dtype(dtype)
    if dtype not in elements or len(shape) > _MAX_RANK:
        raise InvalidArgumentError(f"tensor {name!r}: {list(shape)} {dtype} has no LiteRT tensor type here "
                                   f"(expected rank <= {_MAX_RANK} and one of {sorted(map(str, elements))})")
    raw = bytearray(_TENSOR_TYPE_BYTES)
    raw[0:4] = elements[dtype].to_bytes(4, "little", signed=True)
    raw[4] = len(shape)
    raw[8:8 + 4 * len(shape)] = np.asarray(shape, np.int32).tobytes()
    return TensorInfo(name, tuple(int(d) for d in shape), dtype, bytes(raw))


def _tensor_info(tensor: str, raw: bytes, model: str) -> TensorInfo:
    """Reads ``LiteRtRankedTensorType`` (element type, then the layout: rank in the low
    7 bits of a 32-bit word, then the dimensions as int32) and checks what it read."""
    element = int.from_bytes(raw[0:4], "little", signed=True)
    rank = raw[4] & 0x7F
    dims = tuple(int(d) for d in np.frombuffer(raw, np.int32, count=rank, offset=8)) if rank <= _MAX_RANK else ()
    if element not in _DTYPES or rank > _MAX_RANK or any(d <= 0 for d in dims):
        raise UnimplementedError(
            f"{model}: tensor {tensor!r} reads as element type {element}, rank {rank}, dims {dims}: this "
            "ai-edge-litert's libLiteRt.so lays out tensor types differently from 2.3 (the version this runtime "
            "binds); install ai-edge-litert 2.3")
    return TensorInfo(tensor, dims, np.dtype(_DTYPES[element]), raw)
