"""Signature subsets of a ``.tflite`` without copying its weights: a copy-on-write view.

LiteRT compiles every subgraph of the model it is given. To let it see only some
signatures, :func:`subset_view` maps the file ``MAP_PRIVATE`` (the weights stay the page
cache's pages, shared with every other mapping of the file) and patches, in the private
copy of the few pages it touches, two vectors of the flatbuffer's root table:

- ``subgraphs``: the kept subgraphs' offsets moved to the front, the length cut to them;
- ``signature_defs``: likewise, and each kept signature's ``subgraph_index`` renumbered.

A vector of tables stores, per slot, the table's distance from that slot, so moving an
entry is rewriting one 32-bit offset. ``buffers`` is left alone: buffer numbers do not
change, so XNNPACK's weight cache file of the whole model serves every view (its packed
weights are looked up by buffer number).

Refused (``ValueError``): a model whose operator table has ops that name other subgraphs
(composites' decompositions, control flow: :func:`subgraph_ops`, a read of the operator
table only; SmolLM2's exports have none, one subgraph per signature, but the committed
fixtures ``benchmarks/models/bench_f32.tflite`` and ``runtime/demo_assets/model.tflite``
carry ``STABLEHLO_COMPOSITE`` ops), and a kept signature whose ``subgraph_index`` field is
absent (the default 0) unless its subgraph stays first.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from ai_edge_litert import schema_py_generated as schema

# Field numbers of the root table (tflite schema): Model.subgraphs, Model.signature_defs;
# SignatureDef.subgraph_index.
_MODEL_SUBGRAPHS, _MODEL_SIGNATURES, _SIG_SUBGRAPH = 2, 7, 4
_SUBGRAPH_OPTIONS = ("decompositionSubgraphIndex", "thenSubgraphIndex", "elseSubgraphIndex",
                     "condSubgraphIndex", "bodySubgraphIndex", "subgraphIndex", "initSubgraphIndex")


@dataclass
class View:
    """A patched private mapping of a model file, the bytes LiteRT is given."""

    path: str
    keys: tuple[str, ...]
    mapping: mmap.mmap
    array: np.ndarray  # the mapping as uint8, what NativeModel takes (bytes / memoryview / array)
    patched_bytes: int  # bytes written (private copies are made of their pages only)

    def close(self) -> None:
        """Unmaps (only once nothing refers to :attr:`array` any more)."""
        self.array = np.empty(0, np.uint8)
        try:
            self.mapping.close()
        except BufferError:  # a library object still holds a view: the mapping goes with it
            pass


def _field(buf: memoryview | mmap.mmap, table: int, index: int) -> int:
    """Absolute position of field ``index`` of the table at ``table``, or 0 when absent."""
    vtable = table - struct.unpack_from("<i", buf, table)[0]
    size = struct.unpack_from("<H", buf, vtable)[0]
    slot = 4 + 2 * index
    if slot + 2 > size:
        return 0
    offset = struct.unpack_from("<H", buf, vtable + slot)[0]
    return table + offset if offset else 0


def _vector(buf: memoryview | mmap.mmap, table: int, index: int) -> tuple[int, list[int]]:
    """A vector-of-tables field: its position and its tables' absolute positions."""
    at = _field(buf, table, index)
    start = at + struct.unpack_from("<I", buf, at)[0]
    count = struct.unpack_from("<I", buf, start)[0]
    tables = []
    for i in range(count):
        slot = start + 4 + 4 * i
        tables.append(slot + struct.unpack_from("<I", buf, slot)[0])
    return start, tables


def signature_keys(path: str) -> list[tuple[str, int]]:
    """``[(key, subgraph index)]`` of a model file, in its order (reads the header only)."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        root = schema.Model.GetRootAs(data, 0)
        return [(root.SignatureDefs(i).SignatureKey().decode(), root.SignatureDefs(i).SubgraphIndex())
                for i in range(root.SignatureDefsLength())]


_SUBGRAPH_OPS = {getattr(schema.BuiltinOperator, name) for name in (
    "CALL", "IF", "WHILE", "CALL_ONCE", "STABLEHLO_WHILE", "STABLEHLO_COMPOSITE")}


def subgraph_ops(buf: memoryview | mmap.mmap | np.ndarray) -> list[int]:
    """The builtin codes in the model's operator table that name other subgraphs (control
    flow, composites' decompositions); reads the operator table only (microseconds)."""
    root = schema.Model.GetRootAs(buf, 0)
    codes = []
    for i in range(root.OperatorCodesLength()):
        code = root.OperatorCodes(i)
        value = max(code.BuiltinCode(), code.DeprecatedBuiltinCode())
        if value in _SUBGRAPH_OPS:
            codes.append(value)
    return codes


