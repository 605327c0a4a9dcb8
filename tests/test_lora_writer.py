"""Tests for runtime.adapters.lora_writer."""

from __future__ import annotations

import json
import resource
import signal

import ml_dtypes
import numpy as np
import pytest
from ai_edge_litert import schema_py_generated as schema

from conftest import ADAPTERS, adapter_path
from runtime.errors import InvalidArgumentError
from runtime.adapters.lora_data import FILE_IDENTIFIER, LORA_RANK_METADATA, LoraData
from runtime.adapters.lora_util import Convention, lora_input_name, to_graph_layout
from runtime.adapters.lora_writer import (
    DATA_ALIGNMENT,
    LoraWeights,
    name_adapter_tensors,
    serialize_lora_tensors,
    serialize_lora_weights,
    write_lora_file,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]


def make_weights(
    seed: int = 0, layers=(0, 1), projections=("q", "k", "v", "o"), rank: int = 3, hidden: int = 8
) -> dict[tuple[int, str], LoraWeights]:
    """Graph-layout pairs with distinct, non-square shapes so a missed transpose shows."""
    rng = np.random.default_rng(seed)
    out = {"q": hidden, "k": hidden // 2, "v": hidden // 2, "o": hidden}
    return {
        (layer, proj): LoraWeights(
            rng.standard_normal((hidden, rank)).astype(np.float32),
            rng.standard_normal((rank, out[proj])).astype(np.float32),
        )
        for layer in layers
        for proj in projections
    }


def bits(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).tobytes()


def parse_model(blob: bytes):
    return schema.Model.GetRootAs(blob, 0)


# -- name_adapter_tensors ----------------------------------------------------------


@pytest.mark.parametrize("convention", list(Convention))
def test_names_follow_the_convention_in_sorted_order(convention):
    weights = make_weights(layers=(1, 0), projections=("v", "q"))  # inserted unsorted
    tensors = name_adapter_tensors(weights, convention)
    expected = [
        lora_input_name(convention, layer, proj, side)
        for layer in (0, 1)
        for proj in ("q", "v")
        for side in ("a", "b")
    ]
    assert list(tensors) == expected


def test_litert_torch_keeps_graph_layout():
    weights = make_weights(layers=(0,), projections=("k",), rank=3, hidden=8)
    tensors = name_adapter_tensors(weights, Convention.LITERT_TORCH)
    a = tensors["lora_atten_k_a_prime_weight_0"]
    b = tensors["lora_atten_k_b_prime_weight_0"]
    assert a.shape == (8, 3) and b.shape == (3, 4)  # [in, r], [r, out]
    np.testing.assert_array_equal(a, weights[(0, "k")].a)
    np.testing.assert_array_equal(b, weights[(0, "k")].b)


@pytest.mark.parametrize("convention", [Convention.LITERT_LM, Convention.MEDIAPIPE])
def test_rank_first_conventions_transpose_a_only(convention):
    weights = make_weights(layers=(2,), projections=("o",), rank=3, hidden=8)
    tensors = name_adapter_tensors(weights, convention)
    a = tensors[lora_input_name(convention, 2, "o", "a")]
    b = tensors[lora_input_name(convention, 2, "o", "b")]
    assert a.shape == (3, 8) and b.shape == (3, 8)  # [r, in], [r, out]
    np.testing.assert_array_equal(a, weights[(2, "o")].a.T)
    np.testing.assert_array_equal(b, weights[(2, "o")].b)
    # Stored C-contiguous (the bytes are written as laid out), not as a transposed view.
    assert a.flags.c_contiguous and b.flags.c_contiguous


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_names_cast_to_the_requested_dtype(dtype):
    weights = make_weights(layers=(0,), projections=("q",))
    original_a = weights[(0, "q")].a.copy()
    tensors = name_adapter_tensors(weights, Convention.LITERT_LM, dtype)
    for array in tensors.values():
        assert array.dtype == dtype
    assert bits(tensors["query_w_prime_left_0"]) == bits(original_a.T.astype(dtype))
    np.testing.assert_array_equal(weights[(0, "q")].a, original_a)  # the input is untouched


def test_names_default_dtype_is_float32():
    weights = {(0, "q"): LoraWeights(np.ones((4, 2), np.float64), np.ones((2, 4), np.float64))}
    assert {a.dtype for a in name_adapter_tensors(weights, Convention.LITERT_TORCH).values()} == {
        np.dtype(np.float32)
    }


def test_values_that_overflow_float16_are_refused_naming_the_tensor():
    """Cast silently, 1e5 became Inf in float16: ``runtime convert`` (float16 by default)
    wrote an adapter the runtime then refused to load ("holds NaN or Inf values")."""
    weights = make_weights()
    weights[(1, "k")] = LoraWeights(weights[(1, "k")].a, weights[(1, "k")].b * 1e5)
    name = lora_input_name(Convention.LITERT_LM, 1, "k", "b")
    with pytest.raises(InvalidArgumentError, match=rf"tensor '{name}': values up to .* overflow float16 .* float32"):
        serialize_lora_weights(weights, Convention.LITERT_LM)
    stored = name_adapter_tensors(weights, Convention.LITERT_LM, np.float32)  # where they fit
    assert np.isfinite(stored[name]).all()


def test_names_refuse_an_unknown_projection():
    weights = {(0, "ffn"): LoraWeights(np.ones((4, 2), np.float32), np.ones((2, 4), np.float32))}
    with pytest.raises(InvalidArgumentError, match="ffn"):
        name_adapter_tensors(weights, Convention.LITERT_TORCH)
    mlp = {(0, "gate"): LoraWeights(np.ones((4, 2), np.float32), np.ones((2, 4), np.float32))}
    assert set(name_adapter_tensors(mlp, Convention.LITERT_TORCH)) == {"lora_ff_gate_a_prime_weight_0",
                                                                      "lora_ff_gate_b_prime_weight_0"}
    with pytest.raises(InvalidArgumentError, match="mediapipe convention"):  # its names stop at attention
        name_adapter_tensors(mlp, Convention.MEDIAPIPE)


# -- serialize_lora_tensors ---------------------------------------------------------


def special_values(dtype: np.dtype) -> np.ndarray:
    """Values whose bits a lossy path would change: signed zeros, infinities, NaN, tiny."""
    tiny = float(ml_dtypes.finfo(dtype).smallest_subnormal)
    values = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -2.5, tiny, 65504.0 if dtype == np.float16 else 1e30])
    return values.astype(dtype).reshape(3, 3)


