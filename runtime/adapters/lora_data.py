"""LoraData: zero-copy access to the tensors of a LoRA adapter stored as a ``.tflite`` file.

A LoRA ``.tflite`` file is a TFLite flatbuffer (file identifier ``TFL3``) whose first
subgraph lists one tensor per LoRA weight. A tensor's bytes are either inside the
flatbuffer (``Buffer.data``, as litert-torch writes them) or after it
(``Buffer.offset``/``Buffer.size``, as LiteRT-LM/MediaPipe write them).

Parsing touches only the flatbuffer's tables: a file is memory-mapped and its tensor
bytes are not read until :meth:`LoraData.read_tensor` is called, which returns a
read-only numpy view of the mapped (or caller's) memory, never a copy.

Everything is validated before an object is returned: identifier, every vector and
table position, buffer indices, data ranges, dtypes, shapes, and that each tensor's
data size equals its shape times its element size. Malformed input raises
``InvalidArgumentError``; data that runs past the end of the input raises
``DataLossError`` (a truncated file). Both name the source and the tensor.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from ai_edge_litert import schema_py_generated as schema

from runtime.errors import (
    DataLossError,
    InvalidArgumentError,
    NotFoundError,
    StatusError,
)
from runtime.adapters.lora_util import is_lora_input_name, parse_lora_input_name, rank_axis
from runtime.util.flatbuffer_model import FILE_IDENTIFIER, READ_ERRORS
from runtime.util.scoped_file import FileWatch, ScopedFile

LORA_RANK_METADATA = "lora_rank"
MAX_TENSOR_DIMS = 8
MAX_DIMENSION = 1 << 31

_FLOAT_DTYPES = {schema.TensorType.FLOAT32: np.dtype(np.float32), schema.TensorType.FLOAT16: np.dtype(np.float16)}
_UOFFSET = 4

Buffer = bytes | bytearray | memoryview | mmap.mmap


def tflite_dtype(type_code: int) -> np.dtype | None:
    """The numpy dtype of an adapter tensor of TFLite type ``type_code`` (FLOAT32,
    FLOAT16 or BFLOAT16; ``None`` for any other). bfloat16 is ml_dtypes', imported here
    when a tensor needs it: with numpy 2.4 the import takes ~0.9 s, which every start of
    the runtime paid while it was imported with this module."""
    if type_code == schema.TensorType.BFLOAT16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return _FLOAT_DTYPES.get(type_code)


@dataclass(frozen=True, slots=True)  # slots: hundreds per registered adapter
class TensorInfo:
    """Where one adapter tensor lives and what it holds."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int  # absolute byte offset of the data in the source
    nbytes: int
    placement: str  # "inline" (Buffer.data) or "external" (Buffer.offset/size)


