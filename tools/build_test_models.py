#!/usr/bin/env python3
"""Build the small TFLite models the test-suite runs against.

Run with the ``export`` extra installed (``pip install -e '.[export]'``)::

    python3 tools/build_test_models.py [--out-dir DIR]

With fixed seeds this writes, under ``tests/models/`` by default:

``gqa_default.tflite``
    A tiny Llama-style decoder (RMSNorm, RoPE, grouped-query attention, gated
    SiLU MLP, final norm, separate lm_head), float32, exported with LoRA slots
    of rank 4 and 16, the default ``[1, kv_len, groups, head_dim]`` KV layout
    and no logits on prefill.
``gqa_transposed.tflite``
    The same weights exported with ``KV_LAYOUT_TRANSPOSED`` (K ``[1, groups,
    kv_len, head_dim]``, V ``[1, groups, head_dim, kv_len]``) and
    ``output_logits_on_prefill=True``.
``gqa_grouped.tflite``
    The same weights with K and V both ``[1, groups, kv_len, head_dim]`` (the
    ``grouped`` layout) and ``output_logits_on_prefill=True``.
``gqa_weights.npz``
    Every weight as a float32 array (``[out, in]`` for projections) plus the
    config scalars under ``config.*``; ``tests/reference_model.py`` recomputes
    the forward pass from it in numpy.
``MANIFEST.json``
    Per file: config, signatures (inputs with shapes and dtypes, outputs),
    sha256 and size in bytes.

The weights are drawn with numpy from a fixed seed, so the ``.npz`` is the
source of truth: they are written as a Hugging Face Llama checkpoint which
``runtime.export`` exports. The ``.tflite`` bytes depend on the converter version;
the manifest records the versions used.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata
import io
import json
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
DEFAULT_OUT_DIR = REPO_ROOT / "tests" / "models"

DEFAULT_MODEL_FILE = "gqa_default.tflite"
TRANSPOSED_MODEL_FILE = "gqa_transposed.tflite"
GROUPED_MODEL_FILE = "gqa_grouped.tflite"
WEIGHTS_FILE = "gqa_weights.npz"
MANIFEST_FILE = "MANIFEST.json"

# The per-layer projection names used in the .npz, in [out, in] layout.
ATTENTION_PROJECTIONS = ("q", "k", "v", "o")
MLP_PROJECTIONS = ("gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class TinyGqaConfig:
    """Hyper-parameters of the tiny grouped-query-attention test model."""

    num_layers: int = 2
    hidden: int = 64
    num_heads: int = 4
    num_kv_groups: int = 2
    head_dim: int = 16
    intermediate: int = 128
    vocab: int = 256
    kv_cache_max_len: int = 64
    prefill_seq_lens: tuple[int, ...] = (8, 32)
    lora_ranks: tuple[int, ...] = (4, 16)
    # Rows of the batched decode signatures (decode_batch{B}_lora_r{R}, every rank slot).
    batch_sizes: tuple[int, ...] = (2, 4)
    # Attention windows of the extra decode signatures (decode[_batch{B}]_attend{W}...).
    attention_windows: tuple[int, ...] = (16, 32)
    # Attention windows of the extra prefill signatures (prefill_{L}_attend{W}..., L <= W).
    prefill_windows: tuple[int, ...] = (16, 32)
    rms_eps: float = 1e-6
    rope_base: float = 10_000.0
    # Fraction of head_dim that RoPE rotates (litert-torch "rotary_percentage").
    rope_fraction: float = 1.0
    seed: int = 1234
    # Standard deviation of the projection / embedding weights. Chosen so the
    # logits spread over several units and different tokens give clearly
    # different argmax values.
    weight_std: float = 0.2
    # RMSNorm weights are drawn as 1 + norm_std * N(0, 1).
    norm_std: float = 0.1

    @property
    def attn_scale(self) -> float:
        """The scale applied to q.k (litert-torch default: 1/sqrt(head_dim))."""
        return 1.0 / float(np.sqrt(self.head_dim))

    def to_json(self) -> dict[str, Any]:
        """Returns the config as a JSON-serialisable dict (with derived values)."""
        out = dataclasses.asdict(self)
        out["prefill_seq_lens"] = list(self.prefill_seq_lens)
        out["lora_ranks"] = list(self.lora_ranks)
        out["batch_sizes"] = list(self.batch_sizes)
        out["attention_windows"] = list(self.attention_windows)
        out["prefill_windows"] = list(self.prefill_windows)
        out["attn_scale"] = self.attn_scale
        out["final_logit_softcap"] = None
        out["attn_logit_softcap"] = None
        out["tie_embeddings"] = False
        out["dtype"] = "float32"
        out["quantize"] = "none"
        return out


# --------------------------------------------------------------------------
# Weights (numpy, the source of truth).
# --------------------------------------------------------------------------


def make_weights(cfg: TinyGqaConfig) -> dict[str, np.ndarray]:
    """Draws every weight of the model from ``cfg.seed``.

    Projections are stored as ``[out, in]`` (torch ``nn.Linear`` layout), so a
    layer computes ``y = x @ W.T``.

    Returns:
        A dict from weight name to float32 array, plus ``config.*`` scalars.
    """
    rng = np.random.default_rng(cfg.seed)
    std = cfg.weight_std
    q_dim = cfg.num_heads * cfg.head_dim
    kv_dim = cfg.num_kv_groups * cfg.head_dim

    def dense(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) * std).astype(np.float32)

    def norm(dim: int) -> np.ndarray:
        return (1.0 + rng.standard_normal(dim) * cfg.norm_std).astype(np.float32)

    w: dict[str, np.ndarray] = {}
    w["embedding"] = dense(cfg.vocab, cfg.hidden)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        w[p + "attn_norm"] = norm(cfg.hidden)
        w[p + "q"] = dense(q_dim, cfg.hidden)
        w[p + "k"] = dense(kv_dim, cfg.hidden)
        w[p + "v"] = dense(kv_dim, cfg.hidden)
        w[p + "o"] = dense(cfg.hidden, q_dim)
        w[p + "mlp_norm"] = norm(cfg.hidden)
        w[p + "gate"] = dense(cfg.intermediate, cfg.hidden)
        w[p + "up"] = dense(cfg.intermediate, cfg.hidden)
        w[p + "down"] = dense(cfg.hidden, cfg.intermediate)
    w["final_norm"] = norm(cfg.hidden)
    w["lm_head"] = dense(cfg.vocab, cfg.hidden)
    w.update(config_scalars(cfg))
    return w


def save_npz_deterministic(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Writes ``arrays`` like ``np.savez`` but byte-for-byte reproducibly.

    ``np.savez`` stamps every zip member with the current time, so its sha256
    changes on each build; here every member gets a fixed timestamp and mode.
    The result loads with ``np.load`` as usual.
    """
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, array in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asarray(array), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def config_scalars(cfg: TinyGqaConfig) -> dict[str, np.ndarray]:
    """Config values stored next to the weights as 0-d arrays (``config.*``).

    A softcap of 0 means "no softcap" (the exported graph applies none).
    """
    ints = {
        "num_layers": cfg.num_layers,
        "hidden": cfg.hidden,
        "num_heads": cfg.num_heads,
        "num_kv_groups": cfg.num_kv_groups,
        "head_dim": cfg.head_dim,
        "intermediate": cfg.intermediate,
        "vocab": cfg.vocab,
        "kv_cache_max_len": cfg.kv_cache_max_len,
        "seed": cfg.seed,
    }
    floats = {
        "rms_eps": cfg.rms_eps,
        "rope_base": cfg.rope_base,
        "rope_fraction": cfg.rope_fraction,
        "attn_scale": cfg.attn_scale,
        "final_logit_softcap": 0.0,
        "attn_logit_softcap": 0.0,
    }
    out = {f"config.{k}": np.array(v, dtype=np.int64) for k, v in ints.items()}
    out.update({f"config.{k}": np.array(v, dtype=np.float64) for k, v in floats.items()})
    return out


