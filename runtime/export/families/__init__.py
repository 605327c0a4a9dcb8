"""A loaded Hugging Face model -> the litert-torch decoder with the same weights: the
registry of families (one module each), which :mod:`~runtime.export.families.common`
serves with what they share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from runtime.errors import UnimplementedError
from runtime.export.families import gemma3, llama, qwen2, qwen3
from runtime.export.source import FAMILIES, supported_architectures

# Hugging Face model_type -> its builder: (transformers model in float32, KV length) -> decoder.
BUILDERS: dict[str, Callable[[Any, int], nn.Module]] = {
    "llama": llama.build_decoder,
    "qwen2": qwen2.build_decoder,
    "qwen3": qwen3.build_decoder,
    "gemma3_text": gemma3.build_decoder,
}


def build_decoder(hf_model: Any, kv_length: int) -> nn.Module:
    """The litert-torch decoder of ``hf_model`` (a transformers causal LM in float32) with
    its weights copied in, attending over ``kv_length`` positions."""
    model_type = hf_model.config.model_type
    if model_type not in BUILDERS:
        raise UnimplementedError(f"model_type {model_type!r} is not supported; supported: {supported_architectures()}")
    return BUILDERS[model_type](hf_model, kv_length)