@pytest.mark.parametrize("external", [False, True], ids=["inline", "external"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_serialize_round_trips_bit_exactly(dtype, external):
    rng = np.random.default_rng(7)
    tensors = {
        "lora_atten_q_a_prime_weight_0": rng.standard_normal((16, 5)).astype(dtype),
        "lora_atten_q_b_prime_weight_0": rng.standard_normal((5, 24)).astype(dtype),
        "odd": rng.standard_normal((3,)).astype(dtype),  # 3 elements: not a multiple of the alignment
        "special": special_values(dtype),
    }
    blob = serialize_lora_tensors(tensors, external_data=external)
    assert blob[4:8] == FILE_IDENTIFIER
    data = LoraData.create_from_buffer(blob, name="rt.tflite")
    assert data.get_all_tensor_names() == list(tensors)  # file order is the mapping's order
    for name, array in tensors.items():
        info = data.tensor_info(name)
        assert info.placement == ("external" if external else "inline")
        assert (info.shape, info.dtype, info.nbytes) == (array.shape, dtype, array.nbytes)
        assert bits(data.read_tensor(name)) == bits(array), name
    assert data.nbytes == sum(a.nbytes for a in tensors.values())


@pytest.mark.parametrize("external", [False, True], ids=["inline", "external"])
def test_tensor_data_is_aligned(external):
    tensors = {f"t{i}": np.arange(n, dtype=np.float16) for i, n in enumerate((1, 3, 7, 33, 100))}
    data = LoraData.create_from_buffer(serialize_lora_tensors(tensors, external_data=external))
    offsets = [data.tensor_info(name).offset for name in tensors]
    assert all(offset % DATA_ALIGNMENT == 0 for offset in offsets), offsets
    assert len(set(offsets)) == len(offsets)


def test_external_layout_follows_the_flatbuffer():
    tensors = {
        "query_w_prime_left_0": np.arange(6, dtype=np.float16).reshape(2, 3),
        "query_w_prime_right_0": np.arange(10, dtype=np.float16).reshape(2, 5),
    }
    blob = serialize_lora_tensors(tensors, external_data=True)
    model = parse_model(blob)
    ranges = []
    for index in range(1, model.BuffersLength()):
        buffer = model.Buffers(index)
        assert buffer.DataLength() == 0  # nothing inline
        ranges.append((buffer.Offset(), buffer.Size()))
    assert [size for _, size in ranges] == [12, 20]
    first, second = ranges
    # Data comes after the flatbuffer, in order, each aligned; the file ends with the last tensor.
    assert first[0] % DATA_ALIGNMENT == 0 and second[0] % DATA_ALIGNMENT == 0
    assert first[0] + first[1] <= second[0]
    assert len(blob) == second[0] + second[1]
    assert blob[first[0] : first[0] + 12] == tensors["query_w_prime_left_0"].tobytes()
    assert blob[first[0] + 12 : second[0]] == bytes(second[0] - first[0] - 12)  # zero padding


def test_serialize_writes_a_valid_tflite_model():
    tensors = {
        "lora_atten_v_a_prime_weight_1": np.ones((4, 2), np.float32),
        "lora_atten_v_b_prime_weight_1": np.ones((2, 4), np.float16),
    }
    blob = serialize_lora_tensors(tensors, external_data=False)
    assert schema.Model.ModelBufferHasIdentifier(blob, 0)
    model = parse_model(blob)
    assert model.Version() == 3
    assert model.SubgraphsLength() == 1
    assert model.BuffersLength() == 1 + len(tensors)
    assert model.Buffers(0).DataLength() == 0  # buffer 0 is the conventional empty one
    subgraph = model.Subgraphs(0)
    assert subgraph.TensorsLength() == 2
    seen = []
    for i in range(subgraph.TensorsLength()):
        tensor = subgraph.Tensors(i)
        seen.append((tensor.Name().decode(), tuple(tensor.ShapeAsNumpy()), tensor.Type(), tensor.Buffer()))
    assert seen == [
        ("lora_atten_v_a_prime_weight_1", (4, 2), schema.TensorType.FLOAT32, 1),
        ("lora_atten_v_b_prime_weight_1", (2, 4), schema.TensorType.FLOAT16, 2),
    ]
    assert model.MetadataLength() == 0


@pytest.mark.parametrize("external", [False, True], ids=["inline", "external"])
def test_lora_rank_metadata_is_stored_in_the_buffer_field(external):
    tensors = {"query_w_prime_left_0": np.zeros((2, 8), np.float16)}  # shapes say rank 2
    blob = serialize_lora_tensors(tensors, external_data=external, lora_rank=6)
    model = parse_model(blob)
    assert model.MetadataLength() == 1
    assert model.Metadata(0).Name().decode() == LORA_RANK_METADATA
    assert model.Metadata(0).Buffer() == 6
    assert LoraData.create_from_buffer(blob).get_lora_rank() == 6  # metadata wins over shapes


def test_serialize_accepts_non_contiguous_arrays():
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    views = {"transposed": base.T, "strided": base[:, ::2], "fortran": np.asfortranarray(base)}
    data = LoraData.create_from_buffer(serialize_lora_tensors(views, external_data=False))
    for name, view in views.items():
        assert data.tensor_info(name).shape == view.shape
        np.testing.assert_array_equal(data.read_tensor(name), view)


def test_serialize_empty_mapping_reads_back_empty():
    for external in (False, True):
        data = LoraData.create_from_buffer(serialize_lora_tensors({}, external_data=external))
        assert data.get_all_tensor_names() == []
        assert data.nbytes == 0


def test_serialize_is_deterministic():
    tensors = name_adapter_tensors(make_weights(seed=3), Convention.LITERT_LM, np.float16)
    once = serialize_lora_tensors(tensors, external_data=True, lora_rank=3)
    assert serialize_lora_tensors(tensors, external_data=True, lora_rank=3) == once


@pytest.mark.parametrize(
    "dtype", [np.float64, np.int32, np.int8, np.uint16, np.bool_, np.dtype(">f4"), np.complex64],
    ids=lambda d: np.dtype(d).str,
)
def test_serialize_refuses_other_dtypes(dtype):
    tensors = {
        "fine": np.zeros((2, 2), np.float32),
        "lora_atten_q_a_prime_weight_0": np.zeros((2, 2), dtype),
    }
    for external in (False, True):
        with pytest.raises(
            InvalidArgumentError,
            match=r"tensor 'lora_atten_q_a_prime_weight_0': dtype .* cannot be written, expected float32, float16 or bfloat16",
        ):
            serialize_lora_tensors(tensors, external_data=external)


@pytest.mark.parametrize("rank", [0, -1, 2**32, 4.0, True])
def test_serialize_refuses_a_non_positive_lora_rank(rank):
    with pytest.raises(InvalidArgumentError, match="lora_rank"):
        serialize_lora_tensors({"query_w_prime_left_0": np.zeros((2, 4), np.float16)},
                               external_data=True, lora_rank=rank)


# -- write_lora_file --------------------------------------------------------------------


@pytest.mark.parametrize(
    "convention,default_dtype,placement,has_metadata",
    [
        (Convention.LITERT_TORCH, np.float32, "inline", False),
        (Convention.LITERT_LM, np.float16, "external", True),
        (Convention.MEDIAPIPE, np.float16, "external", True),
    ],
)
def test_write_uses_each_conventions_customary_form(tmp_path, convention, default_dtype, placement, has_metadata):
    weights = make_weights(seed=11, rank=5)
    path = write_lora_file(str(tmp_path / "adapter.tflite"), weights, convention)
    assert path == tmp_path / "adapter.tflite"
    blob = path.read_bytes()
    assert parse_model(blob).MetadataLength() == (1 if has_metadata else 0)
    with LoraData.create_from_file_path(path) as data:
        assert data.get_lora_rank() == 5
        assert len(data.get_all_tensor_names()) == 2 * len(weights)
        for name in data.get_all_tensor_names():
            info = data.tensor_info(name)
            assert info.dtype == default_dtype
            assert info.placement == placement


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("convention", list(Convention))
def test_write_then_read_round_trips_bit_exactly(tmp_path, convention, dtype):
    weights = make_weights(seed=5, rank=4, hidden=16)
    path = write_lora_file(tmp_path / "a.tflite", weights, convention, dtype=dtype)
    with LoraData.create_from_file_path(path) as data:
        assert data.get_lora_rank() == 4
        for (layer, proj), pair in weights.items():
            for side, expected in (("a", pair.a), ("b", pair.b)):
                name = lora_input_name(convention, layer, proj, side)
                stored = data.read_tensor(name)
                assert stored.dtype == dtype
                graph = to_graph_layout(convention, side, stored)
                assert graph.shape == expected.shape
                assert bits(graph) == bits(expected.astype(dtype)), name


def test_write_metadata_rank_is_the_largest(tmp_path):
    weights = {
        (0, "q"): LoraWeights(np.ones((8, 2), np.float32), np.ones((2, 8), np.float32)),
        (1, "q"): LoraWeights(np.ones((8, 7), np.float32), np.ones((7, 8), np.float32)),
        (1, "v"): LoraWeights(np.ones((8, 3), np.float32), np.ones((3, 4), np.float32)),
    }
    for convention in Convention:
        path = write_lora_file(tmp_path / f"{convention.value}.tflite", weights, convention)
        with LoraData.create_from_file_path(path) as data:
            assert data.get_lora_rank() == 7, convention
    model = parse_model((tmp_path / "litert-lm.tflite").read_bytes())
    assert model.Metadata(0).Buffer() == 7


def test_write_without_weights(tmp_path):
    for convention in Convention:
        path = write_lora_file(tmp_path / f"{convention.value}.tflite", {}, convention)
        assert parse_model(path.read_bytes()).MetadataLength() == 0  # no rank to record
        with LoraData.create_from_file_path(path) as data:
            assert data.get_all_tensor_names() == []


def test_write_refuses_an_unwritable_dtype(tmp_path):
    with pytest.raises(InvalidArgumentError, match="dtype int32 cannot be written"):
        write_lora_file(tmp_path / "a.tflite", make_weights(), Convention.LITERT_TORCH, dtype=np.int32)
    assert not (tmp_path / "a.tflite").exists()


def test_a_failed_write_leaves_the_file_as_it_was(tmp_path):
    """A disk filling up mid-write (here: the file size limit) left a truncated adapter under
    the target's name, which then failed to load in place of the one it replaced."""
    path = tmp_path / "adapter.tflite"
    write_lora_file(path, make_weights(), Convention.LITERT_LM)
    before = path.read_bytes()
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
    try:
        with pytest.raises(OSError, match="too large"):
            write_lora_file(path, make_weights(rank=8, hidden=64), Convention.LITERT_LM)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["adapter.tflite"]


def test_write_reproduces_the_committed_fixtures_byte_for_byte(adapter_manifest, expected_tensors):
    # tests/models/adapters/*.tflite were written by this module (tools/build_test_adapters.py);
    # rebuilding them from expected.npz must give the same bytes.
    assert (ADAPTERS / "MANIFEST.json").exists()
    checked = 0
    for file_name, entry in adapter_manifest.items():
        prefix = f"{file_name}::"
        dtype = BF16 if entry["dtype"] == "bfloat16" else np.dtype(entry["dtype"])
        tensors = {k[len(prefix):]: v.astype(dtype) for k, v in expected_tensors.items() if k.startswith(prefix)}
        torch_style = entry["convention"] == Convention.LITERT_TORCH.value
        blob = serialize_lora_tensors(
            tensors, external_data=not torch_style, lora_rank=None if torch_style else entry["rank"]
        )
        committed = adapter_path(file_name.removesuffix(".tflite")).read_bytes()
        assert len(blob) == entry["bytes"] == len(committed), file_name
        assert blob == committed, file_name
        checked += 1
    assert checked == len(json.loads((ADAPTERS / "MANIFEST.json").read_text())) >= 10
