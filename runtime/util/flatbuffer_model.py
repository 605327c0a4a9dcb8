"""A ``.tflite`` read into the schema's object form and written back, for the passes that
rewrite a model's graph (:mod:`runtime.util.attention_rewrite`,
:mod:`runtime.util.kv_cache_precision`): read once, every pass applied, packed once.

Packed with every buffer's data 64-byte aligned (LiteRT hands a custom op only aligned
tensors; XNNPACK reads weights in place), and a tensor or operator object that two
subgraphs share packed once, its table referenced from both, and equal quantization
parameters once (the quantizer repeats them in every subgraph). Data the quantizer stored
after the flatbuffer is brought inside it, so models of 2 GB and more are refused.

Memory: the object form's buffers are views of the bytes read, and the packed model is
built once in a builder sized for it up front (a builder that grows doubles, holding both
copies meanwhile); :func:`write` hands the builder's bytes to the file without another copy.
A SmolLM2-135M f32 export (543 MB) peaks at 1.27 GB in ``tools/attention_kernel.py``
(2.72 GB before), the file written byte for byte the same.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from pathlib import Path

import flatbuffers
import numpy as np
from ai_edge_litert import schema_py_generated as schema

from runtime.errors import DataLossError, InvalidArgumentError
from runtime.util.file_output import write_whole

ALIGNMENT = 64
FLATBUFFER_LIMIT = 2**31 - 2**24  # bytes: a flatbuffer's offsets are 32-bit; room for the tables
# What the schema's generated accessors raise where a corrupt offset points outside the
# bytes (struct and numpy reads past the end, or a position past 2**32 the flatbuffers
# package refuses with TypeError): callers turn them into a StatusError naming the file.
READ_ERRORS = (struct.error, IndexError, ValueError, TypeError, OverflowError)
FILE_IDENTIFIER = b"TFL3"  # a .tflite's, at byte 4
_schema_patch_lock = threading.Lock()


def metadata_bytes(model: bytes | memoryview, name: str) -> memoryview | None:
    """The bytes of ``model``'s (a ``.tflite``'s bytes, or a map of them) metadata entry
    ``name``, stored inside the flatbuffer or after it (offset and size); ``None`` where the
    model has no such entry or the bytes are no ``.tflite`` (no ``TFL3`` identifier: LiteRT
    refuses those when they are loaded, naming its reason). Bytes that carry the identifier
    but are no flatbuffer raise one of :data:`READ_ERRORS`."""
    if bytes(memoryview(model).cast("B")[4:8]) != FILE_IDENTIFIER:
        return None
    root = schema.Model.GetRootAs(model, 0)
    for index in range(root.MetadataLength()):
        entry = root.Metadata(index)
        if entry.Name() == name.encode():
            buffer = root.Buffers(entry.Buffer())
            if buffer.DataLength():
                return memoryview(buffer.DataAsNumpy())
            if buffer.Offset() > 1:
                return memoryview(model).cast("B")[buffer.Offset():buffer.Offset() + buffer.Size()]
            return memoryview(b"")
    return None


def unpack(data: bytes, source: str = "the model") -> schema.ModelT:
    """``data``'s model in object form, every buffer's data inside it. ``source`` names the
    bytes in errors: ``InvalidArgumentError`` when they are not a ``.tflite`` (no ``TFL3``
    file identifier: a ``.litertlm`` bundle, an unrelated file) or when the model would make
    a flatbuffer of 2 GB or more; ``DataLossError`` when an offset in them points outside
    them (a truncated or corrupt file)."""
    if bytes(data[4:8]) != FILE_IDENTIFIER:
        raise InvalidArgumentError(f"{source}: not a .tflite model (no TFL3 file identifier at byte 4)")
    try:
        model = schema.ModelT.InitFromPackedBuf(data, 0)
        outside = 0
        for buffer in model.buffers or ():
            if buffer.offset > 1:  # data after the flatbuffer (the quantizer writes some so): brought inside
                buffer.data = np.frombuffer(data, np.uint8, count=buffer.size, offset=buffer.offset)
                outside += buffer.size
                buffer.offset = buffer.size = 0
    except READ_ERRORS as exc:
        raise DataLossError(f"{source}: a .tflite model truncated or corrupt: its flatbuffer points outside "
                            f"its {len(data):,} bytes ({exc})") from None
    if outside and len(data) >= FLATBUFFER_LIMIT:
        raise InvalidArgumentError(f"{source}: {len(data):,} bytes, its weights partly outside the flatbuffer: "
                                   "a pass over its graph writes one flatbuffer, at most 2 GB")
    problem = _broken_reference(model)
    if problem is not None:
        raise DataLossError(f"{source}: a .tflite model corrupt: {problem}")
    return model


def _broken_reference(model: schema.ModelT) -> str | None:
    """The first index or name of ``model`` the passes would follow into nothing (an operator
    code, a tensor or a buffer that is not there, a subgraph a signature names, a name that
    is not UTF-8), or ``None``: a corrupt file parses, and the passes index by these."""
    codes, buffers = len(model.operatorCodes or ()), len(model.buffers or ())
    subgraphs = model.subgraphs or []
    for g, graph in enumerate(subgraphs):
        tensors = len(graph.tensors or ())
        for t, tensor in enumerate(graph.tensors or ()):
            if not 0 <= tensor.buffer < max(buffers, 1) or (tensor.name is not None and not _utf8(tensor.name)):
                return f"subgraph {g}, tensor {t}: buffer {tensor.buffer} of {buffers}, name {tensor.name!r:.60}"
        for j, op in enumerate(graph.operators or ()):
            indices = [i for i in (*_ints(op.inputs), *_ints(op.outputs)) if i != -1]
            if not 0 <= op.opcodeIndex < codes or any(not 0 <= i < tensors for i in indices):
                return (f"subgraph {g}, operator {j}: operator code {op.opcodeIndex} of {codes}, tensors "
                        f"{indices} of {tensors}")
        if any(not 0 <= i < tensors for i in (*_ints(graph.inputs), *_ints(graph.outputs))):
            return f"subgraph {g}: inputs or outputs outside its {tensors} tensors"
    for sig in model.signatureDefs or ():
        if not _utf8(sig.signatureKey) or not 0 <= sig.subgraphIndex < len(subgraphs):
            return f"signature {sig.signatureKey!r:.60}: subgraph {sig.subgraphIndex} of {len(subgraphs)}"
        tensors = len(subgraphs[sig.subgraphIndex].tensors or ())
        for entry in (*(sig.inputs or ()), *(sig.outputs or ())):
            if not _utf8(entry.name) or not 0 <= entry.tensorIndex < tensors:
                return (f"signature {sig.signatureKey.decode()!r}, entry {entry.name!r:.60}: tensor "
                        f"{entry.tensorIndex} of {tensors}")
    return None


def _ints(values: object) -> list[int]:
    """An index vector of the object form (an array, a list or ``None``) as ints."""
    return [] if values is None else [int(v) for v in values]


def _utf8(name: bytes | None) -> bool:
    """Whether ``name`` is there and decodes as UTF-8."""
    try:
        return name is not None and isinstance(name.decode(), str)
    except UnicodeDecodeError:
        return False


def pack(model: schema.ModelT) -> bytes:
    """``model`` as a ``.tflite``'s bytes (see the module)."""
    return bytes(_packed(model))


