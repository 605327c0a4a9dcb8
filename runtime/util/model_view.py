"""Some signatures of a ``.tflite`` without copying its weights: a copy-on-write view.

LiteRT parses and compiles every subgraph of the model it is given (~30 ms of CPU per plain
signature of SmolLM2-135M, ~43 per LoRA one). To let it see only some signatures,
:meth:`ModelFile.view` maps the file ``MAP_PRIVATE`` (the weights stay the page cache's
pages, shared with every other mapping of the file and every process) and patches, in the
private copy of the few pages it touches, two vectors of the flatbuffer's root table:

- ``subgraphs``: the kept subgraphs' offsets moved to the front, the length cut to them;
- ``signature_defs``: likewise, and each kept signature's ``subgraph_index`` renumbered.

A vector of tables stores, per slot, the table's distance from that slot, so moving an
entry is rewriting one 32-bit offset (20-80 bytes written, well under a millisecond).
``buffers`` is left alone: buffer numbers do not change, so XNNPACK's weight cache file of
the whole model serves every view (it finds packed weights by buffer number).

A composite op (``STABLEHLO_COMPOSITE``: litert-torch's un-inlined ``odml.rms_norm``,
``odml.scaled_dot_product_attention``) names the subgraph of its decomposition: the view
keeps every subgraph the kept signatures' composites name (transitively), after the
signatures' own, and rewrites each such op's ``decomposition_subgraph_index`` in place.
Refused (:class:`ViewRefused`, with the reason): a model with control flow (``CALL``, ``IF``,
``WHILE``, ``CALL_ONCE``, ``STABLEHLO_WHILE``: other fields name subgraphs there), and a
composite whose index field is absent where its subgraph does not stay first. Such a model
is opened whole.

The same header also gives, without compiling anything, the signature keys
(:func:`signature_keys`) and every signature's inputs and outputs
(:func:`signature_details`, the form :meth:`ModelSpec.from_details` reads).
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from runtime.errors import DataLossError, FailedPreconditionError, InvalidArgumentError, NotFoundError
from runtime.util.attention_rewrite import FORMS_METADATA, LINEAR_ROWS, attention_forms, custom_codes
from runtime.util.flatbuffer_model import FILE_IDENTIFIER
from runtime.util.gguf_file import GGUF_MAGIC
from runtime.util.page_advice import advise_huge_pages
from runtime.util.scoped_file import refuse_unless_regular

# Field numbers of the tflite schema's tables this module reads.
_MODEL_OPERATOR_CODES, _MODEL_SUBGRAPHS, _MODEL_METADATA, _MODEL_SIGNATURES = 1, 2, 6, 7
_METADATA_NAME = 0
_CODE_DEPRECATED, _CODE_BUILTIN = 0, 3  # OperatorCode.deprecated_builtin_code (int8), .builtin_code (int32)
_SUBGRAPH_TENSORS, _SUBGRAPH_INPUTS, _SUBGRAPH_OUTPUTS, _SUBGRAPH_OPERATORS = 0, 1, 2, 3
_OP_OPCODE, _OP_OPTIONS_2 = 0, 12  # Operator.opcode_index, .builtin_options_2
_COMPOSITE_DECOMPOSITION = 1  # StableHLOCompositeOptions.decomposition_subgraph_index
_TENSOR_SHAPE, _TENSOR_TYPE = 0, 1
_SIG_INPUTS, _SIG_OUTPUTS, _SIG_KEY, _SIG_SUBGRAPH = 0, 1, 2, 4
_MAP_NAME, _MAP_TENSOR = 0, 1

# Builtin operators that name other subgraphs: CALL, IF, WHILE, CALL_ONCE, STABLEHLO_WHILE,
# STABLEHLO_COMPOSITE (the tflite schema's numbers).
SUBGRAPH_OPS = {31: "CALL", 118: "IF", 119: "WHILE", 129: "CALL_ONCE", 199: "STABLEHLO_WHILE",
                206: "STABLEHLO_COMPOSITE"}
_COMPOSITE = 206  # the one of them a view renumbers
# TensorType (the tflite schema's numbering) -> numpy dtype, for the types an LLM export uses.
_TENSOR_TYPES = {0: np.dtype(np.float32), 1: np.dtype(np.float16), 2: np.dtype(np.int32), 3: np.dtype(np.uint8),
                 4: np.dtype(np.int64), 6: np.dtype(np.bool_), 7: np.dtype(np.int16), 9: np.dtype(np.int8)}

_I32 = struct.Struct("<i")
_U32 = struct.Struct("<I")
_U16 = struct.Struct("<H")

Details = dict[str, tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]]


class ViewRefused(FailedPreconditionError):
    """The model cannot be viewed (its signatures compile only together); the message says why."""


class _Reader:
    """Positions in a flatbuffer: tables, fields, vectors (no bounds checks beyond the
    buffer's own: an out-of-range read raises ``struct.error``, turned into
    ``DataLossError`` by the callers)."""

    def __init__(self, buf: Any) -> None:
        self.buf = buf

    def field(self, table: int, index: int) -> int:
        """Absolute position of field ``index`` of the table at ``table``, or 0 when absent."""
        buf = self.buf
        vtable = table - _I32.unpack_from(buf, table)[0]
        slot = 4 + 2 * index
        if slot + 2 > _U16.unpack_from(buf, vtable)[0]:
            return 0
        offset = _U16.unpack_from(buf, vtable + slot)[0]
        return table + offset if offset else 0

    def vector(self, table: int, index: int) -> tuple[int, int]:
        """A vector field: the position of its first element and its length ((0, 0) when absent)."""
        at = self.field(table, index)
        if not at:
            return 0, 0
        start = at + _U32.unpack_from(self.buf, at)[0]
        return start + 4, _U32.unpack_from(self.buf, start)[0]

    def tables(self, table: int, index: int) -> list[int]:
        """A vector of tables: each table's position."""
        first, count = self.vector(table, index)
        unpack, buf = _U32.unpack_from, self.buf
        return [first + 4 * i + unpack(buf, first + 4 * i)[0] for i in range(count)]

    def string(self, table: int, index: int) -> str:
        """A string field ('' when absent)."""
        at = self.field(table, index)
        if not at:
            return ""
        start = at + _U32.unpack_from(self.buf, at)[0]
        length = _U32.unpack_from(self.buf, start)[0]
        return bytes(self.buf[start + 4:start + 4 + length]).decode("utf-8", errors="replace")

    def scalar(self, table: int, index: int, fmt: str, default: int = 0) -> int:
        """A scalar field, ``default`` when absent."""
        at = self.field(table, index)
        return struct.unpack_from("<" + fmt, self.buf, at)[0] if at else default

    def table(self, table: int, index: int) -> int:
        """A sub-table field's position, or 0 when absent."""
        at = self.field(table, index)
        return at + _U32.unpack_from(self.buf, at)[0] if at else 0

    def root(self) -> int:
        """The root table's position."""
        return _U32.unpack_from(self.buf, 0)[0]


