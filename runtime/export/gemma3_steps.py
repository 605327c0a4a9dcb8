"""Gemma 3's batched, windowed and all-linear signatures.

The steps of :mod:`runtime.export.batch_decode` and :mod:`runtime.export.mlp_lora` walk
litert-torch's standard blocks; Gemma 3's decoder (:mod:`runtime.export.families.gemma3`)
differs around them, and these steps do what it does:

- the attention output passes the post-attention norm before the residual add, and the
  feed-forward carries its own pre and post norms (so the residual takes ``x``, not a
  normed ``x``);
- sliding-window layers and global layers have their own RoPE table and their own mask:
  a sliding layer also masks the positions ``sliding_window`` or more behind each row's
  query. An attention window W (``decode_attend{W}``) narrows every layer's span to the
  cache's first W positions; a sliding layer's rule applies inside it unchanged (with W <=
  sliding_window, as at Gemma 3 270M's 512, nothing inside the window is too old);
- the token embedding is scaled by sqrt(hidden) and the lm_head is the embedding.

The signatures have the inputs and outputs of the other families' (the same names, a
row's KV cache being the single-session name with ``_{row}`` appended), so the runtime drives a
Gemma 3 export as it drives a Llama one. Each row of a batch computes exactly what the
single-session step computes for it: its own token, position, KV cache and LoRA inputs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from runtime.export.batch_decode import BatchDecode
from runtime.export.families.gemma3 import Gemma3Decoder
from runtime.export.litert import kv_utils, lora_utils
from runtime.export.mlp_lora import ATTENTION_PROJECTIONS, AllLinearStep, deltas, feed_forward, lora_key


def is_gemma3(model: nn.Module) -> bool:
    """Whether ``model`` is Gemma 3's own decoder (whose steps this module writes)."""
    return isinstance(model, Gemma3Decoder)


class Gemma3BatchDecode(BatchDecode):
    """``decode_batch{batch}[_attend{window}]`` of Gemma 3's decoder (with one row, the
    single session's ``decode_attend{window}``, or with ``length`` T its T-token step): the
    shared projections run once over the rows, each row attends over its own cache with its
    own masks and adds its own LoRA (on gate/up/down too with ``mlp``). Same constructor as
    :class:`BatchDecode`."""

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, kv_cache: dict[str, torch.Tensor],
                lora: dict[str, torch.Tensor] | None = None) -> dict[str, object]:
        model, batch, length = self.model, self.batch, self.length
        x = model.tok_embedding(tokens) * model.config.embedding_scale  # [B, T, D]
        span = self._span(kv_cache)
        masks = {}  # per attention type, each row's [1, 1, T, span], sliced once for all layers
        for kind, mask in model.masks(input_pos, span).items():
            rows = mask.reshape(batch, 1, length, span)
            masks[kind] = [rows[row:row + 1] for row in range(batch)]
        ropes = {kind: (cos.reshape(batch, 1, length, -1), sin.reshape(batch, 1, length, -1))  # [B, heads, T, n/2]
                 for kind, (cos, sin) in model.ropes(input_pos).items()}
        updated: dict[str, torch.Tensor] = {}
        for layer, (kind, block) in enumerate(zip(model.layer_types, model.transformer_blocks)):
            attended = self._attention(block.atten_func, layer, block.pre_atten_norm(x), ropes[kind], masks[kind],
                                       input_pos, kv_cache, lora, updated)
            x = x + block.post_atten_norm(attended)
            x = x + self._feed_forward(block.ff, x, lora, layer)
        if not self.logits:
            return {"kv_cache": updated}
        return {"logits": model.lm_head(model.final_norm(x)), "kv_cache": updated}


class Gemma3AllLinearStep(AllLinearStep):
    """A prefill or decode step of one session of Gemma 3's decoder with LoRA of rank
    ``lora_rank`` on every linear projection (q/k/v/o and gate/up/down). Same
    constructor and ``lora`` inputs as :class:`AllLinearStep`."""

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, kv_cache: kv_utils.KVCache,
                lora: dict[str, torch.Tensor]) -> dict[str, object]:
        model = self.model

        def attention_lora(layer: int) -> lora_utils.LoRAEntry:
            return lora_utils.LoRAEntry(attention=lora_utils.AttentionLoRA(**{
                long: lora_utils.LoRAWeight(a_prime=lora[lora_key(layer, short, "a_prime")],
                                            b_prime=lora[lora_key(layer, short, "b_prime")])
                for short, long in ATTENTION_PROJECTIONS.items()}))

        def mlp(layer: int) -> functools.partial[torch.Tensor]:
            return functools.partial(feed_forward, model.transformer_blocks[layer].ff, delta=deltas(lora, layer))

        logits = torch.numel(input_pos) == 1 or self.export_config.output_logits_on_prefill
        return model.run(tokens, input_pos, kv_cache, attention_lora, mlp, logits=logits)


def batch_decode_step(model: nn.Module, *args: Any, **kwargs: Any) -> BatchDecode:
    """The batched (or windowed) decode step of ``model``: Gemma 3's for its decoder, else
    :class:`BatchDecode` (the standard decoder's); the arguments are :class:`BatchDecode`'s."""
    step = Gemma3BatchDecode if is_gemma3(model) else BatchDecode
    return step(model, *args, **kwargs)


def all_linear_step(model: nn.Module, *args: Any, **kwargs: Any) -> AllLinearStep:
    """The all-linear prefill/decode step of ``model``: Gemma 3's for its decoder, else
    :class:`AllLinearStep` (the standard decoder's); the arguments are :class:`AllLinearStep`'s."""
    step = Gemma3AllLinearStep if is_gemma3(model) else AllLinearStep
    return step(model, *args, **kwargs)
