#!/usr/bin/env python3
"""Build Hugging Face PEFT and llama.cpp GGUF LoRA fixtures for the test model.

Run with the build virtualenv (torch 2.13.0 plus transformers, peft,
safetensors and gguf)::

    python3 tools/build_peft_fixtures.py [--out-dir DIR]   # with the `export` extra installed
                                                           # (pip install -e '.[export]')

The tiny Llama-style test model (``tests/models/gqa_weights.npz``, see
``tests/reference_model.py``) is rebuilt as a ``transformers``
``LlamaForCausalLM`` and checked against the numpy reference. Then, with the
real ``peft`` library, LoRA adapters are created (A and B drawn from fixed
numpy seeds), saved with ``save_pretrained`` and reloaded in float64 to compute
reference logits. Everything is written under ``tests/models/peft/``:

``<adapter>/adapter_config.json``, ``<adapter>/adapter_model.safetensors``
    PEFT adapters as ``save_pretrained`` writes them (its README.md is dropped).
``base/config.json``
    The ``LlamaConfig`` of the base model (no weights; they are in the npz).
``qkvo_r4.gguf``, ``qkvo_r4_f16.gguf``
    ``qkvo_r4`` in the llama.cpp GGUF LoRA layout (f32 / f16 tensors), written
    with ``gguf.GGUFWriter`` following ``convert_lora_to_gguf.py``.
``not_an_adapter.gguf``
    ``qkvo_r4.gguf`` with ``general.type = "model"``; must be refused.
``reference.npz``
    ``tokens``, ``prefix`` and, per case ``<case>``, ``<case>/logits``
    (``[16, 256]`` float64, every position of ``tokens``) and
    ``<case>/greedy`` (8 greedy tokens continuing ``prefix``).
``MANIFEST.json``
    What every fixture is and tests, the versions used, sha256 and sizes, and
    the PEFT / GGUF semantics the runtime must reproduce.

Every reference is cross-checked: reloading each saved adapter with PEFT gives
the in-memory PEFT logits, and ``reference_model.reference_logits`` with dense
deltas ``scale * B @ A`` read back from the safetensors (or the GGUF) gives the
float64 PEFT logits. The build fails if any check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests"))
sys.path.insert(0, str(REPO_ROOT / "tools"))

import reference_model  # noqa: E402  (tests/reference_model.py)
from build_test_models import save_npz_deterministic  # noqa: E402

WEIGHTS_PATH = REPO_ROOT / "tests" / "models" / "gqa_weights.npz"
DEFAULT_OUT_DIR = REPO_ROOT / "tests" / "models" / "peft"

TOKENS: tuple[int, ...] = (5, 17, 42, 200, 3, 99, 250, 7, 1, 64, 128, 11, 22, 33, 44, 55)
PREFIX_LEN = 11
GREEDY_STEPS = 8

# Standard deviations of the LoRA factors. With hidden 64 these make the
# adapters' deltas a sizeable fraction of the base projections.
A_STD = 0.1
B_STD = 0.2

# Tolerances of the build-time checks.
BASE_TOL = 1e-5  # HF float64 vs numpy float64 (same maths, different order)
F64_TOL = 1e-9  # numpy dense-delta float64 vs PEFT float64
F32_TOL = 1e-4  # PEFT float32 vs PEFT float64
MIN_GREEDY_MARGIN = 1e-3  # top-1 minus top-2 logit at every greedy step

# HF module name suffix -> reference_model projection name.
HF_TO_PROJ = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o"}
# reference_model projection name -> llama.cpp GGUF tensor base name part.
PROJ_TO_GGUF = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output"}

# general.name as convert_lora_to_gguf.py derives it from the adapter directory
# name "qkvo_r4" (gguf.Metadata heuristics title-case it); with it the GGUF
# files are byte-identical to the converter's output.
GGUF_NAME = "Qkvo_R4"

SCALE_CASE = "qkvo_r4_scale_0.5"
BLEND_CASE = "blend_cat_qkvo_r4_0.7_qkvo_r4_b_0.3"
BLEND_WEIGHTS = (0.7, 0.3)

LOG = logging.getLogger("build_peft_fixtures")


# --------------------------------------------------------------------------
# Fixture specs.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    """One PEFT adapter fixture.

    Attributes:
        name: Directory name under the output directory.
        lora: Keyword arguments of ``peft.LoraConfig``.
        seed: numpy seed of the A/B values.
        tests: What the fixture is for (goes into the manifest).
        runtime_supported: False if the runtime must refuse the adapter.
    """

    name: str
    lora: Mapping[str, Any]
    seed: int
    tests: str
    runtime_supported: bool = True


QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]

SPECS: tuple[AdapterSpec, ...] = (
    AdapterSpec(
        "qkvo_r4",
        {"target_modules": QKVO, "r": 4, "lora_alpha": 8},
        seed=101,
        tests="plain LoRA on q/k/v/o of every layer, scaling alpha/r = 2",
    ),
    AdapterSpec(
        "qv_r8_rslora",
        {"target_modules": ["q_proj", "v_proj"], "r": 8, "lora_alpha": 16, "use_rslora": True},
        seed=102,
        tests="rsLoRA: scaling alpha/sqrt(r) = 16/sqrt(8), not alpha/r = 2; q and v only",
    ),
    AdapterSpec(
        "rank_pattern",
        {
            "target_modules": QKVO,
            "r": 4,
            "lora_alpha": 8,
            "rank_pattern": {"layers.1.self_attn.v_proj": 8},
            "alpha_pattern": {"layers.0.self_attn.o_proj": 2},
        },
        seed=103,
        tests=(
            "per-module rank and alpha: layer 1 v has r=8 (scaling 8/8 = 1), layer 0 o has "
            "alpha=2 (scaling 2/4 = 0.5), the rest r=4 alpha=8 (scaling 2)"
        ),
    ),
    AdapterSpec(
        "mlp_only",
        {"target_modules": ["gate_proj", "up_proj", "down_proj"], "r": 4, "lora_alpha": 8},
        seed=104,
        tests="targets only MLP projections, which the TFLite graph cannot carry: must be refused",
        runtime_supported=False,
    ),
    AdapterSpec(
        "qkvo_r4_b",
        {"target_modules": QKVO, "r": 4, "lora_alpha": 8},
        seed=105,
        tests="a second q/k/v/o r=4 adapter (other seed), blended with qkvo_r4",
    ),
    AdapterSpec(
        "layers_1_only",
        {"target_modules": ["q_proj", "v_proj"], "r": 4, "lora_alpha": 8, "layers_to_transform": [1]},
        seed=106,
        tests="layers_to_transform=[1]: tensors only for layer 1 q and v; layer 0 unchanged",
    ),
)
SPEC_BY_NAME = {spec.name: spec for spec in SPECS}


# --------------------------------------------------------------------------
# Base model.
# --------------------------------------------------------------------------


def llama_config(weights: Mapping[str, np.ndarray], attn_implementation: str = "eager") -> Any:
    """Returns the ``transformers.LlamaConfig`` of the test model.

    Values come from the ``config.*`` scalars of ``gqa_weights.npz``.
    """
    from transformers import LlamaConfig

    def i(name: str) -> int:
        return int(weights[f"config.{name}"])

    def f(name: str) -> float:
        return float(weights[f"config.{name}"])

    if f("rope_fraction") != 1.0 or f("final_logit_softcap") or f("attn_logit_softcap"):
        raise ValueError("the npz model has features LlamaForCausalLM does not have")
    if not math.isclose(f("attn_scale"), i("head_dim") ** -0.5):
        raise ValueError("attn_scale differs from 1/sqrt(head_dim)")
    cfg = LlamaConfig(
        vocab_size=i("vocab"),
        hidden_size=i("hidden"),
        intermediate_size=i("intermediate"),
        num_hidden_layers=i("num_layers"),
        num_attention_heads=i("num_heads"),
        num_key_value_heads=i("num_kv_groups"),
        head_dim=i("head_dim"),
        max_position_embeddings=i("kv_cache_max_len"),
        rms_norm_eps=f("rms_eps"),
        rope_parameters={"rope_type": "default", "rope_theta": f("rope_base")},
        hidden_act="silu",
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    cfg._attn_implementation = attn_implementation
    return cfg


def hf_state_dict(weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Maps the npz names to ``LlamaForCausalLM`` state-dict names."""
    state = {
        "model.embed_tokens.weight": weights["embedding"],
        "model.norm.weight": weights["final_norm"],
        "lm_head.weight": weights["lm_head"],
    }
    names = {
        "attn_norm": "input_layernorm",
        "q": "self_attn.q_proj",
        "k": "self_attn.k_proj",
        "v": "self_attn.v_proj",
        "o": "self_attn.o_proj",
        "mlp_norm": "post_attention_layernorm",
        "gate": "mlp.gate_proj",
        "up": "mlp.up_proj",
        "down": "mlp.down_proj",
    }
    for layer in range(int(weights["config.num_layers"])):
        for ours, theirs in names.items():
            state[f"model.layers.{layer}.{theirs}.weight"] = weights[f"layers.{layer}.{ours}"]
    return state


