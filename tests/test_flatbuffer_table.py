"""Tests for runtime.util.flatbuffer_table."""

from __future__ import annotations

import struct

import flatbuffers
import numpy as np
import pytest
from flatbuffers.table import Table
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.errors import DataLossError, InvalidArgumentError, StatusError
from runtime.util.flatbuffer_table import MAX_VECTOR, FlatTable
from runtime.adapters.lora_writer import serialize_lora_tensors

SOURCE = "header.bin"
NAME = "h\u00e9llo"  # non-ASCII: decoded as UTF-8


def _string_table(builder: flatbuffers.Builder, text: str, number: int) -> int:
    name = builder.CreateString(text)
    builder.StartObject(2)
    builder.PrependUOffsetTRelativeSlot(0, name, 0)
    builder.PrependUint64Slot(1, number, 0)
    return builder.EndObject()


def _table_vector(builder: flatbuffers.Builder, tables: list[int]) -> int:
    builder.StartVector(4, len(tables), 4)
    for table in reversed(tables):
        builder.PrependUOffsetTRelative(table)
    return builder.EndVector()


def build_sample() -> bytes:
    """A root table with every kind of field ``FlatTable`` reads.

    ====  ==========================================  ==================
    slot  field                                       value
    ====  ==========================================  ==================
    0     uint64                                      2**40 + 5
    1     uint8                                       200
    2     string                                      NAME
    3     table {0: string, 1: uint64}                {"child", 42}
    4     [table {0: string, 1: uint64}]              item0..item2, 1000+i
    5     (absent, inside the vtable)
    6     bool                                        True
    7     float64                                     2.5
    8     [table] (empty)
    9     int16                                       -300
    ====  ==========================================  ==================
    """
    builder = flatbuffers.Builder(0)
    name = builder.CreateString(NAME)  # created first: ends up at the tail of the buffer
    child = _string_table(builder, "child", 42)
    items = _table_vector(builder, [_string_table(builder, f"item{i}", 1000 + i) for i in range(3)])
    empty = _table_vector(builder, [])
    builder.StartObject(10)
    builder.PrependUint64Slot(0, (1 << 40) + 5, 0)
    builder.PrependUint8Slot(1, 200, 0)
    builder.PrependUOffsetTRelativeSlot(2, name, 0)
    builder.PrependUOffsetTRelativeSlot(3, child, 0)
    builder.PrependUOffsetTRelativeSlot(4, items, 0)
    builder.PrependBoolSlot(6, True, False)
    builder.PrependFloat64Slot(7, 2.5, 0.0)
    builder.PrependUOffsetTRelativeSlot(8, empty, 0)
    builder.PrependInt16Slot(9, -300, 0)
    builder.Finish(builder.EndObject())
    return bytes(builder.Output())


SAMPLE = build_sample()


def root_tab(buf: bytes) -> Table:
    """The root table as flatbuffers' own reader sees it (to find bytes to corrupt)."""
    return Table(bytearray(buf), struct.unpack_from("<I", buf, 0)[0])


def field_position(tab: Table, index: int) -> int:
    """Absolute position of field ``index`` of ``tab`` (which must be present)."""
    offset = tab.Offset(4 + 2 * index)
    assert offset, index
    return tab.Pos + offset


def vector_length_position(tab: Table, index: int) -> int:
    return tab.Vector(tab.Offset(4 + 2 * index)) - 4


def patched(buf: bytes, at: int, fmt: str, value) -> bytes:
    out = bytearray(buf)
    struct.pack_into("<" + fmt, out, at, value)
    return bytes(out)


# -- reading well-formed tables ---------------------------------------------------------


@pytest.mark.parametrize("kind", [bytes, memoryview], ids=["bytes", "memoryview"])
def test_reads_every_field_kind(kind):
    root = FlatTable.root(kind(SAMPLE), SOURCE)
    assert root.scalar(0, "Q") == (1 << 40) + 5
    assert root.scalar(1, "B") == 200
    assert root.string(2) == NAME
    assert root.scalar(6, "?") is True
    assert root.scalar(7, "d") == 2.5
    assert root.scalar(9, "h") == -300
    child = root.table(3)
    assert child is not None
    assert (child.string(0), child.scalar(1, "Q")) == ("child", 42)
    items = root.tables(4)
    assert [(item.string(0), item.scalar(1, "Q")) for item in items] == [
        ("item0", 1000), ("item1", 1001), ("item2", 1002)
    ]
    assert root.tables(8) == []
    assert root.source == SOURCE and child.source == SOURCE


