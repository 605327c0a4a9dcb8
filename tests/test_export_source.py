"""inspect_source: export sources are recognized, and bad ones refused by name, without torch."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from checkpoints import write_llama_directory, write_llama_gguf, write_tokenizer
from conftest import MODELS
from runtime.errors import DataLossError, InvalidArgumentError, NotFoundError, UnimplementedError
from runtime.export.source import check_settings, check_tokenizer, inspect_source


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


def rewrite_config(directory: Path, **changes: object) -> None:
    """config.json with ``changes`` (None: the field removed)."""
    config = json.loads((directory / "config.json").read_text())
    for field, value in changes.items():
        if value is None:
            config.pop(field, None)
        else:
            config[field] = value
    (directory / "config.json").write_text(json.dumps(config))


def rewrite_weights(directory: Path, **changes: object) -> None:
    """model.safetensors with ``changes`` by tensor name (None: the tensor removed)."""
    from safetensors.numpy import load_file, save_file

    weights = load_file(directory / "model.safetensors")
    for name, value in changes.items():
        if value is None:
            del weights[name]
        else:
            weights[name] = value
    save_file(weights, str(directory / "model.safetensors"))


@pytest.mark.parametrize("changes, error, match", [
    ({"model_type": ["llama"]}, UnimplementedError, "model_type ['llama']) is not supported"),
    ({"hidden_size": None}, InvalidArgumentError, "config.json: no hidden_size (expected a positive integer)"),
    ({"vocab_size": "96"}, InvalidArgumentError, "config.json: vocab_size '96': expected a positive integer"),
    ({"num_hidden_layers": 0}, InvalidArgumentError, "num_hidden_layers 0: expected a positive integer"),
    ({"num_key_value_heads": 3}, InvalidArgumentError,
     "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"head_dim": None, "num_attention_heads": 3, "num_key_value_heads": 1}, InvalidArgumentError,
     "hidden_size 32 is not a multiple of num_attention_heads 3 (and no head_dim is given)"),
    ({"head_dim": 7}, InvalidArgumentError, "a head size of 7 (head_dim, or hidden_size / num_attention_heads): "
     "expected an even number"),
    ({"hidden_act": "relu"}, UnimplementedError, "hidden_act 'relu' is not supported; supported: silu"),
    ({"tie_word_embeddings": "yes"}, InvalidArgumentError, "tie_word_embeddings 'yes': expected true or false"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, UnimplementedError,
     "rope_scaling type 'dynamic' recomputes RoPE from the sequence length"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, UnimplementedError,
     "rope_parameters type 'longrope'"),
    ({"rope_parameters": {"rope_type": "su", "rope_theta": 1e4}}, UnimplementedError,
     "rope_parameters type 'su' is not a RoPE type transformers computes; supported: default, linear"),
    ({"use_sliding_window": True}, UnimplementedError, "sliding-window attention"),
    ({"layer_types": [["full_attention"]]}, InvalidArgumentError, "layer_types [['full_attention']]: expected a list"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, UnimplementedError,
     "quantization_config (gptq): quantized checkpoints are not exported"),
])
def test_config_values_the_export_cannot_take(tmp_path: Path, changes: dict, error: type, match: str) -> None:
    """Refused from config.json before transformers fills in its defaults or loads a weight."""
    directory = write_llama_directory(tmp_path / "m", tokenizer=False)
    rewrite_config(directory, **changes)
    with pytest.raises(error) as info:
        inspect_source(directory)
    assert match in str(info.value) and "config.json" in str(info.value)


def test_untied_embeddings_need_their_lm_head(tmp_path: Path) -> None:
    """transformers would initialize a missing lm_head at random and only log it: the export
    would run and be wrong. Llama's default is untied, so a config without the field needs it too."""
    directory = write_llama_directory(tmp_path / "m", tokenizer=False)
    for tie in (False, None):
        rewrite_config(directory, tie_word_embeddings=tie)
        with pytest.raises(NotFoundError, match=r"no tensor lm_head.weight \[96, 32\] \(tie_word_embeddings is false"):
            inspect_source(directory)
    import numpy as np

    rewrite_weights(directory, **{"lm_head.weight": np.zeros((96, 32), np.float32)})
    assert inspect_source(directory).parameters == 21664 + 96 * 32


