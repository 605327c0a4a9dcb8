"""The litert-torch 0.10.0 modules the export uses, imported after its defects are worked
around (:mod:`runtime.export.litert_torch_fixes`). Import litert-torch from here only.

The exporter runs litert-torch's converter step by step, which needs two of its private
functions; they are named here (:func:`run_graph_passes`, :func:`output_names`), so that
this module alone depends on 0.10.0's internals (the ``export`` extra pins that version);
:func:`quantizer_recipe` builds ai-edge-quantizer's recipe as its converter does."""

from typing import Any

from runtime.errors import InvalidArgumentError
from runtime.export import litert_torch_fixes

litert_torch_fixes.apply()

import litert_torch  # noqa: E402
from litert_torch.generative.custom_ops.bmm_4d import bmm_4d  # noqa: E402
from litert_torch.generative.custom_ops.dynamic_update_slice import dynamic_update_slice  # noqa: E402
from litert_torch.generative.layers import attention, builder  # noqa: E402
from litert_torch.generative.layers import kv_cache as kv_utils  # noqa: E402
from litert_torch.generative.layers import lora as lora_utils  # noqa: E402
from litert_torch.generative.layers import model_config as cfg  # noqa: E402
from litert_torch.generative.layers import rotary_position_embedding, sdpa_with_kv_update  # noqa: E402
from litert_torch.generative.utilities import converter  # noqa: E402
from litert_torch.generative.utilities import export_config  # noqa: E402
from litert_torch.generative.utilities import loader  # noqa: E402
from litert_torch.generative.utilities import model_builder  # noqa: E402
from litert_torch.generative.utilities import types as litert_types  # noqa: E402

# The converter's pieces, which runtime.export.lowering runs one by one.
from litert_torch import fx_infra  # noqa: E402
from litert_torch._convert import core as convert_core  # noqa: E402
from litert_torch._convert import litert_converter  # noqa: E402
from litert_torch._convert import signature as litert_signature  # noqa: E402
from litert_torch.backend import export as backend_export  # noqa: E402
from litert_torch.backend import inline_consts  # noqa: E402
from litert_torch.backend import lowerings  # noqa: E402
from litert_torch.quantize import translate_recipe  # noqa: E402

def run_graph_passes(program: Any) -> Any:
    """litert-torch's FX graph passes over an exported program, as its converter runs them."""
    return convert_core._run_convert_passes(program)


def output_names(program: Any, lowered: Any) -> list[str]:
    """A lowered signature's output names, as litert-torch's converter names them."""
    return litert_converter._get_output_names(program, lowered)


def quantizer_recipe(flag: str, model_config: Any) -> Any | None:
    """ai-edge-quantizer's recipe for litert-torch's quantization ``flag`` (a value of
    :data:`~runtime.export.settings.QUANTIZATIONS`) on a decoder of ``model_config``, as
    litert-torch's converter builds it; None for no quantization. Only a "generative" recipe
    (run through ai-edge-quantizer) is one the exporter applies: any other is refused."""
    recipe = converter.get_quant_recipe_from_flag(flag, model_config)
    if recipe is None:
        return None
    if recipe.generative_recipe is None:  # a PT2E recipe: litert-torch's other quantizer
        raise InvalidArgumentError(f"quantize={flag!r}: litert-torch's recipe is not a generative "
                                   "(ai-edge-quantizer) recipe, which is all this exporter runs")
    return translate_recipe.translate_to_ai_edge_recipe(recipe.generative_recipe)


__all__ = ["attention", "backend_export", "bmm_4d", "builder", "cfg", "convert_core", "converter",
           "dynamic_update_slice", "export_config", "fx_infra", "inline_consts", "kv_utils",
           "litert_signature", "litert_torch", "litert_types", "loader", "lora_utils", "lowerings", "model_builder",
           "output_names",
           "quantizer_recipe", "rotary_position_embedding", "run_graph_passes", "sdpa_with_kv_update"]
