"""Export of verify{L} signatures (``--verify-lengths``): what Turbo LoRA's speculative
decoding runs. Needs torch and litert-torch (marked ``export``)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("litert_torch")

import checkpoints  # noqa: E402
from runtime.executor.litert_executor import LlmExecutor  # noqa: E402
from runtime.export.exporter import export  # noqa: E402
from runtime.export.settings import ExportSettings  # noqa: E402
from runtime.export.source import inspect_source  # noqa: E402
from runtime.util.output_projection import read_output_projection  # noqa: E402

pytestmark = pytest.mark.export


@pytest.mark.parametrize("layout", ["default", "transposed", "grouped"])
def test_verify_returns_what_decode_steps_return_and_the_lm_heads_input(tmp_path, layout):
    source = inspect_source(checkpoints.write_llama_directory(tmp_path / "llama", tokenizer=False))
    settings = ExportSettings(lora_ranks=(4,), lora_targets="attention", kv_length=32, prefill_lengths=(8,),
                              kv_layout=layout, verify_lengths=(3,), attention_windows=(8,))
    model = tmp_path / "model.tflite"
    export(source, settings, model_out=model)
    executor = LlmExecutor(model)
    try:
        assert {"verify3", "verify3_lora_r4", "verify3_attend8", "verify3_attend8_lora_r4"} <= set(
            executor.spec.signatures)
        assert executor.spec.verify_lengths(None) == (3,)
        plain, speculative = executor.bind(executor.create_kv_cache()), executor.bind(executor.create_kv_cache())
        executor.prefill(plain, [1, 2, 3, 4], 0)
        executor.prefill(speculative, [1, 2, 3, 4], 0)
        stepped = np.stack([executor.decode(plain, token, 4 + i) for i, token in enumerate([9, 8, 7])])
        logits, hidden = executor.verify(speculative, [9, 8, 7], 4)
        np.testing.assert_allclose(logits, stepped, atol=1e-4)
        lm_head = read_output_projection(model, "verify3", str(model))
        np.testing.assert_allclose(hidden @ lm_head.T, logits, atol=1e-4)
        # (positions 4-6 ran verify3_attend8) Two tokens at 7-8 run the padded whole-cache verify3;
        # the next step at the kept position is unaffected.
        logits2, _ = executor.verify(speculative, [6, 5], 7)
        np.testing.assert_allclose(logits2[0], executor.decode(plain, 6, 7), atol=1e-4)
    finally:
        executor.close()
