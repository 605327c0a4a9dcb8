"""Tests for runtime.util.adapter_formats: detection by content, opening, identity."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import adapter_path
from runtime.errors import InvalidArgumentError, NotFoundError
from runtime.util.adapter_formats import (
    GGUF,
    PEFT,
    TFLITE,
    buffer_identity,
    detect_format,
    file_identity,
    open_adapter,
    open_adapter_buffer,
)
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


def test_open_buffer():
    with pytest.raises(InvalidArgumentError, match="needs its PEFT config"):
        open_adapter_buffer({"a": np.zeros(1)}, name="sd")
    with pytest.raises(InvalidArgumentError, match="goes with a state dict"):
        open_adapter_buffer(b"abc", peft_config={"r": 1}, name="b")
    assert open_adapter_buffer(adapter_path("torch_r4").read_bytes(), name="b").get_lora_rank() == 4


def test_identity_follows_the_files_and_says_why_it_cannot(tmp_path, peft_dir):
    before = file_identity(peft_dir)
    config = peft_dir / "adapter_config.json"
    config.write_text(config.read_text() + " ")  # rewritten: another adapter
    assert file_identity(peft_dir) != before
    plain = tmp_path / "plain.tflite"
    shutil.copy(adapter_path("torch_r4"), plain)
    assert file_identity(plain) == file_identity(str(plain)) and len(file_identity(plain)) == 5
    with pytest.raises(NotFoundError, match="missing.tflite"):
        file_identity(tmp_path / "missing.tflite")
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(InvalidArgumentError, match="without adapter_config.json"):
        file_identity(empty)
    (peft_dir / "adapter_model.safetensors").unlink()
    with pytest.raises(NotFoundError, match="adapter_model.safetensors"):
        file_identity(peft_dir)
