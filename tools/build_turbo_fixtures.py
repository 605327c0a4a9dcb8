#!/usr/bin/env python3
"""Build the committed fixtures of Turbo LoRA (draft heads and speculative decoding).

Two steps, each rerunnable::

    python3 tools/build_turbo_fixtures.py export     # needs the export extra (torch)
    python3 tools/build_turbo_fixtures.py adapters   # numpy and the runtime only

``export`` writes, under ``tests/models/turbo/``, the tiny GQA model of
``tools/build_test_models.py`` (same seed, same weights) with LoRA rank slots 4 and 8 (a blend of two rank-4 adapters), one
prefill length (8), KV length 64, ``verify4`` signatures (plain and ``_lora_r4``/``_r8``) and
the same attending over the first 16 positions (``verify4_attend16...``, beside
``decode_attend16...``), in
both KV layouts: ``default.tflite`` (no prefill logits) and ``transposed.tflite``
(prefill logits).

``adapters`` writes PEFT directories holding ``tests/models/peft/qkvo_r4``'s LoRA
(rank 4 on q/k/v/o of the same tiny model) plus draft heads:

``random_heads/``
    3 heads ``medusa_head.{k}.linear.{weight,bias}`` drawn at random: drafts are mostly
    wrong, which exercises rejection and rewinding.
``trained_heads/``
    3 heads trained (``tools/train_turbo_lora.py``'s trainer) to predict the tiny model's
    own greedy continuations of ``TRAINED_PROMPTS`` with that LoRA (hidden states from
    the runtime): on those prompts their drafts are mostly right.
``lorax_heads/``
    LoRAX's multi-layer layout: ``medusa_head.{k}.{j}.linear`` (2 blocks per head,
    ``medusa_num_layers`` in ``config.json``) and a per-head output projection
    ``medusa_head.{k}.2.weight`` ``[vocab, hidden]``.
``wrong_width_heads/``
    heads of width 32 for the model's 64: must be refused naming ``heads=False``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tools"))
OUT_DIR = REPO_ROOT / "tests" / "models" / "turbo"
LORA_DIR = REPO_ROOT / "tests" / "models" / "peft" / "qkvo_r4"
MODELS = {"default.tflite": ("default", False), "transposed.tflite": ("transposed", True)}
VERIFY_LENGTH = 4
VERIFY_WINDOW = 16  # decode_attend16 and verify4_attend16: a generation crosses it, both kinds run
NUM_HEADS = 3
SEED = 21
# The prompts the trained heads learn the tiny model's continuations of (with the LoRA).
TRAINED_PROMPTS = [[5, 17, 99], [42, 7, 7, 130], [200, 3, 64, 81, 9], [1, 2, 3, 4, 5, 6]]


def export(out_dir: Path) -> None:
    """Exports the tiny model with verify signatures in both KV layouts."""
    import build_test_models as tiny

    from runtime.export.exporter import export as run_export
    from runtime.export.settings import ExportSettings
    from runtime.export.source import inspect_source

    cfg = tiny.TinyGqaConfig()
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as checkpoint:
        tiny.write_hf_checkpoint(cfg, tiny.make_weights(cfg), Path(checkpoint))
        source = inspect_source(checkpoint)
        for name, (layout, prefill_logits) in MODELS.items():
            settings = ExportSettings(lora_ranks=(4, 8), lora_targets="attention", kv_length=cfg.kv_cache_max_len,
                                      prefill_lengths=(8,), kv_layout=layout, prefill_logits=prefill_logits,
                                      verify_lengths=(VERIFY_LENGTH,), attention_windows=(VERIFY_WINDOW,),
                                      attention_kernel="xnnpack")  # fixtures in standard ops: tests derive the op forms
            start = time.perf_counter()
            run_export(source, settings, model_out=out_dir / name)
            print(f"exported {name} in {time.perf_counter() - start:.1f} s", flush=True)


def _state(directory: Path) -> tuple[dict[str, np.ndarray], dict]:
    from safetensors.numpy import load_file

    return load_file(str(directory / "adapter_model.safetensors")), json.loads(
        (directory / "adapter_config.json").read_text())


def _write(out: Path, tensors: dict[str, np.ndarray], config: dict, extra_config: dict | None = None) -> None:
    from safetensors.numpy import save_file

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in sorted(tensors.items())},
              str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if extra_config is not None:
        (out / "config.json").write_text(json.dumps(extra_config, indent=2, sort_keys=True) + "\n")


def greedy_states(model: Path, prompts: list[list[int]], steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The tiny model's greedy continuations with the LoRA of ``LORA_DIR`` (through the
    runtime), and the final hidden state at every generated position: the lm_head is
    ``[256, 64]``, so each hidden state is recovered exactly from its logits (least
    squares). Returns (hidden ``[N, 64]``, future targets ``[N, NUM_HEADS]``, lm_head)."""
    from runtime import Engine, LoraSource, SessionConfig
    from runtime.export.draft_head_training import future_targets
    from runtime.util.output_projection import read_output_projection

    lm_head = read_output_projection(model, "verify4", str(model)).astype(np.float64)
    hidden_rows, target_rows = [], []
    with Engine(model) as engine:
        for prompt in prompts:
            with engine.create_session(SessionConfig(loras=[LoraSource(path=LORA_DIR)])) as session:
                logits = [session.run_prefill(prompt)]
                tokens = list(prompt)
                for _ in range(steps):
                    tokens.append(int(np.argmax(logits[-1])))
                    logits.append(session.run_decode(tokens[-1]))
            states = np.linalg.lstsq(lm_head, np.asarray(logits[:-1], np.float64).T, rcond=None)[0].T
            positions = np.arange(len(prompt) - 1, len(tokens) - 1)
            hidden_rows.append(states.astype(np.float32))
            target_rows.append(future_targets(np.asarray(tokens), positions, NUM_HEADS))
    return np.concatenate(hidden_rows), np.concatenate(target_rows), lm_head.astype(np.float32)


