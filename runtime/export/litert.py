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

__all__ = ["attention", "builder", "cfg", "converter", "export_config", "kv_utils", "litert_torch", "loader",
           "lora_utils", "model_builder", "rotary_position_embedding",
           "sdpa_with_kv_update"]
