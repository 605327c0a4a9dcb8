"""The litert-torch 0.10.0 modules the export uses, imported after its defects are worked
around (:mod:`runtime.export.litert_torch_fixes`). Import litert-torch from here only.

The exporter runs litert-torch's converter step by step, which needs three of its private
functions; they are named here (:func:`run_graph_passes`, :func:`output_names`,
:func:`is_generative_recipe`), so that this module alone depends on 0.10.0's internals (the
``export`` extra pins that version)."""

from typing import Any

from runtime.export import litert_torch_fixes

litert_torch_fixes.apply()

import litert_torch  # noqa: E402
from litert_torch.generative.layers import attention, builder  # noqa: E402
from litert_torch.generative.layers import kv_cache as kv_utils  # noqa: E402
from litert_torch.generative.layers import lora as lora_utils  # noqa: E402
from litert_torch.generative.layers import model_config as cfg  # noqa: E402
from litert_torch.generative.layers import rotary_position_embedding, sdpa_with_kv_update  # noqa: E402
from litert_torch.generative.utilities import converter  # noqa: E402
from litert_torch.generative.utilities import export_config  # noqa: E402
from litert_torch.generative.utilities import loader  # noqa: E402
from litert_torch.generative.utilities import model_builder  # noqa: E402

# The converter's pieces, which runtime.export.lowering and convert run one by one.
from litert_converter.mlir import ir, passmanager  # noqa: E402
from litert_converter.mlir._mlir_libs import converter_api_ext  # noqa: E402
from litert_torch import fx_infra  # noqa: E402
from litert_torch._convert import core as convert_core  # noqa: E402
from litert_torch._convert import litert_converter  # noqa: E402
from litert_torch._convert import signature as litert_signature  # noqa: E402
from litert_torch.backend import export as backend_export  # noqa: E402
from litert_torch.backend import export_utils, inline_consts  # noqa: E402
from litert_torch.quantize import quant_config, translate_recipe  # noqa: E402

def run_graph_passes(program: Any) -> Any:
    """litert-torch's FX graph passes over an exported program, as its converter runs them."""
    return convert_core._run_convert_passes(program)


def output_names(program: Any, lowered: Any) -> list[str]:
    """A lowered signature's output names, as litert-torch's converter names them."""
    return litert_converter._get_output_names(program, lowered)


def is_generative_recipe(recipe: Any) -> bool:
    """Whether a litert-torch quantization recipe runs through ai-edge-quantizer (a
    "generative" recipe), the only kind the exporter applies."""
    return recipe._quantizer_mode == quant_config.QuantConfig._QuantizerMode.AI_EDGE_QUANTIZER


__all__ = ["attention", "backend_export", "builder", "cfg", "convert_core", "converter", "converter_api_ext",
           "export_config", "export_utils", "fx_infra", "inline_consts", "ir", "is_generative_recipe", "kv_utils",
           "litert_signature", "litert_torch", "loader", "lora_utils", "model_builder", "output_names",
           "passmanager", "rotary_position_embedding", "run_graph_passes", "sdpa_with_kv_update",
           "translate_recipe"]
