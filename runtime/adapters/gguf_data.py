"""llama.cpp GGUF LoRA adapters as AdapterData, read with the ``gguf`` package (memory-mapped).

A GGUF LoRA has ``general.type = "adapter"``, ``adapter.type = "lora"``,
``adapter.lora.alpha`` and tensors ``blk.<N>.{attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,ffn_down}.weight.lora_{a,b}``;
as numpy arrays ``lora_a`` is ``[r, in]`` and ``lora_b`` ``[out, r]``, like PEFT's A and
B. llama.cpp scales by ``alpha / r`` (by 1 when alpha is 0).

llama.cpp's converter permutes the rows of Llama's q and k projections (and so of their
LoRA ``b``) into its own RoPE layout, head by head. The runtime's models keep the
Hugging Face layout, so for ``general.architecture = "llama"`` those rows are put back,
which needs the model's head size.
"""

from __future__ import annotations

import functools
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime.errors import FailedPreconditionError, InvalidArgumentError, UnimplementedError
from runtime.adapters.adapter_data import MAX_LAYERS, DerivedLoraData, DerivedTensor, LazyLoraData, refuse_unappliable
from runtime.adapters.lora_util import PROJECTIONS, Convention, lora_input_name
from runtime.util.gguf_file import GGUF_MAGIC
from runtime.util.scoped_file import FileWatch

_NAME = re.compile(r"blk\.(?P<layer>0|[1-9][0-9]*)\.(?P<proj>attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)"
                   r"\.weight\.lora_(?P<side>a|b)")
# llama.cpp's tensor names -> ours; its names are what the error messages show.
_PROJECTIONS = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
                "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"}
_GGUF_NAMES = {ours: theirs for theirs, ours in _PROJECTIONS.items()}
# Architectures whose converter permutes q/k rows for llama.cpp's RoPE ("LlamaModel.permute").
_ROPE_PERMUTED = {"llama"}


def read_gguf_lora(path: str | os.PathLike[str], head_dim: int | None = None) -> LazyLoraData:
    """Opens a GGUF LoRA adapter. ``head_dim`` is needed to undo llama's q/k row permutation.

    The file is read and checked in full with the ``gguf`` reader; the adapter keeps where
    its tensors lie (:class:`_Layout`) and maps the file again at first use, without the
    reader (whose objects took ~6 KiB per tensor, and its parsing most of a first use)."""
    path = Path(path)
    watch = FileWatch(path)
    return LazyLoraData.of(functools.partial(_map, path, _check(path, head_dim)), (watch,))


@dataclass(frozen=True)
class _Layout:
    """Where a checked adapter's pairs lie in its file, and how to apply them."""

    alpha: float  # adapter.lora.alpha: each pair is scaled by alpha / r (by 1 when alpha is 0)
    permuted: bool  # q and k rows are in llama.cpp's RoPE order
    head_dim: int | None
    byte_order: str  # the gguf reader's: "I" native, "S" swapped
    # int32 [pairs, 7]: layer, projection (index into PROJECTIONS), fan-in, rank, fan-out, and
    # the GGML types of lora_a and lora_b; int64 [pairs, 2]: their data offsets in the file.
    pairs: np.ndarray
    offsets: np.ndarray


