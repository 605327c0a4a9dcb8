#!/usr/bin/env python3
"""Build the per-family export fixtures: one tiny random model per supported family,
exported by ``runtime.export``, with a PEFT adapter and float64 reference logits.

Run with the ``export`` extra installed (``pip install -e '.[export]'``)::

    python3 tools/build_family_fixtures.py [--out-dir DIR] [--family NAME ...]

For each family (``llama``: SmolLM2's shape, tied embeddings; ``llama3``: Llama 3.2's
RoPE scaling, separate lm_head; ``qwen2``: q/k/v biases; ``qwen3``: q/k norms and a head
size apart from hidden/heads; ``gemma3``: sliding-window and global layers with their
own RoPE tables, four norms per block, query_pre_attn_scalar != head_dim) this writes,
under ``tests/models/families/<family>/`` by default:

``model.tflite``
    The transformers model (random weights drawn with numpy from a fixed seed, spread so
    that logits differ by units) exported float32 with LoRA slots of rank 8 (attention
    only, and all-linear beside it where the family has it: all but Gemma 3; a DoRA slot
    of rank 8 for Llama, Qwen2 and Qwen3), prefill length 16, KV length 64.
``adapter/``
    A rank-4 PEFT LoRA on q/k/v/o of every layer (``lora_alpha`` 8), random A and B,
    saved by ``peft``.
``adapter_all_linear/`` (all but Gemma 3)
    The same on every linear projection: q/k/v/o and the MLP's gate/up/down.
``adapter_dora/`` (Llama, Qwen2, Qwen3)
    A rank-4 DoRA adapter (``use_dora``) on every linear projection: random A and B, and
    magnitudes ``||W||_row * (1 + 0.3 n)`` (``n`` standard normal), so that each output
    channel is rescaled by its own factor; saved by ``peft``.
``adapter_lora_xs/`` (Llama)
    An R-only LoRA-XS adapter on q/k/v/o: a random ``r x r`` ``lora_R`` per projection
    (``peft_type`` "LORA_XS", ``n_iter`` 10, ``random_state`` 42), its A and B being
    scikit-learn's ``TruncatedSVD`` of the float32 base weight as LoRA-XS's reference
    builds them; its reference is the float64 model with ``W + (alpha / r) B R A``.
``reference.npz``
    transformers in float64 (eager attention): ``tokens`` (a prompt of ``prompt_len``
    tokens and the tokens fed after it), ``logits`` and ``logits_<adapter>`` at every
    position from the prompt's last on (each adapter through ``peft``), and
    ``greedy`` / ``greedy_<adapter>``: the greedy continuation of the prompt.

and ``tests/models/families/MANIFEST.json`` (configs, versions, sizes, sha256, and each
fixture's distance from the reference through this runtime, measured here).
``tests/test_family_fidelity.py`` repeats that comparison without torch.
"""

from __future__ import annotations

import argparse
import copy
import re
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

DEFAULT_OUT_DIR = REPO_ROOT / "tests" / "models" / "families"
PROMPT_LEN = 8
FED_TOKENS = 20  # teacher-forced after the prompt: 21 compared positions
GREEDY_TOKENS = 16
TOLERANCE = 1e-4
# The smallest gap between the best and second-best logit along a greedy path that
# float32 rounding cannot flip.
MIN_GREEDY_MARGIN = 1e-3


@dataclass(frozen=True)
class FamilySpec:
    """One fixture: a transformers config class and its arguments."""

    name: str
    config_class: str
    config: dict[str, Any]
    seed: int


_SMALL = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
FAMILIES = (
    FamilySpec("llama", "LlamaConfig", dict(
        _SMALL, tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100_000.0}), seed=11),
    FamilySpec("llama3", "LlamaConfig", dict(
        _SMALL, tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=8192,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 256}), seed=12),
    FamilySpec("qwen2", "Qwen2Config", dict(
        _SMALL, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}), seed=13),
    FamilySpec("qwen3", "Qwen3Config", dict(
        _SMALL, head_dim=32, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}), seed=14),
    FamilySpec("gemma3", "Gemma3TextConfig", dict(
        _SMALL, head_dim=32, query_pre_attn_scalar=24, sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 8.0}},
        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6), seed=15),
)
LORA_SLOT = 8
ADAPTER_RANK = 4
ADAPTER_ALPHA = 8
TARGETS = ["k_proj", "o_proj", "q_proj", "v_proj"]
ALL_LINEAR_TARGETS = [*TARGETS, "down_proj", "gate_proj", "up_proj"]
# The adapters of each fixture, by directory name: their target modules.
ADAPTERS = {"adapter": TARGETS, "adapter_all_linear": ALL_LINEAR_TARGETS}
# Exported with attention-only slots: Gemma 3's all-linear, batched and windowed steps have
# their own fixture (tools/build_gemma3_fixtures.py -> tests/models/gemma3/).
NO_ALL_LINEAR = {"gemma3"}
LORA_XS_FAMILIES = {"llama"}
DORA_FAMILIES = {"llama", "qwen2", "qwen3"}  # DoRA slots (--dora-ranks) and a DoRA adapter
LORA_XS = {"n_iter": 10, "random_state": 42}


