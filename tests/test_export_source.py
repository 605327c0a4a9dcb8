"""inspect_source: export sources are recognized, and bad ones refused by name, without torch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from checkpoints import write_llama_directory, write_llama_gguf
from conftest import MODELS
from runtime.errors import DataLossError, InvalidArgumentError, NotFoundError, UnimplementedError
from runtime.export.source import inspect_source


def test_a_model_directory(tmp_path: Path) -> None:
    source = inspect_source(write_llama_directory(tmp_path / "llama"))
    assert (source.model_type, source.gguf_file, source.directory) == ("llama", None, tmp_path / "llama")


def test_a_gguf_file(tmp_path: Path) -> None:
    source = inspect_source(write_llama_gguf(tmp_path / "tiny.gguf"))
    assert (source.model_type, source.gguf_file, source.directory) == ("llama", "tiny.gguf", tmp_path)


def test_the_context_length_a_source_states(tmp_path: Path) -> None:
    """What `runtime export`'s default KV length comes from: config.json's max_position_embeddings
    (a multimodal config's text_config's), a GGUF file's {architecture}.context_length."""
    assert inspect_source(write_llama_gguf(tmp_path / "tiny.gguf")).context_length == 256
    directory = write_llama_directory(tmp_path / "llama", tokenizer=False)
    assert inspect_source(directory).context_length == 256
    config = json.loads((directory / "config.json").read_text())
    del config["max_position_embeddings"]
    for stated, expected in (({}, None), ({"max_position_embeddings": 0}, None),
                             ({"max_position_embeddings": "8192"}, None),
                             ({"text_config": {"max_position_embeddings": 32768}}, 32768)):
        (directory / "config.json").write_text(json.dumps({**config, **stated}))
        assert inspect_source(directory).context_length == expected, stated


def test_missing_path_and_missing_config(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="no such file or directory"):
        inspect_source(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotFoundError, match="empty: no config.json"):
        inspect_source(tmp_path / "empty")


def test_unknown_architecture_names_it_and_the_supported_ones(tmp_path: Path) -> None:
    directory = write_llama_directory(tmp_path / "gpt2", tokenizer=False)
    (directory / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnimplementedError) as info:
        inspect_source(directory)
    message = str(info.value)
    assert "GPT2LMHeadModel" in message and "'gpt2'" in message
    assert all(name in message for name in ("llama", "qwen2", "qwen3", "gemma3_text"))


def test_config_that_is_not_json(tmp_path: Path) -> None:
    directory = write_llama_directory(tmp_path / "m", tokenizer=False)
    (directory / "config.json").write_text("{not json")
    with pytest.raises(InvalidArgumentError, match="config.json: not valid JSON"):
        inspect_source(directory)


def test_weights_missing_or_truncated(tmp_path: Path) -> None:
    directory = write_llama_directory(tmp_path / "m", tokenizer=False)
    weights = directory / "model.safetensors"
    blob = weights.read_bytes()
    weights.write_bytes(blob[: len(blob) - 1000])
    with pytest.raises(DataLossError, match="model.safetensors: corrupt or truncated safetensors"):
        inspect_source(directory)
    weights.write_bytes(b"\x08" + bytes(7) + b"garbage!")
    with pytest.raises(DataLossError, match="model.safetensors"):
        inspect_source(directory)
    weights.unlink()
    with pytest.raises(NotFoundError, match=r"no \*.safetensors weights"):
        inspect_source(directory)


def test_truncated_gguf(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "tiny.gguf")
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) - 4096])
    with pytest.raises(DataLossError, match="tiny.gguf: corrupt or truncated GGUF"):
        inspect_source(path)
    path.write_bytes(blob[:64])
    with pytest.raises(InvalidArgumentError, match="tiny.gguf: not a readable GGUF file"):
        inspect_source(path)


def test_a_gguf_adapter_or_other_file_is_not_a_model(tmp_path: Path) -> None:
    adapter = shutil.copy(MODELS / "peft" / "qkvo_r4.gguf", tmp_path / "adapter.gguf")
    with pytest.raises(InvalidArgumentError, match="general.type is 'adapter'"):
        inspect_source(adapter)
    with pytest.raises(InvalidArgumentError, match="neither a directory nor a GGUF file"):
        inspect_source(MODELS / "gqa_default.tflite")


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnimplementedError, match="GGUF architecture 'gpt2' is not supported; supported: Llama"):
        inspect_source(path)
