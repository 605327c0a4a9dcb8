"""A loaded Hugging Face model -> the litert-torch decoder with the same weights: the
registry of families (one module each), which :mod:`~runtime.export.families.common`
serves with what they share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from runtime.errors import UnimplementedError
from runtime.export.families import gemma3, llama, qwen2, qwen3
from runtime.export.litert import model_builder
from runtime.export.source import supported_architectures

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


def blueprint(decoder: nn.Module) -> tuple[Callable[..., nn.Module], tuple[Any, ...], dict[str, Any]]:
    """``(factory, args, kwargs)`` that construct a decoder shaped like ``decoder`` (a
    builder's result), all picklable: another process rebuilds it from them and loads
    ``decoder.state_dict()`` into it (litert-torch's layers hold lambdas, which do not
    pickle, so the module itself cannot be sent)."""
    if isinstance(decoder, gemma3.Gemma3Decoder):
        return gemma3.Gemma3Decoder, (decoder.config, decoder.layer_types, decoder.rope_tables), {}
    if type(decoder) is model_builder.DecoderOnlyModel:
        return model_builder.DecoderOnlyModel, (decoder.config,), {"mask_cache_size": decoder.config.max_seq_len}
    raise UnimplementedError(f"{type(decoder).__name__}: no blueprint to rebuild it in a worker process")
