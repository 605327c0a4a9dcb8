"""The base model's projection weights, read from the ``.tflite`` itself.

An adapter that is not a plain LoRA needs them: an R-only LoRA-XS adapter rebuilds its A
and B from each projection's weight ``W`` ``[out, in]``. ``runtime export`` writes where
each projection lies as the model's ``runtime.projections`` metadata (see
``runtime/export/projection_map.py``): per ``"{layer}.{projection}"``, the shape of the
tensor that holds its rows (litert-torch fuses q/k/v), the rows as ``[start, count]`` runs
in the checkpoint's order, and probe values by which the tensor is found among the model's
constant tensors, whatever the converter named it. Float32 and float16 weights read as they
are; int8 ones (``--quantize int8``, ``int8-weights``) are dequantized per channel, so ``W``
is the quantized model's own weight, not the checkpoint's.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from ai_edge_litert import schema_py_generated as schema

from runtime.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from runtime.util.flatbuffer_model import metadata_bytes

METADATA_NAME = "runtime.projections"
_DTYPES = {schema.TensorType.FLOAT32: np.dtype(np.float32), schema.TensorType.FLOAT16: np.dtype(np.float16),
           schema.TensorType.INT8: np.dtype(np.int8)}


@dataclass(frozen=True)
class _Entry:
    shape: tuple[int, int]
    rows: tuple[tuple[int, int], ...]
    probe: tuple[tuple[int, float], ...]


class ModelWeights:
    """Reads ``W`` ``[out, in]`` float32 of any mapped projection of one model. Thread-safe."""

    @classmethod
    def open(cls, model: str | os.PathLike[str] | bytes | memoryview, source: str) -> ModelWeights:
        """The weights of a model file (memory-mapped: only what is read is paged in) or
        of a model's bytes (or a view of them)."""
        if isinstance(model, (bytes, memoryview)):
            return cls(model, source)
        try:
            with open(model, "rb") as file:
                return cls(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ), source)
        except OSError as exc:
            raise NotFoundError(f"{source}: cannot read the model: {exc.strerror}") from None

    def __init__(self, model: bytes | memoryview | mmap.mmap, source: str) -> None:
        """``model``: the ``.tflite`` bytes (or a memory map of them), kept while in use."""
        self._buffer = model
        self._source = source
        self._model = schema.Model.GetRootAs(model, 0)
        self._entries = self._read_map()
        self._tensors: dict[tuple[int, int], Any] = {}  # entry shape + first probe -> tensor
        self._by_shape: dict[tuple[int, ...], list[Any]] | None = None  # the decode subgraph's constants
        self._lock = threading.Lock()

    @property
    def source(self) -> str:
        """The model's name in messages (its file, usually)."""
        return self._source

    def shape(self, layer: int, projection: str) -> tuple[int, int]:
        """``(out, in)`` of the projection's weight."""
        entry = self._entry(layer, projection)
        return sum(count for _, count in entry.rows), entry.shape[1]

    def weight(self, layer: int, projection: str) -> np.ndarray:
        """The projection's weight, float32 ``[out, in]`` (a new array).
        ``InvalidArgumentError`` when it holds a NaN or an infinity (what is built from it,
        a LoRA-XS SVD or DoRA's norms, would be too)."""
        entry = self._entry(layer, projection)
        tensor = self._tensor(entry, f"{layer}.{projection}")
        rows = np.concatenate([np.arange(start, start + count) for start, count in entry.rows])
        weight = self._dequantized(tensor, rows)
        if not np.isfinite(weight).all():
            raise InvalidArgumentError(f"{self._source}: the base weight of layer {layer} projection {projection!r} "
                                       "holds NaN or infinite values")
        return weight

    # -- the map and the tensors ---------------------------------------------------

    def _read_map(self) -> Mapping[str, _Entry]:
        raw = metadata_bytes(self._buffer, METADATA_NAME)
        if raw is None:
            raise FailedPreconditionError(
                f"{self._source}: the model has no {METADATA_NAME} metadata (where its base weights lie); "
                "export it again with this version of `python -m runtime export`")
        try:
            found = json.loads(bytes(raw).rstrip(b"\0"))
            return {key: _Entry(tuple(value["shape"]), tuple(map(tuple, value["rows"])),
                                tuple((int(i), float(v)) for i, v in value["probe"]))
                    for key, value in found["projections"].items()}
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgumentError(f"{self._source}: {METADATA_NAME} metadata is unreadable: {exc}") from None

    def _entry(self, layer: int, projection: str) -> _Entry:
        entry = self._entries.get(f"{layer}.{projection}")
        if entry is None:
            raise NotFoundError(f"{self._source}: the model's {METADATA_NAME} has no weight for layer {layer} "
                                f"projection {projection!r}")
        return entry

    def _tensor(self, entry: _Entry, what: str) -> Any:
        """The constant tensor of ``entry``'s shape whose probe values match (within half a
        quantization step, float16's rounding, or float32's last bits), the best if several."""
        key = (*entry.shape, *entry.probe[0])
        with self._lock:
            if key in self._tensors:
                return self._tensors[key]
        positions = np.array([position for position, _ in entry.probe])
        expected = np.array([value for _, value in entry.probe], np.float32)
        rows, columns = np.divmod(positions, entry.shape[1])
        best, best_error = None, np.inf
        for tensor in self._constants().get(entry.shape, ()):
            got = self._dequantized(tensor, rows)[np.arange(len(rows)), columns]
            error = float(np.max(np.abs(got - expected) / self._tolerance(tensor, rows, expected)))
            if error < best_error:
                best, best_error = tensor, error
        if best is None or best_error > 1.0:
            raise NotFoundError(f"{self._source}: no constant tensor {list(entry.shape)} holds the base weight of "
                                f"{what} (float32, float16 and int8 weights are read; int4 ones are not)")
        with self._lock:
            self._tensors[key] = best
        return best

    def _constants(self) -> dict[tuple[int, ...], list[Any]]:
        """The decode subgraph's constant float32, float16 and int8 tensors by shape (read
        once: walking the subgraph's thousands of tensors per lookup took seconds at real size)."""
        with self._lock:
            if self._by_shape is None:
                by_shape: dict[tuple[int, ...], list[Any]] = {}
                subgraph = self._model.Subgraphs(self._decode_subgraph())
                for index in range(subgraph.TensorsLength()):
                    tensor = subgraph.Tensors(index)
                    if tensor.Type() in _DTYPES and self._bytes(self._model.Buffers(tensor.Buffer())).nbytes:
                        by_shape.setdefault(tuple(tensor.ShapeAsNumpy()), []).append(tensor)
                self._by_shape = by_shape
            return self._by_shape

    def _decode_subgraph(self) -> int:
        """The subgraph of ``decode``: every weight is used there (a prefill without logits
        drops the last layer's output projection and MLP)."""
        model = self._model
        for index in range(model.SignatureDefsLength()):
            signature = model.SignatureDefs(index)
            if signature.SignatureKey() == b"decode":
                return signature.SubgraphIndex()
        raise InvalidArgumentError(f"{self._source}: the model has no 'decode' signature")

    @staticmethod
    def _tolerance(tensor: Any, rows: np.ndarray, expected: np.ndarray) -> np.ndarray:
        if tensor.Type() == schema.TensorType.INT8:
            scale = tensor.Quantization().ScaleAsNumpy()
            return 0.51 * (scale[rows] if scale.size > 1 else scale[0]) + 1e-7
        relative = 1e-3 if tensor.Type() == schema.TensorType.FLOAT16 else 1e-6
        return relative * np.abs(expected) + 1e-12

    def _dequantized(self, tensor: Any, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` of ``tensor`` as float32."""
        shape = tuple(tensor.ShapeAsNumpy())
        dtype = _DTYPES[tensor.Type()]
        data = np.frombuffer(self._bytes(self._model.Buffers(tensor.Buffer())), dtype=dtype).reshape(shape)
        picked = data[rows].astype(np.float32)
        if tensor.Type() != schema.TensorType.INT8:
            return picked
        quantization = tensor.Quantization()
        scale, zero = quantization.ScaleAsNumpy(), quantization.ZeroPointAsNumpy()
        if quantization.QuantizedDimension() != 0 and scale.size > 1:
            raise InvalidArgumentError(f"{self._source}: int8 weights quantized along axis "
                                       f"{quantization.QuantizedDimension()}, expected the output axis 0")
        zero = zero if np.size(zero) else np.zeros(1, np.int64)
        per_row = (lambda v: np.reshape(v[rows] if v.size > 1 else v[:1], (-1, 1)))
        return ((picked - per_row(zero)) * per_row(scale)).astype(np.float32)

    def _bytes(self, buffer: Any) -> memoryview:
        """A buffer's bytes, inline or after the flatbuffer (``offset``/``size``)."""
        if buffer.DataLength():
            return memoryview(buffer.DataAsNumpy())  # a view of the model's bytes
        if buffer.Offset() > 1:
            return memoryview(self._buffer)[buffer.Offset():buffer.Offset() + buffer.Size()]
        return memoryview(b"")