def _checked(source: str):  # type: ignore[no-untyped-def]
    """Turns a read past the buffer into ``DataLossError`` naming ``source``."""
    class _Guard:
        def __enter__(self) -> None:
            return None

        def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
            if kind is not None and issubclass(kind, (struct.error, IndexError, UnicodeDecodeError)):
                raise DataLossError(f"{source}: not a readable .tflite flatbuffer ({exc})") from None
            return False
    return _Guard()


def signature_keys(buf: Any, source: str = "<model>") -> dict[str, int]:
    """``{signature key: subgraph index}`` of a model's bytes, in its order (the header only:
    well under a millisecond)."""
    with _checked(source):
        reader = _Reader(buf)
        return {reader.string(sig, _SIG_KEY): reader.scalar(sig, _SIG_SUBGRAPH, "i")
                for sig in reader.tables(reader.root(), _MODEL_SIGNATURES)}


def subgraph_references(buf: Any, source: str = "<model>") -> list[str]:
    """The builtin operators in the model's operator table that name other subgraphs
    (control flow, composites' decompositions), by name; reads the operator table only."""
    with _checked(source):
        reader = _Reader(buf)
        found = []
        for code in reader.tables(reader.root(), _MODEL_OPERATOR_CODES):
            value = max(reader.scalar(code, _CODE_DEPRECATED, "b"), reader.scalar(code, _CODE_BUILTIN, "i"))
            if value in SUBGRAPH_OPS:
                found.append(SUBGRAPH_OPS[value])
        return found


def view_refusal(buf: Any, source: str = "<model>") -> str | None:
    """Why the model cannot be viewed, or ``None`` when it can (composites are renumbered;
    control flow is not)."""
    references = sorted(set(subgraph_references(buf, source)) - {SUBGRAPH_OPS[_COMPOSITE]})
    if references:
        return (f"{source}: its ops {references} name other subgraphs, which a view does not renumber; its "
                "signatures compile together")
    return None


