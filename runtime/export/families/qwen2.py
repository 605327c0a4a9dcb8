"""Qwen2 / Qwen2.5: the standard decoder with biases on q/k/v (none on the output projection)."""

from __future__ import annotations

from typing import Any

from torch import nn

from runtime.export.families.common import build_decoder_only


def build_decoder(hf_model: Any, kv_length: int) -> nn.Module:
    """The decoder of a transformers ``Qwen2ForCausalLM`` (float32), weights loaded."""
    return build_decoder_only(hf_model, kv_length, qk_norm=False, qkv_bias=True, output_bias=False)