def lora_xs_adapter(model: Any, seed: int, out: Path) -> dict[str, np.ndarray]:
    """Writes an R-only LoRA-XS adapter on ``model``'s q/k/v/o into ``out``; returns each
    weight's delta ``(alpha / r) B R A`` (float64, by parameter name)."""
    from safetensors.numpy import save_file
    from sklearn.decomposition import TruncatedSVD

    rng = np.random.default_rng(seed + 2000)
    tensors, deltas = {}, {}
    for name, parameter in model.named_parameters():
        if not re.fullmatch(r"model\.layers\.\d+\.self_attn\.[qkvo]_proj\.weight", name):
            continue
        weight = parameter.detach().float().numpy()
        svd = TruncatedSVD(n_components=ADAPTER_RANK, **LORA_XS).fit(weight)
        a, b = svd.components_.astype(np.float64), svd.transform(weight).astype(np.float64)
        r = (rng.standard_normal((ADAPTER_RANK, ADAPTER_RANK)) * 0.05).astype(np.float32)
        tensors[f"base_model.model.{name.removesuffix('.weight')}.lora_R.weight"] = r
        deltas[name] = (ADAPTER_ALPHA / ADAPTER_RANK) * b @ r.astype(np.float64) @ a
    out.mkdir()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA_XS", "r": ADAPTER_RANK, "lora_alpha": ADAPTER_ALPHA, "target_modules": TARGETS,
              "base_model_name_or_path": "llama", **LORA_XS}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return deltas


def merged64(model64: Any, deltas: dict[str, np.ndarray]) -> Any:
    """A copy of the float64 ``model64`` with ``deltas`` added to its weights."""
    import torch

    merged = copy.deepcopy(model64)
    with torch.no_grad():
        for name, parameter in merged.named_parameters():
            if name in deltas:
                parameter += torch.from_numpy(deltas[name])
    return merged.eval()

def build_hf_model(spec: FamilySpec) -> Any:
    """The transformers model with weights drawn from ``spec.seed`` (float32)."""
    import torch
    import transformers

    config = getattr(transformers, spec.config_class)(**spec.config)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    rng = np.random.default_rng(spec.seed)
    zero_centered = config.model_type == "gemma3_text"
    state = model.state_dict()
    with torch.no_grad():
        for name in sorted(state):
            shape = tuple(state[name].shape)
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            if "norm" in name:
                value = rng.standard_normal(shape) * 0.1 + (0.0 if zero_centered else 1.0)
            elif name.endswith("bias"):
                value = rng.standard_normal(shape) * 0.1
            elif "embed_tokens" in name or name == "lm_head.weight":
                value = rng.standard_normal(shape) * 0.3
            else:
                value = rng.standard_normal(shape) * 0.15
            state[name].copy_(torch.from_numpy(value.astype(np.float32)))
    return model.eval()


def add_adapter(model: Any, seed: int, targets: list[str], dora: bool = False) -> Any:
    """A PeftModel on ``targets`` over a copy of ``model`` with random, non-zero A and B;
    with ``dora``, a DoRA adapter whose magnitudes are the base rows' norms times
    ``1 + 0.3 n``."""
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=ADAPTER_RANK, lora_alpha=ADAPTER_ALPHA, target_modules=targets, lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM", use_dora=dora)
    peft_model = get_peft_model(copy.deepcopy(model), config)
    rng = np.random.default_rng(seed + 1000)
    with torch.no_grad():
        for name, parameter in sorted(peft_model.named_parameters()):
            if "lora_magnitude_vector" in name:  # initialized to ||W||_row by peft
                spread = 1.0 + 0.3 * rng.standard_normal(tuple(parameter.shape))
                parameter.copy_(parameter * torch.from_numpy(spread.astype(np.float32)))
            elif "lora_" in name:
                parameter.copy_(torch.from_numpy((rng.standard_normal(tuple(parameter.shape)) * 0.15).astype(np.float32)))
    return peft_model.eval()


def logits64(model: Any, tokens: np.ndarray) -> np.ndarray:
    """Float64 logits at every position of ``tokens``."""
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(tokens[None].astype(np.int64)), use_cache=False).logits[0].numpy()


