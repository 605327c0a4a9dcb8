"""Writes LoRA adapters as ``.tflite`` flatbuffers in either file convention.

* litert-torch style: ``lora_atten_*`` names, tensor bytes inline in ``Buffer.data``.
* LiteRT-LM style: ``*_w_prime_*`` names, bytes after the flatbuffer at
  ``Buffer.offset``/``Buffer.size``, and a ``lora_rank`` metadata entry whose value is
  stored in its buffer-index field.

The inverse of :class:`runtime.adapters.lora_data.LoraData`: whatever this writes, that reads.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import flatbuffers
import numpy as np
from ai_edge_litert import schema_py_generated as schema

from runtime.errors import InvalidArgumentError
from runtime.adapters.lora_data import FILE_IDENTIFIER, LORA_RANK_METADATA, tflite_dtype
from runtime.adapters.lora_util import Convention, from_graph_layout, lora_input_name
from runtime.util.file_output import write_whole

DATA_ALIGNMENT = 64
_TYPE_CODES = {"float32": schema.TensorType.FLOAT32, "float16": schema.TensorType.FLOAT16,
               "bfloat16": schema.TensorType.BFLOAT16}  # by dtype name; the dtype itself is checked too


@dataclass(frozen=True)
class LoraWeights:
    """One projection's LoRA pair in graph layout: ``a`` ``[in, r]``, ``b`` ``[r, out]``."""

    a: np.ndarray
    b: np.ndarray


def name_adapter_tensors(
    weights: Mapping[tuple[int, str], LoraWeights],
    convention: Convention,
    dtype: np.dtype | type = np.float32,
) -> dict[str, np.ndarray]:
    """Names and lays out ``{(layer, projection): LoraWeights}`` as ``convention`` stores them.
    ``InvalidArgumentError`` naming the tensor when finite values overflow ``dtype`` (the
    runtime refuses a file of Inf weights when it is loaded)."""
    tensors: dict[str, np.ndarray] = {}
    for (layer, projection), pair in sorted(weights.items()):
        for side, array in (("a", pair.a), ("b", pair.b)):
            name = lora_input_name(convention, layer, projection, side)
            stored = from_graph_layout(convention, side, np.asarray(array))
            with np.errstate(over="ignore"):  # (checked below)
                cast = np.ascontiguousarray(stored, dtype=dtype)
            if not np.isfinite(cast).all() and np.isfinite(stored).all():
                raise InvalidArgumentError(
                    f"tensor {name!r}: values up to {np.abs(stored).max():.6g} overflow {cast.dtype.name} "
                    "(they would be stored as Inf); write the adapter in float32")
            tensors[name] = cast
    return tensors


def serialize_lora_tensors(
    tensors: Mapping[str, np.ndarray],
    *,
    external_data: bool,
    lora_rank: int | None = None,
) -> bytes:
    """Serializes named tensors to a ``.tflite`` LoRA file.

    ``external_data`` puts tensor bytes after the flatbuffer (aligned to
    ``DATA_ALIGNMENT``) instead of inside it; ``lora_rank`` adds the metadata entry.
    """
    if lora_rank is not None and (type(lora_rank) is not int or not 0 < lora_rank < 2**32):
        raise InvalidArgumentError(f"lora_rank={lora_rank!r}, expected a positive integer (uint32)")
    arrays = {name: np.ascontiguousarray(value) for name, value in tensors.items()}
    for name, array in arrays.items():
        if _type_code(array.dtype) is None:
            raise InvalidArgumentError(
                f"tensor {name!r}: dtype {array.dtype} cannot be written, expected "
                "float32, float16 or bfloat16"
            )
    if not external_data:
        return _build(arrays, lora_rank, data_offsets=None)
    placeholder = {name: 1 for name in arrays}  # non-default, so the field is laid out
    flat_size = len(_build(arrays, lora_rank, data_offsets=placeholder))
    offsets: dict[str, int] = {}
    cursor = flat_size
    for name, array in arrays.items():
        cursor = _align(cursor)
        offsets[name] = cursor
        cursor += array.nbytes
    flat = _build(arrays, lora_rank, data_offsets=offsets)
    if len(flat) != flat_size:
        raise AssertionError("flatbuffer size changed between passes")
    out = bytearray(flat)
    for name, array in arrays.items():
        out.extend(b"\0" * (offsets[name] - len(out)))
        out.extend(array.tobytes())
    return bytes(out)