class LoraData:
    """The tensors of one LoRA adapter file, read by name as views of the source bytes.

    Build one with :meth:`create_from_file_path`, :meth:`create_from_scoped_file` or
    :meth:`create_from_buffer`. Instances are immutable and safe to share between threads.
    """

    format_name = "tflite"
    draft_heads = None  # a .tflite LoRA file carries no draft heads

    def __init__(
        self,
        buffer: Buffer,
        *,
        source_name: str,
        scoped_file: ScopedFile | None = None,
        watch: FileWatch | None = None,
    ) -> None:
        """Parses and validates ``buffer``; prefer the ``create_from_*`` factories."""
        self.source_name = source_name
        self._buffer = buffer
        self._scoped_file = scoped_file
        self._watch = watch
        parsed = _FlatbufferReader(buffer, source_name).read()
        self._tensors: dict[str, TensorInfo] = parsed.tensors
        self._metadata_rank = parsed.lora_rank
        self.release_memory()

    # -- factories -----------------------------------------------------------------

    @classmethod
    def create_from_file_path(cls, path: str | os.PathLike[str]) -> LoraData:
        """Opens and memory-maps the file at ``path``; tensor bytes are not read."""
        return cls.create_from_scoped_file(ScopedFile(path), owns_file=True)

    @classmethod
    def create_from_scoped_file(
        cls, scoped_file: ScopedFile, *, owns_file: bool = False
    ) -> LoraData:
        """Memory-maps an already open file. The caller keeps ownership unless ``owns_file``."""
        try:
            watch = FileWatch(scoped_file.path)
            mapped = scoped_file.memory_map()
            return cls(
                mapped,
                source_name=str(scoped_file.path),
                scoped_file=scoped_file if owns_file else None,
                watch=watch,
            )
        except BaseException:
            if owns_file:
                scoped_file.close()
            raise

    @classmethod
    def create_from_buffer(cls, buffer: Buffer, *, name: str = "<in-memory buffer>") -> LoraData:
        """Reads from bytes, bytearray, memoryview or mmap, kept by reference, never copied.

        The arrays returned by :meth:`read_tensor` are read-only views of ``buffer``; a
        caller that mutates a mutable buffer afterwards changes what they show.
        """
        if isinstance(buffer, memoryview):
            if not buffer.c_contiguous:
                raise InvalidArgumentError(f"{name}: memoryview must be C-contiguous")
            buffer = buffer.cast("B") if buffer.format != "B" or buffer.ndim != 1 else buffer
        elif not isinstance(buffer, bytes | bytearray | mmap.mmap):
            raise InvalidArgumentError(
                f"{name}: expected bytes, bytearray, memoryview or mmap, "
                f"got {type(buffer).__name__}"
            )
        return cls(buffer, source_name=name)

    # -- reading -------------------------------------------------------------------

    def get_all_tensor_names(self) -> list[str]:
        """Every tensor name in the file, in file order."""
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        """Whether the file has a tensor named ``name`` (no tensor bytes are read)."""
        return name in self._tensors

    def tensor_info(self, name: str) -> TensorInfo:
        """Shape, dtype, size and location of tensor ``name``; ``NotFoundError`` if absent."""
        try:
            return self._tensors[name]
        except KeyError:
            raise NotFoundError(f"{self.source_name}: no tensor named {name!r}") from None

    def read_tensor(self, name: str) -> np.ndarray:
        """A read-only view of tensor ``name`` with its dtype and shape (no copy)."""
        info = self.tensor_info(name)
        self._check_source_intact(name)
        array = np.frombuffer(
            self._buffer, dtype=info.dtype, count=math.prod(info.shape), offset=info.offset
        ).reshape(info.shape)
        array.flags.writeable = False
        return array

    def get_lora_rank(self) -> int:
        """The adapter's rank: the ``lora_rank`` metadata if present, else from the shapes.

        Inferred as the largest rank over the LoRA ``a`` tensors, so an adapter whose
        layers use different ranks reports the slot it needs.
        """
        if self._metadata_rank is not None:
            return self._metadata_rank
        ranks = [
            info.shape[rank_axis(parsed.convention, parsed.side)]
            for info in self._tensors.values()
            if is_lora_input_name(info.name) and len(info.shape) == 2
            for parsed in [parse_lora_input_name(info.name)]
            if parsed.side == "a"
        ]
        if not ranks:
            raise NotFoundError(
                f"{self.source_name}: no {LORA_RANK_METADATA!r} metadata and no LoRA 'a' "
                "tensor to infer the rank from"
            )
        return max(ranks)

    def release_memory(self) -> None:
        """Drops this process's mapped pages of a file it opened (they stay in the page
        cache; a later read faults them back in).

        Parsing or materializing touches pages, and the kernel maps their neighbours too,
        so without this a registered adapter would hold most of its file in RSS.
        """
        if self._watch is not None and isinstance(self._buffer, mmap.mmap) and not self._buffer.closed:
            self._buffer.madvise(mmap.MADV_DONTNEED)

    @property
    def nbytes(self) -> int:
        """Total bytes of tensor data (what materializing every tensor would read)."""
        return sum(info.nbytes for info in self._tensors.values())

    def close(self) -> None:
        """Releases the file this object opened itself. Views already handed out keep
        the mapping alive until they are garbage-collected."""
        if self._scoped_file is not None:
            self._scoped_file.close()
            self._scoped_file = None
        if isinstance(self._buffer, mmap.mmap):
            try:
                self._buffer.close()
            except BufferError:
                pass  # numpy views still reference the mapping; it unmaps with them.

    def __enter__(self) -> LoraData:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LoraData({self.source_name!r}, {len(self._tensors)} tensors)"

    def _check_source_intact(self, tensor: str) -> None:
        """Refuses to touch a mapped file that changed since it was parsed.

        Reading a page of a truncated mapping raises SIGBUS and kills the process, so a
        file-backed adapter checks the file first (see :class:`FileWatch`).
        """
        if isinstance(self._buffer, mmap.mmap) and self._buffer.closed:
            raise DataLossError(f"{self.source_name}: tensor {tensor!r}: adapter was closed")
        if self._watch is not None:
            self._watch.check(f"tensor {tensor!r}")