def _check(path: Path, head_dim: int | None) -> _Layout:
    """Reads and checks the whole file with the gguf reader."""
    from gguf import GGUFReader

    check_gguf_header(path)
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, TypeError) as exc:
        raise InvalidArgumentError(f"{path}: not a readable GGUF file: {exc}") from None
    fields = {name: _value(field) for name, field in reader.fields.items()}
    general_type = fields.get("general.type")
    if general_type != "adapter":
        raise InvalidArgumentError(f"{path}: general.type is {general_type!r}, expected 'adapter'")
    if fields.get("adapter.type") != "lora":
        raise InvalidArgumentError(f"{path}: adapter.type is {fields.get('adapter.type')!r}, expected 'lora'")
    alpha = fields.get("adapter.lora.alpha", 0.0)
    if not isinstance(alpha, int | float):
        raise InvalidArgumentError(f"{path}: adapter.lora.alpha is {alpha!r}, expected a number")
    architecture = fields.get("general.architecture")

    pairs: dict[tuple[int, str], dict[str, Any]] = {}
    refused = []
    for tensor in reader.tensors:
        match = _NAME.fullmatch(tensor.name)
        if match is None:
            refused.append(tensor.name)
            continue
        key = (int(match["layer"]), _PROJECTIONS[match["proj"]])
        pairs.setdefault(key, {})[match["side"]] = tensor
    refuse_unappliable(str(path), refused)
    if not pairs:
        raise InvalidArgumentError(f"{path}: no LoRA tensors found")
    permuted = architecture in _ROPE_PERMUTED
    rows, offsets = [], []
    for (layer, projection), sides in sorted(pairs.items()):
        name = f"blk.{layer}.{_GGUF_NAMES[projection]}.weight"
        if set(sides) != {"a", "b"}:
            missing = "lora_b" if "a" in sides else "lora_a"
            raise InvalidArgumentError(f"{path}: {name} has no {missing} (half of a LoRA pair is missing)")
        a, b = sides["a"], sides["b"]
        a_shape, b_shape = tuple(int(d) for d in reversed(a.shape)), tuple(int(d) for d in reversed(b.shape))
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1] or a_shape[0] == 0:
            raise InvalidArgumentError(
                f"{path}: {name}.lora_a {list(a_shape)} and .lora_b {list(b_shape)} are not a LoRA "
                "pair (expected [r, in] and [out, r])"
            )
        if permuted and projection in ("q", "k") and head_dim is not None and (b_shape[0] % head_dim or head_dim % 2):
            raise InvalidArgumentError(
                f"{path}: {name}.lora_b has {b_shape[0]} rows, not whole heads of the even head size {head_dim}"
            )
        if layer >= MAX_LAYERS:
            raise InvalidArgumentError(f"{path}: {name} is in layer {layer}, beyond the {MAX_LAYERS} layers of any model")
        rows.append((layer, PROJECTIONS.index(projection), a_shape[1], a_shape[0], b_shape[0],
                     int(a.tensor_type), int(b.tensor_type)))
        offsets.append((int(a.data_offset), int(b.data_offset)))
    return _Layout(float(alpha), permuted, head_dim, reader.byte_order,
                   _read_only(np.array(rows, np.int32)), _read_only(np.array(offsets, np.int64)))


@dataclass(frozen=True)
class _Stored:
    """One tensor as the file holds it: its name (for messages), GGML type and data, a
    view of the mapped file shaped as the gguf reader shapes it."""

    name: str
    tensor_type: int
    data: np.ndarray


def _map(path: Path, layout: _Layout) -> DerivedLoraData:
    """The adapter's tensors, each computed from the mapped file when read."""
    watch = FileWatch(path)
    with open(path, "rb") as stream:
        mapping = mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ)
    mapped = np.frombuffer(mapping, dtype=np.uint8)
    tensors: dict[str, DerivedTensor] = {}
    for (layer, index, fan_in, rank, fan_out, a_type, b_type), (a_offset, b_offset) in zip(
            layout.pairs.tolist(), layout.offsets.tolist(), strict=True):
        projection = PROJECTIONS[index]
        name = f"blk.{layer}.{_GGUF_NAMES[projection]}.weight"
        a = _Stored(f"{name}.lora_a", a_type, _view(mapped, a_offset, a_type, (rank, fan_in), layout.byte_order))
        b = _Stored(f"{name}.lora_b", b_type, _view(mapped, b_offset, b_type, (fan_out, rank), layout.byte_order))
        scale = layout.alpha / rank if layout.alpha else 1.0
        needs_head_dim = layout.permuted and projection in ("q", "k")
        tensors[lora_input_name(Convention.LITERT_TORCH, layer, projection, "a")] = DerivedTensor(
            (fan_in, rank), np.dtype(np.float32), _a_prime(a, (rank, fan_in), scale, path)
        )
        tensors[lora_input_name(Convention.LITERT_TORCH, layer, projection, "b")] = DerivedTensor(
            (rank, fan_out), np.dtype(np.float32), _b_prime(b, (fan_out, rank), needs_head_dim, layout.head_dim, path)
        )

    def release() -> None:
        if not mapping.closed:
            mapping.madvise(mmap.MADV_DONTNEED)

    return DerivedLoraData(tensors, source_name=str(path), format_name="gguf", watches=(watch,), release=release)


# The GGML types the gguf reader views as numbers; it views every other one as bytes.
_NUMBERS = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
            "I32": np.int32, "I64": np.int64}