def _composite_fields(reader: _Reader, root: int, sub_tables: list[int], order: list[int],
                      source: str) -> list[tuple[int, int]]:
    """Appends to ``order`` every subgraph the composites of its subgraphs name
    (transitively); returns each such op's ``(index field position or 0 when absent, index)``."""
    codes = {i for i, code in enumerate(reader.tables(root, _MODEL_OPERATOR_CODES))
             if max(reader.scalar(code, _CODE_DEPRECATED, "b"), reader.scalar(code, _CODE_BUILTIN, "i")) == _COMPOSITE}
    fields: list[tuple[int, int]] = []
    if not codes:
        return fields
    seen = set(order)
    pending = list(order)
    while pending:
        for op in reader.tables(sub_tables[pending.pop()], _SUBGRAPH_OPERATORS):
            if reader.scalar(op, _OP_OPCODE, "I") not in codes:
                continue
            options = reader.table(op, _OP_OPTIONS_2)
            at = reader.field(options, _COMPOSITE_DECOMPOSITION) if options else 0
            target = _I32.unpack_from(reader.buf, at)[0] if at else 0
            if not 0 <= target < len(sub_tables):
                raise DataLossError(f"{source}: a composite names subgraph {target} of {len(sub_tables)}")
            fields.append((at, target))
            if target not in seen:
                seen.add(target)
                order.append(target)
                pending.append(target)
    return fields


def signature_details(buf: Any, keys: Sequence[str] | None = None, source: str = "<model>") -> Details:
    """``{key: (inputs, outputs)}``, each ``{name: {"shape": tuple, "dtype": np.dtype}}`` in the
    order the library lists them (the subgraph's), read from the flatbuffer itself (``keys``:
    only those signatures): what the library reports once a model compiled, before anything
    is compiled (SmolLM2-135M: ~16 ms for 16 signatures, ~80 ms for 56, on a loaded box)."""
    with _checked(source):
        reader = _Reader(buf)
        root = reader.root()
        subgraphs = reader.tables(root, _MODEL_SUBGRAPHS)
        wanted = None if keys is None else set(keys)
        details: Details = {}
        for sig in reader.tables(root, _MODEL_SIGNATURES):
            key = reader.string(sig, _SIG_KEY)
            if wanted is not None and key not in wanted:
                continue
            sub = subgraphs[reader.scalar(sig, _SIG_SUBGRAPH, "i")]
            tensors = reader.vector(sub, _SUBGRAPH_TENSORS)
            details[key] = (_tensor_maps(reader, sig, _SIG_INPUTS, tensors, _order(reader, sub, _SUBGRAPH_INPUTS),
                                         key, source),
                            _tensor_maps(reader, sig, _SIG_OUTPUTS, tensors, _order(reader, sub, _SUBGRAPH_OUTPUTS),
                                         key, source))
        if wanted is not None and len(details) != len(wanted):
            raise NotFoundError(f"{source}: no signature {sorted(wanted - set(details))}; it has "
                                f"{sorted(signature_keys(buf, source))}")
        return details


def _order(reader: _Reader, sub: int, index: int) -> dict[int, int]:
    """``{tensor number: its place}`` in a subgraph's inputs (or outputs) vector."""
    first, count = reader.vector(sub, index)
    return {number: place for place, number in enumerate(struct.unpack_from(f"<{count}i", reader.buf, first))}


def _tensor_maps(reader: _Reader, sig: int, index: int, tensors: tuple[int, int], order: dict[int, int], key: str,
                 source: str) -> dict[str, dict[str, Any]]:
    """A signature's inputs (or outputs) in the subgraph's order, as the library lists them
    (the signature's own vector is sorted by name)."""
    buf = reader.buf
    first, count = tensors
    found = []
    for entry in reader.tables(sig, index):
        name = reader.string(entry, _MAP_NAME)
        number = reader.scalar(entry, _MAP_TENSOR, "I")
        if number >= count:
            raise DataLossError(f"{source}: signature {key!r} tensor {name!r} is number {number} of {count}")
        slot = first + 4 * number
        tensor = slot + _U32.unpack_from(buf, slot)[0]
        shape_at, rank = reader.vector(tensor, _TENSOR_SHAPE)
        shape = struct.unpack_from(f"<{rank}i", buf, shape_at) if rank else ()
        kind = reader.scalar(tensor, _TENSOR_TYPE, "b")
        if kind not in _TENSOR_TYPES:
            raise InvalidArgumentError(f"{source}: signature {key!r} tensor {name!r} has tensor type {kind}, "
                                       f"expected one of {sorted(_TENSOR_TYPES)}")
        found.append((order.get(number, len(order)), name, {"shape": tuple(shape), "dtype": _TENSOR_TYPES[kind]}))
    return {name: detail for _, name, detail in sorted(found, key=lambda item: item[0])}


