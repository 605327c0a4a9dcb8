#!/usr/bin/env python3
"""Build the Gemma 3 fixture: a tiny Gemma 3 export with batched, windowed and all-linear
signatures, PEFT adapters on it, and float64 transformers (+ peft) references.

Run with the ``export`` extra installed (``pip install -e '.[export]'``)::

    python3 tools/build_gemma3_fixtures.py [--out-dir DIR]

The model is the Gemma 3 family fixture's (``tools/build_family_fixtures.py``: three
layers, sliding window 5 between a global layer, two RoPE tables, four norms per block,
query_pre_attn_scalar != head_dim, random weights from a fixed seed), exported float32
with the default LoRA targets (all-linear: attention-only slots and all-linear ones
beside them) of rank 8, prefill length 16, KV length 64, batched decode of 2 and 4 rows
and an attention window of 16 positions (single and batched decode, and prefill: the
prompt's prefill runs in it). Under
``tests/models/gemma3/`` by default:

``model.tflite``
    That export.
``adapter/``, ``adapter_b/``
    Rank-4 PEFT LoRAs on q/k/v/o (``lora_alpha`` 8), random A and B, saved by ``peft``.
``adapter_all_linear/``, ``adapter_all_linear_b/``
    The same on every linear projection: q/k/v/o and the MLP's gate/up/down.
``reference.npz``
    transformers in float64 (eager attention): ``tokens`` (a prompt of ``prompt_len``
    tokens and the tokens fed after it, past the sliding window and the attention window),
    ``logits`` / ``logits_<adapter>`` at every position from the prompt's last on and
    ``greedy`` / ``greedy_<adapter>``: the greedy continuation of the prompt.
``MANIFEST.json``
    Config, export settings, versions, sizes, sha256, and each adapter's distance from the
    reference through this runtime, measured here.

``tests/test_gemma3.py`` checks it without torch: every adapter against float64, and
every row of a batch against the same session run alone.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tools.build_family_fixtures import (  # noqa: E402  (after the path is set)
    ADAPTER_ALPHA, ADAPTER_RANK, ALL_LINEAR_TARGETS, FAMILIES, GREEDY_TOKENS, TARGETS, add_adapter, build_hf_model,
    check_runtime, file_entries, save_adapters, write_reference,
)

DEFAULT_OUT_DIR = REPO_ROOT / "tests" / "models" / "gemma3"
SPEC = next(spec for spec in FAMILIES if spec.name == "gemma3")
PROMPT_LEN = 8
FED_TOKENS = 28  # teacher-forced after the prompt: past the 16-position window to position 35
TOLERANCE = 1e-4
LORA_SLOT = 8
EXPORT = dict(lora_ranks=(LORA_SLOT,), kv_length=64, prefill_lengths=(16,), batch_sizes=(2, 4),
              attention_windows=(16,), prefill_windows=(16,),
              attention_kernel="xnnpack")  # fixtures in standard ops: tests derive the op forms
# The adapters, by directory name: their target modules and seed offset.
ADAPTERS = {"adapter": (TARGETS, 1), "adapter_b": (TARGETS, 2), "adapter_all_linear": (ALL_LINEAR_TARGETS, 3),
            "adapter_all_linear_b": (ALL_LINEAR_TARGETS, 4)}


def build(out_dir: Path) -> dict[str, Any]:
    """Builds the fixture into ``out_dir``; returns its manifest."""
    import torch

    from runtime.export.exporter import export
    from runtime.export.settings import ExportSettings
    from runtime.export.source import inspect_source

    torch.manual_seed(SPEC.seed)
    model = build_hf_model(SPEC)
    peft_models = {name: add_adapter(model, SPEC.seed + offset, targets)
                   for name, (targets, offset) in ADAPTERS.items()}
    settings = ExportSettings(**EXPORT)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as work:
        model.save_pretrained(work)
        report = export(inspect_source(work), settings, model_out=out_dir / "model.tflite")
    save_adapters(peft_models, out_dir, "gemma3")

    rng = np.random.default_rng(SPEC.seed + 7)
    models64 = {"": model.double(), **{"_" + name: peft.double() for name, peft in peft_models.items()}}
    reference, margin = write_reference(models64, rng, SPEC, PROMPT_LEN, FED_TOKENS, out_dir)
    measured = check_runtime(out_dir, ADAPTERS, reference, "gemma3", TOLERANCE)
    files = sorted(p for p in out_dir.rglob("*") if p.is_file())
    return {
        "generator": "tools/build_gemma3_fixtures.py",
        "versions": {name: importlib.metadata.version(name)
                     for name in ("torch", "transformers", "peft", "litert-torch", "ai-edge-litert")},
        "transformers_config": {"class": SPEC.config_class, **SPEC.config},
        "seed": SPEC.seed,
        "export": {**{key: list(value) for key, value in EXPORT.items() if isinstance(value, tuple)},
                   "kv_length": settings.kv_length, "lora_targets": "default (all-linear)",
                   "seconds": round(sum(report.stage_seconds.values()), 1)},
        "adapters": {name: {"r": ADAPTER_RANK, "lora_alpha": ADAPTER_ALPHA, "target_modules": targets}
                     for name, (targets, _) in ADAPTERS.items()},
        "reference": {"prompt_len": PROMPT_LEN, "fed_tokens": FED_TOKENS, "greedy_tokens": GREEDY_TOKENS,
                      "greedy_margin": round(margin, 4)},
        "runtime_vs_reference": measured,
        "files": file_entries(out_dir, files),
    }


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # peft looks the base model up on the hub when saving
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    args = parser.parse_args(argv)
    manifest = build(args.out_dir)
    (args.out_dir / "MANIFEST.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    sizes = sum(f["size_bytes"] for f in manifest["files"].values())
    print(f"gemma3: {sizes:,} bytes, export {manifest['export']['seconds']} s, "
          f"runtime vs float64 transformers {json.dumps(manifest['runtime_vs_reference'])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
