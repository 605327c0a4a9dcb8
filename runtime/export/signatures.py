"""The signatures of an exported model, as data: a name, the module traced, sample inputs.

The exporter traces every :class:`Signature` of :data:`SIGNATURE_SETS`
(:func:`runtime.export.lowering.signatures_of`), so a new kind of signature is one more
function of the :data:`SignatureSet` shape added there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from runtime.export.batch_decode import BatchDecode
from runtime.export.litert import converter as litert_converter
from runtime.export.litert import kv_utils, lora_utils
from runtime.export.settings import ExportSettings
from runtime.util.signature_names import SignatureName

_KV_LAYOUTS = {"default": kv_utils.KV_LAYOUT_DEFAULT, "transposed": kv_utils.KV_LAYOUT_TRANSPOSED}


@dataclass(frozen=True)
class Signature:
    """One signature: ``module`` is traced with ``sample_kwargs`` under ``name``."""

    name: str
    module: nn.Module
    sample_kwargs: Mapping[str, Any]


# A decoder and the settings -> the signatures it contributes.
SignatureSet = Callable[[nn.Module, ExportSettings], list[Signature]]


def decoder_signatures(model: nn.Module, settings: ExportSettings) -> list[Signature]:
    """``prefill_{L}`` per prefill length and ``decode``; with each LoRA rank slot R also
    ``prefill_{L}_lora_r{R}`` and ``decode_lora_r{R}`` (named by
    :mod:`runtime.util.signature_names`)."""
    layout = _KV_LAYOUTS[settings.kv_layout]
    export_config = litert_converter.ExportConfig(
        output_logits_on_prefill=settings.prefill_logits, kvcache_layout=layout
    )
    module = litert_converter.ExportableModule(model, export_config=export_config).eval()
    kv_cache = kv_utils.KVCache.from_model_config(settings.kv_length, model.config, kv_layout=layout)
    slots: list[tuple[int | None, lora_utils.LoRA | None]] = [(None, None)]
    slots += [(rank, lora_utils.LoRA.zeros(rank, model.config)) for rank in sorted(settings.lora_ranks)]
    signatures = []
    for rank, lora in slots:
        extra = {} if lora is None else {"lora": lora}
        for length in sorted(settings.prefill_lengths):
            signatures.append(Signature(str(SignatureName("prefill", length, lora_rank=rank)), module, {
                "tokens": torch.zeros((1, length), dtype=torch.int32),
                "input_pos": torch.arange(length, dtype=torch.int32),
                "kv_cache": kv_cache,
                **extra,
            }))
        signatures.append(Signature(str(SignatureName("decode", lora_rank=rank)), module, {
            "tokens": torch.zeros((1, 1), dtype=torch.int32),
            "input_pos": torch.zeros((1,), dtype=torch.int32),
            "kv_cache": kv_cache,
            **extra,
        }))
    return signatures


def batch_decode_signatures(model: nn.Module, settings: ExportSettings) -> list[Signature]:
    """``decode_batch{B}_lora_r{R}`` for each batch size B and batch rank slot R
    (``decode_batch{B}`` without LoRA slots), and for each attention window W
    ``decode_attend{W}[_lora_r{R}]`` for every slot and ``decode_batch{B}_attend{W}...``:
    see :mod:`runtime.export.batch_decode`."""
    layout = _KV_LAYOUTS[settings.kv_layout]
    signatures = []
    for window in sorted(settings.attention_windows):
        for rank in (None, *sorted(settings.lora_ranks)):
            module = BatchDecode(model, 1, rank, layout, window).eval()
            signatures.append(Signature(str(SignatureName("decode", window=window, lora_rank=rank)), module,
                                        module.sample_kwargs(settings.kv_length)))
    for batch in sorted(settings.batch_sizes):
        for window in (None, *sorted(settings.attention_windows)):
            for rank in settings.batch_ranks or (None,):
                module = BatchDecode(model, batch, rank, layout, window).eval()
                name = SignatureName("decode", rows=batch, window=window, lora_rank=rank)
                signatures.append(Signature(str(name), module, module.sample_kwargs(settings.kv_length)))
    return signatures


SIGNATURE_SETS: tuple[SignatureSet, ...] = (decoder_signatures, batch_decode_signatures)
