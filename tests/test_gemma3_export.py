"""Gemma 3's batched, windowed and all-linear steps (runtime/export/gemma3_steps.py),
needing the ``export`` extra: in torch, each row of a batched step equals the decoder's own
step for that session, and the all-linear step equals transformers + peft; exported by the
command (default LoRA targets: all-linear), a batch's rows equal their sessions alone and
an all-linear PEFT adapter equals float64 transformers + peft through this runtime."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("litert_torch")

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from runtime import Engine, EngineSettings, SessionConfig  # noqa: E402
from runtime.export import families, grouped_kv  # noqa: E402
from runtime.export.gemma3_steps import Gemma3AllLinearStep, Gemma3BatchDecode  # noqa: E402
from runtime.export.litert import converter, kv_utils  # noqa: E402
from runtime.export.mlp_lora import lora_key, lora_shapes  # noqa: E402
from tools.build_gemma3_fixtures import ADAPTER_ALPHA, ADAPTER_RANK, SPEC  # noqa: E402
from tools.build_family_fixtures import ALL_LINEAR_TARGETS, TARGETS, add_adapter, build_hf_model, logits64  # noqa: E402

pytestmark = pytest.mark.export
KV = 32
LAYOUT = kv_utils.KV_LAYOUT_DEFAULT
LAYOUTS = {"default": LAYOUT, "transposed": kv_utils.KV_LAYOUT_TRANSPOSED, "grouped": grouped_kv.KV_LAYOUT_GROUPED}
PEFT_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
# Three sessions' tokens: their last steps sit before and past the sliding window (5).
STREAMS = [np.random.default_rng(row).integers(3, SPEC.config["vocab_size"], 4 + 7 * row) for row in range(3)]


@pytest.fixture(scope="module")
def hf_model():
    return build_hf_model(SPEC)


@pytest.fixture(scope="module")
def decoder(hf_model):
    return families.build_decoder(hf_model, KV)


def step(decoder, token: int, position: int, kv_cache):
    return decoder(torch.tensor([[token]], dtype=torch.int32), torch.tensor([position], dtype=torch.int32), kv_cache)


def prefilled(decoder, tokens, layout: tuple = LAYOUT) -> kv_utils.KVCache:
    kv_cache = kv_utils.KVCache.from_model_config(KV, decoder.config, kv_layout=layout)
    for position, token in enumerate(tokens):
        kv_cache = step(decoder, int(token), position, kv_cache)["kv_cache"]
    return kv_cache


def row_inputs(caches: list[kv_utils.KVCache]) -> dict[str, torch.Tensor]:
    return {f"{kind}_{layer}_{row}": getattr(entry, f"{kind}_cache").clone()
            for row, cache in enumerate(caches) for layer, entry in enumerate(cache.caches) for kind in ("k", "v")}


def test_the_decoders_steps_are_the_same_in_every_kv_layout(decoder) -> None:
    """Local and global layers, past the sliding window: litert-torch's two layouts and the
    grouped one (runtime.export.grouped_kv, in front of litert-torch's attention) agree."""
    tokens, logits = STREAMS[-1], {}
    for name, layout in LAYOUTS.items():
        kv_cache = kv_utils.KVCache.from_model_config(KV, decoder.config, kv_layout=layout)
        steps = []
        for position, token in enumerate(tokens):
            out = step(decoder, int(token), position, kv_cache)
            kv_cache = out["kv_cache"]
            steps.append(out["logits"][0, -1])
        logits[name] = torch.stack(steps)
    for name in ("transposed", "grouped"):
        assert torch.max(torch.abs(logits[name] - logits["default"])) <= 1e-5, name


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("window", [None, 24])
def test_each_row_of_the_batched_step_equals_the_decoders_own_step(decoder, window, layout) -> None:
    caches = [prefilled(decoder, stream[:-1], LAYOUTS[layout]) for stream in STREAMS]
    batched = Gemma3BatchDecode(decoder, len(STREAMS), None, LAYOUTS[layout], window).eval()
    out = batched(torch.tensor([[int(s[-1])] for s in STREAMS], dtype=torch.int32),
                  torch.tensor([len(s) - 1 for s in STREAMS], dtype=torch.int32), row_inputs(caches))
    for row, (stream, cache) in enumerate(zip(STREAMS, caches)):
        alone = step(decoder, int(stream[-1]), len(stream) - 1, cache)
        assert torch.max(torch.abs(alone["logits"][0] - out["logits"][row])) <= 1e-5
        for layer, entry in enumerate(alone["kv_cache"].caches):
            assert torch.max(torch.abs(entry.k_cache - out["kv_cache"][f"k_{layer}_{row}"])) <= 1e-5
            assert torch.max(torch.abs(entry.v_cache - out["kv_cache"][f"v_{layer}_{row}"])) <= 1e-5


def test_the_all_linear_step_equals_transformers_with_peft(hf_model, decoder) -> None:
    peft_model = add_adapter(hf_model, 5, ALL_LINEAR_TARGETS)
    tokens = STREAMS[-1]
    expected = logits64(peft_model.double(), tokens)
    modules = dict(peft_model.named_modules())
    lora = {key: torch.zeros(shape) for key, shape in lora_shapes(decoder, 8, True).items()}
    for layer in range(SPEC.config["num_hidden_layers"]):
        for projection, path in PEFT_MODULES.items():
            module = modules[f"base_model.model.model.layers.{layer}.{path}"]
            a, b = module.lora_A["default"].weight.float(), module.lora_B["default"].weight.float()
            lora[lora_key(layer, projection, "a_prime")][:, :ADAPTER_RANK] = (ADAPTER_ALPHA / ADAPTER_RANK * a).T
            lora[lora_key(layer, projection, "b_prime")][:ADAPTER_RANK] = b.T
    all_linear = Gemma3AllLinearStep(decoder, 8, converter.ExportConfig(kvcache_layout=LAYOUT)).eval()
    kv_cache = kv_utils.KVCache.from_model_config(KV, decoder.config, kv_layout=LAYOUT)
    rows = []
    for position, token in enumerate(tokens):
        out = all_linear(torch.tensor([[int(token)]], dtype=torch.int32), torch.tensor([position], dtype=torch.int32),
                         kv_cache, lora)
        kv_cache = out["kv_cache"]
        rows.append(out["logits"][0, 0].numpy())
    assert np.max(np.abs(np.stack(rows) - expected)) <= 1e-4


def test_an_export_batches_all_linear_rows_exactly(hf_model, tmp_path: Path) -> None:
    hf_model.save_pretrained(tmp_path / "gemma3")
    model = tmp_path / "gemma3.tflite"
    done = subprocess.run([sys.executable, "-m", "runtime", "export", tmp_path / "gemma3", "--out", model,
                           "--lora-ranks", "4", "--kv-length", str(KV), "--prefill-lengths", "8",
                           "--batch-sizes", "2", "--attention-windows", "16", "--jobs", "2"],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr
    adapters = {}
    for name, targets, seed in (("attention", TARGETS, 1), ("all_linear", ALL_LINEAR_TARGETS, 2)):
        peft_model = add_adapter(hf_model, seed, targets)
        peft_model.save_pretrained(tmp_path / name)
        adapters[name] = (tmp_path / name, peft_model)
    configs = [SessionConfig(lora_path=adapters["all_linear"][0]), SessionConfig(lora_path=adapters["attention"][0])]
    prompts = [[int(t) for t in stream[:-1]] for stream in STREAMS[1:]]
    with Engine(model) as engine:
        sessions = [engine.create_session(config) for config in configs]
        for session, prompt in zip(sessions, prompts):
            session.run_prefill(prompt)
        together = engine.decode_together([(s, int(stream[-1])) for s, stream in zip(sessions, STREAMS[1:])])
        assert dict(engine.stats().decode_batches) == {2: 1}
    for config, prompt, stream, logits in zip(configs, prompts, STREAMS[1:], together):
        with Engine(model, EngineSettings(batch_wait_s=None)) as engine, engine.create_session(config) as session:
            session.run_prefill(prompt)
            assert np.max(np.abs(session.run_decode(int(stream[-1])) - logits)) <= 1e-5
    expected = logits64(adapters["all_linear"][1].double(), STREAMS[1])[-1]  # row 0: the all-linear session
    assert np.max(np.abs(together[0] - expected)) <= 1e-4