# --------------------------------------------------------------------------
# Export (runtime.export).
# --------------------------------------------------------------------------


def write_hf_checkpoint(cfg: TinyGqaConfig, weights: Mapping[str, np.ndarray], out_dir: Path) -> None:
    """Writes ``weights`` as a Hugging Face Llama checkpoint (config.json, model.safetensors)."""
    from safetensors.numpy import save_file

    if cfg.rope_fraction != 1.0:
        raise ValueError("a Llama checkpoint rotates the whole head (rope_fraction 1.0)")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.intermediate,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_groups,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
        "max_position_embeddings": cfg.kv_cache_max_len,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    }
    state = {
        "model.embed_tokens.weight": weights["embedding"],
        "model.norm.weight": weights["final_norm"],
        "lm_head.weight": weights["lm_head"],
    }
    hf_names = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
                **{p: f"self_attn.{p}_proj" for p in ATTENTION_PROJECTIONS},
                **{p: f"mlp.{p}_proj" for p in MLP_PROJECTIONS}}
    for i in range(cfg.num_layers):
        for name, hf_name in hf_names.items():
            state[f"model.layers.{i}.{hf_name}.weight"] = weights[f"layers.{i}.{name}"]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, str(out_dir / "model.safetensors"))


def export_settings(cfg: TinyGqaConfig, *, kv_layout: str, prefill_logits: bool, quantize: str = "none") -> Any:
    """The ``runtime.export`` settings of the test models."""
    from runtime.export.settings import ExportSettings

    # Attention-only slots: the all-linear ones have their own fixtures (tests/models/families).
    return ExportSettings(lora_ranks=tuple(cfg.lora_ranks), lora_targets="attention", kv_length=cfg.kv_cache_max_len,
                          prefill_lengths=tuple(cfg.prefill_seq_lens), quantize=quantize, kv_layout=kv_layout,
                          prefill_logits=prefill_logits, batch_sizes=tuple(cfg.batch_sizes),
                          attention_windows=tuple(cfg.attention_windows), prefill_windows=tuple(cfg.prefill_windows),
                          attention_kernel="xnnpack")  # fixtures in standard ops: tests derive the op forms


