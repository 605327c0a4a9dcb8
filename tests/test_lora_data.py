"""Tests for runtime.adapters.lora_data: every factory, both conventions, bad files."""

from __future__ import annotations

import mmap

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import adapter_path
from retained import retained_per_adapter
from runtime.errors import (
    DataLossError,
    InvalidArgumentError,
    NotFoundError,
    StatusError,
)
from runtime.adapters.lora_data import LoraData
from runtime.adapters.lora_writer import serialize_lora_tensors
from runtime.util.scoped_file import ScopedFile

FIXTURES = ["torch_r4", "litertlm_r4", "mediapipe_r4", "torch_r4_bf16", "litertlm_r8_layer0"]
FACTORIES = ["path", "scoped_file", "bytes", "bytearray", "memoryview", "mmap"]


def open_data(name: str, factory: str) -> LoraData:
    path = adapter_path(name)
    if factory == "path":
        return LoraData.create_from_file_path(path)
    if factory == "scoped_file":
        return LoraData.create_from_scoped_file(ScopedFile(path), owns_file=True)
    blob = path.read_bytes()
    if factory == "bytes":
        return LoraData.create_from_buffer(blob)
    if factory == "bytearray":
        return LoraData.create_from_buffer(bytearray(blob))
    if factory == "memoryview":
        return LoraData.create_from_buffer(memoryview(blob))
    with ScopedFile(path) as f:
        return LoraData.create_from_buffer(f.memory_map())


@pytest.mark.parametrize("factory", FACTORIES)
@pytest.mark.parametrize("name", FIXTURES)
def test_create_rank_names_and_values(name, factory, adapter_manifest, expected_tensors):
    entry = adapter_manifest[f"{name}.tflite"]
    with open_data(name, factory) as data:
        assert data.get_lora_rank() == entry["rank"]
        names = data.get_all_tensor_names()
        expected_names = sorted(k.split("::")[1] for k in expected_tensors if k.startswith(f"{name}.tflite::"))
        assert sorted(names) == expected_names
        assert len(names) == 2 * len(entry["layers"]) * len(entry["projections"])
        for tensor in names:
            array = data.read_tensor(tensor)
            info = data.tensor_info(tensor)
            assert array.dtype == np.dtype(entry["dtype"]) == info.dtype
            assert array.shape == info.shape
            assert array.nbytes == info.nbytes
            assert not array.flags.writeable
            np.testing.assert_array_equal(
                array.astype(np.float32), expected_tensors[f"{name}.tflite::{tensor}"]
            )
        assert "lora_atten_q_a_prime_weight_99" not in names
        with pytest.raises(NotFoundError, match="lora_atten_q_a_prime_weight_99"):
            data.read_tensor("lora_atten_q_a_prime_weight_99")
        with pytest.raises(NotFoundError):
            data.tensor_info("nope")


@pytest.mark.parametrize(
    "name,placement", [("torch_r4", "inline"), ("litertlm_r4", "external"), ("mediapipe_r4", "external")]
)
def test_both_data_placements(name, placement):
    with LoraData.create_from_file_path(adapter_path(name)) as data:
        assert {data.tensor_info(n).placement for n in data.get_all_tensor_names()} == {placement}


def test_litert_lm_shapes_are_rank_first():
    with LoraData.create_from_file_path(adapter_path("litertlm_r4")) as data:
        assert data.tensor_info("query_w_prime_left_0").shape == (4, 64)  # [r, in]
        assert data.tensor_info("key_w_prime_right_1").shape == (4, 32)  # [r, out]
    with LoraData.create_from_file_path(adapter_path("torch_r4")) as data:
        assert data.tensor_info("lora_atten_q_a_prime_weight_0").shape == (64, 4)  # [in, r]
        assert data.tensor_info("lora_atten_k_b_prime_weight_1").shape == (4, 32)  # [r, out]


def test_rank_inferred_without_metadata():
    blob = serialize_lora_tensors(
        {"lora_atten_q_a_prime_weight_0": np.zeros((8, 3), np.float32),
         "lora_atten_q_b_prime_weight_0": np.zeros((3, 8), np.float32)},
        external_data=False,
    )
    assert LoraData.create_from_buffer(blob).get_lora_rank() == 3