def write(model: schema.ModelT, path: Path) -> int:
    """Writes ``model`` to ``path`` as a ``.tflite`` (see the module) under a temporary name
    beside it, then renamed: a failure leaves ``path`` as it was. Returns the bytes written."""
    return write_whole(path, _packed(model))


def _packed(model: schema.ModelT) -> memoryview:
    """The packed model: a view of its builder's bytes."""
    builder = flatbuffers.Builder(_packed_size(model))
    with _schema_patch_lock:  # the schema's classes are patched while packing: one model at a time
        originals = (schema.BufferT.Pack, schema.TensorT.Pack, schema.OperatorT.Pack,
                     schema.QuantizationParametersT.Pack)
        schema.BufferT.Pack = pack_aligned
        # A tensor or operator object in two subgraphs (both forms) is packed once, its table shared.
        schema.TensorT.Pack, schema.OperatorT.Pack = _packed_once(originals[1]), _packed_once(originals[2])
        schema.QuantizationParametersT.Pack = _packed_once_per_content(originals[3])
        try:
            builder.Finish(model.Pack(builder), file_identifier=FILE_IDENTIFIER)
        finally:
            (schema.BufferT.Pack, schema.TensorT.Pack, schema.OperatorT.Pack,
             schema.QuantizationParametersT.Pack) = originals
    return memoryview(builder.Bytes)[builder.Head():]


