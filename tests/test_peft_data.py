"""Tests for runtime.adapters.peft_data with synthetic PEFT adapters (the real-PEFT fixtures
are checked end to end in test_adapter_fidelity.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from retained import retained_per_adapter
from safetensors.numpy import save_file

from runtime.errors import (
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    UnimplementedError,
)
from runtime.adapters.peft_data import PeftLoraConfig, read_peft_directory, read_peft_state_dict

PREFIX = "base_model.model.model.layers"


def pair(rng, layer, proj, r, fan_in=64, fan_out=64):
    key = f"{PREFIX}.{layer}.self_attn.{proj}_proj"
    return {
        f"{key}.lora_A.weight": rng.normal(size=(r, fan_in)).astype(np.float32),
        f"{key}.lora_B.weight": rng.normal(size=(fan_out, r)).astype(np.float32),
    }


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def test_scale_is_folded_into_a(rng):
    sd = {**pair(rng, 0, "q", 4), **pair(rng, 1, "v", 4, fan_out=32)}
    data = read_peft_state_dict(sd, {"r": 4, "lora_alpha": 8, "peft_type": "LORA"})
    assert data.get_all_tensor_names() == [
        "lora_atten_q_a_prime_weight_0", "lora_atten_q_b_prime_weight_0",
        "lora_atten_v_a_prime_weight_1", "lora_atten_v_b_prime_weight_1",
    ]
    a = data.read_tensor("lora_atten_q_a_prime_weight_0")
    b = data.read_tensor("lora_atten_v_b_prime_weight_1")
    np.testing.assert_allclose(a, 2.0 * sd[f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"].T, rtol=1e-6)
    np.testing.assert_array_equal(b, sd[f"{PREFIX}.1.self_attn.v_proj.lora_B.weight"].T)
    assert data.tensor_info("lora_atten_v_b_prime_weight_1").shape == (4, 32)
    assert data.get_lora_rank() == 4 and data.format_name == "peft"


def test_rslora_and_patterns():
    config = PeftLoraConfig.from_dict(
        {"r": 8, "lora_alpha": 16, "use_rslora": True,
         "rank_pattern": {"layers.1.self_attn.v_proj": 4}, "alpha_pattern": {"v_proj": 2}}, "c")
    assert config.scale("model.layers.0.self_attn.q_proj") == pytest.approx(16 / math.sqrt(8))
    assert config.rank_and_alpha("model.layers.1.self_attn.v_proj") == (4, 2.0)
    assert config.rank_and_alpha("model.layers.0.self_attn.v_proj") == (8, 2.0)
    assert config.rank_and_alpha("model.layers.11.self_attn.v_proj") == (8, 2.0)  # "layers.1." is not "layers.11."


def test_rank_pattern_adapter_reads_mixed_ranks(rng):
    sd = {**pair(rng, 0, "q", 4), **pair(rng, 1, "v", 8, fan_out=32)}
    data = read_peft_state_dict(sd, {"r": 4, "lora_alpha": 8, "rank_pattern": {"model.layers.1.self_attn.v_proj": 8}})
    assert data.tensor_info("lora_atten_v_a_prime_weight_1").shape == (64, 8)
    np.testing.assert_allclose(
        data.read_tensor("lora_atten_v_a_prime_weight_1"), 1.0 * sd[f"{PREFIX}.1.self_attn.v_proj.lora_A.weight"].T, rtol=1e-6
    )
    with pytest.raises(InvalidArgumentError, match="rank 8, but the config says r=4"):
        read_peft_state_dict(sd, {"r": 4, "lora_alpha": 8})


def test_lora_xs_folds_r_into_a(rng):
    sd = pair(rng, 0, "k", 4, fan_out=32)
    r = rng.normal(size=(4, 4)).astype(np.float32)
    sd[f"{PREFIX}.0.self_attn.k_proj.lora_R.weight"] = r
    data = read_peft_state_dict(sd, {"r": 4, "lora_alpha": 4})
    a = sd[f"{PREFIX}.0.self_attn.k_proj.lora_A.weight"]
    np.testing.assert_allclose(data.read_tensor("lora_atten_k_a_prime_weight_0"), (r @ a).T, rtol=1e-5)


@pytest.mark.parametrize(
    "config,error,match",
    [
        ({"r": 4, "use_dora": True}, InvalidArgumentError, "has no lora_magnitude_vector though the config says "
         "use_dora: true"),
        ({"r": 4, "use_dora": True, "peft_type": "LORA_XS"}, UnimplementedError, "DoRA over LoRA-XS"),
        ({"r": 4, "use_dora": "yes"}, InvalidArgumentError, "'use_dora' is 'yes', expected true or false"),
        ({"r": 4, "n_iter": 10**9}, InvalidArgumentError, r"n_iter is 1000000000, expected an integer in \[0, 1000\]"),
        ({"r": 4, "random_state": -1}, InvalidArgumentError, "random_state is -1"),
        ({"r": 4, "modules_to_save": ["lm_head"]}, InvalidArgumentError, "modules_to_save"),
        ({"r": 4, "bias": "lora_only"}, InvalidArgumentError, "biases"),
        ({"r": 4, "peft_type": "IA3"}, InvalidArgumentError, "peft_type 'IA3'"),
        ({"lora_alpha": 8}, InvalidArgumentError, "'r' is None"),
        ({"r": 0}, InvalidArgumentError, "positive integer"),
        ({"r": 4, "lora_alpha": "x"}, InvalidArgumentError, "lora_alpha"),
        ({"r": 4, "rank_pattern": [1]}, InvalidArgumentError, "rank_pattern must be an object"),
        ([1, 2], InvalidArgumentError, "JSON object"),
    ],
)
def test_config_refusals(rng, config, error, match):
    with pytest.raises(error, match=match):
        read_peft_state_dict(pair(rng, 0, "q", 4), config)


def test_unappliable_tensors_are_all_listed(rng):
    sd = pair(rng, 0, "q", 4)
    sd["base_model.model.lm_head.lora_A.weight"] = np.zeros((4, 64), np.float32)
    sd["base_model.model.model.embed_tokens.lora_embedding_A"] = np.zeros((4, 256), np.float32)
    sd["base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias"] = np.zeros(64, np.float32)
    with pytest.raises(InvalidArgumentError) as info:
        read_peft_state_dict(sd, {"r": 4})
    message = str(info.value)
    assert "cannot apply 3 tensor(s)" in message
    for fragment in ("lm_head.lora_A", "(embedding LoRA)", "(LoRA bias)"):
        assert fragment in message


def test_a_dora_magnitude_without_use_dora_is_refused(rng):
    sd = pair(rng, 0, "q", 4)
    sd[f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector"] = np.ones(64, np.float32)
    with pytest.raises(InvalidArgumentError, match="has a DoRA magnitude .* but the config has no use_dora: true"):
        read_peft_state_dict(sd, {"r": 4})


def test_mlp_projections_read_like_the_attention_ones(rng):
    sd = pair(rng, 0, "q", 4)
    sd[f"{PREFIX}.1.mlp.gate_proj.lora_A.weight"] = rng.standard_normal((4, 64)).astype(np.float32)
    sd[f"{PREFIX}.1.mlp.gate_proj.lora_B.weight"] = rng.standard_normal((128, 4)).astype(np.float32)
    sd[f"{PREFIX}.1.mlp.down_proj.lora_A.weight"] = rng.standard_normal((4, 128)).astype(np.float32)
    sd[f"{PREFIX}.1.mlp.down_proj.lora_B.weight"] = rng.standard_normal((64, 4)).astype(np.float32)
    data = read_peft_state_dict(sd, {"r": 4, "lora_alpha": 8})
    assert data.tensor_info("lora_ff_gate_a_prime_weight_1").shape == (64, 4)
    assert data.tensor_info("lora_ff_down_b_prime_weight_1").shape == (4, 64)
    np.testing.assert_allclose(data.read_tensor("lora_ff_gate_a_prime_weight_1"),
                               2.0 * sd[f"{PREFIX}.1.mlp.gate_proj.lora_A.weight"].T)  # alpha / r = 2


def test_lora_xs_by_type_and_r_only_files_are_named(rng):
    sd = pair(rng, 0, "q", 4)
    assert read_peft_state_dict(sd, {"r": 4, "peft_type": "lora_xs"}).get_lora_rank() == 4
    r_only = {f"{PREFIX}.0.self_attn.q_proj.lora_R.weight": np.eye(4, dtype=np.float32)}
    with pytest.raises(FailedPreconditionError, match="R-only LoRA-XS adapter.*open it with a model"):
        read_peft_state_dict(r_only, {"r": 4, "peft_type": "LORA_XS"})


def test_missing_half_and_bad_pair(rng):
    sd = pair(rng, 0, "q", 4)
    del sd[f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"]
    with pytest.raises(InvalidArgumentError, match="no lora_B.weight"):
        read_peft_state_dict(sd, {"r": 4})
    sd = pair(rng, 0, "q", 4)
    sd[f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"] = np.zeros((64, 3), np.float32)
    with pytest.raises(InvalidArgumentError, match="not a LoRA pair"):
        read_peft_state_dict(sd, {"r": 4})
    with pytest.raises(InvalidArgumentError, match="layers_to_transform"):
        read_peft_state_dict(pair(rng, 0, "q", 4), {"r": 4, "layers_to_transform": [1]})
    with pytest.raises(InvalidArgumentError, match="no LoRA tensors"):
        read_peft_state_dict({}, {"r": 4})


def test_directory(tmp_path, rng):
    sd = {**pair(rng, 0, "q", 4), **pair(rng, 0, "o", 4)}
    save_file(sd, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 4, "peft_type": "LORA"}))
    data = read_peft_directory(tmp_path)
    np.testing.assert_array_equal(
        data.read_tensor("lora_atten_o_b_prime_weight_0"), sd[f"{PREFIX}.0.self_attn.o_proj.lora_B.weight"].T
    )
    with pytest.raises(NotFoundError, match="no such PEFT adapter directory"):
        read_peft_directory(tmp_path / "adapter_model.safetensors")
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(InvalidArgumentError, match="not valid JSON"):
        read_peft_directory(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(InvalidArgumentError, match="safetensors"):
        read_peft_directory(tmp_path)
    with pytest.raises(NotFoundError, match="no such PEFT adapter"):
        read_peft_directory(tmp_path / "nowhere")
    (tmp_path / "adapter_config.json").unlink()
    with pytest.raises(NotFoundError, match="adapter_config.json"):
        read_peft_directory(tmp_path)


ALL_LINEAR_FANS = {"q": (64, 64), "k": (64, 32), "v": (64, 32), "o": (64, 64),
                   "gate": (64, 128), "up": (64, 128), "down": (128, 64)}


def write_directory(path, rng, layers=4, rank=4, use_dora=False):
    """A PEFT directory of every projection of ``layers`` layers, as peft saves one; returns its state dict."""
    sd = {}
    for layer in range(layers):
        for proj, (fan_in, fan_out) in ALL_LINEAR_FANS.items():
            module = f"{PREFIX}.{layer}.{'mlp' if proj in ('gate', 'up', 'down') else 'self_attn'}.{proj}_proj"
            sd[f"{module}.lora_A.weight"] = rng.standard_normal((rank, fan_in)).astype(np.float32)
            sd[f"{module}.lora_B.weight"] = rng.standard_normal((fan_out, rank)).astype(np.float32)
            if use_dora:
                sd[f"{module}.lora_magnitude_vector"] = rng.uniform(0.5, 1.5, fan_out).astype(np.float32)
    path.mkdir()
    save_file(sd, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 2 * rank, "use_dora": use_dora}))
    return sd


@pytest.mark.parametrize("use_dora", [False, True])
def test_a_registered_directory_keeps_its_pairs_shapes_not_its_modules(tmp_path, rng, use_dora):
    # 28 modules each: the reader used to keep closures and names per module (50 KiB per adapter,
    # 100 KiB with DoRA's magnitudes); now a table of shapes and the config (3 KiB; 5 KiB with DoRA,
    # some of which is numpy's cache of small buffers).
    paths = [tmp_path / f"adapter{i}" for i in range(11)]
    for path in paths:
        write_directory(path, rng, use_dora=use_dora)
    assert retained_per_adapter(read_peft_directory, paths) < 10 * 1024


def test_tensors_are_read_again_after_release_and_equal(tmp_path, rng):
    sd = write_directory(tmp_path / "a", rng, use_dora=True)
    data = read_peft_directory(tmp_path / "a")
    module = f"{PREFIX}.2.mlp.down_proj"
    expected_a, expected_b = 2.0 * sd[f"{module}.lora_A.weight"].T, sd[f"{module}.lora_B.weight"].T
    for _ in range(2):  # registered, then read again after the built tensors were dropped
        np.testing.assert_array_equal(data.read_tensor("lora_ff_down_a_prime_weight_2"), expected_a)
        np.testing.assert_array_equal(data.read_tensor("lora_ff_down_b_prime_weight_2"), expected_b)
        data.release_memory()
    assert data.get_all_tensor_names()[:4] == ["lora_ff_down_a_prime_weight_0", "lora_ff_down_b_prime_weight_0",
                                               "lora_ff_gate_a_prime_weight_0", "lora_ff_gate_b_prime_weight_0"]
    assert (2, "down") in data.dora and (4, "down") not in data.dora
    assert data.nbytes == sum(a.nbytes for key, a in sd.items() if "magnitude" not in key) + sum(
        a.nbytes for key, a in sd.items() if "magnitude" in key)


def test_a_config_rewritten_after_registration_does_not_change_the_adapter(tmp_path, rng):
    sd = write_directory(tmp_path / "a", rng)
    data = read_peft_directory(tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 100}))
    np.testing.assert_array_equal(data.read_tensor("lora_atten_q_a_prime_weight_0"),
                                  2.0 * sd[f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"].T)  # the registered alpha 8


def test_weights_rewritten_after_registration_are_refused_at_first_use(tmp_path, rng):
    write_directory(tmp_path / "a", rng)
    data = read_peft_directory(tmp_path / "a")
    save_file({"x": np.zeros(3, np.float32)}, str(tmp_path / "a" / "adapter_model.safetensors"))
    with pytest.raises(DataLossError, match="adapter_model.safetensors: tensor 'lora_atten_q_a_prime_weight_0': file"):
        data.read_tensor("lora_atten_q_a_prime_weight_0")


def test_a_layer_beyond_any_model_is_refused_when_read(rng):
    sd = {key.replace(".0.", ".99999999999."): value for key, value in pair(rng, 0, "q", 4).items()}
    with pytest.raises(InvalidArgumentError, match="targets layer 99999999999, beyond the 16777216 layers of any model"):
        read_peft_state_dict(sd, {"r": 4})
