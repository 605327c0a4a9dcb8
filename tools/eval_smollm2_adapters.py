#!/usr/bin/env python3
"""Measure the SmolLM2-135M adapters: exact-match accuracy and runtime/transformers agreement.

Run after ``tools/train_smollm2_adapters.py train``, from the repository root::

    nice -n 10 python3 tools/eval_smollm2_adapters.py [--model SMOLLM2.tflite] [--adapter NAME ...]

``--adapter`` picks the adapters (default: every task's attention adapter; ``intent-all-linear``
is the all-linear one of ``tools/train_smollm2_adapters.py train --targets all-linear``).

Every held-out test item of every task (``tools/smollm2_tasks.py``, 100 per task) is put
through the model's chat template (transformers' tokenizer) and answered greedily, float32,
by the base model and by the base with each adapter (cross-task included):

1. transformers + peft, the reference. Prompts of equal length are batched together, so
   no row is padded.
2. With ``--model``, this runtime on a litert-torch export of SmolLM2-135M with a LoRA slot
   of rank >= 8 (``Engine``, ``SessionConfig(lora_path=<PEFT dir>)``, one session per
   model, reset between items). Every generated token sequence is compared with the
   reference's. For each item where they differ, the script records where they part and
   the gap between the two best logits there, in transformers (unbatched) and in the
   runtime: a near-tie explains a flip, a wide gap would be a bug.

It also checks that the runtime's own chat template and tokenizer give the same prompt ids
as transformers. Writes ``benchmarks/results/smollm2_adapters.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOOLS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TOOLS_DIR.parent
for path in (TOOLS_DIR, REPO_ROOT):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import smollm2_tasks as tasks  # noqa: E402
from train_smollm2_adapters import prompt_ids  # noqa: E402

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
BASE = "base"  # the model name of the base model without an adapter
HF_BATCH = 16


@dataclass(frozen=True)
class Item:
    """One test item, ready to run."""

    task: str
    index: int
    example: tasks.Example
    prompt: tuple[int, ...]


# --------------------------------------------------------------------------
# transformers + peft.
# --------------------------------------------------------------------------


class Reference:
    """The base model in transformers with every adapter loaded through peft, float32."""

    def __init__(self, model_dir: Path, adapters: dict[str, Path], threads: int) -> None:
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        names = list(adapters)
        self.model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0]).eval()
        for name in names[1:]:
            self.model.load_adapter(adapters[name], adapter_name=name)
        self.eos = base.generation_config.eos_token_id

    def _with(self, model_name: str) -> Any:
        """A context in which the model runs as ``model_name`` (``base``: no adapter)."""
        import contextlib

        if model_name == BASE:
            return self.model.disable_adapter()
        self.model.set_adapter(model_name)
        return contextlib.nullcontext()

    def generate(self, model_name: str, prompts: list[tuple[int, ...]], max_new_tokens: int) -> list[list[int]]:
        """Greedy tokens for each prompt, up to and without the stop token."""
        import torch

        by_length: dict[int, list[int]] = defaultdict(list)
        for i, prompt in enumerate(prompts):
            by_length[len(prompt)].append(i)
        out: list[list[int]] = [[] for _ in prompts]
        with self._with(model_name), torch.inference_mode():
            for indices in by_length.values():
                for start in range(0, len(indices), HF_BATCH):
                    chunk = indices[start : start + HF_BATCH]
                    ids = torch.tensor([prompts[i] for i in chunk])
                    generated = self.model.generate(
                        input_ids=ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=max_new_tokens,
                        do_sample=False,
                        eos_token_id=self.eos,
                        pad_token_id=self.eos,
                    )[:, ids.shape[1] :]
                    for i, row in zip(chunk, generated.tolist()):
                        out[i] = until_stop(row, self.eos)
        return out

    def next_logits(self, model_name: str, tokens: list[int]) -> Any:
        """Float32 logits after ``tokens`` (one unbatched forward pass)."""
        import torch

        with self._with(model_name), torch.inference_mode():
            return self.model(input_ids=torch.tensor([tokens])).logits[0, -1].numpy()


def until_stop(tokens: list[int], stop: int) -> list[int]:
    """``tokens`` up to (without) the first ``stop``."""
    return tokens[: tokens.index(stop)] if stop in tokens else tokens


# --------------------------------------------------------------------------
# This runtime.
# --------------------------------------------------------------------------


def runtime_outputs(engine: Any, adapter: Path | None, items: list[Item], max_new_tokens: int, stop: int) -> list[list[int]]:
    """Greedy tokens from one session (``adapter`` or the base), reset before every item."""
    from runtime import SessionConfig
    from runtime.cli.progress import progress_bar

    config = SessionConfig(lora_path=adapter) if adapter is not None else SessionConfig()
    out = []
    with engine.create_session(config) as session:
        for item in progress_bar(f"runtime {adapter.name if adapter else BASE}", "item")(items):
            session.reset()
            result = session.generate(list(item.prompt), max_new_tokens=max_new_tokens, stop_tokens=[stop])
            out.append(until_stop(result.tokens, stop))
    return out


def runtime_next_logits(engine: Any, adapter: Path | None, tokens: list[int]) -> Any:
    """The runtime's logits after ``tokens`` in a fresh session."""
    from runtime import SessionConfig

    config = SessionConfig(lora_path=adapter) if adapter is not None else SessionConfig()
    with engine.create_session(config) as session:
        return session.run_prefill(tokens)