def test_rank_without_lora_tensors_is_not_found():
    blob = serialize_lora_tensors({"w": np.zeros((2, 2), np.float32)}, external_data=False)
    with pytest.raises(NotFoundError, match="lora_rank"):
        LoraData.create_from_buffer(blob).get_lora_rank()


# -- zero copy -----------------------------------------------------------------------


def test_read_tensor_views_the_mmap():
    with LoraData.create_from_file_path(adapter_path("litertlm_r4")) as data:
        mapped = data._buffer
        assert isinstance(mapped, mmap.mmap)
        base = np.frombuffer(mapped, dtype=np.uint8)
        array = data.read_tensor("value_w_prime_left_1")
        assert np.shares_memory(array, base)
        del array, base


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_read_tensor_views_the_callers_buffer(kind):
    blob = kind(adapter_path("torch_r4").read_bytes())
    data = LoraData.create_from_buffer(blob)
    array = data.read_tensor("lora_atten_v_b_prime_weight_0")
    assert np.shares_memory(array, np.frombuffer(blob, dtype=np.uint8))
    assert not array.flags.writeable


def test_mutable_buffer_is_kept_by_reference():
    blob = bytearray(adapter_path("torch_r4").read_bytes())
    data = LoraData.create_from_buffer(blob)
    info = data.tensor_info("lora_atten_q_a_prime_weight_0")
    blob[info.offset : info.offset + 4] = np.float32(7.0).tobytes()
    assert data.read_tensor("lora_atten_q_a_prime_weight_0")[0, 0] == 7.0


def test_file_bytes_are_not_read_at_creation(tmp_path):
    # A tensor whose data is past what we could read cheaply still parses: the data
    # range is checked against the size, never touched.
    big = np.zeros((1024, 1024), np.float16)  # 2 MiB of data after the flatbuffer
    path = tmp_path / "big.tflite"
    path.write_bytes(serialize_lora_tensors({"query_w_prime_left_0": big}, external_data=True, lora_rank=1024))
    with LoraData.create_from_file_path(path) as data:
        assert data.nbytes == big.nbytes
        assert data.tensor_info("query_w_prime_left_0").offset >= len(path.read_bytes()) - big.nbytes