def patch_signatures(buf: Any, keys: Sequence[str], source: str = "<model>") -> int:
    """Patches ``buf`` (a writable model) in place so that it holds only the signatures
    ``keys`` (in that order) and their subgraphs; returns the bytes written.
    :class:`ViewRefused` for a model :func:`view_refusal` refuses or a signature that
    cannot be renumbered, ``NotFoundError`` for a key it does not have."""
    reason = view_refusal(buf, source)
    if reason:
        raise ViewRefused(reason)
    with _checked(source):
        reader = _Reader(buf)
        root = reader.root()
        sig_first, sig_count = reader.vector(root, _MODEL_SIGNATURES)
        sub_first, _ = reader.vector(root, _MODEL_SUBGRAPHS)
        sig_tables = reader.tables(root, _MODEL_SIGNATURES)
        sub_tables = reader.tables(root, _MODEL_SUBGRAPHS)
        by_key = {reader.string(sig, _SIG_KEY): i for i, sig in enumerate(sig_tables)}
        missing = [key for key in keys if key not in by_key]
        if missing or not keys:
            raise NotFoundError(f"{source}: a view of signatures {list(keys)}: no signature {missing}; it has "
                                f"{sorted(by_key)}")
        chosen = [by_key[key] for key in keys]
        old_subgraphs = [reader.scalar(sig_tables[i], _SIG_SUBGRAPH, "i") for i in chosen]
        order = list(dict.fromkeys(old_subgraphs))
        if 0 in order:  # subgraph 0 first when kept: a signature may lack the field (the default 0)
            order.remove(0)
            order.insert(0, 0)
        composites = _composite_fields(reader, root, sub_tables, order, source)
        new_index = {old: j for j, old in enumerate(order)}
        for at, old in composites:
            if not at and new_index[old]:
                raise ViewRefused(f"{source}: a composite names subgraph 0 without an index field to renumber")
        for key, index, old in zip(keys, chosen, old_subgraphs):
            if new_index[old] and not reader.field(sig_tables[index], _SIG_SUBGRAPH):
                raise ViewRefused(f"{source}: signature {key!r} has no subgraph_index field to renumber")
        written = 0
        for j, old in enumerate(order):
            slot = sub_first + 4 * j
            _U32.pack_into(buf, slot, sub_tables[old] - slot)
            written += 4
        _U32.pack_into(buf, sub_first - 4, len(order))
        for at, old in composites:
            if at and new_index[old] != old:
                _I32.pack_into(buf, at, new_index[old])
                written += 4
        for j, (index, old) in enumerate(zip(chosen, old_subgraphs)):
            slot = sig_first + 4 * j
            _U32.pack_into(buf, slot, sig_tables[index] - slot)
            at = reader.field(sig_tables[index], _SIG_SUBGRAPH)
            if at:
                _I32.pack_into(buf, at, new_index[old])
                written += 4
            written += 4
        _U32.pack_into(buf, sig_first - 4, len(chosen))
        return written + 8


def select_attention_form(model: Any, forms: dict[int, int], op_form: bool) -> None:
    """Makes the writable bytes ``model`` of a model carrying both ``forms`` of decode
    attention (:func:`runtime.util.attention_rewrite.attention_forms`) read as a model of
    one: the op forms in their standard subgraphs' places (``op_form``) or the standard forms
    left as they are; the op-form subgraphs cut off the end of the subgraph vector either way,
    and the pairing off the end of the metadata vector. Writes the two lengths and, for the
    op form, one offset per paired subgraph: a few bytes, in place (a copy-on-write mapping
    copies the pages they are in). ``InvalidArgumentError`` when a signature names an op-form
    subgraph or the bytes cannot be patched so."""
    reader = _Reader(model)
    root = reader.root()
    standard_count = min(forms.values())
    for key, subgraph in signature_keys(model).items():
        if subgraph >= standard_count:
            raise InvalidArgumentError(f"signature {key!r} runs subgraph {subgraph}, an op form of {FORMS_METADATA}")
    first, _ = reader.vector(root, _MODEL_SUBGRAPHS)
    if op_form:
        for standard, op in forms.items():
            entry, op_entry = first + 4 * standard, first + 4 * op
            target = op_entry + _U32.unpack_from(model, op_entry)[0]  # where the op form's table lies
            if not 0 < target - entry < 2**32:
                raise InvalidArgumentError(f"subgraph {op}'s table lies before the subgraph vector: the two forms "
                                           "cannot be chosen between in place")
            _U32.pack_into(model, entry, target - entry)
    _U32.pack_into(model, first - 4, standard_count)
    entries = reader.tables(root, _MODEL_METADATA)
    if not entries or reader.string(entries[-1], _METADATA_NAME) != FORMS_METADATA:
        raise InvalidArgumentError(f"the {FORMS_METADATA} entry is not the last of the model's metadata")
    metadata_first, _ = reader.vector(root, _MODEL_METADATA)
    _U32.pack_into(model, metadata_first - 4, len(entries) - 1)