def test_absent_fields_give_defaults():
    root = FlatTable.root(SAMPLE, SOURCE)
    # Slot 5 is inside the vtable but unset; slots 10 and 400 are past the vtable's end.
    for index in (5, 10, 400):
        assert root.scalar(index, "I") == 0
        assert root.scalar(index, "I", default=17) == 17
        assert root.scalar(index, "d", default=1.5) == 1.5
        assert root.string(index) is None
        assert root.table(index) is None
        assert root.tables(index) == []
    child = root.table(3)
    assert child.string(2) is None and child.scalar(5, "B", 9) == 9


def test_scalar_default_is_not_used_for_a_stored_value():
    builder = flatbuffers.Builder(0)
    builder.StartObject(2)
    builder.PrependUint32Slot(0, 0, 1)  # 0 differs from the schema default 1: stored
    builder.PrependUint32Slot(1, 5, 0)
    builder.Finish(builder.EndObject())
    root = FlatTable.root(bytes(builder.Output()), SOURCE)
    assert root.scalar(0, "I", default=1) == 0
    assert root.scalar(1, "I", default=99) == 5


def test_embedded_in_a_larger_buffer_through_a_memoryview():
    # As .litertlm headers are read: a flatbuffer that starts at byte 32 of the file.
    data = b"\xaa" * 32 + SAMPLE + b"\xbb" * 16
    with memoryview(data)[32 : 32 + len(SAMPLE)] as header:
        root = FlatTable.root(header, SOURCE)
        assert root.string(2) == NAME
        assert [item.scalar(1, "Q") for item in root.tables(4)] == [1000, 1001, 1002]


def test_bounds_are_those_of_the_view_not_of_the_object_behind_it():
    # The string is the last thing in the buffer; cut the view before its end.
    data = SAMPLE + b"\0" * 64
    cut = len(SAMPLE) - 4
    with memoryview(data)[:cut] as header:
        root = FlatTable.root(header, SOURCE)
        assert root.scalar(0, "Q") == (1 << 40) + 5  # what is inside the view still reads
        with pytest.raises(DataLossError, match=rf"{SOURCE}: string field 2 runs past the end"):
            root.string(2)


def test_reads_a_tflite_model_written_by_lora_writer():
    # Field numbers from the TFLite schema: Model {version 0, subgraphs 2, buffers 4,
    # metadata 6}, SubGraph {tensors 0}, Tensor {type 1, buffer 2, name 3},
    # Buffer {data 0, offset 1, size 2}, Metadata {name 0, buffer 1}.
    tensors = {"query_w_prime_left_0": np.ones((3, 8), np.float16), "query_w_prime_right_0": np.ones((3, 4), np.float16)}
    blob = serialize_lora_tensors(tensors, external_data=True, lora_rank=3)
    model = FlatTable.root(blob, "adapter.tflite")
    assert model.scalar(0, "I") == 3
    (subgraph,) = model.tables(2)
    names = [(t.string(3), t.scalar(1, "b"), t.scalar(2, "I")) for t in subgraph.tables(0)]
    assert names == [("query_w_prime_left_0", 1, 1), ("query_w_prime_right_0", 1, 2)]  # 1: FLOAT16
    buffers = model.tables(4)
    assert len(buffers) == 3
    assert [b.scalar(2, "Q") for b in buffers] == [0, 48, 24]
    for buffer, array in zip(buffers[1:], tensors.values()):
        offset, size = buffer.scalar(1, "Q"), buffer.scalar(2, "Q")
        assert blob[offset : offset + size] == array.tobytes()
    (metadata,) = model.tables(6)
    assert (metadata.string(0), metadata.scalar(1, "I")) == ("lora_rank", 3)


# -- corrupt input ---------------------------------------------------------------------


@pytest.mark.parametrize("buf", [b"", b"\x04\0\0"], ids=["empty", "3 bytes"])
def test_too_short_for_a_root(buf):
    with pytest.raises(DataLossError, match=rf"{SOURCE}: root at byte 0 is outside the {len(buf)}-byte header"):
        FlatTable.root(buf, SOURCE)


def test_root_offset_outside_the_buffer():
    bad = patched(SAMPLE, 0, "I", len(SAMPLE) + 100)
    with pytest.raises(DataLossError, match=rf"{SOURCE}: root at byte {len(SAMPLE) + 100} is outside"):
        FlatTable.root(bad, SOURCE)


def test_root_vtable_outside_the_buffer():
    pos = root_tab(SAMPLE).Pos
    bad = patched(SAMPLE, pos, "i", -(1 << 20))  # vtable = pos + 1 MiB
    with pytest.raises(DataLossError, match=rf"{SOURCE}: root vtable at byte {pos + (1 << 20)} is outside"):
        FlatTable.root(bad, SOURCE)