def _packed_size(model: schema.ModelT) -> int:
    """Bytes the packed model takes, over-estimated: its buffers' data, aligned, and a
    generous allowance for the tables (so that the builder never grows)."""
    data = sum(len(buffer.data) + ALIGNMENT for buffer in model.buffers or () if buffer.data is not None)
    items = sum(len(graph.tensors or ()) + len(graph.operators or ()) for graph in model.subgraphs or ())
    return min(data + 512 * items + (1 << 22), flatbuffers.Builder.MAX_BUFFER_SIZE)


def _packed_once(pack: Callable[[object, flatbuffers.Builder], int]) -> Callable[[object, flatbuffers.Builder], int]:
    """``pack`` remembering each object's table per builder (by identity: the objects live
    in the model being packed for as long as the builder does)."""
    tables: dict[tuple[int, int], int] = {}

    def packed(self: object, builder: flatbuffers.Builder) -> int:
        key = (id(builder), id(self))
        if key not in tables:
            tables[key] = pack(self, builder)
        return tables[key]
    return packed


def _packed_once_per_content(pack: Callable[[object, flatbuffers.Builder], int]
                             ) -> Callable[[object, flatbuffers.Builder], int]:
    """``QuantizationParametersT.Pack`` sharing one table among equal parameters. The
    quantizer gives every subgraph's tensors their own per-channel scales and zero points,
    equal across the signatures that share a weight: SmolLM2's int8 export of
    ``tools/build_smollm2.py`` (91 subgraphs) carried 170 MB of copies beside 135 MB of
    weights. Parameters with details (blockwise, custom) are packed as they are."""
    tables: dict[tuple, int] = {}

    def packed(self: schema.QuantizationParametersT, builder: flatbuffers.Builder) -> int:
        if self.details is not None:
            return pack(self, builder)
        key = (self.quantizedDimension,
               *(None if v is None else (len(v), np.asarray(v).tobytes())
                 for v in (self.min, self.max, self.scale, self.zeroPoint)))
        if key not in tables:
            tables[key] = pack(self, builder)
        return tables[key]
    return packed


def pack_aligned(self: schema.BufferT, builder: flatbuffers.Builder) -> int:
    """``BufferT.Pack`` with the data vector aligned to :data:`ALIGNMENT` bytes (the
    builder pads the whole buffer to its largest alignment, so the data lies aligned in
    the file, and in a file mapped at a page boundary)."""
    data = None
    if self.data is not None:
        raw = np.ascontiguousarray(self.data, np.uint8)  # the data itself where it is bytes already
        builder.StartVector(1, raw.size, ALIGNMENT)
        builder.head = builder.head - raw.size
        builder.Bytes[builder.head:builder.head + raw.size] = memoryview(raw).cast("B")
        data = builder.EndVector()
    schema.BufferStart(builder)
    if data is not None:
        schema.BufferAddData(builder, data)
    schema.BufferAddOffset(builder, self.offset)
    schema.BufferAddSize(builder, self.size)
    return schema.BufferEnd(builder)
