"""Tests for runtime.adapters.adapter_formats: detection by content, opening, identity, digests."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import adapter_path
from runtime.errors import DataLossError, InvalidArgumentError, NotFoundError
from runtime.adapters.adapter_formats import GGUF, PEFT, TFLITE, AdapterOrigin, detect_format, open_adapter, peft_directory
from test_gguf_data import gguf_tensors, write


@pytest.fixture
def peft_dir(tmp_path):
    rng = np.random.default_rng(0)
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{key}.lora_A.weight": rng.normal(size=(4, 64)).astype(np.float32),
               f"{key}.lora_B.weight": rng.normal(size=(64, 4)).astype(np.float32)},
              str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    return tmp_path


def test_detects_by_content_not_name(tmp_path, peft_dir):
    disguised = tmp_path / "adapter.bin"
    shutil.copy(adapter_path("torch_r4"), disguised)
    assert detect_format(disguised) == TFLITE
    rng = np.random.default_rng(0)
    hf = {"v": (rng.normal(size=(4, 64)).astype(np.float32), rng.normal(size=(32, 4)).astype(np.float32))}
    gguf = write(tmp_path / "lora.tflite", {k: v for k, v in gguf_tensors(hf).items()})
    assert detect_format(gguf) == GGUF
    assert detect_format(peft_dir) == PEFT
    assert detect_format(peft_dir / "adapter_model.safetensors") == PEFT
    assert open_adapter(peft_dir).format_name == "peft"
    assert open_adapter(gguf).format_name == "gguf"
    assert open_adapter(disguised).format_name == "tflite"


def test_unknown_and_missing(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"hello world, not an adapter")
    with pytest.raises(InvalidArgumentError, match="unknown adapter format"):
        detect_format(tmp_path / "x.bin")
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(InvalidArgumentError, match="empty"):
        detect_format(tmp_path / "empty")
    with pytest.raises(NotFoundError):
        detect_format(tmp_path / "missing")
    sub = tmp_path / "dir"
    sub.mkdir()
    with pytest.raises(InvalidArgumentError, match="without adapter_config.json"):
        detect_format(sub)


def file_identity(path):
    return AdapterOrigin.of_file(path).key


def buffer_identity(buffer, peft_config=None):
    return AdapterOrigin.of_buffer(buffer, peft_config, name="buffer").key


def test_a_peft_adapter_is_its_directory_or_the_safetensors_in_it(tmp_path, peft_dir):
    assert peft_directory(peft_dir) == peft_dir
    assert peft_directory(peft_dir / "adapter_model.safetensors") == peft_dir
    assert peft_directory(adapter_path("torch_r4")) is None
    stray = tmp_path.parent / f"{tmp_path.name}_stray.safetensors"
    stray.write_bytes(b"x")  # no adapter_config.json beside it
    assert peft_directory(stray) is None
    origin = AdapterOrigin.of_file(peft_dir / "adapter_model.safetensors")
    assert origin.path == str(peft_dir) and origin.peft
    assert origin.open().format_name == "peft"


def test_identity(tmp_path, peft_dir):
    assert file_identity(peft_dir) == file_identity(peft_dir / "adapter_model.safetensors")
    link = tmp_path.parent / f"{tmp_path.name}_link"
    link.symlink_to(peft_dir)
    assert file_identity(link) == file_identity(peft_dir)
    blob = adapter_path("torch_r4").read_bytes()
    assert buffer_identity(blob) == buffer_identity(bytes(blob))
    assert buffer_identity(blob) != buffer_identity(blob[:-1])
    sd = {"k": np.zeros(3, np.float32)}
    assert buffer_identity(sd, {"r": 4}) == buffer_identity({"k": np.zeros(3, np.float32)}, {"r": 4})
    assert buffer_identity(sd, {"r": 4}) != buffer_identity(sd, {"r": 8})


def test_mutable_buffers_are_snapshotted_and_immutable_ones_kept():
    blob = adapter_path("torch_r4").read_bytes()
    assert AdapterOrigin.of_buffer(blob, name="b").buffer is blob
    mutable = bytearray(blob)
    origin = AdapterOrigin.of_buffer(mutable, name="b")
    mutable[:] = bytes(len(mutable))  # the caller reuses its buffer
    assert origin.buffer == blob and origin.key == buffer_identity(blob)
    state = {"k": np.ones(3, np.float32)}
    snapshot = AdapterOrigin.of_buffer(state, {"r": 1}, name="sd").buffer
    state["k"][:] = 7
    assert snapshot["k"].tolist() == [1, 1, 1] and not snapshot["k"].flags.writeable
    with pytest.raises(InvalidArgumentError, match="expected bytes"):
        AdapterOrigin.of_buffer(12, name="n")


def test_sha256_checks_the_file_the_peft_weights_or_the_bytes(tmp_path, peft_dir):
    import hashlib

    def digest(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    path = adapter_path("torch_r4")
    AdapterOrigin.of_file(path).check_sha256(digest(path.read_bytes()).upper())
    weights = (peft_dir / "adapter_model.safetensors").read_bytes()
    AdapterOrigin.of_file(peft_dir).check_sha256(digest(weights))
    with pytest.raises(DataLossError, match="adapter_model.safetensors: SHA-256 is"):
        AdapterOrigin.of_file(peft_dir).check_sha256(digest(b"other"))
    AdapterOrigin.of_buffer(b"abc", name="b").check_sha256(digest(b"abc"))
    with pytest.raises(DataLossError, match="<mine>: SHA-256 is"):
        AdapterOrigin.of_buffer(b"abc", name="<mine>").check_sha256(digest(b"abd"))
    with pytest.raises(InvalidArgumentError, match="a state dict has none"):
        AdapterOrigin.of_buffer({"k": np.zeros(1)}, {"r": 1}, name="sd").check_sha256(digest(b""))


def test_open_buffer():
    with pytest.raises(InvalidArgumentError, match="needs its PEFT config"):
        AdapterOrigin.of_buffer({"a": np.zeros(1)}, name="sd").open()
    with pytest.raises(InvalidArgumentError, match="goes with a state dict"):
        AdapterOrigin.of_buffer(b"abc", {"r": 1}, name="b").open()
    assert AdapterOrigin.of_buffer(adapter_path("torch_r4").read_bytes(), name="b").open().get_lora_rank() == 4


def test_identity_follows_the_files_and_says_why_it_cannot(tmp_path, peft_dir):
    before = file_identity(peft_dir)
    config = peft_dir / "adapter_config.json"
    config.write_text(config.read_text() + " ")  # rewritten: another adapter
    assert file_identity(peft_dir) != before
    plain = tmp_path / "plain.tflite"
    shutil.copy(adapter_path("torch_r4"), plain)
    assert file_identity(plain) == file_identity(str(plain)) and len(file_identity(plain)) == 6
    with pytest.raises(NotFoundError, match="missing.tflite"):
        file_identity(tmp_path / "missing.tflite")
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(InvalidArgumentError, match="without adapter_config.json"):
        file_identity(empty)
    (peft_dir / "adapter_model.safetensors").unlink()
    with pytest.raises(NotFoundError, match="adapter_model.safetensors"):
        file_identity(peft_dir)
