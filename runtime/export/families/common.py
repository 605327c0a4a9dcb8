"""What the families share: litert-torch configs built from a checkpoint's own config, RoPE
tables, and the weight mapping, plus the standard decoder-only model (Llama, Qwen2, Qwen3).

Each family's litert-torch ``ModelConfig`` is built from the checkpoint's own config, not
from litert-torch's fixed example configs. The pitfalls (none of them raises; the
logits are simply wrong):

- litert-torch fuses q/k/v into one projection. The interleaved layout (per KV group:
  its q heads, its k, its v) suits Llama and Qwen2; a model with q/k norms normalizes
  per head, so Qwen3 and Gemma 3 use the plain [q; k; v] layout split per head
  (``qkv_fused_interleaved=False, qkv_transpose_before_split=True``).
- Tied embeddings: the lm_head is the embedding, and the checkpoint's ``lm_head.weight``
  (the same tensor) is not mapped.
- RoPE is taken from the loaded model's own rotary embedding (its ``inv_freq`` and
  attention scaling), so default, linear, Llama 3 and YaRN scaling all come out as
  transformers computes them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch
from torch import nn

from runtime.errors import UnimplementedError
from runtime.export.layout import LENGTH_DEPENDENT_ROPE
from runtime.export.litert import cfg, model_builder
from runtime.export.litert import loader as loading

# runtime.export.layout.ACTIVATIONS names these keys for the check before loading.
_ACTIVATIONS = {
    "silu": cfg.ActivationType.SILU,
    "gelu_pytorch_tanh": cfg.ActivationType.GELU_TANH,
}


def build_decoder_only(hf_model: Any, kv_length: int, *, qk_norm: bool, qkv_bias: bool,
                       output_bias: bool) -> nn.Module:
    """litert-torch's standard decoder (``DecoderOnlyModel``) for a Llama-shaped
    ``hf_model`` (float32) with its weights copied in, attending over ``kv_length``
    positions: ``qk_norm`` normalizes q and k per head (Qwen3), the biases are those of
    the q/k/v and output projections."""
    config = hf_model.config
    refuse_sliding_window(config)
    inv_freq, scaling = rope_table(hf_model.model.rotary_emb)
    norm = rms_norm(config.rms_norm_eps)
    block = cfg.TransformerBlockConfig(
        attn_config=attention_config(config, inv_freq, qk_norm=norm if qk_norm else None, qkv_bias=qkv_bias,
                                     output_bias=output_bias),
        ff_config=gated_feed_forward(config, activation=config.hidden_act,
                                     bias=bool(getattr(config, "mlp_bias", False))),
        pre_attention_norm_config=norm,
        post_attention_norm_config=norm,
    )
    model_config = decoder_config(
        config, kv_length, block, norm,
        lm_head_share_weight_with_embedding=bool(config.tie_word_embeddings),
        build_rope=functools.partial(rope_from_table, inv_freq=inv_freq, scaling=scaling),
    )
    names = dataclasses.replace(
        model_builder.TENSOR_NAMES,
        lm_head=None if config.tie_word_embeddings else "lm_head",
        attn_query_norm="model.layers.{}.self_attn.q_norm" if qk_norm else None,
        attn_key_norm="model.layers.{}.self_attn.k_norm" if qk_norm else None,
    )
    model = model_builder.DecoderOnlyModel(model_config, mask_cache_size=kv_length)
    load_weights(model, hf_model, names)
    return model.eval()


def decoder_config(config: Any, kv_length: int,
                   blocks: cfg.TransformerBlockConfig | list[cfg.TransformerBlockConfig],
                   final_norm: cfg.NormalizationConfig, **extra: Any) -> cfg.ModelConfig:
    """The ``ModelConfig`` of the checkpoint's ``config`` over ``kv_length`` positions: one
    block config for every layer or one per layer; ``extra``: more ModelConfig fields."""
    return cfg.ModelConfig(vocab_size=config.vocab_size, num_layers=config.num_hidden_layers, max_seq_len=kv_length,
                           embedding_dim=config.hidden_size, block_configs=blocks, final_norm_config=final_norm,
                           **extra)


def attention_config(config: Any, inv_freq: torch.Tensor, *, qk_norm: cfg.NormalizationConfig | None,
                     qkv_bias: bool, output_bias: bool, **extra: Any) -> cfg.AttentionConfig:
    """The attention of a block. With ``qk_norm`` (q and k normalized per head) the fused
    projection is laid out [q; k; v] and split per head; without, per KV group (litert-torch's
    interleaved default). ``extra``: more AttentionConfig fields."""
    head_dim = head_dim_of(config)
    per_head = qk_norm is not None
    return cfg.AttentionConfig(
        num_heads=config.num_attention_heads,
        head_dim=head_dim,
        num_query_groups=config.num_key_value_heads,
        rotary_percentage=2 * inv_freq.numel() / head_dim,
        qkv_use_bias=qkv_bias,
        output_proj_use_bias=output_bias,
        qkv_fused_interleaved=not per_head,
        qkv_transpose_before_split=per_head,
        query_norm_config=qk_norm or cfg.NormalizationConfig(),
        key_norm_config=qk_norm or cfg.NormalizationConfig(),
        **extra,
    )


def head_dim_of(config: Any) -> int:
    """The checkpoint's head size (``head_dim`` when given; Qwen3 and Gemma set it apart
    from hidden_size / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rms_norm(epsilon: float, zero_centered: bool = False) -> cfg.NormalizationConfig:
    """An RMSNorm config (``zero_centered``: the weight is stored as w - 1, Gemma's way).

    Lowered as plain ops, not as litert-torch's ``odml.rms_norm`` composite: a composite
    is a subgraph of its own, which the interpreter calls once per norm and which cuts
    XNNPACK's partition of the signature in two. SmolLM2-135M had ~60 of them per
    signature, 3,374 subgraphs in all; inlined, the logits are the same bit for bit, an
    open takes ~0.4 s and ~50 MiB less, and decode is 0-10% faster (within the
    benchmark's run-to-run spread)."""
    return cfg.NormalizationConfig(type=cfg.NormalizationType.RMS_NORM, epsilon=epsilon,
                                   zero_centered=zero_centered, enable_hlfb=False)


