"""Tests for runtime.adapters.gguf_data with GGUF files written by the gguf package."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFWriter
from retained import retained_per_adapter

from runtime.errors import DataLossError, FailedPreconditionError, InvalidArgumentError
from runtime.adapters.gguf_data import read_gguf_lora, undo_rope_permutation

HEAD_DIM = 16


def llama_permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows (HF order -> its RoPE order)."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write(path, tensors, *, general_type="adapter", adapter_type="lora", alpha=8.0, arch="llama"):
    writer = GGUFWriter(str(path), arch)
    writer.add_string("general.type", general_type)
    writer.add_string("adapter.type", adapter_type)
    writer.add_float32("adapter.lora.alpha", alpha)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def hf():
    rng = np.random.default_rng(1)
    return {
        proj: (rng.normal(size=(4, 64)).astype(np.float32), rng.normal(size=(out, 4)).astype(np.float32))
        for proj, out in (("q", 64), ("k", 32), ("v", 32), ("output", 64))
    }


def gguf_tensors(hf, dtype=np.float32):
    tensors = {}
    for proj, (a, b) in hf.items():
        if proj in ("q", "k"):
            b = llama_permute(b, b.shape[0] // HEAD_DIM)
        tensors[f"blk.0.attn_{proj}.weight.lora_a"] = a.astype(dtype)
        tensors[f"blk.0.attn_{proj}.weight.lora_b"] = b.astype(dtype)
    return tensors


def test_undo_rope_permutation_inverts_llama_cpp():
    rows = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    np.testing.assert_array_equal(undo_rope_permutation(llama_permute(rows, 4), 16), rows)
    odd_heads = np.arange(48 * 2, dtype=np.float32).reshape(48, 2)  # 3 heads of 16, as SmolLM2's 3 KV heads
    np.testing.assert_array_equal(undo_rope_permutation(llama_permute(odd_heads, 3), 16), odd_heads)


def test_an_odd_number_of_kv_heads_is_read(tmp_path, hf):
    a, b = hf["k"]
    three_heads = {"k": (a, np.concatenate([b, b[:HEAD_DIM]]))}  # the k projection of 3 heads
    data = read_gguf_lora(write(tmp_path / "k3.gguf", gguf_tensors(three_heads)), head_dim=HEAD_DIM)
    np.testing.assert_array_equal(data.read_tensor("lora_atten_k_b_prime_weight_0"), three_heads["k"][1].T)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_reads_llama_lora_back_to_hf_layout(tmp_path, hf, dtype):
    data = read_gguf_lora(write(tmp_path / "a.gguf", gguf_tensors(hf, dtype)), head_dim=HEAD_DIM)
    assert data.format_name == "gguf" and data.get_lora_rank() == 4
    for proj, name in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")):
        a, b = (x.astype(dtype).astype(np.float32) for x in hf[proj])
        np.testing.assert_allclose(data.read_tensor(f"lora_atten_{name}_a_prime_weight_0"), (2.0 * a).T, rtol=1e-6)
        np.testing.assert_array_equal(data.read_tensor(f"lora_atten_{name}_b_prime_weight_0"), b.T)


def test_other_architectures_are_not_unpermuted(tmp_path, hf):
    tensors = {k: v for k, v in gguf_tensors(hf).items() if "attn_v" in k}
    data = read_gguf_lora(write(tmp_path / "q.gguf", tensors, arch="qwen2", alpha=0.0))
    a, b = hf["v"]
    np.testing.assert_array_equal(data.read_tensor("lora_atten_v_a_prime_weight_0"), a.T)  # alpha 0: scale 1
    np.testing.assert_array_equal(data.read_tensor("lora_atten_v_b_prime_weight_0"), b.T)


def test_head_dim_needed_only_when_reading_q_k(tmp_path, hf):
    data = read_gguf_lora(write(tmp_path / "a.gguf", gguf_tensors(hf)))
    assert data.tensor_info("lora_atten_q_b_prime_weight_0").shape == (4, 64)
    data.read_tensor("lora_atten_v_b_prime_weight_0")
    with pytest.raises(FailedPreconditionError, match="head size"):
        data.read_tensor("lora_atten_q_b_prime_weight_0")


def test_refusals(tmp_path, hf):
    tensors = gguf_tensors(hf)
    with pytest.raises(InvalidArgumentError, match="general.type is 'model'"):
        read_gguf_lora(write(tmp_path / "m.gguf", tensors, general_type="model"))
    with pytest.raises(InvalidArgumentError, match="adapter.type is 'control_vector'"):
        read_gguf_lora(write(tmp_path / "c.gguf", tensors, adapter_type="control_vector"))
    other = dict(tensors)
    other["blk.0.ffn_norm.weight.lora_a"] = np.zeros((4, 64), np.float32)
    with pytest.raises(InvalidArgumentError, match=r"cannot apply 1 tensor\(s\).*ffn_norm"):
        read_gguf_lora(write(tmp_path / "f.gguf", other))
    half_mlp = dict(tensors)
    half_mlp["blk.0.ffn_up.weight.lora_a"] = np.zeros((4, 64), np.float32)
    with pytest.raises(InvalidArgumentError, match="ffn_up.weight has no lora_b"):
        read_gguf_lora(write(tmp_path / "u.gguf", half_mlp))
    half = {k: v for k, v in tensors.items() if k != "blk.0.attn_v.weight.lora_b"}
    with pytest.raises(InvalidArgumentError, match="attn_v.weight has no lora_b"):
        read_gguf_lora(write(tmp_path / "h.gguf", half))
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(InvalidArgumentError, match="not a readable GGUF"):
        read_gguf_lora(tmp_path / "junk.gguf")


def test_a_registered_file_keeps_its_pairs_shapes_not_the_reader(tmp_path, hf):
    # The reader's fields and tensors (with their memmap views) used to stay with the adapter:
    # 47 KiB per adapter of 4 pairs; now a table of shapes and the data offsets (3 KiB).
    paths = [write(tmp_path / f"a{i}.gguf", gguf_tensors(hf)) for i in range(11)]
    assert retained_per_adapter(lambda path: read_gguf_lora(path, head_dim=HEAD_DIM), paths) < 8 * 1024


def test_read_again_after_release_and_refused_once_rewritten(tmp_path, hf):
    path = write(tmp_path / "a.gguf", gguf_tensors(hf))
    data = read_gguf_lora(path, head_dim=HEAD_DIM)
    for _ in range(2):  # registered, then read again after the mapped file was dropped
        np.testing.assert_array_equal(data.read_tensor("lora_atten_k_b_prime_weight_0"), hf["k"][1].T)
        data.release_memory()
    write(path, {k: v for k, v in gguf_tensors(hf).items() if "attn_v" in k})
    with pytest.raises(DataLossError, match="a.gguf: tensor 'lora_atten_q_a_prime_weight_0': file"):
        data.read_tensor("lora_atten_q_a_prime_weight_0")


@pytest.mark.parametrize("kind", ["Q8_0", "BF16"])
def test_quantized_tensors_read_as_the_gguf_reader_dequantizes_them(tmp_path, kind):
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize, quantize

    kind = GGMLQuantizationType[kind]
    rng = np.random.default_rng(2)
    stored = {"blk.0.attn_v.weight.lora_a": rng.standard_normal((32, 64)).astype(np.float32),
              "blk.0.attn_v.weight.lora_b": rng.standard_normal((32, 32)).astype(np.float32)}
    path = tmp_path / "q.gguf"
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", 32.0)
    for name, array in stored.items():
        writer.add_tensor(name, quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expected = {t.name: dequantize(t.data, kind) for t in GGUFReader(path).tensors}
    data = read_gguf_lora(path)
    np.testing.assert_array_equal(data.read_tensor("lora_atten_v_a_prime_weight_0"),
                                  expected["blk.0.attn_v.weight.lora_a"].T)  # alpha / r = 1
    np.testing.assert_array_equal(data.read_tensor("lora_atten_v_b_prime_weight_0"),
                                  expected["blk.0.attn_v.weight.lora_b"].T)
