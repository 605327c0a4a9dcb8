"""One lowered MLIR module (every signature, :mod:`runtime.export.lowering`) -> a ``.tflite``:
litert-torch's converter passes, the flatbuffer, and the quantizer run once over it."""

from __future__ import annotations

import os
from typing import Any

from runtime.errors import InvalidArgumentError
from runtime.export.litert import converter as litert_converter
from runtime.export.litert import converter_api_ext, ir, is_generative_recipe, passmanager, translate_recipe
from runtime.export.settings import ExportSettings


def to_tflite_ops(module: ir.Module, context: ir.Context) -> None:
    """Runs litert-torch's conversion passes over ``module`` in place, configured as its
    ``Converter`` configures them for a PyTorch model without PT2E quantization."""
    config = converter_api_ext.ConvertToTFLConfig()
    config.model_origin_framework = "PYTORCH"
    config.unsafe_fuse_dynamic_shaped_broadcast = True
    config.canonicalizing_inf_as_min_max_float = False  # litert-torch clamps infinities before lowering
    if hasattr(config, "enable_x64"):
        config.enable_x64 = False
    with context:
        converter_api_ext.run_convert_to_tfl_passes(module, passmanager.PassManager(), config)


def add_metadata(module: ir.Module, context: ir.Context, entries: dict[str, str]) -> None:
    """Gives the flatbuffer ``entries`` (name -> text) as metadata: the converter writes a
    module's ``tfl.metadata`` dictionary (which the lowering leaves unset) into the model."""
    with context:
        module.operation.attributes["tfl.metadata"] = ir.DictAttr.get(
            {name: ir.StringAttr.get(text) for name, text in entries.items()})


def serialize(module: ir.Module, out_path: str | os.PathLike[str] | None = None) -> bytes | None:
    """Writes ``module``'s flatbuffer to ``out_path``, or returns it when none is given."""
    if out_path is None:
        return converter_api_ext.export_flatbuffer_to_bytes(module.operation)
    converter_api_ext.export_flatbuffer_to_file(module.operation, str(out_path))
    return None


def quantize(flatbuffer: bytes, settings: ExportSettings, model_config: Any) -> bytes:
    """``flatbuffer`` quantized as ``settings.quantize`` says (with ai-edge-quantizer, by
    litert-torch's recipe for ``model_config``, the decoder's ``ModelConfig``)."""
    recipe = litert_converter.get_quant_recipe_from_flag(settings.litert_quantize, model_config)
    if recipe is None:
        return flatbuffer
    if not is_generative_recipe(recipe):
        raise InvalidArgumentError(f"quantize={settings.quantize!r}: litert-torch's recipe is not a generative "
                                   "(ai-edge-quantizer) recipe, which is all this exporter runs")
    try:
        return translate_recipe.quantize_model(flatbuffer,
                                               translate_recipe.translate_to_ai_edge_recipe(recipe.generative_recipe))
    except ValueError as exc:  # the quantizer's word when a weight does not split into its blocks
        if "block size" not in str(exc):
            raise
        reason = " ".join(str(exc).split()).rsplit("Error: ", 1)[-1]
    raise InvalidArgumentError(f"quantize={settings.quantize!r} does not fit this model: {reason}")