def test_scalar_outside_the_buffer():
    tab = root_tab(SAMPLE)
    vtable = tab.Pos - struct.unpack_from("<i", SAMPLE, tab.Pos)[0]
    bad = patched(SAMPLE, vtable + 4, "H", 0xFFFF)  # field 0 now lies 64 KiB past the table
    root = FlatTable.root(bad, SOURCE)
    assert root.scalar(1, "B") == 200
    with pytest.raises(DataLossError, match=rf"{SOURCE}: field 0 at byte {tab.Pos + 0xFFFF} is outside"):
        root.scalar(0, "Q")


def test_subtable_outside_the_buffer():
    bad = patched(SAMPLE, field_position(root_tab(SAMPLE), 3), "I", 1 << 24)
    root = FlatTable.root(bad, SOURCE)
    with pytest.raises(DataLossError, match=rf"{SOURCE}: field 3 at byte \d+ is outside"):
        root.table(3)


def test_string_length_past_the_end():
    tab = root_tab(SAMPLE)
    length_at = tab.Indirect(field_position(tab, 2))
    assert struct.unpack_from("<I", SAMPLE, length_at)[0] == len(NAME.encode())
    bad = patched(SAMPLE, length_at, "I", len(SAMPLE))
    with pytest.raises(DataLossError, match=rf"{SOURCE}: string field 2 runs past the end"):
        FlatTable.root(bad, SOURCE).string(2)


def test_string_that_is_not_utf8():
    encoded = NAME.encode()
    at = SAMPLE.index(encoded)
    bad = SAMPLE[:at] + b"\xff" * len(encoded) + SAMPLE[at + len(encoded) :]
    root = FlatTable.root(bad, SOURCE)
    with pytest.raises(InvalidArgumentError, match=rf"{SOURCE}: string field 2 is not UTF-8"):
        root.string(2)
    assert root.table(3).string(0) == "child"  # the rest still reads


@pytest.mark.parametrize("count", [MAX_VECTOR + 1, 0xFFFFFFFF], ids=["max+1", "uint32 max"])
def test_vector_count_above_the_limit(count):
    bad = patched(SAMPLE, vector_length_position(root_tab(SAMPLE), 4), "I", count)
    with pytest.raises(DataLossError, match=rf"{SOURCE}: vector field 4 of {count} items runs past the end"):
        FlatTable.root(bad, SOURCE).tables(4)


def test_vector_count_above_the_limit_even_when_the_buffer_holds_it():
    # 4 MiB of trailing zeros: every one of the MAX_VECTOR + 1 slots lies inside the buffer.
    count = MAX_VECTOR + 1
    big = SAMPLE + bytes(4 * (count + 2))
    bad = patched(big, vector_length_position(root_tab(big), 4), "I", count)
    with pytest.raises(DataLossError, match=rf"{SOURCE}: vector field 4 of {count} items runs past the end"):
        FlatTable.root(bad, SOURCE).tables(4)


def test_vector_count_past_the_end_of_a_small_buffer():
    count = len(SAMPLE) // 4  # far below MAX_VECTOR, yet more slots than the buffer holds
    bad = patched(SAMPLE, vector_length_position(root_tab(SAMPLE), 4), "I", count)
    with pytest.raises(DataLossError, match=rf"vector field 4 of {count} items runs past the end"):
        FlatTable.root(bad, SOURCE).tables(4)


def test_vector_element_outside_the_buffer():
    tab = root_tab(SAMPLE)
    second_slot = vector_length_position(tab, 4) + 4 + 4
    bad = patched(SAMPLE, second_slot, "I", 1 << 24)
    with pytest.raises(DataLossError, match=rf"{SOURCE}: field 4\[1\] at byte \d+ is outside"):
        FlatTable.root(bad, SOURCE).tables(4)


def walk(table: FlatTable, depth: int = 0) -> None:
    """Reads every field of ``table`` in every way (and sub-tables, two levels down)."""
    for index in range(11):
        for read, args in (
            (table.scalar, (index, "Q")),
            (table.scalar, (index, "d")),
            (table.string, (index,)),
            (table.table, (index,)),
            (table.tables, (index,)),
        ):
            try:
                value = read(*args)
            except StatusError as exc:
                assert SOURCE in str(exc)
                continue
            children = value if isinstance(value, list) else [value]
            if depth < 2:
                for child in children:
                    if isinstance(child, FlatTable):
                        walk(child, depth + 1)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    flips=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=6),
    cut=st.one_of(st.none(), st.integers(0, 1 << 16)),
)
def test_mutated_buffers_raise_only_status_errors(flips, cut):
    buf = bytearray(SAMPLE)
    for position, value in flips:
        buf[position % len(buf)] = value
    if cut is not None:
        buf = buf[: cut % (len(buf) + 1)]
    try:
        root = FlatTable.root(bytes(buf), SOURCE)
    except StatusError as exc:
        assert isinstance(exc, DataLossError | InvalidArgumentError)
        assert SOURCE in str(exc)
        return
    walk(root)