def test_tensors_missing_misshapen_or_not_float(tmp_path: Path) -> None:
    import numpy as np

    directory = write_llama_directory(tmp_path / "m", tokenizer=False)
    rewrite_weights(directory, **{"model.layers.1.mlp.up_proj.weight": None})
    with pytest.raises(NotFoundError, match=r"no tensor model.layers.1.mlp.up_proj.weight \[64, 32\]"):
        inspect_source(directory)
    rewrite_weights(directory, **{"model.layers.1.mlp.up_proj.weight": np.zeros((64, 32), np.int32)})
    with pytest.raises(UnimplementedError, match="model.safetensors: tensor model.layers.1.mlp.up_proj.weight is "
                       r"I32, expected a float type"):
        inspect_source(directory)
    rewrite_weights(directory, **{"model.layers.1.mlp.up_proj.weight": np.zeros((32, 64), np.float32)})
    with pytest.raises(InvalidArgumentError, match=r"tensor model.layers.1.mlp.up_proj.weight has shape \[32, 64\], "
                       r"expected \[64, 32\] from config.json"):
        inspect_source(directory)
    rewrite_config(directory, intermediate_size=48)  # the config disagreeing with every MLP tensor
    with pytest.raises(InvalidArgumentError, match=r"model.layers.0.mlp.gate_proj.weight has shape \[64, 32\], "
                       r"expected \[48, 32\]"):
        inspect_source(directory)


