"""DoRA slots: an all-linear LoRA slot whose projections also take a per-output-channel scale.

PEFT's DoRA (``use_dora``) applies, for a linear layer ``W`` ``[out, in]`` with bias ``b``::

    y = g * (W x) + b + g * (s B A x),   g = m / ||W + s B A||_row

(``m`` the trained magnitude, the row norm taken over ``in``, the bias not scaled). The
runtime folds ``g`` into the adapter's ``b_prime`` when it materializes it (``x a (b g)`` is
``g * (x a b)``), so the graph needs only the base projection's output rescaled:
``y = (W x) * (1 + m') + b + x a b'`` with the input ``m' = g - 1`` ``[out]``
(``lora_atten_q_m_prime_weight_{L}``, ``lora_ff_gate_m_prime_weight_{L}``, ...): zeros leave
the projection plain, as zero ``a``/``b`` inputs do. litert-torch fuses q/k/v into one
projection; their three scales are concatenated in the fused layout and applied once, before
the split (Qwen2's q/k/v biases stay unscaled).

:class:`DoraStep` is a single session's prefill or decode step in such a slot;
:class:`runtime.export.batch_decode.BatchDecode` (``dora=True``) the attention-window steps.
Gemma 3's own decoder has no DoRA slots (:func:`check_dora`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.errors import UnimplementedError
from runtime.export.litert import export_config as export_cfg, kv_utils
from runtime.adapters.lora_util import PROJECTIONS
from runtime.export.mlp_lora import (
    AllLinearStep, Project, check_mlp_lora, deltas, is_standard_decoder, lora_attention, lora_key, lora_shapes,
)

# A projection's output scale less one (``m'``), by our projection name.
Scales = dict[str, torch.Tensor]


def check_dora(model: nn.Module) -> None:
    """Raises ``UnimplementedError`` unless ``model``'s blocks are the standard ones this
    module writes out (Llama, Qwen2, Qwen3), naming the flag."""
    if not is_standard_decoder(model):
        raise UnimplementedError(
            f"--dora-ranks is not available for {type(model).__name__} (Gemma 3's own decoder): DoRA slots are "
            "exported for Llama, Qwen2 and Qwen3")
    check_mlp_lora(model)
    if any(block.atten_func.config.use_alibi for block in model.transformer_blocks):
        raise UnimplementedError("--dora-ranks does not support ALiBi attention")


def scaled_linear(linear: nn.Linear, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``linear(x)`` with ``W x`` scaled per output channel by ``1 + scale``; the bias is not."""
    y = F.linear(x, linear.weight) * (scale + 1.0)
    return y if linear.bias is None else y + linear.bias


def fused_qkv_scale(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The q, k and v scales (``[..., out]`` each, in the checkpoint's channel order) as one
    vector in the order of ``attn``'s fused q/k/v projection: ``[q; k; v]``, or per KV group
    its q heads, its k and its v (litert-torch's interleaved layout)."""
    config = attn.config
    if config.qkv_transpose_before_split:
        return torch.cat((q, k, v), dim=-1)
    groups = config.num_query_groups
    lead = q.shape[:-1]
    parts = [t.reshape(*lead, groups, -1) for t in (q, k, v)]
    return torch.cat(parts, dim=-1).reshape(*lead, -1)


def layer_scales(lora: dict[str, torch.Tensor], layer: int) -> Scales:
    """One layer's ``m'`` inputs of a single session, by projection."""
    return {projection: lora[lora_key(layer, projection, "m_prime")] for projection in PROJECTIONS}


def dora_projector(attn: nn.Module, scales: Scales) -> Project:
    """An attention's base projections rescaled by their ``m'`` inputs (the fused q/k/v by
    the three scales in the fused layout), for :func:`lora_attention`."""
    qkv_scale = fused_qkv_scale(attn, scales["q"], scales["k"], scales["v"])
    return lambda name, linear, inputs: scaled_linear(linear, inputs, qkv_scale if name == "qkv" else scales[name])


class DoraStep(AllLinearStep):
    """A prefill or decode step of one session of ``model`` (litert-torch's
    ``DecoderOnlyModel``) in a DoRA slot of rank ``lora_rank``: LoRA on every linear
    projection and each projection's output scale."""

    def __init__(self, model: nn.Module, lora_rank: int, export_config: export_cfg.ExportConfig) -> None:
        check_dora(model)
        super().__init__(model, lora_rank, export_config)

    def sample_lora(self) -> dict[str, torch.Tensor]:
        """Zero ``lora`` inputs of the right shapes; they also fix the inputs' names."""
        return {key: torch.zeros(shape) for key, shape in lora_shapes(self.model, self.lora_rank, True, True).items()}

    def attention(self, attn: nn.Module, layer: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                  mask: torch.Tensor, input_pos: torch.Tensor, kv_entry: kv_utils.KVCacheEntry,
                  lora: dict[str, torch.Tensor]) -> tuple[torch.Tensor, kv_utils.KVCacheEntry]:
        """The block's attention with its projections rescaled (:func:`dora_projector`)."""
        return lora_attention(attn, x, rope, mask, input_pos, kv_entry, deltas(lora, layer),
                              dora_projector(attn, layer_scales(lora, layer)))

    def projector(self, lora: dict[str, torch.Tensor], layer: int) -> Project:
        """The feed-forward's projections rescaled by their ``m'`` inputs."""
        scales = layer_scales(lora, layer)
        return lambda name, linear, inputs: scaled_linear(linear, inputs, scales[name])
