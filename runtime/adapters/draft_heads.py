"""Draft heads carried by an adapter (Turbo LoRA / Medusa): reading them, running them.

An adapter's safetensors may hold, beside its LoRA tensors, K draft heads. Head k maps
the final hidden state ``h`` (the lm_head's input, after the final norm) through residual
blocks ``h <- h + SiLU(W h + b)`` and then an output projection to logits for the token
k+2 positions ahead (head 0 drafts the token after the trunk's own next one). Layouts read:

* Medusa / Predibase: ``medusa_head.{k}.linear.weight`` ``[hidden, hidden]`` and
  ``.bias`` ``[hidden]``, one block per head, the base model's own lm_head after it;
* LoRAX's multi-layer layout: ``medusa_head.{k}.{j}.linear.{weight,bias}`` for blocks
  ``j = 0 .. medusa_num_layers-1`` (``medusa_num_layers`` in ``adapter_config.json``, or
  in a ``config.json`` beside it, checked against the keys), and where present a per-head
  output projection ``medusa_head.{k}.{medusa_num_layers}.weight`` ``[vocab, hidden]``
  used instead of the base lm_head.

Keys may carry a prefix (``base_model.model.``): everything from ``medusa_head.`` on is
read. Every head must have the same blocks; the first malformed tensor is named.

This runtime's extension: an optional ``medusa_head.vocab`` ``[V]`` of token ids (the
tokens the heads were trained to draft, as ``tools/train_turbo_lora.py`` writes it). The
heads that use the base lm_head then draft among those ids only: their projection is
``[K, hidden] x [hidden, V]`` instead of the whole vocabulary (SmolLM2: 49,152 rows, a
pass over 113 MB of f32 weights per step). Drafts are only proposals, so the output stays
the trunk's own either way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime.errors import FailedPreconditionError, InvalidArgumentError

VOCAB_KEY = "medusa_head.vocab"
_KEY = re.compile(
    r"(?:.*\.)?medusa_head\.(?P<head>0|[1-9][0-9]*)\."
    r"(?:(?P<block>0|[1-9][0-9]*)\.)?(?:linear\.(?P<part>weight|bias)|(?P<out>weight))"
)
CONFIG_KEYS = ("medusa_num_layers", "medusa_num_heads")


def is_draft_head_key(key: str) -> bool:
    """Whether a safetensors key belongs to a draft head (not to the LoRA)."""
    return "medusa_head." in key


@dataclass(frozen=True)
class DraftHead:
    """One head: residual blocks ``(W [hidden, hidden], b [hidden])`` applied in order,
    then ``out`` ``[vocab, hidden]`` (``None``: the base model's lm_head)."""

    blocks: tuple[tuple[np.ndarray, np.ndarray], ...]
    out: np.ndarray | None = None


@dataclass(frozen=True)
class DraftHeads:
    """An adapter's K draft heads, all of width ``width`` (the model's hidden size)."""

    heads: tuple[DraftHead, ...]
    width: int
    vocab: np.ndarray | None = None  # token ids the shared-lm_head heads draft among (None: all)

    @property
    def count(self) -> int:
        """K: how many tokens past the trunk's next one the heads draft."""
        return len(self.heads)

    @property
    def nbytes(self) -> int:
        """Bytes of every head's weights (they count in the adapter's bytes)."""
        return sum(w.nbytes + b.nbytes for head in self.heads for w, b in head.blocks) + sum(
            head.out.nbytes for head in self.heads if head.out is not None) + (
            self.vocab.nbytes if self.vocab is not None else 0)

    def hidden_states(self, hidden: np.ndarray) -> np.ndarray:
        """Each head's blocks applied to one final hidden state ``[width]``: ``[K, width]``."""
        rows = np.empty((self.count, self.width), np.float32)
        for k, head in enumerate(self.heads):
            h = hidden
            for weight, bias in head.blocks:
                # einsum, not BLAS: these products are small, and a multi-threaded BLAS waits for
                # its threads on a busy machine (measured: 66 ms for what takes 1 ms on one).
                z = np.einsum("ij,j->i", weight, h) + bias
                h = h + z / (1.0 + np.exp(-z))  # h + SiLU(W h + b)
            rows[k] = h
        return rows

    def draft(self, hidden: np.ndarray, lm_head: Callable[[np.ndarray], np.ndarray]) -> list[int]:
        """The K draft tokens from one final hidden state: each head's argmax, through its
        own output projection or ``lm_head`` (``[K, width]`` -> ``[K, V]``, all heads
        without one in a single product; V: the ids of :attr:`vocab` in that order, or the
        whole vocabulary)."""
        rows = self.hidden_states(np.asarray(hidden, np.float32))
        own = [k for k, head in enumerate(self.heads) if head.out is not None]
        shared = [k for k, head in enumerate(self.heads) if head.out is None]
        drafts = [0] * self.count
        if shared:
            best = np.argmax(lm_head(rows[shared]), axis=-1)
            for k, token in zip(shared, best if self.vocab is None else self.vocab[best]):
                drafts[k] = int(token)
        for k in own:
            drafts[k] = int(np.argmax(np.einsum("vj,j->v", self.heads[k].out, rows[k])))
        return drafts


def read_draft_heads(shapes: Mapping[str, tuple[int, ...]], load: Callable[[str], np.ndarray],
                     config: Mapping[str, Any], source: str) -> DraftHeads | None:
    """The draft heads among the tensors ``shapes`` (``load`` reads one), or ``None`` when
    there are none. ``config``: the adapter's config (``medusa_num_layers`` if given)."""
    keys = [key for key in shapes if is_draft_head_key(key) and key != VOCAB_KEY]
    if not keys:
        return None
    vocab = None
    if VOCAB_KEY in shapes:
        vocab = np.asarray(load(VOCAB_KEY))
        if (vocab.ndim != 1 or vocab.dtype.kind not in "iu" or not vocab.size or vocab.min() < 0
                or vocab.max() > np.iinfo(np.int64).max):  # (uint64 ids past it would turn negative below)
            raise InvalidArgumentError(f"{source}: {VOCAB_KEY!r} is {list(vocab.shape)} {vocab.dtype}, expected "
                                       "[V] non-negative integer token ids")
        vocab = vocab.astype(np.int64)
    parts: dict[int, dict[tuple[int, str], str]] = {}
    for key in keys:
        match = _KEY.fullmatch(key)
        if match is None:
            raise InvalidArgumentError(f"{source}: draft-head tensor {key!r} is not medusa_head.{{k}}.linear.weight/"
                                       "bias, medusa_head.{k}.{j}.linear.weight/bias or medusa_head.{k}.{j}.weight")
        block = int(match["block"]) if match["block"] is not None else 0
        part = match["part"] or "out"
        if part == "out" and match["block"] is None:
            raise InvalidArgumentError(f"{source}: draft-head tensor {key!r}: an output projection is "
                                       "medusa_head.{k}.{j}.weight with j = medusa_num_layers")
        parts.setdefault(int(match["head"]), {})[(block, part)] = key
    count = len(parts)
    if sorted(parts) != list(range(count)):
        raise InvalidArgumentError(f"{source}: draft heads {sorted(parts)} are not numbered 0 .. {count - 1}")
    layers = _num_layers(parts[0], config, source)
    first = _head(0, parts[0], layers, shapes, load, source)
    width = first.blocks[0][0].shape[0]
    heads = [first, *(_head(k, parts[k], layers, shapes, load, source, width) for k in range(1, count))]
    declared = config.get("medusa_num_heads")
    if declared is not None and declared != count:
        raise InvalidArgumentError(f"{source}: medusa_num_heads is {declared!r} but the file holds {count} heads")
    return DraftHeads(tuple(heads), width, vocab)


def read_heads_config(directory: Path) -> dict[str, Any]:
    """The draft heads' settings of a PEFT directory: ``medusa_*`` entries of its
    ``adapter_config.json``, overridden by a ``config.json`` beside it (LoRAX's)."""
    found: dict[str, Any] = {}
    for name in ("adapter_config.json", "config.json"):
        path = directory / name
        if path.is_file():
            try:
                config = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise InvalidArgumentError(f"{path}: not valid JSON: {exc}") from None
            if isinstance(config, Mapping):
                found.update({key: config[key] for key in CONFIG_KEYS if key in config})
    return found


def _num_layers(first: Mapping[tuple[int, str], str], config: Mapping[str, Any], source: str) -> int:
    blocks = sorted({block for block, part in first if part != "out"})
    declared = config.get("medusa_num_layers")
    if declared is not None and (not isinstance(declared, int) or declared != len(blocks)):
        raise InvalidArgumentError(f"{source}: medusa_num_layers is {declared!r} but head 0 has {len(blocks)} "
                                   "residual block(s)")
    return len(blocks)


def _head(k: int, parts: Mapping[tuple[int, str], str], layers: int, shapes: Mapping[str, tuple[int, ...]],
          load: Callable[[str], np.ndarray], source: str, width: int | None = None) -> DraftHead:
    """Head ``k``'s blocks and output projection, every block ``width`` wide (``None``:
    as wide as its first block, for head 0; the others must be as wide as head 0, whose
    width alone is checked against the model's)."""
    expected = {(j, part) for j in range(layers) for part in ("weight", "bias")}
    outs = {key for key in parts if key[1] == "out"}
    missing = sorted(expected - set(parts))
    extra = sorted(set(parts) - expected - outs)
    if missing or extra or not layers or outs - {(layers, "out")}:
        raise InvalidArgumentError(
            f"{source}: draft head {k} has blocks {sorted(b for b, p in parts if p != 'out')} and output "
            f"projection(s) {sorted(b for b, _ in outs)}: expected weight and bias of blocks 0 .. {layers - 1} "
            f"like head 0, and at most one output projection medusa_head.{k}.{layers}.weight")
    blocks = []
    like = f" (hidden = {width}, head 0's)" if width else ""
    for j in range(layers):
        w_key, b_key = parts[(j, "weight")], parts[(j, "bias")]
        w_shape, b_shape = shapes[w_key], shapes[b_key]
        width = width or (w_shape[0] if w_shape else 0)
        if len(w_shape) != 2 or w_shape != (width, width) or b_shape != (width,) or not width:
            raise InvalidArgumentError(f"{source}: draft head {k} block {j}: {w_key!r} is {list(w_shape)} and "
                                       f"{b_key!r} {list(b_shape)}, expected [hidden, hidden] and [hidden]{like}")
        blocks.append((_float32(load(w_key), w_key, source), _float32(load(b_key), b_key, source)))
    out = None
    if outs:
        out_key = parts[(layers, "out")]
        if len(shapes[out_key]) != 2 or shapes[out_key][1] != width:
            raise InvalidArgumentError(f"{source}: draft head {k}'s output projection {out_key!r} is "
                                       f"{list(shapes[out_key])}, expected [vocab, {width}]")
        out = _float32(load(out_key), out_key, source)
    return DraftHead(tuple(blocks), out)


def _float32(array: np.ndarray, key: str, source: str) -> np.ndarray:
    array = np.asarray(array)
    if array.dtype.kind != "f":
        raise InvalidArgumentError(f"{source}: draft-head tensor {key!r} has dtype {array.dtype}, expected floating "
                                   "point")
    if not np.all(np.isfinite(array)):
        raise InvalidArgumentError(f"{source}: draft-head tensor {key!r} holds NaN or Inf")
    return np.ascontiguousarray(array, dtype=np.float32)


def check_heads(heads: DraftHeads, width: int | None, vocab: int, source: str) -> None:
    """Refuses heads a model cannot run, with one error type (``FailedPreconditionError``)
    naming the way out: no verify signatures (``width`` ``None``), a width other than the
    model's hidden size, or an output projection of another vocabulary."""
    alone = "or load the LoRA alone with heads=False (`--no-draft-heads`)"
    if width is None:
        raise FailedPreconditionError(
            f"{source}: the adapter carries {heads.count} draft heads but the model has no verify signatures; "
            f"re-export the model with `python -m runtime export ... --verify-lengths 4`, {alone}")
    if heads.width != width:
        raise FailedPreconditionError(
            f"{source}: the draft heads are {heads.width} wide but the model's hidden size is {width} (heads of "
            f"another model; a model exported with --verify-lengths takes heads of its own width), {alone}")
    if heads.vocab is not None and int(heads.vocab.max()) >= vocab:
        raise FailedPreconditionError(
            f"{source}: {VOCAB_KEY} holds token id {int(heads.vocab.max())}, outside the model's vocabulary of "
            f"{vocab}, {alone}")
    for k, head in enumerate(heads.heads):
        if head.out is not None and head.out.shape[0] != vocab:
            raise FailedPreconditionError(
                f"{source}: draft head {k}'s output projection has {head.out.shape[0]} rows, the model's vocabulary "
                f"{vocab}, {alone}")


def read_adapter_heads(name: str, *, peft_directory: str | None = None, state_dict: Mapping[str, Any] | None = None,
                       peft_config: Mapping[str, Any] | None = None) -> DraftHeads | None:
    """The draft heads of a PEFT adapter: a directory (its ``adapter_model.safetensors``,
    settings from :func:`read_heads_config`) or an in-memory state dict with its config;
    ``None`` when it carries none. Other adapter formats carry no heads."""
    if peft_directory is not None:
        from safetensors import SafetensorError, safe_open

        directory = Path(peft_directory)
        weights = directory / "adapter_model.safetensors"
        try:
            handle = safe_open(str(weights), framework="np")
            shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()
                      if is_draft_head_key(key)}
        except (SafetensorError, OSError, ValueError) as exc:
            raise InvalidArgumentError(f"{weights}: not a readable safetensors file: {exc}") from None
        return read_draft_heads(shapes, handle.get_tensor, read_heads_config(directory), name)
    if state_dict is not None:
        arrays = {str(key): np.asarray(value) for key, value in state_dict.items() if is_draft_head_key(str(key))}
        config = {key: peft_config[key] for key in CONFIG_KEYS if peft_config and key in peft_config}
        return read_draft_heads({k: a.shape for k, a in arrays.items()}, arrays.__getitem__, config, name)
    return None