def patch_signatures(buf: memoryview | mmap.mmap, keys: Sequence[str], *, cut_subgraphs: bool = True) -> int:
    """Patches ``buf`` (a writable model) in place so that it holds only the signatures
    ``keys`` (in that order) and their subgraphs; returns the bytes written. Without
    ``cut_subgraphs`` only the signature table is cut: every subgraph stays listed (do
    subgraphs no signature names cost anything at open?)."""
    if subgraph_ops(buf):
        raise ValueError("the model's ops name other subgraphs (control flow or composites): a view would have "
                         "to renumber them; open it whole")
    root = struct.unpack_from("<I", buf, 0)[0]
    sig_start, sig_tables = _vector(buf, root, _MODEL_SIGNATURES)
    sub_start, sub_tables = _vector(buf, root, _MODEL_SUBGRAPHS)
    model = schema.Model.GetRootAs(buf, 0)
    by_key = {model.SignatureDefs(i).SignatureKey().decode(): i for i in range(len(sig_tables))}
    missing = [k for k in keys if k not in by_key]
    if missing:
        raise ValueError(f"no signature {missing} (has {sorted(by_key)})")
    chosen = [by_key[k] for k in keys]
    old_subgraphs = [model.SignatureDefs(i).SubgraphIndex() for i in chosen]
    order: list[int] = []
    for sub in old_subgraphs:  # subgraph 0 first when kept: a signature may lack the field
        if sub not in order:
            order.append(sub)
    if 0 in order:
        order.remove(0)
        order.insert(0, 0)
    if not cut_subgraphs:
        order = list(range(len(sub_tables)))
    written = 0
    for j, old in enumerate(order):
        slot = sub_start + 4 + 4 * j
        struct.pack_into("<I", buf, slot, sub_tables[old] - slot)
        written += 4
    struct.pack_into("<I", buf, sub_start, len(order))
    for j, (index, old_sub) in enumerate(zip(chosen, old_subgraphs)):
        slot = sig_start + 4 + 4 * j
        struct.pack_into("<I", buf, slot, sig_tables[index] - slot)
        at = _field(buf, sig_tables[index], _SIG_SUBGRAPH)
        new_sub = order.index(old_sub)
        if at:
            struct.pack_into("<I", buf, at, new_sub)
        elif new_sub != 0:
            raise ValueError(f"signature {keys[j]}: subgraph_index absent, cannot renumber")
        written += 8
    struct.pack_into("<I", buf, sig_start, len(chosen))
    return written + 8


def subset_view(path: str, keys: Sequence[str], *, cut_subgraphs: bool = True) -> View:
    """A private, patched mapping of ``path`` showing only the signatures ``keys`` (and,
    with ``cut_subgraphs``, only their subgraphs)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        mapping = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    written = patch_signatures(mapping, keys, cut_subgraphs=cut_subgraphs)
    return View(path, tuple(keys), mapping, np.frombuffer(mapping, np.uint8), written)


def subset_file(path: str, keys: Sequence[str], out: str) -> int:
    """Writes to ``out`` a copy of ``path`` patched to the signatures ``keys`` (the same
    bytes as the view: every weight kept, so the same weight cache file serves it); returns
    its size. The alternative "small file" without the other subgraphs' op tables differs
    from it by the dropped subgraphs' tables only (they are never parsed once unlisted)."""
    with open(path, "rb") as file:
        data = bytearray(file.read())
    patch_signatures(memoryview(data), keys)
    with open(out, "wb") as file:
        file.write(data)
    return len(data)


_DTYPES = {schema.TensorType.FLOAT32: "float32", schema.TensorType.INT32: "int32", schema.TensorType.INT64: "int64",
           schema.TensorType.FLOAT16: "float16", schema.TensorType.INT8: "int8", schema.TensorType.BOOL: "bool"}


def signature_details(buf: memoryview | mmap.mmap | np.ndarray) -> dict[str, tuple[dict[str, dict], dict[str, dict]]]:
    """Every signature's inputs and outputs (``{name: {"shape", "dtype"}}``) read from the
    flatbuffer itself, the form ``NativeModel.signature_details`` returns: what a
    ``ModelSpec`` can be built from before anything is compiled."""
    root = schema.Model.GetRootAs(buf, 0)
    out = {}
    for i in range(root.SignatureDefsLength()):
        sig = root.SignatureDefs(i)
        sub = root.Subgraphs(sig.SubgraphIndex())

        def described(count: int, item: Any) -> dict[str, dict]:
            tensors = {}
            for j in range(count):
                entry = item(j)
                tensor = sub.Tensors(entry.TensorIndex())
                tensors[entry.Name().decode()] = {"shape": tuple(int(d) for d in tensor.ShapeAsNumpy()),
                                                  "dtype": np.dtype(_DTYPES.get(tensor.Type(), "uint8"))}
            return tensors

        out[sig.SignatureKey().decode()] = (described(sig.InputsLength(), sig.Inputs),
                                            described(sig.OutputsLength(), sig.Outputs))
    return out