def _view(mapped: np.ndarray, offset: int, kind: int, shape: tuple[int, int], byte_order: str) -> np.ndarray:
    """A tensor's data in the mapped file, as the gguf reader views it (its ``_build_tensors``)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    ggml_type = GGMLQuantizationType(kind)
    count = shape[0] * shape[1]
    if ggml_type.name in _NUMBERS:
        dtype = np.dtype(_NUMBERS[ggml_type.name])
        data = mapped[offset : offset + count * dtype.itemsize].view(dtype)
        return data.view(data.dtype.newbyteorder(byte_order)).reshape(shape)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    return mapped[offset : offset + count * type_size // block_size].reshape(quant_shape_to_byte_shape(shape, ggml_type))


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


# GGUF value types: fixed sizes; 8 = string, 9 = array.
_FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
MAX_ITEMS = 1 << 20  # metadata arrays and tensor counts; an adapter has a few hundred
MAX_HEADER_BYTES = 1 << 24


def check_gguf_header(path: Path) -> None:
    """Walks the GGUF header with bounds checks before the ``gguf`` reader sees it.

    The reader trusts counts: a corrupt array length makes it loop for billions of
    elements over a small file. Every count and length is checked against the bytes
    that remain, and against ``MAX_ITEMS``.
    """
    with open(path, "rb") as file:
        data = file.read(MAX_HEADER_BYTES)
    cursor = 0

    def take(size: int, what: str) -> bytes:
        nonlocal cursor
        if size < 0 or cursor + size > len(data):
            raise InvalidArgumentError(f"{path}: not a readable GGUF file: {what} runs past the end of the header")
        chunk = data[cursor : cursor + size]
        cursor += size
        return chunk

    def number(fmt: str, what: str) -> int:
        return struct.unpack("<" + fmt, take(struct.calcsize(fmt), what))[0]

    def count(what: str, item_size: int) -> int:
        n = number("Q", what)
        if n > MAX_ITEMS or n * item_size > len(data) - cursor:
            raise InvalidArgumentError(f"{path}: not a readable GGUF file: {what} of {n} items is implausible")
        return n

    def value(kind: int, what: str, depth: int = 0) -> None:
        if kind in _FIXED_SIZES:
            take(_FIXED_SIZES[kind], what)
        elif kind == _STRING:
            take(count(what, 1), what)
        elif kind == _ARRAY and depth < 2:
            item_kind = number("I", what)
            for _ in range(count(what, _FIXED_SIZES.get(item_kind, 8))):
                value(item_kind, what, depth + 1)
        else:
            raise InvalidArgumentError(f"{path}: not a readable GGUF file: {what} has unknown value type {kind}")

    if take(4, "magic") != GGUF_MAGIC:
        raise InvalidArgumentError(f"{path}: not a readable GGUF file: wrong magic")
    version = number("I", "version")
    if version not in (2, 3):
        raise InvalidArgumentError(f"{path}: not a readable GGUF file: version {version}, expected 2 or 3")
    tensors = count("tensor count", 8 + 4 + 4 + 8)
    for index in range(count("metadata count", 8 + 4)):
        key = take(count(f"metadata key {index}", 1), f"metadata key {index}")
        value(number("I", f"metadata {key!r} type"), f"metadata {key!r}")
    for index in range(tensors):
        take(count(f"tensor {index} name", 1), f"tensor {index} name")
        dims = number("I", f"tensor {index} dimensions")
        if dims > 4:
            raise InvalidArgumentError(f"{path}: not a readable GGUF file: tensor {index} has {dims} dimensions")
        take(8 * dims + 4 + 8, f"tensor {index} info")


def _a_prime(tensor: Any, shape: tuple[int, int], scale: float, path: Path):
    def compute() -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore"):  # non-finite values are refused later
            return (np.float32(scale) * _dequantize(tensor, shape, path)).T

    return compute


def _b_prime(tensor: Any, shape: tuple[int, int], permuted: bool, head_dim: int | None, path: Path):
    def compute() -> np.ndarray:
        b = _dequantize(tensor, shape, path)
        if permuted:
            if head_dim is None:
                raise FailedPreconditionError(
                    f"{path}: tensor {tensor.name!r}: undoing llama.cpp's RoPE row order needs the "
                    "model's head size (open the adapter with head_dim=)"
                )
            b = undo_rope_permutation(b, head_dim)
        return b.T

    return compute


def undo_rope_permutation(rows: np.ndarray, head_dim: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute``: per head, rows ``[0, 2, 4, .., 1, 3, ..]`` order
    back to the Hugging Face ``[first half, second half]`` order."""
    heads = rows.shape[0] // head_dim
    return rows.reshape(heads, head_dim // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _dequantize(tensor: Any, shape: tuple[int, int], path: Path) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kind = GGMLQuantizationType(tensor.tensor_type)
    if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        data = np.asarray(tensor.data, dtype=np.float32)
    else:
        try:
            data = dequantize(np.asarray(tensor.data), kind).astype(np.float32)
        except (NotImplementedError, ValueError, TypeError) as exc:
            raise UnimplementedError(f"{path}: tensor {tensor.name!r}: cannot read {kind.name} data: {exc}") from None
    if data.size != shape[0] * shape[1]:
        raise InvalidArgumentError(
            f"{path}: tensor {tensor.name!r} holds {data.size} values, expected {shape[0]} x {shape[1]}"
        )
    return data.reshape(shape)


def _value(field: Any) -> Any:
    try:
        return field.contents()
    except (ValueError, IndexError, TypeError, UnicodeDecodeError):
        return None