def build_base_model(weights: Mapping[str, np.ndarray], dtype: Any, *, exact: bool | None = None) -> Any:
    """Builds a fresh ``LlamaForCausalLM`` with the npz weights, in ``dtype``.

    Args:
        weights: The arrays of ``gqa_weights.npz``.
        dtype: torch dtype of every parameter.
        exact: Remove transformers' hard-coded float32 steps (see
            :func:`make_fully_float64`). Defaults to ``dtype == torch.float64``.
    """
    import torch
    from transformers import LlamaForCausalLM

    exact = dtype == torch.float64 if exact is None else exact
    model = LlamaForCausalLM(llama_config(weights, "sdpa" if exact else "eager"))
    model.load_state_dict(
        {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in hf_state_dict(weights).items()},
        strict=True,
    )
    # A made-up id: it ends up as base_model_name_or_path in adapter_config.json.
    model.name_or_path = "tests/models/peft/base"
    model = model.to(dtype).eval()
    if exact:
        make_fully_float64(model)
    return model


def make_fully_float64(model: Any) -> None:
    """Removes the float32 steps transformers keeps in a float64 Llama.

    In transformers 5.x, even with float64 parameters, ``LlamaForCausalLM``
    computes three things in float32:

    * ``LlamaRotaryEmbedding``: ``inv_freq``, the angles and cos/sin
      (``torch.arange(..., dtype=torch.float)``, ``.float()`` in ``forward``);
    * ``LlamaRMSNorm``: ``hidden_states.to(torch.float32)`` before the norm;
    * eager attention: ``softmax(..., dtype=torch.float32)``.

    Together they move the logits by ~7e-6 against a float64 computation. This
    replaces the rotary embedding's and every RMSNorm's ``forward`` with the
    same formulas in the input dtype; the model must use the "sdpa" attention
    implementation (torch's SDPA computes in the input dtype on CPU).
    """
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    if model.config._attn_implementation != "sdpa":
        raise ValueError("use attn_implementation='sdpa' for a float64 softmax")
    cfg = model.config
    base = float(cfg.rope_parameters["rope_theta"])
    dim = int(cfg.head_dim)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))

    def rope_forward(x: Any, position_ids: Any) -> tuple[Any, Any]:
        freqs = position_ids[..., None].to(torch.float64) * inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    model.model.rotary_emb.forward = rope_forward

    def norm_forward(norm: Any) -> Callable[[Any], Any]:
        def forward(hidden_states: Any) -> Any:
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            return norm.weight * (hidden_states * torch.rsqrt(variance + norm.variance_epsilon))
        return forward

    for module in model.modules():
        if isinstance(module, LlamaRMSNorm):
            module.forward = norm_forward(module)


