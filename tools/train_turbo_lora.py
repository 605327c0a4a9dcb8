#!/usr/bin/env python3
"""Train Turbo LoRA draft heads (Medusa-1 style) for SmolLM2-135M-Instruct, on CPU.

For any exported family and your own examples, ``python -m runtime train-turbo`` does this
and trains the LoRA too (docs/turbo-training.md); this tool reproduces the README's SmolLM2
``order_json`` numbers.

Needs torch, transformers 5 and peft (the ``export`` extra), the prepared model and a
trained LoRA of ``tools/train_smollm2_adapters.py``::

    nice -n 10 python3 tools/train_smollm2_adapters.py train --task order_json   # or --untrained-lora below
    nice -n 10 python3 tools/train_turbo_lora.py --task order_json [--untrained-lora] [--heads 3]

What it does, and what it does not:

* **Heads on top of a frozen LoRA, not joint training.** Joint LoRA + heads training on
  two shared cores does not fit (a LoRA step took 245 s on the loaded box); Medusa-1
  freezes the trunk the same way. Without a trained LoRA for the task,
  ``--untrained-lora`` uses PEFT's initialization (B = 0: the base model's behaviour at a
  rank-8 LoRA's cost), which keeps "the same LoRA with and without heads" comparable.
* **Self-distillation.** The trunk (base + the LoRA) answers every training item greedily
  (batched ``generate``); one teacher-forced forward over prompt + answer caches its final
  hidden states (after the final norm: the lm_head's input). The heads learn what the
  trunk itself will say, which is what verification keeps.
* Head k maps ``h`` to ``h + SiLU(W_k h + b_k)`` and the base lm_head (frozen, tied to
  the embedding in SmolLM2) gives its logits for the token k+2 positions ahead. ``W_k``
  starts at zero; cheap steps first regress each head's output onto the trunk's own hidden
  state that produced its target (no vocabulary product), then cross-entropy over the
  whole vocabulary finishes (AdamW).
* Per-head top-1 on held-out items (teacher-forced, the ``tools/smollm2_tasks.py`` test
  split), as Medusa's training log prints it, goes to ``training.json``.

The Turbo adapter is written as a PEFT directory: the LoRA's files, with the heads added
to its ``adapter_model.safetensors`` as ``medusa_head.{k}.linear.{weight,bias}``, the draft
vocabulary (every token of the trunk's training answers) as ``medusa_head.vocab`` (the
heads are trained, and draft, among those ids: see ``runtime/adapters/draft_heads.py``), and
``medusa_num_heads`` / ``medusa_num_layers`` in its ``adapter_config.json``, under
``$RUNTIME_CACHE/adapters/smollm2/<task>-turbo/``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

TOOLS_DIR = Path(__file__).resolve().parent
for folder in (TOOLS_DIR, TOOLS_DIR.parent):  # the tasks beside it; the runtime of this checkout
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

HEADS_FILE = "adapter_model.safetensors"


def train_heads(hidden: np.ndarray, targets: np.ndarray, lm_head: np.ndarray, *, steps: int = 300,
                batch: int = 256, learning_rate: float = 3e-3, seed: int = 0, threads: int = 2,
                future: np.ndarray | None = None, regress_steps: int = 600, vocab: np.ndarray | None = None
                ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Heads ``[(W_k [H, H], b_k [H])]`` trained so that ``lm_head @ (h + SiLU(W_k h + b_k))``
    predicts ``targets[:, k]`` from ``hidden`` ``[N, H]`` (target -1: no token there, not
    counted). ``lm_head`` ``[vocab, H]`` stays frozen.

    With ``future`` ``[N, K, H]`` (the trunk's own hidden state that produced each target),
    ``regress_steps`` cheap steps first pull each head's output towards it (mean squared
    error: no vocabulary product), then ``steps`` steps of cross-entropy over the whole
    vocabulary (each costs K products with the lm_head) finish. With ``vocab`` (token ids)
    the cross-entropy runs over those ids only, as the runtime then drafts."""
    import torch

    from runtime.export.draft_head_training import DraftHeadStack, cross_entropy_loss, regression_loss, restrict

    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    h_all = torch.from_numpy(np.ascontiguousarray(hidden, np.float32))
    lm_head, mapped = restrict(lm_head, targets, vocab)
    t_all = torch.from_numpy(np.ascontiguousarray(mapped, np.int64))
    projection = torch.from_numpy(np.ascontiguousarray(lm_head, np.float32))
    heads = DraftHeadStack(targets.shape[1], hidden.shape[1])
    optimizer = torch.optim.AdamW(heads.parameters(), lr=learning_rate, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    if future is not None:
        f_all = torch.from_numpy(np.ascontiguousarray(future, np.float32))
        for _ in range(regress_steps):
            rows = torch.randint(0, len(h_all), (min(batch * 4, len(h_all)),), generator=generator)
            loss = regression_loss(heads, h_all[rows], t_all[rows], f_all[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    for _ in range(steps):
        rows = torch.randint(0, len(h_all), (min(batch, len(h_all)),), generator=generator)
        loss, _ = cross_entropy_loss(heads, h_all[rows], t_all[rows], projection)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return heads.as_arrays()


# --------------------------------------------------------------------------
# SmolLM2: the trunk's own greedy answers and its hidden states there (self-distillation).
# --------------------------------------------------------------------------


def zero_lora(out_dir: Path, rank: int = 8) -> Path:
    """A rank-``rank`` PEFT adapter on q/k/v/o of SmolLM2 as PEFT initializes one (B = 0:
    the base model's behaviour, the same cost as any rank-8 LoRA on the graph)."""
    from safetensors.numpy import save_file

    layers, width, kv = 30, 576, 192
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(layers):
        for projection, fan_out in (("q", width), ("k", kv), ("v", kv), ("o", width)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{projection}_proj"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, width)) / np.sqrt(width)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = np.zeros((fan_out, rank), np.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / HEADS_FILE))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "k_proj",
              "v_proj", "o_proj"], "bias": "none", "note": "PEFT's initialization (B = 0), not trained"}
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def trunk_answers(model: Any, tokenizer: Any, instructions: list[str], max_new_tokens: int, batch: int = 16
                  ) -> list[tuple[list[int], list[int]]]:
    """``(prompt ids, the trunk's greedy answer ids up to and with its end token)`` per
    instruction, generated in left-padded batches."""
    import torch
    import train_smollm2_adapters as lora_training

    prompts = [lora_training.prompt_ids(tokenizer, text) for text in instructions]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = []
    with torch.inference_mode():
        for start in range(0, len(prompts), batch):
            group = prompts[start:start + batch]
            width = max(map(len, group))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            print(f"generating answers {start + 1}-{start + len(group)} of {len(prompts)}", flush=True)
            generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                       do_sample=False, pad_token_id=pad)
            for prompt, row in zip(group, generated[:, width:].tolist()):
                answer = []
                for token in row:
                    answer.append(token)
                    if token == tokenizer.eos_token_id:
                        break
                out.append((prompt, answer))
    return out


def trunk_states(model: Any, sequences: list[tuple[list[int], list[int]]], count: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Final hidden states (the lm_head's input) where the trunk produced each answer token
    (teacher-forced, one forward per sequence), the tokens each head must draft there, and
    the trunk's hidden state that produced each of those tokens ``[N, K, H]`` (zero past
    the end)."""
    import torch

    from runtime.export.draft_head_training import future_targets

    hidden_rows, target_rows, future_rows = [], [], []
    head = model.get_output_embeddings().weight.detach().numpy()
    with torch.inference_mode():
        for prompt, answer in sequences:
            ids = np.asarray(prompt + answer, np.int64)
            out = model(input_ids=torch.from_numpy(ids)[None], output_hidden_states=True)
            states = out.hidden_states[-1][0].float().numpy()
            if not hidden_rows:  # the last hidden state must be the lm_head's input (after the final norm)
                error = float(np.max(np.abs(states[-1] @ head.T - out.logits[0, -1].float().numpy())))
                if error > 1e-3:
                    raise SystemExit(f"error: hidden_states[-1] is not the lm_head's input (logits off by {error})")
            positions = np.arange(len(prompt) - 1, len(ids) - 1)  # each predicts an answer token
            hidden_rows.append(states[positions])
            target_rows.append(future_targets(ids, positions, count))
            padded = np.concatenate([states, np.zeros((count + 1, states.shape[1]), np.float32)])
            future_rows.append(np.stack([padded[positions + k + 1] for k in range(count)], axis=1))
    return np.concatenate(hidden_rows), np.concatenate(target_rows), np.concatenate(future_rows)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    import smollm2_tasks as tasks

    from runtime.export.draft_head_training import head_top1, write_turbo_adapter

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--task", required=True, choices=sorted(tasks.TASKS))
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400, help="cross-entropy steps (after the regression ones)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--train-items", type=int, default=160)
    parser.add_argument("--test-items", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--out", type=Path, help="the Turbo adapter's directory (default: <task>-turbo beside the LoRA)")
    parser.add_argument("--untrained-lora", action="store_true",
                        help="use PEFT's initialization (B = 0) as the LoRA when the task has no trained one")
    args = parser.parse_args(argv)

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    task = tasks.TASKS[args.task]
    lora_dir = tasks.adapter_dir(args.task)
    if not (lora_dir / HEADS_FILE).is_file():
        if not args.untrained_lora:
            raise SystemExit(f"error: no trained LoRA at {lora_dir}: run tools/train_smollm2_adapters.py train "
                             f"--task {args.task} first, or pass --untrained-lora")
        lora_dir = zero_lora(lora_dir.parent / f"{args.task}-untrained-r8")
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(tasks.hf_model_dir())
    base = AutoModelForCausalLM.from_pretrained(tasks.hf_model_dir(), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(lora_dir)).eval()
    lm_head = base.get_output_embeddings().weight.detach().numpy()
    train, test = tasks.split(task, args.train_items, args.test_items)
    train_seqs = trunk_answers(model, tokenizer, [e.instruction for e in train], args.max_new_tokens)
    test_seqs = trunk_answers(model, tokenizer, [e.instruction for e in test], args.max_new_tokens)
    generated = time.perf_counter()
    print(f"generated the trunk's answers in {generated - started:.0f} s", flush=True)
    train_hidden, train_targets, train_future = trunk_states(model, train_seqs, args.heads)
    test_hidden, test_targets, _ = trunk_states(model, test_seqs, args.heads)
    cached = time.perf_counter()
    print(f"cached {len(train_hidden)} training and {len(test_hidden)} held-out positions in "
          f"{cached - generated:.0f} s", flush=True)
    # The draft vocabulary: every token of the trunk's training answers.
    vocab = np.unique(np.concatenate([np.asarray(answer, np.int64) for _, answer in train_seqs]))
    heads = train_heads(train_hidden, train_targets, lm_head, steps=args.steps, batch=args.batch,
                        future=train_future, vocab=vocab, threads=args.threads)
    trained = time.perf_counter()
    top1 = head_top1(heads, test_hidden, test_targets, lm_head, vocab)
    top1_full = head_top1(heads, test_hidden, test_targets, lm_head)
    record = {
        "task": args.task, "heads": args.heads, "steps": args.steps, "batch": args.batch,
        "train_items": len(train), "test_items": len(test), "train_positions": int(len(train_hidden)),
        "held_out_top1_per_head": [round(x, 4) for x in top1],
        "held_out_top1_per_head_whole_vocabulary": [round(x, 4) for x in top1_full],
        "draft_vocabulary": int(len(vocab)),
        "generate_seconds": round(generated - started, 1), "cache_seconds": round(cached - generated, 1),
        "train_seconds": round(trained - cached, 1), "lora": str(lora_dir),
        "method": "self-distillation: heads trained on the trunk's own greedy answers, hidden states cached, "
                  "LoRA frozen",
    }
    out_dir = args.out or lora_dir.parent / f"{args.task}-turbo"
    write_turbo_adapter(lora_dir, out_dir, heads, record, vocab)
    print(json.dumps(record, indent=2))
    print(f"wrote {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
