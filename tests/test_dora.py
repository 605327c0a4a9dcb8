"""DoRA adapters (runtime/adapters/dora.py and their materialization in runtime/components/lora.py):
the output scale g = m / ||W + u s B A||_row for a session's scale u, folded into b and written
as g - 1 into the DoRA slot's scale inputs; blends refused by name. The model is the Llama
family fixture (tests/models/families/llama, exported with --dora-ranks 8), whose
``adapter_dora`` matches float64 peft in tests/test_family_fidelity.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import MODELS
from runtime import Engine, LoraSource, SessionConfig
from runtime.cli.main import main
from runtime.components.lora import LoRA, plan_adapter
from runtime.errors import InvalidArgumentError
from runtime.executor.litert_executor import LlmExecutor
from runtime.adapters.adapter_formats import open_adapter
from runtime.adapters.dora import DoraMagnitudes, DoraProjection
from runtime.adapters.lora_util import lora_input_name, Convention
from runtime.adapters.lora_xs import LoraXsFactors
from runtime.util.model_weights import ModelWeights
from runtime.util.signature_names import DORA, LoraSlot

FAMILY = MODELS / "families" / "llama"
MODEL = FAMILY / "model.tflite"
DORA_ADAPTER = FAMILY / "adapter_dora"
_PEFT_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
               "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def test_the_output_scale_is_the_magnitude_over_the_adapted_rows_norm_at_any_scale():
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((6, 5)).astype(np.float32)
    a, b = rng.standard_normal((5, 2)).astype(np.float32), rng.standard_normal((2, 6)).astype(np.float32)
    magnitude = rng.uniform(0.5, 2.0, 6)
    reads = []
    dora = DoraMagnitudes.of({(0, "q"): DoraProjection("m", magnitude, lambda: reads.append(1) or weight)}, "test")
    for scale in (1.0, 0.5, -2.0):
        adapted = weight.astype(np.float64) + scale * (a.astype(np.float64) @ b).T
        expected = magnitude / np.linalg.norm(adapted, axis=1)
        np.testing.assert_allclose(dora.output_scale((0, "q"), a, b, scale), expected, rtol=1e-12)
    assert len(reads) == 1  # the base weight is read once, whatever the scale


def test_a_zero_row_norm_is_refused_by_name():
    zeros = np.zeros((3, 4), np.float32)
    dora = DoraMagnitudes.of({(1, "up"): DoraProjection("layers.1.mlp.up_proj.lora_magnitude_vector", np.ones(3),
                                                     lambda: zeros)}, "adapter")
    with pytest.raises(InvalidArgumentError, match="up_proj.lora_magnitude_vector'.* zero or non-finite row norm"):
        dora.output_scale((1, "up"), np.zeros((4, 1), np.float32), np.zeros((1, 3), np.float32), 1.0)


class _Buffer:
    def write(self, data_array):
        self.array = np.array(data_array)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_materializing_writes_g_into_b_and_g_minus_one_into_the_scale_inputs(scale):
    executor = LlmExecutor(MODEL)
    executor.close()
    slot = LoraSlot(8, DORA)
    inputs = executor.spec.lora_slots[slot]
    weights = ModelWeights.open(MODEL, str(MODEL))
    with open_adapter(DORA_ADAPTER, lora_xs=LoraXsFactors(lambda: weights)) as data:
        lora = LoRA([(plan_adapter(data, executor.spec.lora_slots), scale)], slot, inputs, lambda name: _Buffer())
    stored = load_file(str(DORA_ADAPTER / "adapter_model.safetensors"))
    config = json.loads((DORA_ADAPTER / "adapter_config.json").read_text())
    s = scale * config["lora_alpha"] / config["r"]
    for layer, projection in [(0, "q"), (1, "v"), (2, "down")]:
        module = f"base_model.model.model.layers.{layer}.{_PEFT_NAMES[projection]}"
        a, b = stored[f"{module}.lora_A.weight"].astype(np.float64), stored[f"{module}.lora_B.weight"].astype(np.float64)
        adapted = weights.weight(layer, projection).astype(np.float64) + s * b @ a
        g = stored[f"{module}.lora_magnitude_vector"] / np.linalg.norm(adapted, axis=1)
        buffers = {side: lora.buffers[lora_input_name(Convention.LITERT_TORCH, layer, projection, side)].array
                   for side in ("a", "b", "m")}
        np.testing.assert_allclose(buffers["m"], g - 1, atol=1e-6)
        np.testing.assert_allclose((buffers["a"] @ buffers["b"])[:, :], (s * g[:, None] * (b @ a)).T, atol=1e-5)


def test_a_blend_with_a_dora_adapter_is_refused_naming_it():
    with Engine(MODEL) as engine:
        with pytest.raises(InvalidArgumentError, match="adapter_dora: a DoRA adapter cannot be blended"):
            engine.create_session(SessionConfig(loras=[LoraSource(path=DORA_ADAPTER, scale=0.5),
                                                       LoraSource(path=FAMILY / "adapter", scale=0.5)]))
        with engine.create_session(SessionConfig(lora_path=DORA_ADAPTER, lora_scale=0.5)) as session:
            assert session.run_prefill([5, 6, 7]).shape[-1] > 0  # alone, at a scale of its own


def test_a_changed_scale_changes_the_output_and_zero_scale_is_the_base_model():
    prompt = [5, 17, 42, 9]
    with Engine(MODEL) as engine:
        lora_id = engine.register_adapter(LoraSource(path=DORA_ADAPTER))
        logits = {}
        for scale in (1.0, 0.5):
            with engine.create_session(SessionConfig(adapters={lora_id: scale})) as session:
                logits[scale] = session.run_prefill(prompt)
        with engine.create_session(SessionConfig()) as session:
            base = session.run_prefill(prompt)
    assert np.max(np.abs(logits[1.0] - logits[0.5])) > 0.1
    assert np.max(np.abs(logits[0.5] - base)) > 0.1


def test_inspect_check_says_dora_and_convert_refuses_it(capsys, tmp_path):
    assert main(["inspect", "--check", str(DORA_ADAPTER), "--model", str(MODEL)]) == 0
    out = capsys.readouterr().out
    assert "goes in slot dora r8" in out and "DoRA: magnitudes on 21 projections" in out
    assert main(["convert", str(DORA_ADAPTER), "--model", str(MODEL), "--out", str(tmp_path / "a.tflite")]) == 2
    assert "a DoRA adapter (use_dora) cannot be written as a .tflite LoRA file" in capsys.readouterr().err
    assert not (tmp_path / "a.tflite").exists()
