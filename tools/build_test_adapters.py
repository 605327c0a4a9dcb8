"""Builds the LoRA adapter fixtures the tests use, for the test models' shapes.

Needs only the runtime itself (no torch). Run from the repository root:

    python tools/build_test_adapters.py

Writes ``tests/models/adapters/*.tflite``, ``expected.npz`` (every tensor as written,
keyed ``"<file>::<tensor>"``, so tests can check exact values) and ``MANIFEST.json``.
Seeds are fixed, so the files are rebuilt byte for byte.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from runtime.adapters.lora_data import LoraData
from runtime.adapters.lora_util import ATTENTION_PROJECTIONS, Convention
from runtime.adapters.lora_writer import LoraWeights, name_adapter_tensors, write_lora_file

OUT_DIR = Path(__file__).resolve().parent.parent / "tests" / "models" / "adapters"

# Shapes of tests/models/gqa_*.tflite: hidden 64, 4 heads x 16, 2 KV groups x 16.
NUM_LAYERS = 2
HIDDEN = 64
OUT_FEATURES = {"q": 64, "k": 32, "v": 32, "o": 64}
IN_FEATURES = {"q": HIDDEN, "k": HIDDEN, "v": HIDDEN, "o": 64}


@dataclass(frozen=True)
class AdapterSpec:
    """One fixture file: what it covers and how it is stored."""

    name: str
    convention: Convention
    rank: int
    seed: int
    dtype: np.dtype = np.dtype(np.float32)
    layers: tuple[int, ...] = tuple(range(NUM_LAYERS))
    projections: tuple[str, ...] = ATTENTION_PROJECTIONS
    hidden: int = HIDDEN
    scale: float = 0.25
    zero: bool = False
    description: str = ""


SPECS = [
    AdapterSpec("torch_r4", Convention.LITERT_TORCH, 4, seed=1,
                description="litert-torch names, f32 inline, rank 4, every layer and projection"),
    AdapterSpec("litertlm_r4", Convention.LITERT_LM, 4, seed=2, dtype=np.dtype(np.float16),
                description="LiteRT-LM w_prime names, f16 at offsets, lora_rank metadata"),
    AdapterSpec("mediapipe_r4", Convention.MEDIAPIPE, 4, seed=3, dtype=np.dtype(np.float16),
                description="MediaPipe dotted names, f16 at offsets, lora_rank metadata"),
    AdapterSpec("torch_r16", Convention.LITERT_TORCH, 16, seed=4, scale=0.15,
                description="litert-torch, rank 16 (fills the r16 slot)"),
    AdapterSpec("torch_r4_bf16", Convention.LITERT_TORCH, 4, seed=5, dtype=np.dtype(ml_dtypes.bfloat16),
                description="litert-torch names, bfloat16 inline"),
    AdapterSpec("torch_r4_layer1_qv", Convention.LITERT_TORCH, 4, seed=6, layers=(1,),
                projections=("q", "v"), description="only layer 1, q and v"),
    AdapterSpec("litertlm_r8_layer0", Convention.LITERT_LM, 8, seed=7, dtype=np.dtype(np.float16),
                layers=(0,), description="only layer 0, rank 8 (goes in the r16 slot)"),
    AdapterSpec("torch_r4_zero", Convention.LITERT_TORCH, 4, seed=8, zero=True,
                description="all zeros: must give the base model's logits"),
    AdapterSpec("torch_r32", Convention.LITERT_TORCH, 32, seed=9,
                description="rank 32: above every slot of the test models"),
    AdapterSpec("wrong_hidden_r4", Convention.LITERT_TORCH, 4, seed=10, hidden=48,
                description="made for a model with hidden size 48"),
]


def make_weights(spec: AdapterSpec) -> dict[tuple[int, str], LoraWeights]:
    """Random graph-layout LoRA pairs, rounded to the file's dtype so values are exact."""
    rng = np.random.default_rng(spec.seed)
    weights = {}
    for layer in spec.layers:
        for proj in spec.projections:
            fan_in = spec.hidden if proj != "o" else IN_FEATURES["o"]
            fan_out = OUT_FEATURES[proj] if spec.hidden == HIDDEN else spec.hidden
            a = rng.normal(0.0, spec.scale, (fan_in, spec.rank))
            b = rng.normal(0.0, spec.scale, (spec.rank, fan_out))
            if spec.zero:
                a, b = np.zeros_like(a), np.zeros_like(b)
            weights[(layer, proj)] = LoraWeights(_round(a, spec.dtype), _round(b, spec.dtype))
    return weights


def _round(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Float32 values exactly representable in ``dtype``."""
    return array.astype(dtype).astype(np.float32)


def main() -> None:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    expected: dict[str, np.ndarray] = {}
    manifest = {}
    for spec in SPECS:
        weights = make_weights(spec)
        path = write_lora_file(
            OUT_DIR / f"{spec.name}.tflite", weights, spec.convention, dtype=spec.dtype
        )
        for name, array in name_adapter_tensors(weights, spec.convention, spec.dtype).items():
            expected[f"{path.name}::{name}"] = array.astype(np.float32)
        with LoraData.create_from_file_path(path) as data:  # round-trip check
            assert data.get_lora_rank() == spec.rank, spec
        blob = path.read_bytes()
        manifest[path.name] = {
            "description": spec.description,
            "convention": spec.convention.value,
            "rank": spec.rank,
            "dtype": spec.dtype.name,
            "layers": list(spec.layers),
            "projections": list(spec.projections),
            "hidden": spec.hidden,
            "seed": spec.seed,
            "bytes": len(blob),
            "sha256": hashlib.sha256(blob).hexdigest(),
        }
    np.savez_compressed(OUT_DIR / "expected.npz", **expected)
    (OUT_DIR / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"wrote {len(SPECS)} adapters to {OUT_DIR}")


if __name__ == "__main__":
    main()