def weights_read_in_place(model: memoryview | bytes) -> bool:
    """Whether the steps of ``model`` (its bytes, in the form shown) read its weights from the
    model's own mapping: the float32 linear layers' op, ``LINEAR_ROWS``. Other models' steps
    read XNNPACK's packed copy."""
    try:
        return LINEAR_ROWS in custom_codes(model)
    except (struct.error, TypeError, ValueError, IndexError):  # a table the flatbuffers package cannot read
        return False


def advise_weights_read_in_place(mapping: mmap.mmap, model: memoryview | bytes) -> bool:
    """For a model whose steps read its weights from this mapping (:func:`weights_read_in_place`),
    asks for the pages not in memory yet to come 2 MB at a time (:mod:`runtime.util.page_advice`);
    whether it asked and the system took it. Other models' steps read XNNPACK's packed copy, and
    the advice would only bring 2 MB runs of weights around the open's scattered reads into
    memory (an int8 SmolLM2: 103 MB against 13)."""
    return weights_read_in_place(model) and advise_huge_pages(mapping)


@dataclass
class ModelView:
    """A private, patched mapping of a model showing only :attr:`keys`: :attr:`data` is what
    LiteRT is given. Unmapped once nothing refers to it any more (a compiled model reading
    it keeps it)."""

    keys: tuple[str, ...]
    data: memoryview
    patched_bytes: int
    _mapping: mmap.mmap = field(repr=False)


@dataclass(frozen=True)
class ModelFile:
    """A model stored in a file: the whole file, or the bytes ``begin``... ``end`` of it (a
    ``.litertlm`` bundle's model section)."""

    path: Path
    begin: int = 0
    end: int | None = None

    def _map(self, private: bool) -> tuple[mmap.mmap, memoryview]:
        """The file mapped from the page holding :attr:`begin`, and the model's bytes in it."""
        start = self.begin - self.begin % mmap.ALLOCATIONGRANULARITY
        try:  # (non-blocking: a FIFO is refused below rather than waited on)
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            raise NotFoundError(f"{self.path}: cannot open the model file: {exc.strerror}") from None
        try:
            refuse_unless_regular(fd, self.path, "a model file")  # mmap would fail with "No such device"
            size = os.fstat(fd).st_size
            end = size if self.end is None else self.end
            if not self.begin < end <= size:
                raise InvalidArgumentError(f"{self.path}: the model at bytes {self.begin}...{end} of a "
                                           f"{size}-byte file")
            head = os.pread(fd, 8, self.begin)
            if head.startswith(GGUF_MAGIC):
                raise InvalidArgumentError(f"{self.path}: a GGUF model, which the runtime does not run: `runtime "
                                           "export` makes a .tflite model of it (the export extra; docs/export.md)")
            if head[4:] != FILE_IDENTIFIER:
                raise InvalidArgumentError(f"{self.path}: not a .tflite model (no TFL3 file identifier at byte "
                                           f"{self.begin + 4})")
            if private:
                mapping = mmap.mmap(fd, end - start, flags=mmap.MAP_PRIVATE,
                                    prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
            else:
                mapping = mmap.mmap(fd, end - start, access=mmap.ACCESS_READ, offset=start)
        finally:
            os.close(fd)
        return mapping, memoryview(mapping)[self.begin - start:]

    def header(self) -> memoryview:
        """The model's bytes, mapped read-only (only the pages read are loaded)."""
        return self._map(private=False)[1]

    def view(self, keys: Sequence[str], *, attention_op_form: bool | None = None) -> ModelView:
        """A copy-on-write mapping of the model showing only the signatures ``keys``;
        :class:`ViewRefused` when the model cannot be viewed. ``attention_op_form``: for a
        model carrying both forms of decode attention, the form shown (``True``: the custom
        op's; ``False``: the standard one; ``None``: the model is shown as it is)."""
        mapping, data = self._map(private=True)
        if attention_op_form is not None:
            try:
                forms = attention_forms(data)
                if forms:
                    select_attention_form(data, forms, op_form=attention_op_form)
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(f"{self.path}: {exc.args[0]}") from None
        written = patch_signatures(data, keys, str(self.path))
        if attention_op_form is not False:  # (the standard form shown: no op reads the weights)
            advise_weights_read_in_place(mapping, data)
        return ModelView(tuple(keys), data, written, mapping)