def build_adapters(out_dir: Path) -> None:
    """Writes the PEFT directories with draft heads (see the module notes)."""
    from train_turbo_lora import train_heads

    from runtime.export.draft_head_training import head_top1

    rng = np.random.default_rng(SEED)
    lora, config = _state(LORA_DIR)
    hidden = 64
    heads_config = {**config, "medusa_num_heads": NUM_HEADS, "medusa_num_layers": 1}

    def random_heads(width: int) -> dict[str, np.ndarray]:
        return {name: array for k in range(NUM_HEADS) for name, array in (
            (f"medusa_head.{k}.linear.weight", rng.standard_normal((width, width)) * 0.3),
            (f"medusa_head.{k}.linear.bias", rng.standard_normal(width) * 0.1))}

    _write(out_dir / "random_heads", {**lora, **random_heads(hidden)}, heads_config)
    _write(out_dir / "wrong_width_heads", {**lora, **random_heads(32)}, heads_config)
    lorax = {}
    for k in range(NUM_HEADS):
        for j in range(2):
            lorax[f"medusa_head.{k}.{j}.linear.weight"] = rng.standard_normal((hidden, hidden)) * 0.1
            lorax[f"medusa_head.{k}.{j}.linear.bias"] = rng.standard_normal(hidden) * 0.1
        lorax[f"medusa_head.{k}.2.weight"] = rng.standard_normal((256, hidden)) * 0.2
    _write(out_dir / "lorax_heads", {**lora, **lorax}, config,
           extra_config={"medusa_num_heads": NUM_HEADS, "medusa_num_layers": 2})

    # A random model's greedy text is chaotic (heads trained on 120 prompts reach 2% top-1 on
    # others), so the heads learn the continuations of TRAINED_PROMPTS, which the tests
    # generate from: their drafts are mostly right there, and mostly wrong elsewhere.
    model = out_dir / "default.tflite"
    train_hidden, train_targets, lm_head = greedy_states(model, TRAINED_PROMPTS, 40)
    heads = train_heads(train_hidden, train_targets, lm_head, steps=1500, batch=512, learning_rate=1e-2)
    top1 = head_top1(heads, train_hidden, train_targets, lm_head)
    trained = {name: array for k, (weight, bias) in enumerate(heads)
               for name, array in ((f"medusa_head.{k}.linear.weight", weight), (f"medusa_head.{k}.linear.bias", bias))}
    _write(out_dir / "trained_heads", {**lora, **trained}, heads_config)
    (out_dir / "trained_heads" / "training.json").write_text(json.dumps(
        {"prompts": TRAINED_PROMPTS, "top1_per_head_on_those_prompts": [round(x, 4) for x in top1],
         "positions": int(len(train_hidden))}, indent=2) + "\n")
    print(f"trained heads: top-1 per head on their prompts {[round(x, 3) for x in top1]}")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("step", choices=("export", "adapters"))
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    if args.step == "export":
        export(args.out_dir)
    else:
        build_adapters(args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