def model_logits(model: Any, tokens: Sequence[int]) -> np.ndarray:
    """Logits of every position of ``tokens`` (no KV cache), as float64 numpy."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(tokens)], dtype=torch.long), use_cache=False)
    return out.logits[0].to(torch.float64).numpy()


def greedy(logits_fn: Callable[[Sequence[int]], np.ndarray], prefix: Sequence[int], steps: int
           ) -> tuple[np.ndarray, float]:
    """Greedy continuation of ``prefix`` for ``steps`` tokens (full recompute).

    Returns:
        The new tokens and the smallest top-1 minus top-2 logit gap seen.
    """
    seq = list(prefix)
    margin = math.inf
    for _ in range(steps):
        last = logits_fn(seq)[-1]
        top2 = np.sort(last)[-2:]
        margin = min(margin, float(top2[1] - top2[0]))
        seq.append(int(np.argmax(last)))
    return np.array(seq[len(prefix):], dtype=np.int64), margin


# --------------------------------------------------------------------------
# PEFT adapters.
# --------------------------------------------------------------------------


def lora_layers(model: Any) -> Iterator[tuple[str, Any]]:
    """Yields ``(name, LoraLayer)`` of ``model`` sorted by module name."""
    from peft.tuners.lora import LoraLayer

    found = [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]
    yield from sorted(found, key=lambda item: item[0])


def fill_lora_weights(model: Any, adapter: str, seed: int) -> None:
    """Overwrites every A and B of ``adapter`` with numpy normal draws.

    PEFT initialises B to zero (A kaiming-uniform); here both are
    ``N(0, A_STD)`` / ``N(0, B_STD)`` from ``numpy.random.default_rng(seed)``,
    drawn in module-name order and rounded to float32, so the values do not
    depend on the torch version.
    """
    import torch

    rng = np.random.default_rng(seed)
    for _, layer in lora_layers(model):
        if adapter not in layer.lora_A:
            continue
        a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
        a_val = (rng.standard_normal(tuple(a.shape)) * A_STD).astype(np.float32)
        b_val = (rng.standard_normal(tuple(b.shape)) * B_STD).astype(np.float32)
        with torch.no_grad():
            a.copy_(torch.from_numpy(a_val))
            b.copy_(torch.from_numpy(b_val))


def lora_config(spec: AdapterSpec) -> Any:
    """The ``peft.LoraConfig`` of ``spec`` (no dropout, no bias)."""
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, bias="none", **spec.lora)


def save_adapter(model: Any, adapter: str, out: Path) -> None:
    """``save_pretrained`` of one adapter into ``out`` (exactly two files).

    PEFT writes non-"default" adapters into ``<dir>/<adapter>/`` and adds a
    README.md model card; the two adapter files are moved into ``out``.
    """
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, selected_adapters=[adapter])
        src = Path(tmp) if adapter == "default" else Path(tmp) / adapter
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for fname in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copyfile(src / fname, out / fname)


def load_peft(weights: Mapping[str, np.ndarray], adapter_dirs: Mapping[str, Path], dtype: Any) -> Any:
    """A fresh base model in ``dtype`` with the saved adapters loaded by PEFT.

    The first adapter is active. The whole model is cast to ``dtype``
    afterwards (PEFT keeps the stored float32 for LoRA weights otherwise).
    """
    from peft import PeftModel

    items = list(adapter_dirs.items())
    model = PeftModel.from_pretrained(
        build_base_model(weights, dtype), str(items[0][1]), adapter_name=items[0][0]
    )
    for name, path in items[1:]:
        model.load_adapter(str(path), adapter_name=name)
    model.set_adapter(items[0][0])
    return model.to(dtype).eval()


def layer_scalings(model: Any, adapter: str) -> dict[str, float]:
    """``{module name: scaling}`` PEFT uses for ``adapter``."""
    prefix = "base_model.model."
    return {
        name.removeprefix(prefix): float(layer.scaling[adapter])
        for name, layer in lora_layers(model)
        if adapter in layer.scaling
    }


# --------------------------------------------------------------------------
# Reading adapters back (the mapping the runtime must implement).
# --------------------------------------------------------------------------

_PEFT_KEY = re.compile(
    r"^base_model\.model\.(?P<module>model\.layers\.(?P<layer>\d+)\.[a-z_]+\.(?P<proj>[a-z_]+))"
    r"\.lora_(?P<ab>[AB])\.weight$"
)


def pattern_key(patterns: Sequence[str], module: str) -> str | None:
    """PEFT's rank/alpha pattern lookup: the first key ``k`` (in order) with
    ``re.match(rf"(.*\\.)?({k})$", module)``; keys are regular expressions."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def peft_scaling(config: Mapping[str, Any], module: str, rank: int) -> float:
    """Scaling of one module from ``adapter_config.json``.

    ``alpha = alpha_pattern[match] or lora_alpha``; scaling is ``alpha / r`` or,
    with ``use_rslora``, ``alpha / sqrt(r)``; ``r`` is the stored rank (it
    already reflects ``rank_pattern``).
    """
    alpha_patterns = config.get("alpha_pattern") or {}
    key = pattern_key(list(alpha_patterns), module)
    alpha = float(alpha_patterns[key]) if key is not None else float(config["lora_alpha"])
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def read_peft_adapter(path: Path) -> tuple[dict[str, Any], dict[tuple[int, str], tuple[np.ndarray, np.ndarray, float]]]:
    """Reads a PEFT adapter directory without peft.

    Returns:
        The adapter config and ``{(layer, hf_proj): (A [r, in], B [out, r],
        scaling)}`` with ``hf_proj`` the HF module name (``q_proj``...).
    """
    from safetensors.numpy import load_file

    config = json.loads((path / "adapter_config.json").read_text())
    tensors = load_file(str(path / "adapter_model.safetensors"))
    pairs: dict[tuple[int, str], dict[str, Any]] = {}
    for key, value in tensors.items():
        m = _PEFT_KEY.match(key)
        if m is None:
            raise ValueError(f"unexpected tensor {key!r}")
        entry = pairs.setdefault((int(m["layer"]), m["proj"]), {"module": m["module"]})
        entry[m["ab"]] = value
    out = {}
    for k, entry in sorted(pairs.items()):
        a, b = entry["A"], entry["B"]
        if a.shape[0] != b.shape[1]:
            raise ValueError(f"rank mismatch for {k}")
        out[k] = (a, b, peft_scaling(config, entry["module"], a.shape[0]))
    return config, out


def dense_deltas(pairs: Mapping[tuple[int, str], tuple[np.ndarray, np.ndarray, float]],
                 multiplier: float = 1.0) -> dict[tuple[int, str], np.ndarray]:
    """``{(layer, "q"|"k"|"v"|"o"): multiplier * scaling * B @ A}`` in float64."""
    deltas = {}
    for (layer, hf_proj), (a, b, scaling) in pairs.items():
        if hf_proj not in HF_TO_PROJ:
            raise ValueError(f"{hf_proj} cannot be expressed as an attention delta")
        deltas[(layer, HF_TO_PROJ[hf_proj])] = (
            multiplier * scaling * (b.astype(np.float64) @ a.astype(np.float64))
        )
    return deltas


