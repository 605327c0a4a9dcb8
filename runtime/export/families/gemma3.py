"""Gemma 3 (text) as a litert-torch decoder that takes LoRA.

litert-torch 0.10.0's own Gemma 3 decoder has no ``lora`` argument, so a LoRA export of
it fails. This decoder is built from litert-torch's layers (its attention applies LoRA
to q/k/v/o) and does what Gemma 3 does around them:

- the token embedding is multiplied by sqrt(hidden); the lm_head is the embedding;
- four zero-centered RMSNorms per block: before attention, after attention (before the
  residual add), before and after the MLP (litert-torch's feed-forward holds those two);
- q and k are RMS-normalized per head before RoPE;
- sliding-window layers attend to the last ``sliding_window`` positions, global layers to
  all; each attention type has its own RoPE table;
- attention scores are scaled by ``query_pre_attn_scalar ** -0.5``: litert-torch scales
  by ``head_dim ** -0.5``, so when the two differ the ratio is folded into the q norm's
  weight (the norm comes right before RoPE, both linear in q).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from runtime.errors import UnimplementedError
from runtime.export.families.common import (
    attention_config, causal_mask, decoder_config, gated_feed_forward, head_dim_of, load_weights, rms_norm,
    rope_from_table, rope_table,
)
from runtime.export.litert import attention, builder, cfg, kv_utils, lora_utils
from runtime.export.litert import export_config as export_cfg
from runtime.export.litert import loader as loading

TENSOR_NAMES = loading.ModelLoader.TensorNames(
    ff_up_proj="model.layers.{}.mlp.up_proj",
    ff_down_proj="model.layers.{}.mlp.down_proj",
    ff_gate_proj="model.layers.{}.mlp.gate_proj",
    attn_query_proj="model.layers.{}.self_attn.q_proj",
    attn_key_proj="model.layers.{}.self_attn.k_proj",
    attn_value_proj="model.layers.{}.self_attn.v_proj",
    attn_output_proj="model.layers.{}.self_attn.o_proj",
    attn_query_norm="model.layers.{}.self_attn.q_norm",
    attn_key_norm="model.layers.{}.self_attn.k_norm",
    pre_attn_norm="model.layers.{}.input_layernorm",
    post_attn_norm="model.layers.{}.post_attention_layernorm",
    pre_ff_norm="model.layers.{}.pre_feedforward_layernorm",
    post_ff_norm="model.layers.{}.post_feedforward_layernorm",
    embedding="model.embed_tokens",
    final_norm="model.norm",
    lm_head=None,
)
_SLIDING = "sliding_attention"


class Gemma3Block(attention.TransformerBlock):
    """One Gemma 3 block; the attention output is normalized before the residual add."""

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        input_pos: torch.Tensor,
        kv_cache: kv_utils.KVCacheEntry,
        lora: lora_utils.LoRAEntry | None = None,
        feed_forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, kv_utils.KVCacheEntry]:
        """``x`` -> (block output, updated KV entry); ``lora`` adds to q/k/v/o;
        ``feed_forward`` replaces the block's own (e.g. one with LoRA on gate/up/down)."""
        attended, kv_cache = self.atten_func(self.pre_atten_norm(x), rope, mask, input_pos, kv_cache, lora)
        x = x + self.post_atten_norm(attended)
        return x + (feed_forward or self.ff)(x), kv_cache


