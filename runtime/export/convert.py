"""A litert-torch decoder -> a ``.tflite`` file with every signature of the export."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from runtime.errors import InvalidArgumentError
from runtime.export.litert import converter as litert_converter
from runtime.export.litert import litert_torch
from runtime.export.settings import ExportSettings
from runtime.export.signatures import SIGNATURE_SETS, SignatureSet


def convert(
    model: nn.Module,
    settings: ExportSettings,
    out_path: str | os.PathLike[str],
    signature_sets: Sequence[SignatureSet] = SIGNATURE_SETS,
) -> None:
    """Traces ``model`` once per signature of ``signature_sets``, lowers, quantizes as
    ``settings.quantize`` says and writes the flatbuffer to ``out_path``."""
    litert_torch.config.show_progress = False  # the export command shows its own
    torch._dynamo.config.cache_size_limit = 64  # one graph per signature; as litert-torch sets it
    converter = litert_torch.Converter()
    for signature_set in signature_sets:
        for signature in signature_set(model, settings):
            converter.add_signature(signature.name, signature.module, sample_kwargs=dict(signature.sample_kwargs))
    recipe = litert_converter.get_quant_recipe_from_flag(settings.litert_quantize, model.config)
    try:
        converted = converter.convert(quant_config=recipe)
    except ValueError as exc:  # the quantizer's word when a weight does not split into its blocks
        if "block size" not in str(exc):
            raise
        reason = " ".join(str(exc).split()).rsplit("Error: ", 1)[-1]
    else:
        converted.export(str(out_path))
        return
    raise InvalidArgumentError(f"quantize={settings.quantize!r} does not fit this model: {reason}")
