"""The signatures of an exported model, as data: a name, the module traced, sample inputs.

The exporter traces every :class:`Signature` of :data:`SIGNATURE_SETS`
(:func:`runtime.export.lowering.signatures_of`), so a new kind of signature is one more
function of the :data:`SignatureSet` shape added there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from runtime.errors import UnimplementedError
from runtime.export.dora import DoraStep, check_dora
from runtime.export import grouped_kv
from runtime.export.gemma3_steps import all_linear_step, batch_decode_step
from runtime.export.litert import converter as litert_converter
from runtime.export.litert import kv_utils, lora_utils, model_builder
from runtime.export.mlp_lora import AllLinearStep, CausalMaskStep, check_mlp_lora, is_standard_decoder
from runtime.export.settings import ExportSettings
from runtime.export.verify import VerifyStep
from runtime.util.kv_layout import KV_LAYOUT_DEFAULT, KV_LAYOUT_GROUPED, KV_LAYOUT_TRANSPOSED
from runtime.util.signature_names import ALL_LINEAR, ATTENTION, DORA, SCORE, LoraSlot, SignatureName

_KV_LAYOUTS = {KV_LAYOUT_DEFAULT: kv_utils.KV_LAYOUT_DEFAULT, KV_LAYOUT_TRANSPOSED: kv_utils.KV_LAYOUT_TRANSPOSED,
               KV_LAYOUT_GROUPED: grouped_kv.KV_LAYOUT_GROUPED}


@dataclass(frozen=True)
class Signature:
    """One signature: ``module`` is traced under ``name`` with the sample inputs that
    ``sample_kwargs()`` builds (KV caches and LoRA zeros: built when the signature is
    traced, by the worker that traces it, and dropped after); ``rows`` is its batch size."""

    name: str
    module: nn.Module
    rows: int
    sample_kwargs: Callable[[], Mapping[str, Any]]


# A decoder and the settings -> the signatures it contributes.
SignatureSet = Callable[[nn.Module, ExportSettings], list[Signature]]


def lora_slots(model: nn.Module, settings: ExportSettings, ranks: Sequence[int]) -> list[LoraSlot]:
    """The LoRA slots of ``ranks``: attention-only for each, and all-linear beside it when
    ``settings.lora_targets`` asks for it (by default: when the model's family supports it,
    see :func:`runtime.export.mlp_lora.check_mlp_lora`)."""
    targets = settings.lora_targets
    if targets is None:
        try:
            check_mlp_lora(model)
            targets = ALL_LINEAR
        except UnimplementedError:
            targets = ATTENTION
    elif targets == ALL_LINEAR:
        check_mlp_lora(model)
    slots = [LoraSlot(rank) for rank in sorted(ranks)]
    if targets == ALL_LINEAR:
        slots += [LoraSlot(rank, ALL_LINEAR) for rank in sorted(ranks)]
    return slots


def single_session_slots(model: nn.Module, settings: ExportSettings) -> list[LoraSlot]:
    """The slots of one session's signatures: :func:`lora_slots` of ``settings.lora_ranks``
    and the DoRA slots of ``settings.dora_ranks`` (refused by name for Gemma 3's decoder)."""
    if settings.dora_ranks:
        check_dora(model)
    return lora_slots(model, settings, settings.lora_ranks) + [LoraSlot(rank, DORA)
                                                               for rank in sorted(settings.dora_ranks)]


def session_step(model: nn.Module, slot: LoraSlot | None, export_config: litert_converter.ExportConfig
                 ) -> tuple[nn.Module, Callable[[], dict[str, object]]]:
    """The module one session's prefill/decode/verify steps of ``slot`` trace (``None``: no
    LoRA inputs) and what builds the sample ``lora`` input that fixes its LoRA inputs'
    names and shapes (``{}`` without a slot)."""
    if slot is None:
        return _own_step(model, export_config), dict
    if slot.targets == DORA:
        module = DoraStep(model, slot.rank, export_config).eval()
    elif slot.targets == ALL_LINEAR:
        module = all_linear_step(model, slot.rank, export_config).eval()
    elif is_standard_decoder(model) and not any(block.atten_func.config.use_alibi for block in model.transformer_blocks):
        # litert-torch's own LoRA step costs 6 ops more per layer (mlp_lora.lora_attention)
        module = AllLinearStep(model, slot.rank, export_config, mlp=False).eval()
    else:
        return _own_step(model, export_config), lambda: {"lora": lora_utils.LoRA.zeros(slot.rank, model.config)}
    return module, lambda: {"lora": module.sample_lora()}


def _own_step(model: nn.Module, export_config: litert_converter.ExportConfig) -> nn.Module:
    """The step ``model``'s own forward takes: litert-torch's decoder given its causal mask
    (:class:`CausalMaskStep`), a decoder of this package's (Gemma 3's) as it is."""
    if isinstance(model, model_builder.DecoderOnlyModel):
        return CausalMaskStep(model, export_config).eval()
    return litert_converter.ExportableModule(model, export_config=export_config).eval()


def decoder_signatures(model: nn.Module, settings: ExportSettings) -> list[Signature]:
    """``prefill_{L}`` per prefill length and ``decode``; with each LoRA slot also
    ``prefill_{L}_lora_r{R}`` and ``decode_lora_r{R}`` (and ``..._lora_all_r{R}`` for the
    all-linear slots, ``..._lora_dora_r{R}`` for the DoRA ones; names by
    :mod:`runtime.util.signature_names`)."""
    layout = _KV_LAYOUTS[settings.kv_layout]
    export_config = litert_converter.ExportConfig(
        output_logits_on_prefill=settings.prefill_logits, kvcache_layout=layout
    )
    signatures = []
    for slot in (None, *single_session_slots(model, settings)):
        module, lora = session_step(model, slot, export_config)
        for length in sorted(settings.prefill_lengths):
            signatures.append(Signature(str(SignatureName("prefill", length, lora_slot=slot)), module, 1,
                                        session_inputs(model, settings, length, lora)))
        signatures.append(Signature(str(SignatureName("decode", lora_slot=slot)), module, 1,
                                    session_inputs(model, settings, 1, lora)))
    return signatures


def session_inputs(model: nn.Module, settings: ExportSettings, length: int,
                   lora: Callable[[], dict[str, object]]) -> Callable[[], dict[str, Any]]:
    """What builds one session's sample inputs: ``length`` tokens at positions
    ``0..length-1``, the KV cache and ``lora()``."""
    layout = _KV_LAYOUTS[settings.kv_layout]

    def build() -> dict[str, Any]:
        return {
            "tokens": torch.zeros((1, length), dtype=torch.int32),
            "input_pos": torch.arange(length, dtype=torch.int32),
            "kv_cache": kv_utils.KVCache.from_model_config(settings.kv_length, model.config, kv_layout=layout),
            **lora(),
        }
    return build


def windowed_step(model: nn.Module, settings: ExportSettings, rows: int, window: int | None,
                  slot: LoraSlot | None, length: int = 1, logits: bool = True) -> nn.Module:
    """The module of a batched or windowed step (:mod:`runtime.export.batch_decode`):
    ``rows`` sessions of one token, or one session of ``length`` tokens, for ``slot``."""
    return batch_decode_step(model, rows, slot.rank if slot else None, _KV_LAYOUTS[settings.kv_layout], window,
                             mlp=slot is not None and slot.targets == ALL_LINEAR,
                             dora=slot is not None and slot.targets == DORA, length=length, logits=logits).eval()


def batch_decode_signatures(model: nn.Module, settings: ExportSettings) -> list[Signature]:
    """``decode_batch{B}_lora_r{R}`` for each batch size B and batch rank slot R
    (``decode_batch{B}`` without LoRA slots), and for each attention window W
    ``decode_attend{W}[_lora_r{R}]`` for every slot and ``decode_batch{B}_attend{W}...``;
    all-linear slots likewise; for each prefill window W ``prefill_{L}_attend{W}[_lora_r{R}]``
    for every slot and prefill length L <= W: see :mod:`runtime.export.batch_decode`."""
    signatures = []

    def add(rows: int, window: int | None, slot: LoraSlot | None) -> None:
        module = windowed_step(model, settings, rows, window, slot)
        name = SignatureName("decode", rows=rows, window=window, lora_slot=slot)
        signatures.append(Signature(str(name), module, rows,
                                    functools.partial(module.sample_kwargs, settings.kv_length)))

    for window in sorted(settings.attention_windows):
        for slot in (None, *single_session_slots(model, settings)):
            add(1, window, slot)
    for window in sorted(settings.prefill_windows):
        for slot in (None, *single_session_slots(model, settings)):
            for length in sorted(length for length in settings.prefill_lengths if length <= window):
                module = windowed_step(model, settings, 1, window, slot, length, logits=settings.prefill_logits)
                signatures.append(Signature(str(SignatureName("prefill", length, window=window, lora_slot=slot)),
                                            module, 1, functools.partial(module.sample_kwargs, settings.kv_length)))
    batch_slots = lora_slots(model, settings, settings.batch_ranks) if settings.batch_ranks else [None]
    for batch in sorted(settings.batch_sizes):
        for window in (None, *sorted(settings.attention_windows)):
            for slot in batch_slots:
                add(batch, window, slot)
    return signatures


def verify_signatures(model: nn.Module, settings: ExportSettings) -> list[Signature]:
    """``verify{L}`` and ``verify{L}_lora_r{R}`` (``..._lora_all_r{R}``) for each verify
    length L and LoRA slot: L tokens at L positions, logits and final hidden states at all
    L (see :mod:`runtime.export.verify`); and ``verify{L}_attend{W}...`` for each attention
    window W >= L, so that a verify attends over no more of the cache than a decode step."""
    if not settings.verify_lengths:
        return []
    if not hasattr(model, "final_norm"):
        raise UnimplementedError(f"--verify-lengths is not available for {type(model).__name__}: it has no "
                                 "final_norm whose output the draft heads take")
    layout = _KV_LAYOUTS[settings.kv_layout]
    export_config = litert_converter.ExportConfig(output_logits_on_prefill=True, kvcache_layout=layout)
    signatures = []
    for slot in (None, *lora_slots(model, settings, settings.lora_ranks)):
        step, lora = session_step(model, slot, export_config)
        module = VerifyStep(step, model.final_norm).eval()
        for length in sorted(settings.verify_lengths):
            signatures.append(Signature(str(SignatureName("verify", length, lora_slot=slot)), module, 1,
                                        session_inputs(model, settings, length, lora)))
            for window in sorted(w for w in settings.attention_windows if w >= length):
                windowed = VerifyStep(windowed_step(model, settings, 1, window, slot, length), model.final_norm).eval()
                signatures.append(Signature(str(SignatureName("verify", length, window=window, lora_slot=slot)),
                                            windowed, 1, functools.partial(windowed.step.sample_kwargs,
                                                                           settings.kv_length)))
    return signatures


def score_signatures(model: nn.Module, settings: ExportSettings) -> list[Signature]:
    """``score_{L}`` per score length, with each LoRA slot also ``score_{L}_lora_r{R}``
    (``..._lora_all_r{R}``, ``..._lora_dora_r{R}``): the prefill step of that slot traced
    with ``output_logits_on_prefill``, so that it returns the logits at all L positions
    while the ``prefill_{L}`` signatures (without ``settings.prefill_logits``) compute none."""
    if not settings.score_lengths:
        return []
    export_config = litert_converter.ExportConfig(output_logits_on_prefill=True,
                                                  kvcache_layout=_KV_LAYOUTS[settings.kv_layout])
    signatures = []
    for slot in (None, *single_session_slots(model, settings)):
        module, lora = session_step(model, slot, export_config)
        for length in sorted(settings.score_lengths):
            signatures.append(Signature(str(SignatureName(SCORE, length, lora_slot=slot)), module, 1,
                                        session_inputs(model, settings, length, lora)))
    return signatures


SIGNATURE_SETS: tuple[SignatureSet, ...] = (decoder_signatures, batch_decode_signatures, verify_signatures,
                                            score_signatures)