def serialize_lora_weights(
    weights: Mapping[tuple[int, str], LoraWeights],
    convention: Convention,
    *,
    dtype: np.dtype | type | None = None,
) -> bytes:
    """The bytes of an adapter file in ``convention``'s customary form.

    litert-torch: float32 by default, inline data, no metadata. LiteRT-LM / MediaPipe:
    float16 by default, data after the flatbuffer, ``lora_rank`` metadata (the largest
    rank of ``weights``).
    """
    torch_style = convention is Convention.LITERT_TORCH
    dtype = dtype or (np.float32 if torch_style else np.float16)
    rank = max(pair.a.shape[1] for pair in weights.values()) if weights else None
    return serialize_lora_tensors(
        name_adapter_tensors(weights, convention, dtype),
        external_data=not torch_style,
        lora_rank=None if torch_style else rank,
    )


def write_lora_file(
    path: str | os.PathLike[str],
    weights: Mapping[tuple[int, str], LoraWeights],
    convention: Convention,
    *,
    dtype: np.dtype | type | None = None,
) -> Path:
    """Writes :func:`serialize_lora_weights` of ``weights`` to ``path``, whole or not at all
    (a failed write leaves ``path`` as it was)."""
    path = Path(path)
    write_whole(path, serialize_lora_weights(weights, convention, dtype=dtype))
    return path


def _build(
    arrays: Mapping[str, np.ndarray],
    lora_rank: int | None,
    data_offsets: Mapping[str, int] | None,
) -> bytes:
    builder = flatbuffers.Builder(1024)
    buffers = [_empty_buffer(builder)]
    for name, array in arrays.items():
        if data_offsets is None:
            builder.StartVector(1, array.nbytes, DATA_ALIGNMENT)
            builder.head -= array.nbytes
            builder.Bytes[builder.head : builder.head + array.nbytes] = array.tobytes()
            data = builder.EndVector()
            schema.BufferStart(builder)
            schema.BufferAddData(builder, data)
        else:
            schema.BufferStart(builder)
            schema.BufferAddOffset(builder, data_offsets[name])
            schema.BufferAddSize(builder, array.nbytes)
        buffers.append(schema.BufferEnd(builder))

    tensors = []
    for index, (name, array) in enumerate(arrays.items(), start=1):
        name_offset = builder.CreateString(name)
        shape = builder.CreateNumpyVector(np.asarray(array.shape, dtype=np.int32))
        schema.TensorStart(builder)
        schema.TensorAddShape(builder, shape)
        schema.TensorAddType(builder, _type_code(array.dtype))
        schema.TensorAddBuffer(builder, index)
        schema.TensorAddName(builder, name_offset)
        tensors.append(schema.TensorEnd(builder))

    tensor_vector = _offset_vector(builder, schema.SubGraphStartTensorsVector, tensors)
    schema.SubGraphStart(builder)
    schema.SubGraphAddTensors(builder, tensor_vector)
    subgraph = schema.SubGraphEnd(builder)

    metadata = []
    if lora_rank is not None:
        key = builder.CreateString(LORA_RANK_METADATA)
        schema.MetadataStart(builder)
        schema.MetadataAddName(builder, key)
        schema.MetadataAddBuffer(builder, lora_rank)
        metadata.append(schema.MetadataEnd(builder))

    subgraphs = _offset_vector(builder, schema.ModelStartSubgraphsVector, [subgraph])
    buffer_vector = _offset_vector(builder, schema.ModelStartBuffersVector, buffers)
    metadata_vector = (
        _offset_vector(builder, schema.ModelStartMetadataVector, metadata) if metadata else None
    )
    schema.ModelStart(builder)
    schema.ModelAddVersion(builder, 3)
    schema.ModelAddSubgraphs(builder, subgraphs)
    schema.ModelAddBuffers(builder, buffer_vector)
    if metadata_vector is not None:
        schema.ModelAddMetadata(builder, metadata_vector)
    builder.Finish(schema.ModelEnd(builder), file_identifier=FILE_IDENTIFIER)
    return bytes(builder.Output())


def _empty_buffer(builder: flatbuffers.Builder) -> int:
    schema.BufferStart(builder)
    return schema.BufferEnd(builder)


def _offset_vector(builder: flatbuffers.Builder, start_vector, offsets: list[int]) -> int:
    start_vector(builder, len(offsets))
    for offset in reversed(offsets):
        builder.PrependUOffsetTRelative(offset)
    return builder.EndVector()


def _align(value: int) -> int:
    return -(-value // DATA_ALIGNMENT) * DATA_ALIGNMENT


def _type_code(dtype: np.dtype) -> int | None:
    """The TFLite type a tensor of ``dtype`` is written as (``None``: not an adapter's
    float32, float16 or bfloat16 in native byte order)."""
    code = _TYPE_CODES.get(dtype.name)
    return code if code is not None and dtype == tflite_dtype(code) else None