def write_shards(directory: Path) -> dict[str, str]:
    """``directory``'s model.safetensors split in two shards with an index; returns its weight_map."""
    from safetensors.numpy import load_file, save_file

    weights = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    names = sorted(weights)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({name: weights[name] for name in part}, str(directory / shard))
        weight_map.update(dict.fromkeys(part, shard))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def test_sharded_weights(tmp_path: Path) -> None:
    """The shards an index names are read, each must exist; shards without an index are not
    what transformers reads."""
    directory = write_llama_directory(tmp_path / "m", tokenizer=False)
    weight_map = write_shards(directory)
    assert inspect_source(directory).parameters == 21664
    from safetensors.numpy import load_file, save_file

    first = load_file(directory / "model-00001-of-00002.safetensors")
    save_file({**load_file(directory / "model-00002-of-00002.safetensors"), **first},
              str(directory / "model-00002-of-00002.safetensors"))
    with pytest.raises(InvalidArgumentError, match=r"model-00002-of-00002.safetensors: tensor \S+ is also in "
                       "model-00001-of-00002.safetensors"):
        inspect_source(directory)
    (directory / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(NotFoundError, match=r"model.safetensors.index.json: names shard "
                       r"model-00002-of-00002.safetensors \(e.g. for model\.\S+\), which is not a file in"):
        inspect_source(directory)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        name: "../elsewhere.safetensors" for name in weight_map}}))
    with pytest.raises(NotFoundError, match="names shard ../elsewhere.safetensors"):
        inspect_source(directory)
    (directory / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(InvalidArgumentError, match="model.safetensors.index.json: not a readable JSON object"):
        inspect_source(directory)
    (directory / "model.safetensors.index.json").unlink()
    with pytest.raises(NotFoundError, match="no model.safetensors or model.safetensors.index.json .* found "
                       "model-00001-of-00002.safetensors"):
        inspect_source(directory)


def test_a_peft_adapter_directory_is_not_a_model(tmp_path: Path) -> None:
    adapter = shutil.copytree(MODELS / "peft" / "qkvo_r4", tmp_path / "adapter")
    base = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path") or "unnamed"
    with pytest.raises(InvalidArgumentError, match=f"adapter: a PEFT adapter \\(adapter_config.json\\), not a model: "
                       f"export its base model \\({base}\\)"):
        inspect_source(adapter)


def test_symbolic_links_that_lead_nowhere(tmp_path: Path) -> None:
    """A link loop or a dangling link is named as such, not reported as a missing file."""
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(NotFoundError, match="loop: a symbolic link that leads to no file"):
        inspect_source(tmp_path / "loop")
    directory = write_llama_directory(tmp_path / "m", tokenizer=False)
    (directory / "config.json").unlink()
    (directory / "config.json").symlink_to("config.json")
    with pytest.raises(NotFoundError, match="config.json: a symbolic link that leads to no file"):
        inspect_source(directory)
    directory = write_llama_directory(tmp_path / "n", tokenizer=False)
    (directory / "model.safetensors").unlink()
    (directory / "model.safetensors").symlink_to(tmp_path / "gone.safetensors")
    with pytest.raises(NotFoundError, match="model.safetensors: a symbolic link that leads to no file"):
        inspect_source(directory)


def write_gguf(path: Path, metadata: bool = True, dtype: type = np.float32, **tensors: object) -> Path:
    """A one-block Llama GGUF model (hidden 4, MLP 8, 2 heads) of ``dtype`` tensors, with
    ``tensors`` (name -> numpy array, None: left out) in place of its own; the dimensions'
    metadata transformers reads unless not ``metadata``."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    if metadata:
        writer.add_block_count(1)
        writer.add_embedding_length(4)
        writer.add_feed_forward_length(8)
        writer.add_head_count(2)
    shapes = {"token_embd.weight": (16, 4), "output_norm.weight": (4,), "blk.0.attn_norm.weight": (4,),
              "blk.0.ffn_norm.weight": (4,), "blk.0.ffn_gate.weight": (8, 4), "blk.0.ffn_up.weight": (8, 4),
              "blk.0.ffn_down.weight": (4, 8), **{f"blk.0.attn_{p}.weight": (4, 4) for p in ("q", "k", "v", "output")}}
    for name, tensor in {**{name: np.zeros(shape, dtype) for name, shape in shapes.items()}, **tensors}.items():
        if tensor is not None:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_tensor_types_transformers_cannot_dequantize(tmp_path: Path) -> None:
    """gguf's dequantize, which transformers loads with, reads no integer or F64 tensors: the
    load failed after torch with NotImplementedError."""
    path = write_gguf(tmp_path / "m.gguf", **{"blk.0.attn_q.weight": np.zeros((4, 4), np.int32)})
    with pytest.raises(UnimplementedError, match=r"m.gguf: tensor blk.0.attn_q.weight is I32 \(1 tensors of type "
                       r"I32\), which transformers cannot dequantize; readable: F32, F16, BF16, Q4_0"):
        inspect_source(path)
    assert inspect_source(write_gguf(tmp_path / "f.gguf", dtype=np.float16)).parameters == 236


def test_gguf_metadata_and_tensors_the_model_is_built_from(tmp_path: Path) -> None:
    """transformers fills missing metadata with its defaults and a missing tensor at random."""
    with pytest.raises(InvalidArgumentError, match="m.gguf: metadata llama.block_count is None, expected a positive "
                       "integer"):
        inspect_source(write_gguf(tmp_path / "m.gguf", metadata=False))
    with pytest.raises(NotFoundError, match=r"n.gguf: no tensor blk.0.ffn_up.weight \(a llama model of 1 blocks"):
        inspect_source(write_gguf(tmp_path / "n.gguf", **{"blk.0.ffn_up.weight": None}))


def test_gguf_tensors_of_other_shapes_than_the_metadata_states(tmp_path: Path) -> None:
    """transformers failed on them only once every weight was dequantized, after torch."""
    cases = {"blk.0.attn_k.weight": (np.zeros((2, 4), np.float32), r"\[2, 4\], expected \[4, 4\] from the file's metadata"),
             "blk.0.ffn_down.weight": (np.zeros((8, 4), np.float32), r"\[8, 4\], expected \[4, 8\]"),
             "output_norm.weight": (np.zeros(5, np.float32), r"\[5\], expected \[4\]"),
             "token_embd.weight": (np.zeros((16, 3), np.float32), r"\[16, 3\], expected \[vocab, 4\]"),
             "output.weight": (np.zeros((15, 4), np.float32), r"\[15, 4\], expected \[16, 4\] \(token_embd")}
    for name, (tensor, expected) in cases.items():
        with pytest.raises(InvalidArgumentError, match=f"m.gguf: tensor {name} has shape {expected}"):
            inspect_source(write_gguf(tmp_path / "m.gguf", **{name: tensor}))
    assert inspect_source(write_gguf(tmp_path / "m.gguf", **{"output.weight": np.zeros((16, 4), np.float32)}))


def test_the_tokenizer_a_bundle_carries(tmp_path: Path) -> None:
    """Missing or unreadable, refused by name before torch (transformers said "Couldn't
    instantiate the backend tokenizer" after importing it)."""
    directory = write_llama_directory(tmp_path / "m")
    check_tokenizer(inspect_source(directory))
    write_tokenizer(directory, vocab=120)  # ids 96-119 have no embedding row
    with pytest.raises(InvalidArgumentError, match="tokenizer.json: token ids up to 119, but the model's vocab_size "
                       "is 96"):
        check_tokenizer(inspect_source(directory))
    (directory / "tokenizer.json").write_text("{broken")
    with pytest.raises(InvalidArgumentError, match="tokenizer.json: not a readable JSON file"):
        check_tokenizer(inspect_source(directory))
    (directory / "tokenizer.json").write_text("[]")
    with pytest.raises(InvalidArgumentError, match="tokenizer.json: expected a Hugging Face tokenizer"):
        check_tokenizer(inspect_source(directory))
    (directory / "tokenizer.json").unlink()
    with pytest.raises(NotFoundError, match=r"m: no tokenizer \(tokenizer.json or tokenizer.model or vocab.json"):
        check_tokenizer(inspect_source(directory))
    with pytest.raises(NotFoundError, match=r"tiny.gguf: no tokenizer \(tokenizer.ggml.model metadata\)"):
        check_tokenizer(inspect_source(write_llama_gguf(tmp_path / "tiny.gguf")))


def test_settings_the_model_cannot_take(tmp_path: Path) -> None:
    """Refused from the config's dimensions, before loading: the quantizer named a block that
    does not divide the weights only after every signature was lowered, and DoRA slots for
    Gemma 3 were refused once its weights were loaded."""
    for source in (inspect_source(write_llama_directory(tmp_path / "m", tokenizer=False)),
                   inspect_source(write_llama_gguf(tmp_path / "tiny.gguf"))):
        check_settings(source, ["none", "int4-block32"], dora_ranks=(8,))
        with pytest.raises(InvalidArgumentError, match=r"quantize='int4-block128' does not fit this model: its "
                           "hidden_size 32 is not divisible by block size 128"):
            check_settings(source, ["int8", "int4-block128"], dora_ranks=())
    gemma = replace(source, model_type="gemma3_text")
    check_settings(gemma, ["none"], dora_ranks=())
    with pytest.raises(UnimplementedError, match="tiny.gguf: --dora-ranks is not available for gemma3_text"):
        check_settings(gemma, ["none"], dora_ranks=(8,))


@pytest.mark.parametrize("field, value", [("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
                                          ("use_bidirectional_attention", True)])
def test_gemma3_values_its_decoder_does_not_compute(tmp_path: Path, field: str, value: object) -> None:
    directory = write_llama_directory(tmp_path / "m", tokenizer=False)
    rewrite_config(directory, model_type="gemma3_text", hidden_act=None, **{field: value})
    with pytest.raises(UnimplementedError, match=f"config.json: {field} {value} is not supported for gemma3_text"):
        inspect_source(directory)


def test_every_family_has_a_layout() -> None:
    """The checks before loading know every family the source check accepts."""
    from runtime.export.layout import LAYOUTS
    from runtime.export.source import FAMILIES

    assert set(LAYOUTS) == set(FAMILIES)


def test_a_file_of_a_model_directory_or_a_directory_of_gguf_files(tmp_path: Path) -> None:
    """Named for what it is, not "no GGUF magic" / "no config.json" alone."""
    directory = write_llama_directory(tmp_path / "m", tokenizer=False)
    for name in ("config.json", "model.safetensors"):
        with pytest.raises(InvalidArgumentError, match=f"m/{name}: a file of the model directory .*m; give the "
                           "directory"):
            inspect_source(directory / name)
    (tmp_path / "g").mkdir()
    write_llama_gguf(tmp_path / "g" / "tiny.gguf")
    with pytest.raises(NotFoundError, match="g: no config.json .*; it holds tiny.gguf: give a GGUF file itself"):
        inspect_source(tmp_path / "g")
