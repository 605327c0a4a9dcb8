#!/usr/bin/env python3
"""Build the small TFLite models the test-suite runs against.

Run with the build virtualenv (torch 2.13.0 + litert-torch 0.10.0)::

    /work/venv-build/bin/python tools/build_test_models.py [--out-dir DIR]

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
``gqa_weights.npz``
    Every weight as a float32 array (``[out, in]`` for projections) plus the
    config scalars under ``config.*``; ``tests/reference_model.py`` recomputes
    the forward pass from it in numpy.
``MANIFEST.json``
    Per file: config, signatures (inputs with shapes and dtypes, outputs),
    sha256 and size in bytes.

The weights are drawn with numpy from a fixed seed, so the ``.npz`` is the
source of truth and the torch model is filled from it. The ``.tflite`` bytes
depend on the converter version; the manifest records the versions used.

Two defects of litert-torch 0.10.0 are worked around here, see
:func:`install_tensorflow_schema_stand_in` and :func:`patch_lora_gqa_sizes`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import io
import json
import shutil
import sys
import tempfile
import time
import types
import zipfile
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT_DIR = REPO_ROOT / "tests" / "models"

DEFAULT_MODEL_FILE = "gqa_default.tflite"
TRANSPOSED_MODEL_FILE = "gqa_transposed.tflite"
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
# litert-torch 0.10.0 workarounds.
# --------------------------------------------------------------------------


def install_tensorflow_schema_stand_in() -> None:
    """Workaround (a): let ``litert_torch.generative.layers.lora`` import.

    litert-torch 0.10.0's ``generative/layers/lora.py`` does
    ``from tensorflow.lite.python import schema_py_generated``, although
    conversion needs no TensorFlow at all. The same flatbuffer schema ships as
    ``ai_edge_litert.schema_py_generated``, so we register stand-in packages
    ``tensorflow``, ``tensorflow.lite`` and ``tensorflow.lite.python`` in
    ``sys.modules`` whose ``schema_py_generated`` is that module.

    ``torch._dynamo`` is imported first: on import it looks up the
    third-party libraries it skips (``tensorflow`` among them) with
    ``importlib.util.find_spec``, which raises ``ValueError`` for a
    ``sys.modules`` entry without ``__spec__``. So the lookup runs before the
    stand-ins exist, and each stand-in also gets a real ``ModuleSpec``
    (``is_package=True``, no origin) for any later lookup.

    Does nothing if a real TensorFlow is installed.
    """
    import torch._dynamo  # noqa: F401  (must precede the stand-ins)

    if "tensorflow" in sys.modules or importlib.util.find_spec("tensorflow"):
        return
    from ai_edge_litert import schema_py_generated

    parent: types.ModuleType | None = None
    for name in ("tensorflow", "tensorflow.lite", "tensorflow.lite.python"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
        module.__path__ = []  # type: ignore[attr-defined]
        sys.modules[name] = module
        if parent is not None:
            setattr(parent, name.rsplit(".", 1)[1], module)
        parent = module
    assert parent is not None
    sys.modules["tensorflow.lite.python.schema_py_generated"] = schema_py_generated
    parent.schema_py_generated = schema_py_generated  # type: ignore[attr-defined]


def patch_lora_gqa_sizes() -> None:
    """Workaround (b): correct the LoRA slot shapes for GQA/MHA models.

    ``LoRA.zeros()`` (used by ``convert_to_tflite`` to trace the LoRA
    signatures) builds its tensors with ``LoRA._from_tensor_generator``, which
    in 0.10.0 sizes the q output as ``(heads // groups) * head_dim`` and the
    k/v outputs as ``head_dim``, i.e. as if there were a single KV group. With
    more than one group the traced ``apply_lora(..., shape=q.shape)`` reshape
    fails. The replacement uses q out = heads*head_dim, k/v out =
    groups*head_dim and o in = heads*head_dim (o out = embedding_dim), which
    matches the fused qkv projection of ``CausalSelfAttention``.
    """
    import torch
    from litert_torch.generative.layers import lora as lora_utils
    from litert_torch.generative.layers import model_config as cfg_lib

    def _from_tensor_generator(
        cls: type,
        tensor_generator: Callable[[tuple[int, ...], torch.dtype], torch.Tensor],
        rank: int,
        config: cfg_lib.ModelConfig,
        dtype: torch.dtype = torch.float32,
    ) -> Any:
        adapters = []
        dim = config.embedding_dim
        for i in range(config.num_layers):
            attn = config.block_config(i).attn_config
            q_out = attn.num_heads * attn.head_dim
            kv_out = attn.num_query_groups * attn.head_dim

            def weight(in_dim: int, out_dim: int) -> lora_utils.LoRAWeight:
                return lora_utils.LoRAWeight(
                    a_prime=tensor_generator((in_dim, rank), dtype),
                    b_prime=tensor_generator((rank, out_dim), dtype),
                )

            adapters.append(
                lora_utils.LoRAEntry(
                    attention=lora_utils.AttentionLoRA(
                        query=weight(dim, q_out),
                        key=weight(dim, kv_out),
                        value=weight(dim, kv_out),
                        output=weight(q_out, dim),
                    )
                )
            )
        return cls(adapters=tuple(adapters))

    lora_utils.LoRA._from_tensor_generator = classmethod(_from_tensor_generator)


# --------------------------------------------------------------------------
# Torch model.
# --------------------------------------------------------------------------


def litert_model_config(cfg: TinyGqaConfig) -> Any:
    """Returns the litert-torch ``ModelConfig`` for ``cfg``."""
    from litert_torch.generative.layers import model_config as mc

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


def fused_qkv(cfg: TinyGqaConfig, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Packs separate q/k/v ``[out, in]`` weights into litert-torch's fused layout.

    ``CausalSelfAttention`` views the fused output as ``[groups, -1]`` and
    splits each group into ``(heads_per_group*head_dim, head_dim, head_dim)``,
    so the rows are, per KV group g: the q rows of heads
    ``g*heads_per_group ... (g+1)*heads_per_group - 1``, then k of group g,
    then v of group g.
    """
    per_group = cfg.num_heads // cfg.num_kv_groups
    hd = cfg.head_dim
    rows = []
    for g in range(cfg.num_kv_groups):
        rows.append(q[g * per_group * hd : (g + 1) * per_group * hd])
        rows.append(k[g * hd : (g + 1) * hd])
        rows.append(v[g * hd : (g + 1) * hd])
    return np.concatenate(rows, axis=0)


def build_torch_model(cfg: TinyGqaConfig, weights: Mapping[str, np.ndarray]) -> Any:
    """Builds the litert-torch ``DecoderOnlyModel`` and loads ``weights`` into it."""
    import torch
    from litert_torch.generative.utilities import model_builder

    model = model_builder.DecoderOnlyModel(
        litert_model_config(cfg), mask_cache_size=cfg.kv_cache_max_len
    )
    state: dict[str, np.ndarray] = {
        "tok_embedding.weight": weights["embedding"],
        "lm_head.weight": weights["lm_head"],
        "final_norm.weight": weights["final_norm"],
    }
    for i in range(cfg.num_layers):
        p, b = f"layers.{i}.", f"transformer_blocks.{i}."
        state[b + "pre_atten_norm.weight"] = weights[p + "attn_norm"]
        state[b + "atten_func.qkv_projection.weight"] = fused_qkv(
            cfg, weights[p + "q"], weights[p + "k"], weights[p + "v"]
        )
        state[b + "atten_func.output_projection.weight"] = weights[p + "o"]
        state[b + "post_atten_norm.weight"] = weights[p + "mlp_norm"]
        state[b + "ff.w1.weight"] = weights[p + "gate"]
        state[b + "ff.w3.weight"] = weights[p + "up"]
        state[b + "ff.w2.weight"] = weights[p + "down"]
    model.load_state_dict(
        {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}, strict=True
    )
    return model.eval()


# --------------------------------------------------------------------------
# Export and description.
# --------------------------------------------------------------------------


def export_model(
    model: Any,
    cfg: TinyGqaConfig,
    out_file: Path,
    *,
    transposed_kv: bool,
    output_logits_on_prefill: bool,
) -> float:
    """Converts ``model`` to ``out_file`` and returns the seconds it took."""
    from litert_torch.generative.layers import kv_cache as kv_utils
    from litert_torch.generative.utilities import converter

    export_config = converter.ExportConfig(
        output_logits_on_prefill=output_logits_on_prefill,
        kvcache_layout=(
            kv_utils.KV_LAYOUT_TRANSPOSED if transposed_kv else kv_utils.KV_LAYOUT_DEFAULT
        ),
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        written = converter.convert_to_tflite(
            model,
            output_path=tmp,
            output_name_prefix="gqa",
            prefill_seq_len=list(cfg.prefill_seq_lens),
            kv_cache_max_len=cfg.kv_cache_max_len,
            quantize="none",
            config=model.config,
            lora_ranks=list(cfg.lora_ranks),
            export_config=export_config,
        )
        shutil.move(written, out_file)
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
    import torch

    install_tensorflow_schema_stand_in()
    patch_lora_gqa_sizes()
    torch.manual_seed(cfg.seed)

    out_dir.mkdir(parents=True, exist_ok=True)
    weights = make_weights(cfg)
    save_npz_deterministic(out_dir / WEIGHTS_FILE, weights)
    model = build_torch_model(cfg, weights)

    variants = {
        DEFAULT_MODEL_FILE: {"kv_layout": "default", "output_logits_on_prefill": False},
        TRANSPOSED_MODEL_FILE: {"kv_layout": "transposed", "output_logits_on_prefill": True},
    }
    manifest: dict[str, Any] = {
        "generator": "tools/build_test_models.py",
        "versions": {
            name: package_version(name) for name in ("torch", "litert-torch", "ai-edge-litert")
        },
        "files": {},
    }
    for file_name, export in variants.items():
        seconds = export_model(
            model,
            cfg,
            out_dir / file_name,
            transposed_kv=export["kv_layout"] == "transposed",
            output_logits_on_prefill=export["output_logits_on_prefill"],
        )
        print(f"exported {file_name} in {seconds:.1f} s", flush=True)
        manifest["files"][file_name] = {
            "config": {**cfg.to_json(), **export, "weights": WEIGHTS_FILE},
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
