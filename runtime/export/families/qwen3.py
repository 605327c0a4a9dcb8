"""Qwen3: the standard decoder with q and k RMS-normalized per head before RoPE."""

from __future__ import annotations

from typing import Any

from torch import nn

from runtime.export.families.common import build_decoder_only


def build_decoder(hf_model: Any, kv_length: int) -> nn.Module:
    """The decoder of a transformers ``Qwen3ForCausalLM`` (float32), weights loaded."""
    bias = bool(getattr(hf_model.config, "attention_bias", False))
    return build_decoder_only(hf_model, kv_length, qk_norm=True, qkv_bias=bias, output_bias=False)