def merged_weights(weights: Mapping[str, np.ndarray],
                   pairs: Mapping[tuple[int, str], tuple[np.ndarray, np.ndarray, float]]) -> dict[str, np.ndarray]:
    """A copy of the npz weights with ``scaling * B @ A`` merged into every
    targeted projection (any of q/k/v/o/gate/up/down_proj), in float64."""
    npz_name = {**HF_TO_PROJ, "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    out = dict(weights)
    for (layer, hf_proj), (a, b, scaling) in pairs.items():
        key = f"layers.{layer}.{npz_name[hf_proj]}"
        out[key] = out[key].astype(np.float64) + scaling * (b.astype(np.float64) @ a.astype(np.float64))
    return out


def add_deltas(*parts: Mapping[tuple[int, str], np.ndarray]) -> dict[tuple[int, str], np.ndarray]:
    """Sums dense delta maps key by key."""
    out: dict[tuple[int, str], np.ndarray] = {}
    for part in parts:
        for key, value in part.items():
            out[key] = out[key] + value if key in out else value
    return out


# --------------------------------------------------------------------------
# GGUF.
# --------------------------------------------------------------------------


def llama_cpp_permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (HF "rotate half" -> GGML interleaved).

    Within each head of ``head_dim = 2*h`` rows, HF row ``s*h + i``
    (``s`` in {0, 1}) moves to row ``2*i + s``:
    ``reshape(n_head, 2, h, -1).swapaxes(1, 2).reshape(shape)``.
    """
    shape = rows.shape
    return rows.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def llama_cpp_unpermute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`llama_cpp_permute`: GGML row ``2*i + s`` -> HF row ``s*h + i``."""
    shape = rows.shape
    return rows.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def gguf_lora_tensors(pairs: Mapping[tuple[int, str], tuple[np.ndarray, np.ndarray, float]],
                      num_heads: int, num_kv_heads: int) -> list[tuple[str, np.ndarray]]:
    """The tensors ``convert_lora_to_gguf.py`` writes for a llama PEFT adapter.

    Per pair, ``blk.{L}.{attn_q|attn_k|attn_v|attn_output}.weight.lora_a`` is
    PEFT's A unchanged (numpy ``[r, in]``) and ``...lora_b`` is PEFT's B
    (numpy ``[out, r]``), with the rows of B permuted by
    :func:`llama_cpp_permute` for q (``n_head = num_heads``) and k
    (``n_head = num_kv_heads``). Order: by layer, then by HF module name
    (k, o, q, v), a before b -- the order of the converter, which follows the
    sorted safetensors keys.
    """
    out = []
    for (layer, hf_proj), (a, b, _) in sorted(pairs.items()):
        if hf_proj == "q_proj":
            b = llama_cpp_permute(b, num_heads)
        elif hf_proj == "k_proj":
            b = llama_cpp_permute(b, num_kv_heads)
        base = f"blk.{layer}.{PROJ_TO_GGUF[HF_TO_PROJ[hf_proj]]}.weight"
        out.append((base + ".lora_a", np.ascontiguousarray(a)))
        out.append((base + ".lora_b", np.ascontiguousarray(b)))
    return out


def write_gguf_lora(path: Path, tensors: Sequence[tuple[str, np.ndarray]], *, alpha: float,
                    name: str, dtype: Any, general_type: str = "adapter") -> None:
    """Writes a llama.cpp LoRA GGUF with ``gguf.GGUFWriter``.

    Key/value pairs, in the converter's order: ``general.architecture =
    "llama"`` (by the writer), ``general.type`` (``"adapter"``),
    ``adapter.type = "lora"``, ``general.name``, ``adapter.lora.alpha``
    (float32) and ``general.quantization_version = 2``. No ``file_type`` and
    no hyper-parameters: the converter writes none for adapters. Tensors are
    cast to ``dtype`` (float32 -> F32, float16 -> F16).
    """
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type(general_type)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_name(name)
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for tensor_name, value in tensors:
        writer.add_tensor(tensor_name, np.ascontiguousarray(value.astype(dtype)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_field_value(field: Any) -> Any:
    """Scalar or string value of a ``GGUFReader`` field."""
    import gguf

    part = field.parts[field.data[0]]
    if field.types and field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part.tolist()[0]


def read_gguf_lora(path: Path, num_heads: int, num_kv_heads: int
                   ) -> tuple[dict[str, Any], dict[tuple[int, str], tuple[np.ndarray, np.ndarray, float]], dict[str, Any]]:
    """Reads a GGUF LoRA back into HF layout, the way the runtime should.

    Returns:
        The key/values, ``{(layer, hf_proj): (A [r, in], B [out, r],
        alpha / r)}`` with q/k B rows un-permuted, and a description of each
        tensor (``tensor.shape`` -- GGML order -- and ``tensor.data.shape``).
    """
    import gguf

    reader = gguf.GGUFReader(str(path))
    kv = {name: gguf_field_value(field) for name, field in reader.fields.items()
          if not name.startswith("GGUF.")}
    described = {}
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    gguf_to_hf = {v: k for k, v in HF_TO_PROJ.items()}
    proj_of = {v: gguf_to_hf[k] for k, v in PROJ_TO_GGUF.items()}
    for t in reader.tensors:
        described[t.name] = {
            "tensor_type": t.tensor_type.name,
            "shape": [int(x) for x in t.shape],
            "data_shape": list(t.data.shape),
            "data_dtype": str(t.data.dtype),
        }
        m = re.fullmatch(r"blk\.(\d+)\.([a-z_]+)\.weight\.lora_([ab])", t.name)
        if m is None:
            raise ValueError(f"unexpected tensor {t.name}")
        halves.setdefault((int(m[1]), proj_of[m[2]]), {})[m[3]] = np.array(t.data, dtype=np.float32)
    alpha = float(kv["adapter.lora.alpha"])
    pairs = {}
    for (layer, hf_proj), ab in sorted(halves.items()):
        a, b = ab["a"], ab["b"]
        if hf_proj == "q_proj":
            b = llama_cpp_unpermute(b, num_heads)
        elif hf_proj == "k_proj":
            b = llama_cpp_unpermute(b, num_kv_heads)
        rank = a.shape[0]
        # llama.cpp: scale = alpha ? user_scale * alpha / rank : user_scale,
        # rank = ne[0] of lora_b.
        pairs[(layer, hf_proj)] = (a, b, alpha / rank if alpha else 1.0)
    return kv, pairs, described


# --------------------------------------------------------------------------
# Build.
# --------------------------------------------------------------------------


def package_versions() -> dict[str, str]:
    """Versions of the libraries that made the fixtures."""
    out = {"python": sys.version.split()[0]}
    for pkg in ("torch", "transformers", "peft", "safetensors", "gguf", "numpy"):
        out[pkg] = importlib.metadata.version(pkg)
    return out


def sha256(path: Path) -> str:
    """Hex sha256 of a file."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    """Largest absolute element difference."""
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def check(label: str, diff: float, tol: float, report: dict[str, float]) -> None:
    """Records ``diff`` under ``label`` and fails the build if it exceeds ``tol``."""
    report[label] = diff
    LOG.info("%-60s max|diff| = %.3g (tol %.0e)", label, diff, tol)
    if not diff <= tol:
        raise SystemExit(f"check failed: {label}: {diff} > {tol}")


class Builder:
    """Builds every fixture and collects the references and the manifest."""

    def __init__(self, out_dir: Path) -> None:
        import torch

        self.out_dir = out_dir
        self.weights = reference_model.load_weights(WEIGHTS_PATH)
        self.num_heads = int(self.weights["config.num_heads"])
        self.num_kv_heads = int(self.weights["config.num_kv_groups"])
        self.f32, self.f64 = torch.float32, torch.float64
        self.refs: dict[str, np.ndarray] = {
            "tokens": np.array(TOKENS, dtype=np.int64),
            "prefix": np.array(TOKENS[:PREFIX_LEN], dtype=np.int64),
        }
        self.diffs: dict[str, float] = {}
        self.cases: dict[str, dict[str, Any]] = {}
        self.files: dict[str, dict[str, Any]] = {}

    # -- helpers ---------------------------------------------------------

    def numpy_logits(self, deltas: Mapping[tuple[int, str], np.ndarray] | None) -> Callable[[Sequence[int]], np.ndarray]:
        """``tokens -> logits`` of the numpy reference with ``deltas``."""
        return lambda toks: reference_model.reference_logits(self.weights, toks, lora=deltas)

    def record_case(self, case: str, logits_fn: Callable[[Sequence[int]], np.ndarray],
                    numpy_fn: Callable[[Sequence[int]], np.ndarray] | None, **info: Any) -> np.ndarray:
        """Computes and stores ``<case>/logits`` and ``<case>/greedy``.

        ``logits_fn`` is the float64 PEFT model; ``numpy_fn`` (if given) the
        dense-delta numpy reference that must agree with it.
        """
        logits = logits_fn(TOKENS)
        tokens, margin = greedy(logits_fn, TOKENS[:PREFIX_LEN], GREEDY_STEPS)
        if margin < MIN_GREEDY_MARGIN:
            raise SystemExit(f"{case}: greedy top-2 margin {margin} is too small to be robust")
        if numpy_fn is not None:
            check(f"{case}: numpy reference vs torch float64", max_diff(numpy_fn(TOKENS), logits),
                  F64_TOL, self.diffs)
            np_tokens, _ = greedy(numpy_fn, TOKENS[:PREFIX_LEN], GREEDY_STEPS)
            if not np.array_equal(np_tokens, tokens):
                raise SystemExit(f"{case}: numpy greedy {np_tokens} != PEFT greedy {tokens}")
        self.refs[f"{case}/logits"] = logits
        self.refs[f"{case}/greedy"] = tokens
        base = self.refs.get("base/logits")
        self.cases[case] = {
            **info,
            "keys": [f"{case}/logits", f"{case}/greedy"],
            "greedy": tokens.tolist(),
            "min_greedy_margin": round(margin, 6),
            "max_abs_change_vs_base": None if base is None else round(max_diff(logits, base), 6),
        }
        return logits

    # -- steps -----------------------------------------------------------

    def check_base(self) -> None:
        """Step 1: the HF model without LoRA reproduces the numpy reference."""
        stock64 = build_base_model(self.weights, self.f64, exact=False)
        model64 = build_base_model(self.weights, self.f64)
        model32 = build_base_model(self.weights, self.f32)
        ref = self.numpy_logits(None)(TOKENS)
        check("base: stock HF float64 vs numpy reference", max_diff(model_logits(stock64, TOKENS), ref),
              BASE_TOL, self.diffs)
        check("base: HF float64 (float32 steps removed) vs numpy reference",
              max_diff(model_logits(model64, TOKENS), ref), F64_TOL, self.diffs)
        check("base: HF float32 vs numpy reference", max_diff(model_logits(model32, TOKENS), ref),
              F32_TOL, self.diffs)

        self.record_case("base", lambda t: model_logits(model64, t), self.numpy_logits(None),
                         description="base model, no adapter (HF float64)")
        cfg_dir = self.out_dir / "base"
        cfg_dir.mkdir(parents=True, exist_ok=True)
        cfg = model64.config.to_dict()
        cfg.pop("transformers_version", None)
        cfg.pop("dtype", None)
        cfg.pop("torch_dtype", None)
        cfg["architectures"] = ["LlamaForCausalLM"]
        (cfg_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    def build_adapter(self, spec: AdapterSpec) -> None:
        """Step 2: create, save, reload and check one PEFT adapter."""
        from peft import get_peft_model

        out = self.out_dir / spec.name
        model32 = get_peft_model(build_base_model(self.weights, self.f32), lora_config(spec))
        fill_lora_weights(model32, "default", spec.seed)
        model32.eval()
        before = model_logits(model32, TOKENS)
        save_adapter(model32, "default", out)

        reloaded32 = load_peft(self.weights, {"default": out}, self.f32)
        check(f"{spec.name}: PEFT reload float32 vs in-memory float32",
              max_diff(model_logits(reloaded32, TOKENS), before), 0.0, self.diffs)
        model64 = load_peft(self.weights, {"default": out}, self.f64)
        check(f"{spec.name}: PEFT float64 vs float32", max_diff(model_logits(model64, TOKENS), before),
              F32_TOL, self.diffs)

        config, pairs = read_peft_adapter(out)
        scalings = layer_scalings(model64, "default")
        for (layer, hf_proj), (a, b, scaling) in pairs.items():
            module = next(m for m in scalings if m.endswith(f"layers.{layer}.self_attn.{hf_proj}")
                          or m.endswith(f"layers.{layer}.mlp.{hf_proj}"))
            if not math.isclose(scalings[module], scaling, rel_tol=1e-12):
                raise SystemExit(f"{spec.name}: scaling of {module}: PEFT {scalings[module]} vs ours {scaling}")
        if spec.runtime_supported:
            numpy_fn = self.numpy_logits(dense_deltas(pairs))
            how = "reference_logits(weights, tokens, lora=dense deltas)"
        else:
            merged = merged_weights(self.weights, pairs)
            numpy_fn = lambda t: reference_model.reference_logits(merged, t)  # noqa: E731
            how = "reference_logits on npz weights with scaling * B @ A merged into the MLP weights"
        self.record_case(
            spec.name, lambda t: model_logits(model64, t), numpy_fn,
            description=spec.tests,
            adapter=spec.name,
            runtime_supported=spec.runtime_supported,
            numpy_check=how,
        )
        self.files[spec.name] = {
            "kind": "peft",
            "tests": spec.tests,
            "runtime_supported": spec.runtime_supported,
            "seed": spec.seed,
            "lora_config": {k: v for k, v in spec.lora.items()},
            "adapter_config": {k: config.get(k) for k in (
                "r", "lora_alpha", "use_rslora", "target_modules", "rank_pattern", "alpha_pattern",
                "layers_to_transform", "layers_pattern", "base_model_name_or_path", "peft_type",
                "task_type", "fan_in_fan_out", "use_dora", "lora_bias")},
            "tensors": {k: {"A": list(a.shape), "B": list(b.shape)} for k, (a, b, _) in
                        ((f"layers.{l}.{p}", v) for (l, p), v in pairs.items())},
            "scaling": scalings,
            "reference_case": spec.name,
            "files": self.describe_files(out),
        }

    def build_scale_case(self) -> None:
        """Step 2b: qkvo_r4 at user scale 0.5 (PEFT ``rescale_adapter_scale``)."""
        from peft.helpers import rescale_adapter_scale

        path = self.out_dir / "qkvo_r4"
        model64 = load_peft(self.weights, {"default": path}, self.f64)
        with rescale_adapter_scale(model64, 0.5):
            scaled = model_logits(model64, TOKENS)
            scalings = layer_scalings(model64, "default")
            _, pairs = read_peft_adapter(path)
            self.record_case(
                SCALE_CASE, lambda t: model_logits(model64, t), self.numpy_logits(dense_deltas(pairs, 0.5)),
                description="qkvo_r4 with its delta multiplied by 0.5",
                api="peft.helpers.rescale_adapter_scale(model, 0.5) (== LoraLayer.set_scale('default', 0.5)"
                    " on every LoRA layer == LoraLayer.scale_layer(0.5)); scaling 0.5*alpha/r = 1.0",
                scaling=scalings,
            )
        # The per-layer API gives the same result.
        model_b = load_peft(self.weights, {"default": path}, self.f64)
        for _, layer in lora_layers(model_b):
            layer.set_scale("default", 0.5)
        check(f"{SCALE_CASE}: set_scale vs rescale_adapter_scale",
              max_diff(model_logits(model_b, TOKENS), scaled), 0.0, self.diffs)

    def build_blend_case(self) -> None:
        """Step 2c: ``add_weighted_adapter([a, b], [0.7, 0.3], combination_type="cat")``."""
        import torch

        dirs = {"qkvo_r4": self.out_dir / "qkvo_r4", "qkvo_r4_b": self.out_dir / "qkvo_r4_b"}
        names = list(dirs)
        model64 = load_peft(self.weights, dirs, self.f64)
        model64.add_weighted_adapter(names, list(BLEND_WEIGHTS), "blend", combination_type="cat")
        model64.set_adapter("blend")
        for _, layer in lora_layers(model64):
            if layer.lora_A["blend"].weight.dtype != torch.float64:
                raise SystemExit("blend adapter not in float64")
        # What "cat" built: A = cat_i(w_i * scaling_i * A_i) (rows), B = cat_i(B_i)
        # (columns), r = sum(r_i), lora_alpha = r, so scaling 1 and
        # delta = sum_i w_i * scaling_i * B_i @ A_i (weights NOT square-rooted).
        for _, layer in lora_layers(model64):
            a_new = layer.lora_A["blend"].weight.detach().numpy()
            b_new = layer.lora_B["blend"].weight.detach().numpy()
            want_a = np.concatenate([w * layer.scaling[n] * layer.lora_A[n].weight.detach().numpy()
                                     for n, w in zip(names, BLEND_WEIGHTS)], axis=0)
            want_b = np.concatenate([layer.lora_B[n].weight.detach().numpy() for n in names], axis=1)
            if layer.scaling["blend"] != 1.0 or max_diff(a_new, want_a) or max_diff(b_new, want_b):
                raise SystemExit("add_weighted_adapter(cat) did not do what the manifest says")
        deltas = add_deltas(*(dense_deltas(read_peft_adapter(p)[1], w)
                              for p, w in zip(dirs.values(), BLEND_WEIGHTS)))
        self.record_case(
            BLEND_CASE, lambda t: model_logits(model64, t), self.numpy_logits(deltas),
            description="0.7 * qkvo_r4 + 0.3 * qkvo_r4_b (deltas, each with its own alpha/r)",
            api='PeftModel.add_weighted_adapter(["qkvo_r4", "qkvo_r4_b"], [0.7, 0.3], "blend", '
                'combination_type="cat")',
            math="dW = 0.7 * (8/4) * B_a @ A_a + 0.3 * (8/4) * B_b @ A_b",
        )

        # The blended adapter itself, made in float32 and saved (rank 8, alpha 8).
        model32 = load_peft(self.weights, dirs, self.f32)
        model32.add_weighted_adapter(names, list(BLEND_WEIGHTS), "blend", combination_type="cat")
        model32.set_adapter("blend")
        out = self.out_dir / "blend_cat"
        save_adapter(model32, "blend", out)
        spec = AdapterSpec(
            "blend_cat", {"r": 8, "lora_alpha": 8, "target_modules": QKVO}, seed=0,
            tests=f"the adapter add_weighted_adapter(cat) saved for {BLEND_CASE} "
                  "(r=8, alpha=8, A rows pre-multiplied by w_i*scaling_i); float32-rounded",
        )
        model64b = load_peft(self.weights, {"default": out}, self.f64)
        _, pairs = read_peft_adapter(out)
        logits = self.record_case(
            "blend_cat", lambda t: model_logits(model64b, t), self.numpy_logits(dense_deltas(pairs)),
            description=spec.tests, adapter="blend_cat", runtime_supported=True,
            numpy_check="reference_logits(weights, tokens, lora=dense deltas)",
        )
        check(f"blend_cat (saved, float32) vs {BLEND_CASE}", max_diff(logits, self.refs[f"{BLEND_CASE}/logits"]),
              F32_TOL, self.diffs)
        config = json.loads((out / "adapter_config.json").read_text())
        self.files["blend_cat"] = {
            "kind": "peft",
            "tests": spec.tests,
            "runtime_supported": True,
            "adapter_config": {k: config.get(k) for k in ("r", "lora_alpha", "use_rslora", "target_modules")},
            "scaling": layer_scalings(model64b, "default"),
            "reference_case": "blend_cat",
            "files": self.describe_files(out),
        }

    def build_gguf(self) -> None:
        """Step 3/4: the llama.cpp GGUF LoRA files, read back and checked."""
        src = self.out_dir / "qkvo_r4"
        config, pairs = read_peft_adapter(src)
        tensors = gguf_lora_tensors(pairs, self.num_heads, self.num_kv_heads)
        alpha = float(config["lora_alpha"])
        qkvo_logits = self.refs["qkvo_r4/logits"]
        layouts = {}
        for fname, dtype, case in (("qkvo_r4.gguf", np.float32, "qkvo_r4"),
                                   ("qkvo_r4_f16.gguf", np.float16, "qkvo_r4_f16_gguf")):
            path = self.out_dir / fname
            write_gguf_lora(path, tensors, alpha=alpha, name=GGUF_NAME, dtype=dtype)
            kv, back, described = read_gguf_lora(path, self.num_heads, self.num_kv_heads)
            for key, (a, b, scaling) in pairs.items():
                a2, b2, s2 = back[key]
                tol = 0.0 if dtype == np.float32 else 1e-3
                if max_diff(a, a2) > tol or max_diff(b, b2) > tol or s2 != scaling:
                    raise SystemExit(f"{fname}: {key} does not round-trip")
            numpy_fn = self.numpy_logits(dense_deltas(back))
            gguf_logits = numpy_fn(TOKENS)
            if dtype == np.float32:
                check(f"{fname}: numpy from GGUF vs PEFT float64 qkvo_r4", max_diff(gguf_logits, qkvo_logits),
                      F64_TOL, self.diffs)
            else:
                self.diffs[f"{fname}: numpy from GGUF (f16-rounded) vs PEFT float64 qkvo_r4"] = max_diff(
                    gguf_logits, qkvo_logits)
                self.record_case(case, numpy_fn, None,
                                 description="qkvo_r4 with A/B rounded to float16 (numpy float64 reference)")
            layouts[fname] = {"kv": kv, "tensors": described}
            self.files[fname] = {
                "kind": "gguf",
                "tests": f"llama.cpp GGUF LoRA equivalent to qkvo_r4, {np.dtype(dtype).name} tensors",
                "runtime_supported": True,
                "source_adapter": "qkvo_r4",
                "reference_case": case,
                "kv": kv,
                "tensors": described,
                "files": self.describe_files(path),
            }
        path = self.out_dir / "not_an_adapter.gguf"
        write_gguf_lora(path, tensors, alpha=alpha, name=GGUF_NAME, dtype=np.float16, general_type="model")
        kv, _, _ = read_gguf_lora(path, self.num_heads, self.num_kv_heads)
        self.files["not_an_adapter.gguf"] = {
            "kind": "gguf",
            "tests": 'qkvo_r4_f16.gguf with general.type = "model" instead of "adapter": must be refused '
                     "(llama.cpp: 'expect general.type to be 'adapter'')",
            "runtime_supported": False,
            "kv": kv,
            "files": self.describe_files(path),
        }

    def compare_with_llama_cpp(self, llama_cpp_dir: Path) -> None:
        """Runs llama.cpp's own ``convert_lora_to_gguf.py`` on ``qkvo_r4`` and
        requires byte-identical output to ``qkvo_r4.gguf`` / ``qkvo_r4_f16.gguf``."""
        import subprocess

        script = llama_cpp_dir / "convert_lora_to_gguf.py"
        for outtype, fname in (("f32", "qkvo_r4.gguf"), ("f16", "qkvo_r4_f16.gguf")):
            with tempfile.TemporaryDirectory() as tmp:
                produced = Path(tmp) / fname
                subprocess.run(
                    [sys.executable, str(script), "--base", str(self.out_dir / "base"), "--outtype", outtype,
                     "--outfile", str(produced), str(self.out_dir / "qkvo_r4")],
                    check=True, cwd=llama_cpp_dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )
                same = produced.read_bytes() == (self.out_dir / fname).read_bytes()
            LOG.info("%s: byte-identical to convert_lora_to_gguf.py --outtype %s: %s", fname, outtype, same)
            if not same:
                raise SystemExit(f"{fname} differs from llama.cpp's converter output")

    def describe_files(self, path: Path) -> dict[str, dict[str, Any]]:
        """``{relative path: {size, sha256}}`` for a file or a directory."""
        paths = sorted(path.iterdir()) if path.is_dir() else [path]
        return {str(p.relative_to(self.out_dir)): {"size": p.stat().st_size, "sha256": sha256(p)} for p in paths}

    def write_outputs(self) -> None:
        """Writes reference.npz and MANIFEST.json."""
        ref_path = self.out_dir / "reference.npz"
        save_npz_deterministic(ref_path, self.refs)
        manifest = {
            "generator": "tools/build_peft_fixtures.py",
            "versions": package_versions(),
            "base_model": {
                "weights": "tests/models/gqa_weights.npz",
                "hf_class": "transformers.LlamaForCausalLM",
                "hf_config": "base/config.json",
                "note": "HF q/k/v/o/gate/up/down weights are the npz layers.N.{q,k,v,o,gate,up,down} "
                        "([out, in]); HF RoPE (rotate half, theta 10000) equals the npz/TFLite model's.",
            },
            "tokens": list(TOKENS),
            "prefix": list(TOKENS[:PREFIX_LEN]),
            "greedy_steps": GREEDY_STEPS,
            "reference_npz": {
                "file": "reference.npz",
                "keys": "tokens [16] int64; prefix [11] int64; <case>/logits [16, 256] float64 = logits of "
                        "every position of tokens; <case>/greedy [8] int64 = greedy continuation of prefix "
                        "(argmax, full recompute each step)",
                "computed_with": "PEFT model reloaded from the saved files, cast to torch.float64, "
                                 "eager attention, no KV cache; cross-checked with "
                                 "tests/reference_model.reference_logits using dense deltas",
                "sha256": sha256(ref_path),
                "size": ref_path.stat().st_size,
            },
            "init": f"A ~ N(0, {A_STD}), B ~ N(0, {B_STD}) from numpy default_rng(seed), float32, "
                    "module-name order (PEFT's own init is overwritten)",
            "cases": self.cases,
            "fixtures": self.files,
            "semantics": SEMANTICS,
            "checks_max_abs_diff": {k: float(f"{v:.3g}") for k, v in self.diffs.items()},
        }
        (self.out_dir / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")

    def run(self, llama_cpp_dir: Path | None = None) -> None:
        """Builds everything (and optionally cross-checks the GGUF files)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.check_base()
        for spec in SPECS:
            self.build_adapter(spec)
        self.build_scale_case()
        self.build_blend_case()
        self.build_gguf()
        if llama_cpp_dir is not None:
            self.compare_with_llama_cpp(llama_cpp_dir)
        self.write_outputs()


SEMANTICS: dict[str, Any] = {
    "peft_tensor_names": "base_model.model.model.layers.{L}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight "
                         "(mlp.{gate,up,down}_proj for MLP); A is [r, in], B is [out, r] (nn.Linear layout); "
                         "the adapter name is not in the key",
    "delta": "W' = W + scaling * B @ A ([out, in]); y = x @ W'.T",
    "scaling": "lora_alpha / r; with use_rslora: lora_alpha / sqrt(r)",
    "rank_pattern": "r of a module = rank_pattern[k] for the first key k (dict order) with "
                    "re.match(rf'(.*\\.)?({k})$', module_name), module_name like "
                    "'model.layers.1.self_attn.v_proj' (keys are regexes); else r. The stored A/B shapes "
                    "already have that rank.",
    "alpha_pattern": "same matching as rank_pattern, replaces lora_alpha for that module; scaling = "
                     "alpha_module / r_module",
    "layers_to_transform": "only those layer indices get LoRA modules; no tensors for other layers",
    "user_scale": "peft.helpers.rescale_adapter_scale(model, s) / LoraLayer.set_scale(name, s) / "
                  "LoraLayer.scale_layer(s): scaling becomes s * lora_alpha / r (rsLoRA: s * alpha / sqrt(r)), "
                  "i.e. the delta is multiplied by s",
    "cat_blend": "add_weighted_adapter(names, weights, new, combination_type='cat'): new r = sum r_i, new "
                 "lora_alpha = new r (scaling 1; use_rslora copied from the first adapter's config), A_new = "
                 "concat_rows(w_i * scaling_i * A_i), B_new = concat_cols(B_i), so dW = sum_i w_i * scaling_i * "
                 "B_i @ A_i: linear in w_i, NOT square-rooted (the 'linear'/'ties' types put sqrt(|w_i * "
                 "scaling_i|) on A and B instead)",
    "gguf_layout": {
        "kv": "general.architecture='llama'; general.type='adapter'; adapter.type='lora'; general.name; "
              "adapter.lora.alpha (float32); general.quantization_version=2 (uint32). No file_type, no "
              "llama.* hyper-parameters",
        "tensor_names": "blk.{L}.attn_q.weight.lora_a / .lora_b, attn_k, attn_v, attn_output",
        "lora_a": "PEFT A unchanged: numpy [r, in]; GGML ne = [in, r] (GGUFReader tensor.shape = [in, r], "
                  "tensor.data.shape = (r, in))",
        "lora_b": "PEFT B: numpy [out, r]; GGML ne = [r, out] (tensor.shape = [r, out], tensor.data.shape = "
                  "(out, r)); rows of q and k permuted (see q_k_permutation)",
        "q_k_permutation": "q: n = num_attention_heads; k: n = num_key_value_heads. "
                           "B_gguf = B_hf.reshape(n, 2, head_dim//2, r).swapaxes(1, 2).reshape(out, r), i.e. "
                           "per head GGUF row 2*i+s = HF row s*head_dim/2+i. Undo: B_hf = B_gguf.reshape(n, "
                           "head_dim//2, 2, r).swapaxes(1, 2).reshape(out, r). A, v and o are not permuted.",
        "scale": "llama.cpp: scale = user_scale * alpha / r with r = lora_b ne[0] per tensor (user_scale "
                 "alone if alpha == 0); no rsLoRA and no alpha_pattern in GGUF",
        "dtypes": "--outtype f32 -> F32 lora_a/lora_b; f16 -> F16 (also bf16, q8_0)",
        "tensor_order": "per layer, by HF module name (k, o, q, v), lora_a then lora_b",
        "verified": "qkvo_r4.gguf / qkvo_r4_f16.gguf are byte-identical to the output of llama.cpp's "
                    "convert_lora_to_gguf.py --outtype f32 / f16 --base base qkvo_r4 (llama.cpp vendored in "
                    "the llama-cpp-python 0.3.36 sdist; check with --llama-cpp-dir)",
    },
}


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument(
        "--llama-cpp-dir", type=Path, default=None,
        help="a llama.cpp checkout (e.g. vendor/llama.cpp of the llama-cpp-python sdist); if given, its "
             "convert_lora_to_gguf.py is run on qkvo_r4 and must produce the same GGUF bytes",
    )
    args = parser.parse_args(argv)
    # PEFT stores target_modules as a set and writes it to adapter_config.json
    # in set iteration order, which depends on str hashing: fix the hash seed.
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]])
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("gguf", "transformers", "torchao", "peft"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    import torch

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    Builder(args.out_dir.resolve()).run(args.llama_cpp_dir.resolve() if args.llama_cpp_dir else None)
    LOG.info("wrote %s", args.out_dir)


if __name__ == "__main__":
    main()