def greedy64(model: Any, prompt: np.ndarray, steps: int) -> tuple[np.ndarray, float]:
    """The greedy continuation of ``prompt`` in float64 and its smallest top-1 margin."""
    tokens = list(prompt)
    margin = np.inf
    for _ in range(steps):
        last = logits64(model, np.array(tokens))[-1]
        top2 = np.sort(last)[-2:]
        margin = min(margin, float(top2[1] - top2[0]))
        tokens.append(int(np.argmax(last)))
    return np.array(tokens[len(prompt):], dtype=np.int32), margin


def runtime_distance(model_file: Path, adapter: Path | None, reference: dict[str, np.ndarray]) -> tuple[float, bool]:
    """Max |logit diff| through the runtime and whether its greedy tokens match."""
    from runtime import Engine, SessionConfig

    suffix = "" if adapter is None else "_" + adapter.name
    tokens = reference["tokens"]
    with Engine(model_file) as engine:
        config = SessionConfig(lora_path=adapter)
        with engine.create_session(config) as session:
            rows = [session.run_prefill([int(t) for t in tokens[:PROMPT_LEN]])]
            rows += [session.run_decode(int(t)) for t in tokens[PROMPT_LEN:]]
        with engine.create_session(config) as session:
            greedy = session.generate([int(t) for t in tokens[:PROMPT_LEN]], max_new_tokens=GREEDY_TOKENS,
                                      stop_tokens=[]).tokens
    diff = float(np.max(np.abs(np.stack(rows) - reference["logits" + suffix])))
    return diff, list(greedy) == reference["greedy" + suffix].tolist()


def build_family(spec: FamilySpec, out_dir: Path) -> dict[str, Any]:
    """Builds one family's fixture into ``out_dir`` and returns its manifest entry."""
    import torch

    from runtime.export.exporter import export
    from runtime.export.settings import ExportSettings
    from runtime.export.source import inspect_source

    torch.manual_seed(spec.seed)
    model = build_hf_model(spec)
    adapters = {name: targets for name, targets in ADAPTERS.items()
                if name != "adapter_all_linear" or spec.name not in NO_ALL_LINEAR}
    peft_models = {name: add_adapter(model, spec.seed + index, targets)
                   for index, (name, targets) in enumerate(adapters.items())}
    dora = spec.name in DORA_FAMILIES
    if dora:
        adapters["adapter_dora"] = ALL_LINEAR_TARGETS
        peft_models["adapter_dora"] = add_adapter(model, spec.seed + 3000, ALL_LINEAR_TARGETS, dora=True)
    settings = ExportSettings(lora_ranks=(LORA_SLOT,), dora_ranks=(LORA_SLOT,) if dora else (), kv_length=64,
                              prefill_lengths=(16,), lora_targets="attention" if spec.name in NO_ALL_LINEAR else None,
                              attention_kernel="xnnpack")  # fixtures in standard ops: tests derive the op forms
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as work:
        model.save_pretrained(work)
        report = export(inspect_source(work), settings, model_out=out_dir / "model.tflite")
    lora_xs_deltas = (lora_xs_adapter(model, spec.seed, out_dir / "adapter_lora_xs")
                      if spec.name in LORA_XS_FAMILIES else None)
    save_adapters(peft_models, out_dir, spec.name)

    rng = np.random.default_rng(spec.seed + 1)
    models64 = {"": model.double(), **{"_" + name: peft.double() for name, peft in peft_models.items()}}
    if lora_xs_deltas is not None:
        models64["_adapter_lora_xs"] = merged64(models64[""], lora_xs_deltas)
        adapters["adapter_lora_xs"] = TARGETS
    reference, margin = write_reference(models64, rng, spec, PROMPT_LEN, FED_TOKENS, out_dir)
    effect = {name: float(np.max(np.abs(reference["logits_" + name] - reference["logits"]))) for name in adapters}
    measured = check_runtime(out_dir, adapters, reference, spec.name, TOLERANCE)
    files = sorted(p for p in out_dir.rglob("*") if p.is_file())
    return {
        "transformers_config": {"class": spec.config_class, **spec.config},
        "seed": spec.seed,
        "export": {"lora_ranks": list(settings.lora_ranks), "dora_ranks": list(settings.dora_ranks),
                   "kv_length": settings.kv_length,
                   "prefill_lengths": list(settings.prefill_lengths), "quantize": settings.quantize,
                   "seconds": round(sum(report.stage_seconds.values()), 1)},
        "adapters": {name: {"r": ADAPTER_RANK, "lora_alpha": ADAPTER_ALPHA, "target_modules": targets,
                            **({"use_dora": True} if name == "adapter_dora" else {})}
                     for name, targets in adapters.items()},
        "reference": {"prompt_len": PROMPT_LEN, "fed_tokens": FED_TOKENS, "greedy_tokens": GREEDY_TOKENS,
                      "logit_std": float(reference["logits"].std()), "greedy_margin": round(margin, 4),
                      "adapter_max_abs_effect": effect},
        "runtime_vs_reference": measured,
        "files": file_entries(out_dir, files),
    }