def top2_gap(logits: Any) -> tuple[int, int, float]:
    """The best and second-best token and the logit gap between them."""
    import numpy as np

    order = np.argsort(-logits)
    return int(order[0]), int(order[1]), float(logits[order[0]] - logits[order[1]])


def explain_mismatch(reference: Reference, engine: Any, adapter: Path | None, model_name: str,
                     item: Item, ours: list[int], theirs: list[int], tokenizer: Any) -> dict[str, Any]:
    """Where two greedy outputs part, and how close the top two logits are there."""
    step = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    context = list(item.prompt) + theirs[:step]
    hf_best, hf_second, hf_gap = top2_gap(reference.next_logits(model_name, context))
    rt_best, rt_second, rt_gap = top2_gap(runtime_next_logits(engine, adapter, context))
    return {
        "model": model_name,
        "task": item.task,
        "index": item.index,
        "instruction": item.example.instruction,
        "transformers": tokenizer.decode(theirs),
        "runtime": tokenizer.decode(ours),
        "first_different_step": step,
        "transformers_top2": [tokenizer.decode([hf_best]), tokenizer.decode([hf_second]), round(hf_gap, 6)],
        "runtime_top2": [tokenizer.decode([rt_best]), tokenizer.decode([rt_second]), round(rt_gap, 6)],
    }


# --------------------------------------------------------------------------
# The run.
# --------------------------------------------------------------------------


def test_items(tokenizer: Any, num_test: int) -> dict[str, list[Item]]:
    """Every task's held-out items with their prompt ids."""
    out = {}
    for name, task in tasks.TASKS.items():
        test = tasks.held_out(task, num_test)
        out[name] = [Item(name, i, e, tuple(prompt_ids(tokenizer, e.instruction))) for i, e in enumerate(test)]
    return out


def check_runtime_prompts(model_dir: Path, items: dict[str, list[Item]]) -> dict[str, int]:
    """How many prompts the runtime's ChatTemplate + HfTokenizer render to the same ids."""
    from runtime import HfTokenizer
    from runtime.components.chat_template import ChatTemplate

    template = ChatTemplate((model_dir / "chat_template.jinja").read_text())
    tokenizer = HfTokenizer(model_dir / "tokenizer.json")
    every = [item for task_items in items.values() for item in task_items]
    same = sum(
        tokenizer.encode(template.render([{"role": "user", "content": item.example.instruction}])) == list(item.prompt)
        for item in every
    )
    return {"identical": same, "total": len(every)}


def accuracy(items: list[Item], outputs: list[list[int]], tokenizer: Any) -> float:
    """The fraction of items answered exactly."""
    hits = sum(tasks.is_correct(tokenizer.decode(out), item.example.answer) for item, out in zip(items, outputs))
    return hits / len(items)


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def adapter_names() -> list[str]:
    """The adapters this script can evaluate: each task's attention adapter (named as the
    task) and its all-linear one (``<task>-all-linear``)."""
    return [*tasks.TASKS, *(f"{task}-all-linear" for task in tasks.TASKS)]


