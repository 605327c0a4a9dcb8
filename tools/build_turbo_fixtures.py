#!/usr/bin/env python3
"""Build the committed fixtures of Turbo LoRA (draft heads and speculative decoding).

Two steps, each rerunnable::

    python3 tools/build_turbo_fixtures.py export     # needs the export extra (torch)
    python3 tools/build_turbo_fixtures.py adapters   # numpy and the runtime only

``export`` writes, under ``tests/models/turbo/``, the tiny GQA model of
``tools/build_test_models.py`` (same seed, same weights) with LoRA rank slot 4, one
prefill length (8), KV length 64 and ``verify4`` signatures (plain and ``_lora_r4``), in
both KV layouts: ``default.tflite`` (no prefill logits) and ``transposed.tflite``
(prefill logits).

``adapters`` writes PEFT directories holding ``tests/models/peft/qkvo_r4``'s LoRA
(rank 4 on q/k/v/o of the same tiny model) plus draft heads:

``random_heads/``
    3 heads ``medusa_head.{k}.linear.{weight,bias}`` drawn at random: drafts are mostly
    wrong, which exercises rejection and rewinding.
``trained_heads/``
    3 heads fitted (least squares on the SiLU's input, then a few gradient steps) to
    predict the tiny model's own greedy continuations with that LoRA, from hidden states
    the runtime's ``verify4_lora_r4`` returns: drafts are mostly right.
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
NUM_HEADS = 3
SEED = 21


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
            settings = ExportSettings(lora_ranks=(4,), lora_targets="attention", kv_length=cfg.kv_cache_max_len,
                                      prefill_lengths=(8,), kv_layout=layout, prefill_logits=prefill_logits,
                                      verify_lengths=(VERIFY_LENGTH,))
            start = time.perf_counter()
            run_export(source, settings, model_out=out_dir / name)
            print(f"exported {name} in {time.perf_counter() - start:.1f} s", flush=True)


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
