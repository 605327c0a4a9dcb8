"""A ``.tflite`` read into the schema's object form and written back, for the passes that
rewrite a model's graph (:mod:`runtime.util.attention_rewrite`,
:mod:`runtime.util.kv_cache_precision`): read once, every pass applied, packed once.

Packed with every buffer's data 64-byte aligned (LiteRT hands a custom op only aligned
tensors; XNNPACK reads weights in place), and a tensor or operator object that two
subgraphs share packed once, its table referenced from both. Data the quantizer stored
after the flatbuffer is brought inside it, so models of 2 GB and more are refused.
"""

from __future__ import annotations

from collections.abc import Callable

import flatbuffers
import numpy as np
from ai_edge_litert import schema_py_generated as schema

from runtime.errors import InvalidArgumentError

ALIGNMENT = 64
FLATBUFFER_LIMIT = 2**31 - 2**24  # bytes: a flatbuffer's offsets are 32-bit; room for the tables


def unpack(data: bytes) -> schema.ModelT:
    """``data``'s model in object form, every buffer's data inside it.
    ``InvalidArgumentError`` when that would make a flatbuffer of 2 GB or more."""
    model = schema.ModelT.InitFromPackedBuf(data, 0)
    outside = 0
    for buffer in model.buffers or ():
        if buffer.offset > 1:  # data after the flatbuffer (the quantizer writes some so): brought inside
            buffer.data = np.frombuffer(data, np.uint8, count=buffer.size, offset=buffer.offset)
            outside += buffer.size
            buffer.offset = buffer.size = 0
    if outside and len(data) >= FLATBUFFER_LIMIT:
        raise InvalidArgumentError(f"the model is {len(data):,} bytes, its weights partly outside the flatbuffer: "
                                   "a pass over its graph writes one flatbuffer, at most 2 GB")
    return model


def pack(model: schema.ModelT) -> bytes:
    """``model`` as a ``.tflite``'s bytes (see the module)."""
    builder = flatbuffers.Builder(1 << 20)
    originals = schema.BufferT.Pack, schema.TensorT.Pack, schema.OperatorT.Pack
    schema.BufferT.Pack = pack_aligned
    # A tensor or operator object in two subgraphs (both forms) is packed once, its table shared.
    schema.TensorT.Pack, schema.OperatorT.Pack = _packed_once(originals[1]), _packed_once(originals[2])
    try:
        builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    finally:
        schema.BufferT.Pack, schema.TensorT.Pack, schema.OperatorT.Pack = originals
    return bytes(builder.Output())


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


def pack_aligned(self: schema.BufferT, builder: flatbuffers.Builder) -> int:
    """``BufferT.Pack`` with the data vector aligned to :data:`ALIGNMENT` bytes (the
    builder pads the whole buffer to its largest alignment, so the data lies aligned in
    the file, and in a file mapped at a page boundary)."""
    data = None
    if self.data is not None:
        raw = np.asarray(self.data, np.uint8).tobytes()
        builder.StartVector(1, len(raw), ALIGNMENT)
        builder.head = builder.head - len(raw)
        builder.Bytes[builder.head:builder.head + len(raw)] = raw
        data = builder.EndVector()
    schema.BufferStart(builder)
    if data is not None:
        schema.BufferAddData(builder, data)
    schema.BufferAddOffset(builder, self.offset)
    schema.BufferAddSize(builder, self.size)
    return schema.BufferEnd(builder)