@dataclass
class _Parsed:
    tensors: dict[str, TensorInfo]
    lora_rank: int | None


class _FlatbufferReader:
    """Walks the flatbuffer with the generated schema classes, checking every position."""

    def __init__(self, buffer: Buffer, source_name: str) -> None:
        self.buf = buffer
        self.size = len(buffer)
        self.source = source_name

    def read(self) -> _Parsed:
        if self.size == 0:
            raise InvalidArgumentError(f"{self.source}: empty input, expected a .tflite file")
        if self.size < 8:
            raise DataLossError(f"{self.source}: {self.size} bytes is too short for a flatbuffer")
        if bytes(self.buf[4:8]) != FILE_IDENTIFIER:
            raise InvalidArgumentError(
                f"{self.source}: file identifier is {bytes(self.buf[4:8])!r}, "
                f"expected {FILE_IDENTIFIER!r} (not a .tflite flatbuffer)"
            )
        with self._guard("model root"):
            model = schema.Model.GetRootAs(self.buf, 0)
            self._check_table(model, "model root")
            buffers = self._vector(model, 12, _UOFFSET, "model.buffers")
            subgraphs_start, n_subgraphs = self._vector(model, 8, _UOFFSET, "model.subgraphs")
        if n_subgraphs == 0:
            raise InvalidArgumentError(f"{self.source}: the model has no subgraph")
        with self._guard("subgraph 0"):
            subgraph = self._table_at(schema.SubGraph, subgraphs_start, 0, "subgraph 0")
            tensors_start, n_tensors = self._vector(subgraph, 4, _UOFFSET, "subgraph 0 tensors")
        tensors: dict[str, TensorInfo] = {}
        for index in range(n_tensors):
            info = self._tensor(tensors_start, index, buffers)
            if info.name in tensors:
                raise InvalidArgumentError(
                    f"{self.source}: tensor {info.name!r}: duplicate name (tensor {index})"
                )
            tensors[info.name] = info
        return _Parsed(tensors, self._metadata_rank(model))

    def _tensor(self, tensors_start: int, index: int, buffers: tuple[int, int]) -> TensorInfo:
        where = f"tensor {index}"
        buffers_start, n_buffers = buffers
        with self._guard(where):
            tensor = self._table_at(schema.Tensor, tensors_start, index, where)
            name = self._string(tensor, 10, where)
            where = f"tensor {name!r}"
            shape_start, n_dims = self._vector(tensor, 4, 4, f"{where} shape")
            if n_dims > MAX_TENSOR_DIMS:
                raise InvalidArgumentError(
                    f"{self.source}: {where}: {n_dims} dimensions, at most {MAX_TENSOR_DIMS} allowed"
                )
            shape = _shared(struct.unpack_from(f"<{n_dims}i", self.buf, shape_start) if n_dims else ())
            type_code = tensor.Type()
            buffer_index = tensor.Buffer()
        for dim in shape:
            if not 0 <= dim < MAX_DIMENSION:
                raise InvalidArgumentError(
                    f"{self.source}: {where}: dimension {dim} in shape {list(shape)} is "
                    f"outside [0, {MAX_DIMENSION})"
                )
        dtype = tflite_dtype(type_code)
        if dtype is None:
            raise InvalidArgumentError(
                f"{self.source}: {where}: unsupported dtype {_type_name(type_code)}, "
                "expected FLOAT32, FLOAT16 or BFLOAT16"
            )
        if not 0 <= buffer_index < n_buffers:
            raise InvalidArgumentError(
                f"{self.source}: {where}: buffer index {buffer_index} is outside the "
                f"{n_buffers} buffers of the file"
            )
        with self._guard(f"{where} buffer"):
            buffer = self._table_at(schema.Buffer, buffers_start, buffer_index, f"buffer {buffer_index}")
        offset, nbytes, placement = self._data_range(buffer, where)
        expected = math.prod(shape) * dtype.itemsize
        if nbytes != expected:
            raise InvalidArgumentError(
                f"{self.source}: {where}: holds {nbytes} bytes of data, expected {expected} "
                f"for shape {list(shape)} of {dtype.name}"
            )
        return _shared(TensorInfo(name, shape, dtype, offset, nbytes, placement))

    def _data_range(self, buffer: Any, where: str) -> tuple[int, int, str]:
        with self._guard(f"{where} buffer"):
            external_offset = buffer.Offset()
            external_size = buffer.Size()
            inline_start, inline_len = self._vector(buffer, 4, 1, f"{where} data")
        if inline_len:
            return inline_start, inline_len, "inline"
        if external_offset > 1 or external_size > 0:
            end = external_offset + external_size
            if end > self.size:
                raise DataLossError(
                    f"{self.source}: {where}: data at bytes [{external_offset}, {end}) runs "
                    f"past the end of the {self.size}-byte input (truncated?)"
                )
            return external_offset, external_size, "external"
        return 0, 0, "inline"

    def _metadata_rank(self, model: Any) -> int | None:
        with self._guard("metadata"):
            metadata_start, n_metadata = self._vector(model, 16, _UOFFSET, "model.metadata")
            for i in range(n_metadata):
                entry = self._table_at(schema.Metadata, metadata_start, i, f"metadata {i}")
                if self._string(entry, 4, f"metadata {i}") == LORA_RANK_METADATA:
                    rank = int(entry.Buffer())
                    if not 0 < rank < MAX_DIMENSION:
                        raise InvalidArgumentError(
                            f"{self.source}: metadata {LORA_RANK_METADATA!r}={rank}, "
                            "expected a positive rank"
                        )
                    return rank
        return None

    # -- bounds-checked primitives -------------------------------------------------

    @contextmanager
    def _guard(self, where: str) -> Iterator[None]:
        """Turns a failure of the generated accessors into a status error."""
        try:
            yield
        except StatusError:
            raise
        except READ_ERRORS as exc:
            raise DataLossError(
                f"{self.source}: {where}: flatbuffer offset out of range ({exc}); "
                "the file is truncated or corrupt"
            ) from None
        except UnicodeDecodeError:
            raise InvalidArgumentError(f"{self.source}: {where}: name is not UTF-8") from None

    def _check_table(self, obj: Any, where: str) -> None:
        pos = obj._tab.Pos
        if not 0 <= pos <= self.size - _UOFFSET:
            raise DataLossError(f"{self.source}: {where}: table at byte {pos} is outside the input")
        vtable = pos - struct.unpack_from("<i", self.buf, pos)[0]
        if not 0 <= vtable <= self.size - 4:
            raise DataLossError(f"{self.source}: {where}: vtable at byte {vtable} is outside the input")

    def _vector(self, obj: Any, field: int, element_size: int, where: str) -> tuple[int, int]:
        """``(start, length)`` of a vector field, after checking it lies inside the input."""
        tab = obj._tab
        offset = tab.Offset(field)
        if not offset:
            return 0, 0
        start = tab.Vector(offset)
        length = tab.VectorLen(offset)
        if start < 0 or start + length * element_size > self.size:
            raise DataLossError(
                f"{self.source}: {where}: vector of {length} elements at byte {start} runs "
                f"past the end of the {self.size}-byte input"
            )
        return start, length

    def _table_at(self, table_class: type, vector_start: int, index: int, where: str) -> Any:
        """Element ``index`` of a checked vector of tables, as a schema object."""
        slot = vector_start + _UOFFSET * index
        table = table_class()
        table.Init(self.buf, slot + struct.unpack_from("<I", self.buf, slot)[0])
        self._check_table(table, where)
        return table

    def _string(self, obj: Any, field: int, where: str) -> str:
        if not obj._tab.Offset(field):
            raise InvalidArgumentError(f"{self.source}: {where}: has no name")
        tab = obj._tab
        start = tab.Indirect(tab.Pos + tab.Offset(field))
        if not 0 <= start <= self.size - _UOFFSET:
            raise DataLossError(f"{self.source}: {where}: name at byte {start} is outside the input")
        length = struct.unpack_from("<I", self.buf, start)[0]
        if start + _UOFFSET + length > self.size:
            raise DataLossError(f"{self.source}: {where}: name runs past the end of the input")
        return _shared(bytes(self.buf[start + _UOFFSET : start + _UOFFSET + length]).decode("utf-8"))


_SHARED: dict[Any, Any] = {}
_MAX_SHARED = 1 << 16


def _shared(value: Any) -> Any:
    """One object for equal names, shapes and tensor infos across every adapter read: each
    registered adapter keeps hundreds of them, mostly the same as the previous adapter's
    (bounded, so that random files cannot grow it forever)."""
    if len(_SHARED) < _MAX_SHARED:
        return _SHARED.setdefault(value, value)
    return _SHARED.get(value, value)


def _type_name(code: int) -> str:
    names = {v: k for k, v in vars(schema.TensorType).items() if not k.startswith("_")}
    return names.get(code, f"type code {code}")
