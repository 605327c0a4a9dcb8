#!/usr/bin/env python3
"""Export a model of Qwen2.5-0.5B's exact shapes (random weights) f32 and int8 with
``runtime export``, measure time and peak memory, and check the exports against float64
transformers.

No real checkpoint of 0.5B-1B parameters is in the package lists; an export's time and
memory depend on the shapes, not on what the weights learned, so a checkpoint with
Qwen2.5-0.5B's config (24 layers, hidden 896, 14 heads / 2 KV heads, MLP 4864, vocabulary
151,936, tied embeddings, q/k/v biases; 494M parameters) and random weights (seeded,
stored in bfloat16 as the real one is) stands in. It carries the bench model's small
sentencepiece tokenizer (``benchmarks/models/hf/tokenizer.model``, committed) as a
stand-in too: llama.cpp's converter needs one to write the GGUF the benchmark runs beside
ours (``benchmarks/qwen05b.py``), and refuses a BPE tokenizer whose pre-tokenizer it does
not know; the ids past the tokenizer's become unused tokens, and the vocabulary the model
computes stays 151,936. Both
precisions come from one export (``--quantize none,int8``). Run with the ``export`` extra,
niced::

    nice -n 10 python3 tools/build_qwen05b.py [--cache DIR] [--force] [--jobs N]

Writes into ``$RUNTIME_CACHE/models/qwen2.5-0.5b-random/`` (default
``~/.cache/runtime/models/qwen2.5-0.5b-random/``), never into the repository: the
checkpoint (``checkpoint/``), ``qwen2.5-0.5b-random-{f32,int8}.tflite`` (LoRA slot 8, KV
length 1024, the default prefill lengths 32, 128 and 512), the export's ``--report`` JSON,
and ``report.json``: the command, wall time, peak RSS (of the largest process, of each
kind of process, and of the whole tree as the exporter sampled it), the per-stage
breakdown, and per precision the max |logit diff| against float64 transformers over a
16-token prompt and 16 teacher-forced steps, with the logits' standard deviation and how
many greedy tokens agree.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from build_smollm2 import cache_dir  # noqa: E402  (this script's directory is on sys.path)

NAME = "qwen2.5-0.5b-random"
# Qwen/Qwen2.5-0.5B-Instruct's config.json, the fields that shape the model.
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "hidden_act": "silu", "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 21,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
}
PRECISIONS = {"f32": "none", "int8": "int8"}
EXPORT_ARGS = ("--lora-ranks", "8", "--kv-length", "1024")
PROMPT, STEPS, SEED = 16, 16, 25
STAND_IN_TOKENIZER = REPO_ROOT / "benchmarks" / "models" / "hf" / "tokenizer.model"


def build_checkpoint(directory: Path) -> Path:
    """Writes the random checkpoint (config.json, model.safetensors in bfloat16) once, and
    the stand-in tokenizer beside it."""
    if not (directory / "model.safetensors").is_file():
        import torch
        import transformers

        torch.manual_seed(SEED)
        config = transformers.Qwen2Config(**{k: v for k, v in QWEN25_05B.items() if k not in ("architectures",)})
        model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
        directory.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(directory)
        print(f"checkpoint: {sum(p.numel() for p in model.parameters()):,} parameters in {directory}", flush=True)
    if not (directory / "tokenizer.model").is_file():
        shutil.copyfile(STAND_IN_TOKENIZER, directory / "tokenizer.model")
    return directory


def export(checkpoint: Path, out_dir: Path, jobs: int | None, force: bool) -> dict[str, Any]:
    """Both precisions from one export in a child process: its wall time, the peak RSS of
    its largest process (``wait4``), and the exporter's own report (each process's peak,
    the tree's sampled peak, the stages)."""
    models = {precision: out_dir / f"{NAME}-{precision}.tflite" for precision in PRECISIONS}
    report = out_dir / f"{NAME}.export.json"
    if all(model.exists() for model in models.values()) and report.exists() and not force:
        print(f"{', '.join(m.name for m in models.values())}: already built (--force rebuilds)", flush=True)
        return json.loads((out_dir / "report.json").read_text())["export"]
    command = [sys.executable, "-m", "runtime", "export", str(checkpoint), "--out",
               str(out_dir / f"{NAME}-{{precision}}.tflite"), *EXPORT_ARGS, "--quantize", ",".join(PRECISIONS.values()),
               "--verbose", "--report", str(report)]
    if jobs is not None:
        command += ["--jobs", str(jobs)]
    print("$ " + " ".join(["python", *command[1:]]), flush=True)
    start = time.perf_counter()
    child = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the export failed with exit code {os.waitstatus_to_exitcode(status)}")
    measured = json.loads(report.read_text())
    return {"command": " ".join(["python", *command[1:]]), "seconds": round(time.perf_counter() - start, 1),
            "largest_process_peak_rss_bytes": usage.ru_maxrss * 1024,
            **{key: measured[key] for key in ("exporter_peak_rss_bytes", "worker_peak_rss_bytes",
                                              "finisher_peak_rss_bytes", "jobs", "stages", "signatures")},
            "tree_peak_rss_bytes": measured["peak_rss_bytes"], "tree_peak_pss_bytes": measured["peak_pss_bytes"],
            "tflite_bytes": {precision: model.stat().st_size for precision, model in models.items()}}


def reference(checkpoint: Path, tokens: list[int]) -> np.ndarray:
    """float64 transformers' logits for ``tokens`` from the prompt's last position on."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, PROMPT - 1:].numpy()
    return logits


def runtime_logits(model: Path, tokens: list[int]) -> np.ndarray:
    """The export's logits for the same positions, through this runtime: a prefill of the
    prompt, then one decode step per following token."""
    from runtime import Engine, SessionConfig

    with Engine(model) as engine, engine.create_session(SessionConfig()) as session:
        rows = [session.run_prefill(tokens[:PROMPT])] + [session.run_decode(t) for t in tokens[PROMPT:]]
    return np.stack(rows)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--cache", type=Path, help="output directory (default: see the module docstring)")
    parser.add_argument("--force", action="store_true", help="export again even when the files exist")
    parser.add_argument("--jobs", type=int, help="passed to runtime export (default: its own)")
    args = parser.parse_args(argv)
    out_dir = cache_dir(args.cache, NAME)
    out_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = build_checkpoint(out_dir / "checkpoint")
    report_file = out_dir / "report.json"
    report: dict[str, Any] = {"config": QWEN25_05B, "export_args": list(EXPORT_ARGS),
                              "export": export(checkpoint, out_dir, args.jobs, args.force)}
    report_file.write_text(json.dumps(report, indent=2) + "\n")
    tokens = [int(t) for t in np.random.default_rng(SEED).integers(0, QWEN25_05B["vocab_size"], PROMPT + STEPS)]
    expected = reference(checkpoint, tokens)
    report["fidelity"] = {"prompt_tokens": PROMPT, "steps": STEPS, "logit_std": float(expected.std())}
    for precision in PRECISIONS:
        got = runtime_logits(out_dir / f"{NAME}-{precision}.tflite", tokens)
        report["fidelity"][precision] = {
            "max_abs_logit_diff": float(np.max(np.abs(got - expected))),
            "greedy_tokens_agreeing": int(np.sum(got.argmax(-1) == expected.argmax(-1))), "of": len(expected)}
        print(f"{precision}: {report['fidelity'][precision]} (logit std {report['fidelity']['logit_std']:.3f})",
              flush=True)
    report_file.write_text(json.dumps(report, indent=2) + "\n")
    print(f"report: {report_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