def litert_model_config(cfg: TinyGqaConfig) -> Any:
    """The litert-torch ``ModelConfig`` of ``cfg`` (tools/train_demo.py trains a litert-torch
    model of this shape directly)."""
    from runtime.export.litert import cfg as mc

    norm = mc.NormalizationConfig(type=mc.NormalizationType.RMS_NORM, epsilon=cfg.rms_eps)
    attn = mc.AttentionConfig(
        num_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        num_query_groups=cfg.num_kv_groups,
        rotary_base=int(cfg.rope_base),
        rotary_percentage=cfg.rope_fraction,
    )
    ff = mc.FeedForwardConfig(
        type=mc.FeedForwardType.GATED,
        activation=mc.ActivationConfig(mc.ActivationType.SILU),
        intermediate_size=cfg.intermediate,
    )
    block = mc.TransformerBlockConfig(
        attn_config=attn,
        ff_config=ff,
        pre_attention_norm_config=norm,
        post_attention_norm_config=norm,
    )
    return mc.ModelConfig(
        vocab_size=cfg.vocab,
        num_layers=cfg.num_layers,
        max_seq_len=cfg.kv_cache_max_len,
        embedding_dim=cfg.hidden,
        block_configs=block,
        final_norm_config=norm,
        lm_head_share_weight_with_embedding=False,
    )


def export_model(
    model: Any,
    cfg: TinyGqaConfig,
    out_file: Path,
    *,
    transposed_kv: bool,
    output_logits_on_prefill: bool,
) -> float:
    """Converts a litert-torch ``model`` of ``cfg``'s shape (tools/train_demo.py's) to
    ``out_file`` with ``runtime.export`` and returns the seconds it took."""
    from runtime.export.exporter import export_decoder

    settings = export_settings(cfg, kv_layout="transposed" if transposed_kv else "default",
                               prefill_logits=output_logits_on_prefill)
    start = time.perf_counter()
    export_decoder(model, settings, out_file)
    return time.perf_counter() - start