def gated_feed_forward(config: Any, activation: str, bias: bool = False,
                       norm: cfg.NormalizationConfig | None = None) -> cfg.FeedForwardConfig:
    """The gated MLP ``down(act(gate(x)) * up(x))``, with Gemma's norms around it when given."""
    if activation not in _ACTIVATIONS:
        raise UnimplementedError(
            f"{config.model_type}: activation {activation!r} is not supported (supported: {', '.join(_ACTIVATIONS)})"
        )
    return cfg.FeedForwardConfig(
        type=cfg.FeedForwardType.GATED,
        activation=cfg.ActivationConfig(_ACTIVATIONS[activation]),
        intermediate_size=config.intermediate_size,
        use_bias=bias,
        pre_ff_norm_config=norm or cfg.NormalizationConfig(),
        post_ff_norm_config=norm or cfg.NormalizationConfig(),
    )


def rope_table(rotary_embedding: nn.Module, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` of a transformers rotary embedding (per layer type
    for models that have one table per attention type)."""
    prefix = f"{layer_type}_" if layer_type else ""
    rope_type = rotary_embedding.rope_type
    if isinstance(rope_type, dict):
        rope_type = rope_type[layer_type]
    if rope_type in LENGTH_DEPENDENT_ROPE:
        raise UnimplementedError(f"RoPE type {rope_type!r} depends on the sequence length; it cannot be exported")
    inv_freq = getattr(rotary_embedding, f"{prefix}inv_freq").detach().to(torch.float32).clone()
    return inv_freq, float(getattr(rotary_embedding, f"{prefix}attention_scaling"))


def rope_from_table(
    input_pos: torch.Tensor, n_elem: int | None = None, base: float | None = None, *,
    inv_freq: torch.Tensor, scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """litert-torch's ``build_rope`` contract (cos and sin ``[1, T, n_elem/2]``) computed
    from a fixed ``inv_freq`` table; ``n_elem`` and ``base`` are implied by the table."""
    angles = input_pos.to(torch.float32).unsqueeze(-1) * inv_freq
    cos, sin = torch.cos(angles), torch.sin(angles)
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return cos.unsqueeze(0), sin.unsqueeze(0)


def causal_mask(input_pos: torch.Tensor, span: int) -> torch.Tensor:
    """The additive causal mask ``[T, span]`` of queries at ``input_pos`` over the cache's
    first ``span`` positions: 0 up to each query's position, -inf after. Computed in the graph
    from the positions, where litert-torch's mask is a ``[kv_length, kv_length]`` float32
    constant rows are gathered from (64 MiB in the file at 4,096 positions)."""
    positions = torch.arange(span, dtype=input_pos.dtype)
    return torch.where(positions[None, :] > input_pos[:, None], -math.inf, 0.0)


def load_weights(model: nn.Module, hf_model: Any, names: loading.ModelLoader.TensorNames) -> None:
    """Maps ``hf_model``'s weights onto ``model`` with litert-torch's loader (which fuses
    q/k/v in the layout the config asks for) and checks every tensor found a place."""
    state = dict(hf_model.state_dict())
    tied = model.config.lm_head_share_weight_with_embedding
    if tied:
        state.pop("lm_head.weight", None)
    missing, unexpected = loading.ModelLoader("<transformers model>", names, custom_loader=lambda _: state).load(
        model, strict=False
    )
    missing = [name for name in missing if not (tied and name == "lm_head.weight")]
    if state or missing or unexpected:
        raise UnimplementedError(
            f"{hf_model.config.model_type}: weights do not map onto the litert-torch model "
            f"(unmapped {sorted(state)[:5]}, missing {missing[:5]}, unexpected {unexpected[:5]})"
        )


def refuse_sliding_window(config: Any) -> None:
    """Raises ``UnimplementedError`` when ``config`` has sliding-window layers."""
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if getattr(config, "use_sliding_window", False) or layer_types != {"full_attention"}:
        raise UnimplementedError(
            f"{config.model_type}: sliding-window attention (use_sliding_window / layer_types) is not supported "
            "for this family"
        )