def save_adapters(peft_models: dict[str, Any], out_dir: Path, base_name: str) -> None:
    """Saves each PEFT model as ``out_dir/<name>/`` (no model card; the config's keys and its
    ``target_modules``, which peft writes in a set's order, sorted: a rebuild gives the same bytes)."""
    for name, peft_model in peft_models.items():
        peft_model.peft_config["default"].base_model_name_or_path = base_name
        peft_model.save_pretrained(out_dir / name)
        (out_dir / name / "README.md").unlink()  # peft's model-card template
        config_file = out_dir / name / "adapter_config.json"
        config = json.loads(config_file.read_text())
        if isinstance(config.get("target_modules"), list):
            config["target_modules"] = sorted(config["target_modules"])
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_reference(models64: dict[str, Any], rng: np.random.Generator, spec: Any, prompt_len: int,
                    fed_tokens: int, out_dir: Path) -> tuple[dict[str, np.ndarray], float]:
    """Picks a prompt whose greedy paths under every float64 model of ``models64`` (by file
    suffix) have no near-ties, and writes their logits and greedy tokens to
    ``out_dir/reference.npz``; returns the reference and the smallest greedy margin."""
    for _ in range(20):
        tokens = rng.integers(3, spec.config["vocab_size"], prompt_len + fed_tokens).astype(np.int32)
        greedy = {suffix: greedy64(m, tokens[:prompt_len], GREEDY_TOKENS) for suffix, m in models64.items()}
        margin = min(found_margin for _, found_margin in greedy.values())
        if margin > MIN_GREEDY_MARGIN:
            break
    else:
        raise SystemExit(f"{spec.name}: no prompt without near-ties in its greedy paths")
    reference = {"tokens": tokens, "prompt_len": np.array(prompt_len)}
    for suffix, m in models64.items():
        reference["logits" + suffix] = logits64(m, tokens)[prompt_len - 1:]
        reference["greedy" + suffix] = greedy[suffix][0]
    np.savez(out_dir / "reference.npz", **reference)
    return reference, margin


def check_runtime(out_dir: Path, adapters: Iterable[str], reference: dict[str, np.ndarray], label: str,
                  tolerance: float) -> dict[str, dict[str, object]]:
    """The runtime on ``out_dir/model.tflite``, plain and with each adapter directory, against
    the float64 ``reference``: max |logit diff| and greedy agreement per adapter; exits naming
    the fixture ``label`` and the adapter when one is off by more than ``tolerance``."""
    measured = {}
    for name, adapter in (("plain", None), *((name, out_dir / name) for name in adapters)):
        diff, same = runtime_distance(out_dir / "model.tflite", adapter, reference)
        measured[name] = {"max_abs_logit_diff": diff, "greedy_tokens_identical": same}
        if diff > tolerance or not same:
            raise SystemExit(f"{label} {name}: max |diff| {diff:.2e}, greedy identical: {same}")
    return measured


def file_entries(out_dir: Path, files: list[Path]) -> dict[str, dict[str, object]]:
    """The manifest's entry of each of ``files``: size and SHA-256, by path under ``out_dir``."""
    return {str(p.relative_to(out_dir)): {"size_bytes": p.stat().st_size,
                                          "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
            for p in files}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    import importlib.metadata

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # peft looks the base model up on the hub when saving
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--family", action="append", choices=[f.name for f in FAMILIES],
                        help="build only these (default: all)")
    args = parser.parse_args(argv)
    manifest_file = args.out_dir / "MANIFEST.json"
    manifest = json.loads(manifest_file.read_text()) if manifest_file.exists() else {"families": {}}
    manifest["generator"] = "tools/build_family_fixtures.py"
    manifest["versions"] = {name: importlib.metadata.version(name)
                            for name in ("torch", "transformers", "peft", "litert-torch", "ai-edge-litert")}
    for spec in FAMILIES:
        if args.family and spec.name not in args.family:
            continue
        entry = build_family(spec, args.out_dir / spec.name)
        manifest["families"][spec.name] = entry
        sizes = sum(f["size_bytes"] for f in entry["files"].values())
        print(f"{spec.name}: {sizes:,} bytes, export {entry['export']['seconds']} s, "
              f"runtime vs float64 transformers {json.dumps(entry['runtime_vs_reference'])}", flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    manifest_file.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