class Gemma3Decoder(nn.Module):
    """Gemma 3's text decoder over a KV cache of ``config.max_seq_len`` positions."""

    def __init__(self, config: cfg.ModelConfig, layer_types: list[str],
                 rope_tables: dict[str, tuple[torch.Tensor, float]]) -> None:
        """``layer_types``: each layer's attention type; ``rope_tables``: (inv_freq,
        attention scaling) per attention type."""
        super().__init__()
        self.config = config
        self.tok_embedding = nn.Embedding(config.vocab_size, config.embedding_dim)
        self.lm_head = nn.Linear(config.embedding_dim, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_embedding.weight
        self.transformer_blocks = nn.ModuleList(
            Gemma3Block(config.block_config(i), config) for i in range(config.num_layers)
        )
        self.final_norm = builder.build_norm(config.embedding_dim, config.final_norm_config)
        self.layer_types = layer_types
        self.rope_tables = rope_tables
        self.register_buffer("kv_positions", torch.arange(config.max_seq_len, dtype=torch.int32), persistent=False)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        input_pos: torch.Tensor,
        kv_cache: kv_utils.KVCache,
        lora: lora_utils.LoRA | None = None,
        export_config: export_cfg.ExportConfig | None = None,
    ) -> dict[str, Any]:
        """Runs ``tokens`` at positions ``input_pos``; returns ``logits`` (unless a prefill
        exported without them) and the updated ``kv_cache``."""
        logits = export_config is None or input_pos.numel() == 1 or export_config.output_logits_on_prefill
        return self.run(tokens, input_pos, kv_cache, lambda layer: lora.adapters[layer] if lora is not None else None,
                        lambda layer: None, logits=logits)

    def run(
        self,
        tokens: torch.Tensor,
        input_pos: torch.Tensor,
        kv_cache: kv_utils.KVCache,
        attention_lora: Callable[[int], lora_utils.LoRAEntry | None],
        feed_forward: Callable[[int], Callable[[torch.Tensor], torch.Tensor] | None],
        logits: bool,
    ) -> dict[str, Any]:
        """One session's step: ``attention_lora(layer)`` is that layer's q/k/v/o LoRA (or
        None), ``feed_forward(layer)`` replaces its feed-forward (or None); ``logits``:
        whether to compute them."""
        x = self.tok_embedding(tokens) * self.config.embedding_scale
        masks = {kind: mask[None, None] for kind, mask in self.masks(input_pos, self.config.max_seq_len).items()}
        ropes = self.ropes(input_pos)
        updated = []
        for i, (kind, block) in enumerate(zip(self.layer_types, self.transformer_blocks)):
            x, entry = block(x, ropes[kind], masks[kind], input_pos, kv_cache.caches[i], attention_lora(i),
                             feed_forward(i))
            updated.append(entry)
        kv_cache = kv_utils.KVCache(tuple(updated))
        if not logits:
            return {"kv_cache": kv_cache}
        return {"logits": self.lm_head(self.final_norm(x)), "kv_cache": kv_cache}

    def masks(self, input_pos: torch.Tensor, span: int) -> dict[str, torch.Tensor]:
        """Per attention type, the additive mask ``[T, span]`` of queries at ``input_pos``
        over the cache's first ``span`` positions: causal, and on sliding-window layers
        positions ``sliding_window`` or more behind the query masked too."""
        causal = causal_mask(input_pos, span)
        masks = {}
        for kind in self.rope_tables:
            window = self.config.block_config(self.layer_types.index(kind)).attn_config.sliding_window_size
            if window is None:
                masks[kind] = causal
            else:
                too_old = self.kv_positions[None, :span] <= input_pos[:, None] - window  # [T, span]
                masks[kind] = causal.masked_fill(too_old, -math.inf)
        return masks

    def ropes(self, input_pos: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per attention type, RoPE's (cos, sin) ``[1, T, head_dim / 2]`` at ``input_pos``."""
        return {kind: rope_from_table(input_pos, inv_freq=inv_freq, scaling=scaling)
                for kind, (inv_freq, scaling) in self.rope_tables.items()}


def build_decoder(hf_model: Any, kv_length: int) -> Gemma3Decoder:
    """The decoder of a transformers ``Gemma3ForCausalLM`` (float32), weights loaded."""
    config = hf_model.config
    for field in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(config, field, None) is not None:
            raise UnimplementedError(f"gemma3_text: {field}={getattr(config, field)} is not supported")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnimplementedError("gemma3_text: use_bidirectional_attention=True (an embedding model) is not supported")
    head_dim = head_dim_of(config)
    norm = rms_norm(config.rms_norm_eps, zero_centered=True)
    feed_forward = gated_feed_forward(config, activation=config.hidden_activation, norm=norm)
    tables = {kind: rope_table(hf_model.model.rotary_emb, kind) for kind in sorted(set(config.layer_types))}
    blocks = []
    for kind in config.layer_types:
        blocks.append(cfg.TransformerBlockConfig(
            attn_config=attention_config(
                config, tables[kind][0], qk_norm=norm, qkv_bias=bool(config.attention_bias),
                output_bias=bool(config.attention_bias),
                attn_type=cfg.AttentionType.LOCAL_SLIDING if kind == _SLIDING else cfg.AttentionType.GLOBAL,
                sliding_window_size=config.sliding_window if kind == _SLIDING else None,
            ),
            ff_config=feed_forward,
            pre_attention_norm_config=norm,
            post_attention_norm_config=norm,
        ))
    model_config = decoder_config(config, kv_length, blocks, norm, embedding_scale=config.hidden_size**0.5,
                                  lm_head_share_weight_with_embedding=True)
    model = Gemma3Decoder(model_config, list(config.layer_types), tables)
    load_weights(model, hf_model, TENSOR_NAMES)
    _fold_query_scale(model, head_dim, config.query_pre_attn_scalar)
    return model.eval()


def _fold_query_scale(model: Gemma3Decoder, head_dim: int, query_pre_attn_scalar: float) -> None:
    scale = math.sqrt(head_dim / query_pre_attn_scalar)
    if scale == 1.0:
        return
    with torch.no_grad():
        for block in model.transformer_blocks:
            weight = block.atten_func.query_norm.weight  # zero-centered: the norm multiplies by 1 + weight
            weight.copy_(scale * (1.0 + weight.double()) - 1.0)
