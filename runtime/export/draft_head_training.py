"""Medusa-1 draft heads as torch trains them, and the PEFT directory that carries them.

Head k maps the final hidden state ``h`` (the lm_head's input) to ``h + SiLU(W_k h + b_k)``;
the base lm_head (frozen) then gives its logits for the token k+2 positions ahead (head 0
drafts the token after the trunk's own next one). ``W_k`` and ``b_k`` start at zero: each
head starts as the trunk's own next-token guess. Two losses train them:

* regression (cheap, no vocabulary product): each head's output is pulled towards the
  trunk's own hidden state that produced its target token;
* cross-entropy over the draft vocabulary (the lm_head rows of the tokens the heads may
  draft, as the runtime then drafts: ``runtime/adapters/draft_heads.py``).

The layout written is the one the runtime reads: ``medusa_head.{k}.linear.{weight,bias}``
and ``medusa_head.vocab`` in the LoRA's ``adapter_model.safetensors``, and
``medusa_num_heads`` / ``medusa_num_layers`` in its ``adapter_config.json``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


class DraftHeadStack(torch.nn.Module):
    """K residual blocks of width H side by side (one per head), zero-initialised."""

    def __init__(self, count: int, width: int) -> None:
        """``count`` heads on hidden states of ``width``."""
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(count, width, width))
        self.bias = torch.nn.Parameter(torch.zeros(count, width))

    @property
    def count(self) -> int:
        """K: how many heads."""
        return self.weight.shape[0]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[N, H]`` -> every head's output ``[N, K, H]``."""
        z = torch.einsum("kij,nj->nki", self.weight, hidden) + self.bias
        return hidden[:, None, :] + torch.nn.functional.silu(z)

    def as_arrays(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """``[(W_k [H, H], b_k [H])]`` as float32 arrays."""
        weight, bias = self.weight.detach().numpy(), self.bias.detach().numpy()
        return [(weight[k].copy(), bias[k].copy()) for k in range(self.count)]


def regression_loss(heads: DraftHeadStack, hidden: torch.Tensor, targets: torch.Tensor,
                    future: torch.Tensor) -> torch.Tensor:
    """Mean squared distance of each head's output to ``future`` ``[N, K, H]`` (the trunk's
    hidden state that produced the head's target), over rows with a target (``targets``
    ``[N, K]``, -1 for none), summed over heads."""
    keep = (targets >= 0).float()
    distance = ((heads(hidden) - future) ** 2).sum(-1)
    return ((distance * keep).sum(0) / keep.sum(0).clamp(min=1)).sum()


def cross_entropy_loss(heads: DraftHeadStack, hidden: torch.Tensor, targets: torch.Tensor,
                       projection: torch.Tensor, weights: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, list[float]]:
    """Cross-entropy of each head's logits (its output through ``projection`` ``[V, H]``)
    against ``targets`` ``[N, K]`` (indices into ``projection``'s rows, -1 for none), summed
    over heads (each weighted by ``weights`` ``[K]`` if given), and each head's top-1 on the
    rows with a target."""
    outputs = heads(hidden)
    loss = hidden.new_zeros(())
    top1 = []
    for k in range(heads.count):
        keep = targets[:, k] >= 0
        if not bool(keep.any()):
            top1.append(0.0)
            continue
        logits = outputs[keep, k] @ projection.T
        term = torch.nn.functional.cross_entropy(logits, targets[keep, k])
        loss = loss + (term if weights is None else weights[k] * term)
        top1.append(float((logits.argmax(-1) == targets[keep, k]).float().mean()))
    return loss, top1


def restrict(lm_head: np.ndarray, targets: np.ndarray, vocab: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The lm_head rows of ``vocab`` and ``targets`` as indices into it (-1 where a target
    is not in ``vocab`` or absent); unchanged without ``vocab``."""
    if vocab is None:
        return lm_head, targets
    index = np.full(max(int(vocab.max()), int(targets.max(initial=0))) + 1, -1, np.int64)
    index[vocab] = np.arange(len(vocab))
    mapped = np.where(targets >= 0, index[np.clip(targets, 0, None)], -1)
    return np.ascontiguousarray(lm_head[vocab]), mapped


def head_top1(heads: list[tuple[np.ndarray, np.ndarray]], hidden: np.ndarray, targets: np.ndarray,
              lm_head: np.ndarray, vocab: np.ndarray | None = None) -> list[float]:
    """Per head, the fraction of positions (with a target) where its argmax (among
    ``vocab``, as the runtime drafts) is the target; a target outside ``vocab`` is a miss."""
    projection, mapped = restrict(lm_head, targets, vocab)
    scores = []
    for k, (weight, bias) in enumerate(heads):
        keep = targets[:, k] >= 0
        z = hidden[keep] @ weight.T + bias
        rows = hidden[keep] + z / (1.0 + np.exp(-z))
        predicted = np.concatenate([np.argmax(rows[i:i + 512] @ projection.T, axis=-1)
                                    for i in range(0, len(rows), 512)] or [np.zeros(0, np.int64)])
        scores.append(float(np.mean(predicted == mapped[keep, k])) if keep.any() else 0.0)
    return scores


def future_targets(tokens: np.ndarray, positions: np.ndarray, count: int) -> np.ndarray:
    """For each position i of ``positions`` (whose hidden state predicts ``tokens[i+1]``),
    the tokens head k must draft: ``tokens[i + k + 2]`` (-1 past the end)."""
    out = np.full((len(positions), count), -1, np.int64)
    for k in range(count):
        ahead = positions + k + 2
        inside = ahead < len(tokens)
        out[inside, k] = tokens[ahead[inside]]
    return out


def write_turbo_adapter(lora_dir: Path, out_dir: Path, heads: list[tuple[np.ndarray, np.ndarray]],
                        record: dict[str, Any] | None = None, vocab: np.ndarray | None = None) -> None:
    """Writes ``lora_dir``'s PEFT adapter with ``heads`` (and the draft vocabulary
    ``medusa_head.vocab``, if given) added, as ``out_dir``; ``record`` as its
    ``training.json``. Each file is written whole or not at all, ``adapter_config.json``
    last: an interrupted write leaves no directory that reads as an adapter."""
    from safetensors.numpy import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {key: value for key, value in load_file(str(lora_dir / WEIGHTS_FILE)).items()
               if "medusa_head." not in key}
    for k, (weight, bias) in enumerate(heads):
        tensors[f"medusa_head.{k}.linear.weight"] = np.ascontiguousarray(weight, np.float32)
        tensors[f"medusa_head.{k}.linear.bias"] = np.ascontiguousarray(bias, np.float32)
    if vocab is not None:
        tensors["medusa_head.vocab"] = np.ascontiguousarray(vocab, np.int32)
    _write_whole(out_dir / WEIGHTS_FILE, lambda path: save_file(tensors, str(path)))
    config = json.loads((lora_dir / CONFIG_FILE).read_text())
    config.update(medusa_num_heads=len(heads), medusa_num_layers=1)
    if record is not None:
        text = json.dumps(record, indent=2) + "\n"
        _write_whole(out_dir / "training.json", lambda path: path.write_text(text))
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    _write_whole(out_dir / CONFIG_FILE, lambda path: path.write_text(text))


def _write_whole(target: Path, write: Callable[[Path], object]) -> None:
    """``write(temporary)`` beside ``target``, then renamed to it; the temporary is removed
    whatever happens, so an interrupted write leaves neither file half-written."""
    temporary = target.with_name(f".{target.name}.tmp")
    try:
        write(temporary)
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