def test_file_shrunk_after_open_is_data_loss(tmp_path):
    path = tmp_path / "a.tflite"
    blob = adapter_path("litertlm_r4").read_bytes()
    path.write_bytes(blob)
    data = LoraData.create_from_file_path(path)
    with open(path, "r+b") as f:
        f.truncate(len(blob) // 2)
    with pytest.raises(DataLossError, match="shrank"):
        data.read_tensor("query_w_prime_left_0")
    data.close()


# -- bad input -------------------------------------------------------------------------


def test_empty_and_foreign_inputs(tmp_path):
    with pytest.raises(InvalidArgumentError, match="empty"):
        LoraData.create_from_buffer(b"")
    with pytest.raises(InvalidArgumentError, match="file identifier"):
        LoraData.create_from_buffer(b"\x10\0\0\0GGUF" + bytes(64))
    with pytest.raises(DataLossError):
        LoraData.create_from_buffer(b"\x08\0\0")
    with pytest.raises(InvalidArgumentError, match="expected bytes"):
        LoraData.create_from_buffer("not bytes")  # type: ignore[arg-type]
    empty = tmp_path / "empty.tflite"
    empty.write_bytes(b"")
    with pytest.raises(InvalidArgumentError, match="empty"):
        LoraData.create_from_file_path(empty)
    with pytest.raises(NotFoundError):
        LoraData.create_from_file_path(tmp_path / "missing.tflite")
    with pytest.raises(InvalidArgumentError, match="directory"):
        LoraData.create_from_file_path(tmp_path)


def test_truncated_external_data_is_data_loss():
    blob = adapter_path("litertlm_r4").read_bytes()
    with pytest.raises(DataLossError, match="past the end"):
        LoraData.create_from_buffer(blob[:-100], name="cut.tflite")


def test_size_mismatch_names_the_tensor():
    blob = bytearray(adapter_path("litertlm_r4").read_bytes())
    data = LoraData.create_from_buffer(bytes(blob))
    info = data.tensor_info("key_w_prime_left_1")
    # Rewrite the shape's first dimension (4 -> 5) in place.
    shape_bytes = np.asarray(info.shape, np.int32).tobytes()
    at = bytes(blob).find(shape_bytes, 0)
    assert at > 0
    blob[at : at + 4] = np.int32(5).tobytes()
    with pytest.raises(InvalidArgumentError, match=r"tensor '.*': holds \d+ bytes of data, expected"):
        LoraData.create_from_buffer(bytes(blob), name="bad.tflite")


def test_duplicate_names():
    tensors = {"lora_atten_q_a_prime_weight_0": np.zeros((2, 2), np.float32)}
    blob = serialize_lora_tensors(tensors, external_data=False)
    name = b"lora_atten_q_a_prime_weight_0"
    twice = serialize_lora_tensors(
        {"lora_atten_q_a_prime_weight_0": np.zeros((2, 2), np.float32),
         "lora_atten_q_a_prime_weight_1": np.zeros((2, 2), np.float32)},
        external_data=False,
    )
    twice = twice.replace(b"lora_atten_q_a_prime_weight_1", name)
    assert name.decode() in LoraData.create_from_buffer(blob).get_all_tensor_names()
    with pytest.raises(InvalidArgumentError, match="duplicate"):
        LoraData.create_from_buffer(twice)


def test_unsupported_dtype_and_absurd_dims():
    blob = bytearray(serialize_lora_tensors({"t": np.zeros((2, 3), np.float32)}, external_data=False))
    data = LoraData.create_from_buffer(bytes(blob))
    assert data.tensor_info("t").shape == (2, 3)
    at = bytes(blob).find(np.asarray([2, 3], np.int32).tobytes())
    huge = bytearray(blob)
    huge[at : at + 4] = np.int32(-7).tobytes()
    with pytest.raises(InvalidArgumentError, match="dimension -7"):
        LoraData.create_from_buffer(bytes(huge))
    huge[at : at + 8] = np.asarray([1 << 30, 1 << 30], np.int32).tobytes()
    with pytest.raises(InvalidArgumentError, match="expected"):
        LoraData.create_from_buffer(bytes(huge))
    int_blob = serialize_lora_tensors({"t": np.zeros((2, 3), ml_dtypes.bfloat16)}, external_data=False)
    assert LoraData.create_from_buffer(int_blob).read_tensor("t").dtype == ml_dtypes.bfloat16


def _valid_blobs() -> list[bytes]:
    return [adapter_path(n).read_bytes() for n in ("torch_r4_layer1_qv", "litertlm_r8_layer0", "mediapipe_r4")]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    which=st.integers(0, 2),
    flips=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=8),
    cut=st.one_of(st.none(), st.integers(0, 1 << 20)),
    extra=st.binary(max_size=64),
)
def test_mutated_files_raise_only_status_errors(which, flips, cut, extra):
    blob = bytearray(_valid_blobs()[which])
    for position, value in flips:
        blob[position % len(blob)] = value
    if cut is not None:
        blob = blob[: cut % (len(blob) + 1)]
    blob += extra
    try:
        data = LoraData.create_from_buffer(bytes(blob), name="fuzz.tflite")
    except StatusError as exc:
        assert "fuzz.tflite" in str(exc)
        return
    for name in data.get_all_tensor_names():
        assert data.read_tensor(name).nbytes == data.tensor_info(name).nbytes
    try:
        data.get_lora_rank()
    except StatusError:
        pass


def test_files_of_one_layout_share_their_tensor_infos(tmp_path):
    # 56 tensors each: every adapter used to keep a TensorInfo per tensor (7.4 KiB per adapter in
    # all); adapters of the same layout now share them and keep their name -> info dict (3 KiB).
    rng = np.random.default_rng(0)
    paths = []
    for index in range(11):
        tensors = {f"lora_atten_{proj}_{side}_prime_weight_{layer}": rng.standard_normal(
            (64, 4) if side == "a" else (4, 64)).astype(np.float32)
            for layer in range(7) for proj in "qkvo" for side in "ab"}
        paths.append(tmp_path / f"adapter{index}.tflite")
        paths[-1].write_bytes(serialize_lora_tensors(tensors, external_data=True))
    first, second = (LoraData.create_from_file_path(path) for path in paths[:2])
    name = "lora_atten_k_b_prime_weight_3"
    assert first.tensor_info(name) is second.tensor_info(name)
    assert not np.array_equal(first.read_tensor(name), second.read_tensor(name))
    assert retained_per_adapter(LoraData.create_from_file_path, paths) < 5 * 1024