def describe_signatures(path: Path) -> dict[str, Any]:
    """Lists every signature of a .tflite with its inputs and outputs."""
    from ai_edge_litert.interpreter import Interpreter

    interp = Interpreter(model_path=str(path))
    out: dict[str, Any] = {}
    for name in sorted(interp.get_signature_list()):
        runner = interp.get_signature_runner(name)
        inputs = runner.get_input_details()
        outputs = runner.get_output_details()
        out[name] = {
            "inputs": {
                k: {"shape": [int(d) for d in v["shape"]], "dtype": np.dtype(v["dtype"]).name}
                for k, v in sorted(inputs.items())
            },
            "outputs": {
                k: {"shape": [int(d) for d in v["shape"]], "dtype": np.dtype(v["dtype"]).name}
                for k, v in sorted(outputs.items())
            },
        }
    return out


def file_facts(path: Path) -> dict[str, Any]:
    """Returns the sha256 and the size in bytes of ``path``."""
    data = path.read_bytes()
    return {"sha256": hashlib.sha256(data).hexdigest(), "size_bytes": len(data)}


def package_version(name: str) -> str | None:
    """Returns the installed version of a distribution, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def build(out_dir: Path, cfg: TinyGqaConfig) -> dict[str, Any]:
    """Builds every test model into ``out_dir`` and returns the manifest."""
    from runtime.export.exporter import export
    from runtime.export.source import inspect_source

    out_dir.mkdir(parents=True, exist_ok=True)
    weights = make_weights(cfg)
    save_npz_deterministic(out_dir / WEIGHTS_FILE, weights)

    variants = {
        DEFAULT_MODEL_FILE: {"kv_layout": "default", "output_logits_on_prefill": False},
        TRANSPOSED_MODEL_FILE: {"kv_layout": "transposed", "output_logits_on_prefill": True},
        GROUPED_MODEL_FILE: {"kv_layout": "grouped", "output_logits_on_prefill": True},
    }
    manifest: dict[str, Any] = {
        "generator": "tools/build_test_models.py",
        "versions": {
            name: package_version(name)
            for name in ("torch", "transformers", "litert-torch", "ai-edge-litert")
        },
        "files": {},
    }
    with tempfile.TemporaryDirectory() as checkpoint:
        write_hf_checkpoint(cfg, weights, Path(checkpoint))
        source = inspect_source(checkpoint)
        for file_name, variant in variants.items():
            settings = export_settings(cfg, kv_layout=variant["kv_layout"],
                                       prefill_logits=variant["output_logits_on_prefill"])
            report = export(source, settings, model_out=out_dir / file_name)
            print(f"exported {file_name} in {sum(report.stage_seconds.values()):.1f} s", flush=True)
            manifest["files"][file_name] = {
                "config": {**cfg.to_json(), **variant, "weights": WEIGHTS_FILE},
                "signatures": describe_signatures(out_dir / file_name),
                **file_facts(out_dir / file_name),
            }

    manifest["files"][WEIGHTS_FILE] = {
        "config": cfg.to_json(),
        "arrays": {
            k: {"shape": list(v.shape), "dtype": v.dtype.name} for k, v in weights.items()
        },
        **file_facts(out_dir / WEIGHTS_FILE),
    }
    (out_dir / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="where to write the models"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    manifest = build(args.out_dir, TinyGqaConfig())
    for name, entry in manifest["files"].items():
        print(f"{name}: {entry['size_bytes']} bytes sha256={entry['sha256'][:16]}...")
    print(f"total build time {time.perf_counter() - start:.1f} s")
    # The adapter fixtures need only the runtime (no torch); they are built here too so
    # that one command rebuilds everything the tests use.
    import build_test_adapters

    build_test_adapters.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
