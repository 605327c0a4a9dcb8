"""The litert-torch 0.10.0 modules the export uses, imported after its defects are worked
around (:mod:`runtime.export.litert_torch_fixes`). Import litert-torch from here only."""

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

__all__ = ["attention", "backend_export", "builder", "cfg", "convert_core", "converter", "converter_api_ext",
           "export_config", "export_utils", "fx_infra", "inline_consts", "ir", "kv_utils", "litert_converter",
           "litert_signature", "litert_torch", "loader", "lora_utils", "model_builder", "passmanager",
           "quant_config", "rotary_position_embedding", "sdpa_with_kv_update", "translate_recipe"]