def adapter_path(name: str) -> Path:
    """The PEFT directory of adapter ``name`` (one of :func:`adapter_names`)."""
    task, _, targets = name.partition("-")
    return tasks.adapter_dir(task, targets or "attention")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Evaluates everything and returns the results record."""
    from transformers import AutoTokenizer

    model_dir = tasks.hf_model_dir()
    adapters = {name: adapter_path(name) for name in args.adapter or tasks.TASKS}
    missing = [str(p) for p in [model_dir, *adapters.values()] if not p.exists()]
    if missing:
        raise SystemExit(f"error: missing {', '.join(missing)}: run tools/train_smollm2_adapters.py train first")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    items = test_items(tokenizer, args.num_test)
    if args.task:
        items = {name: items[name] for name in args.task}
    model_names = [BASE, *adapters]
    reference = Reference(model_dir, adapters, args.threads)
    eos = reference.eos

    record: dict[str, Any] = {
        "generator": "tools/eval_smollm2_adapters.py",
        "base_model": {"hf_dir": str(model_dir), "source": tasks.GGUF_FILE},
        "greedy": True,
        "dtype": "float32",
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "tasks": {
            name: {
                "description": task.description,
                "num_test": len(items[name]),
                "example": {"instruction": items[name][0].example.instruction, "answer": items[name][0].example.answer},
                "prompt_tokens_mean": round(sum(len(i.prompt) for i in items[name]) / len(items[name]), 1),
            }
            for name, task in tasks.TASKS.items() if name in items
        },
        "adapters": {},
        "transformers_peft": {"accuracy": {}, "seconds": 0.0},
    }
    for name, path in adapters.items():
        training = json.loads((path / "training.json").read_text())
        record["adapters"][name] = {
            "dir": str(path),
            "rank": training["config"]["rank"],
            "alpha": training["config"]["alpha"],
            "target_modules": training["target_modules"],
            "steps": training["config"]["steps"],
            "batch": training["config"]["batch"],
            "learning_rate": training["config"]["learning_rate"],
            "train_examples": training["train_examples"],
            "train_seconds": training["train_seconds"],
            "train_cpu_seconds": training.get("train_cpu_seconds"),
            "final_loss": training["losses"][-1],
            "adapter_bytes": (path / "adapter_model.safetensors").stat().st_size,
        }

    hf_outputs: dict[str, dict[str, list[list[int]]]] = {}
    start = time.perf_counter()
    for model_name in model_names:
        hf_outputs[model_name] = {}
        record["transformers_peft"]["accuracy"][model_name] = {}
        for task_name, task_items in items.items():
            outputs = reference.generate(model_name, [i.prompt for i in task_items], args.max_new_tokens)
            hf_outputs[model_name][task_name] = outputs
            acc = accuracy(task_items, outputs, tokenizer)
            record["transformers_peft"]["accuracy"][model_name][task_name] = acc
            print(f"transformers+peft {model_name:>13} on {task_name:<13} {acc:6.1%}  "
                  f"e.g. {tokenizer.decode(outputs[0])!r}", flush=True)
    record["transformers_peft"]["seconds"] = round(time.perf_counter() - start, 1)
    record["transformers_peft"]["samples"] = {
        model_name: {task_name: tokenizer.decode(outs[0]) for task_name, outs in per_task.items()}
        for model_name, per_task in hf_outputs.items()
    }

    if args.model is not None:
        record["runtime"] = run_runtime(args, model_dir, adapters, items, hf_outputs, reference, tokenizer, eos)
    record["versions"] = {
        name: importlib.metadata.version(name)
        for name in ("torch", "transformers", "peft", "ai-edge-litert", "litert-torch")
    }
    return record


def run_runtime(args: argparse.Namespace, model_dir: Path, adapters: dict[str, Path], items: dict[str, list[Item]],
                hf_outputs: dict[str, dict[str, list[list[int]]]], reference: Reference, tokenizer: Any,
                eos: int) -> dict[str, Any]:
    """The same evaluation through this runtime, and its agreement with transformers."""
    from runtime import Engine, EngineSettings

    model_path = Path(args.model)
    out: dict[str, Any] = {
        "model": {"path": str(model_path), "bytes": model_path.stat().st_size, "sha256": file_sha256(model_path)},
        "prompt_ids_from_runtime_chat_template": check_runtime_prompts(model_dir, items),
        "accuracy": {},
        "identical_outputs": {},
        "mismatches": [],
    }
    start = time.perf_counter()
    with Engine(model_path, EngineSettings(num_threads=args.threads), tokenizer=model_dir / "tokenizer.json") as engine:
        out["model"]["lora_slots"] = [str(slot) for slot in engine.spec.slots]
        out["model"]["kv_length"] = engine.spec.kv_length
        for model_name in [BASE, *adapters]:
            adapter = adapters.get(model_name)
            out["accuracy"][model_name] = {}
            out["identical_outputs"][model_name] = {}
            for task_name, task_items in items.items():
                ours = runtime_outputs(engine, adapter, task_items, args.max_new_tokens, eos)
                theirs = hf_outputs[model_name][task_name]
                acc = accuracy(task_items, ours, tokenizer)
                same = sum(a == b for a, b in zip(ours, theirs))
                out["accuracy"][model_name][task_name] = acc
                out["identical_outputs"][model_name][task_name] = {"identical": same, "total": len(task_items)}
                print(f"runtime           {model_name:>13} on {task_name:<13} {acc:6.1%}  "
                      f"identical to transformers+peft: {same}/{len(task_items)}", flush=True)
                for item, a, b in zip(task_items, ours, theirs):
                    if a != b:
                        out["mismatches"].append(
                            explain_mismatch(reference, engine, adapter, model_name, item, a, b, tokenizer)
                        )
    out["seconds"] = round(time.perf_counter() - start, 1)
    counts = [c for per_task in out["identical_outputs"].values() for c in per_task.values()]
    out["identical_total"] = {"identical": sum(c["identical"] for c in counts), "total": sum(c["total"] for c in counts)}
    return out


def markdown(record: dict[str, Any]) -> str:
    """The results as markdown tables."""
    task_names = list(record["tasks"])
    lines = ["# Real adapters on SmolLM2-135M-Instruct", ""]
    lines.append(f"Generated by `{record['generator']}`; greedy, float32, exact match on "
                 f"{', '.join(str(t['num_test']) for t in record['tasks'].values())} held-out items.")
    lines += ["", "| task | what it asks | example instruction | expected answer |", "|---|---|---|---|"]
    for name, task in record["tasks"].items():
        instruction = task["example"]["instruction"].replace("\n", " / ").replace("|", "\\|")
        lines.append(f"| {name} | {task['description']} | {instruction} | `{task['example']['answer']}` |")
    lines += ["", "| adapter | rank / alpha | steps x batch | train time (wall, shared box) | CPU time | final loss | bytes |",
              "|---|---|---|---:|---:|---:|---:|"]
    for name, a in record["adapters"].items():
        cpu = f"{a['train_cpu_seconds'] / 60:.1f} min" if a["train_cpu_seconds"] is not None else "not recorded"
        lines.append(f"| {name} | {a['rank']} / {a['alpha']} | {a['steps']} x {a['batch']} | "
                     f"{a['train_seconds'] / 60:.1f} min | {cpu} | {a['final_loss']:.4f} | {a['adapter_bytes']:,} |")

    def table(title: str, accuracy: dict[str, dict[str, float]]) -> list[str]:
        rows = ["", f"**{title}**", "", "| model | " + " | ".join(task_names) + " |",
                "|---|" + "---:|" * len(task_names)]
        for model_name, per_task in accuracy.items():
            label = "base alone" if model_name == BASE else f"base + {model_name} adapter"
            rows.append(f"| {label} | " + " | ".join(f"{per_task[t]:.0%}" for t in task_names) + " |")
        return rows

    lines += table("Accuracy, transformers + peft", record["transformers_peft"]["accuracy"])
    runtime = record.get("runtime")
    if runtime:
        lines += table(f"Accuracy, this runtime (`{Path(runtime['model']['path']).name}`, "
                       f"LoRA slots {runtime['model']['lora_slots']})", runtime["accuracy"])
        lines += ["", "**Greedy outputs identical, runtime vs transformers + peft**", "",
                  "| model | " + " | ".join(task_names) + " |", "|---|" + "---:|" * len(task_names)]
        for model_name, per_task in runtime["identical_outputs"].items():
            label = "base alone" if model_name == BASE else f"base + {model_name} adapter"
            lines.append(f"| {label} | " + " | ".join(f"{per_task[t]['identical']}/{per_task[t]['total']}" for t in task_names) + " |")
        total = runtime["identical_total"]
        prompts = runtime["prompt_ids_from_runtime_chat_template"]
        lines += ["", f"In all {total['identical']}/{total['total']} outputs identical. The runtime's own chat "
                  f"template and tokenizer give the same prompt ids as transformers for "
                  f"{prompts['identical']}/{prompts['total']} prompts."]
        if runtime["mismatches"]:
            lines += ["", "| model | task | item | step | transformers | runtime | top-2 gap (transformers / runtime) |",
                      "|---|---|---:|---:|---|---|---|"]
            for m in runtime["mismatches"]:
                lines.append(f"| {m['model']} | {m['task']} | {m['index']} | {m['first_different_step']} | "
                             f"`{m['transformers']!r}` | `{m['runtime']!r}` | "
                             f"{m['transformers_top2'][2]:.2g} / {m['runtime_top2'][2]:.2g} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", type=Path, help="a litert-torch export of SmolLM2-135M with a LoRA rank slot >= 8")
    parser.add_argument("--num-test", type=int, default=100, help="held-out items per task")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "smollm2_adapters.json")
    parser.add_argument("--adapter", action="append", choices=adapter_names(),
                        help="an adapter to evaluate (repeatable; default: every task's attention adapter)")
    parser.add_argument("--task", action="append", choices=sorted(tasks.TASKS),
                        help="a task to evaluate on (repeatable; default: every task)")
    args = parser.parse_args(argv)
    if args.model is not None and not args.model.is_file():
        raise SystemExit(f"error: {args.model}: no such model file")
    record = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(record))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
