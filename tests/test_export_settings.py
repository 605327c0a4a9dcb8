"""ExportSettings: the defaults are a valid export, and every bad field is named."""

from __future__ import annotations

import pytest

from runtime.errors import InvalidArgumentError
from runtime.export.settings import QUANTIZATIONS, ExportSettings, default_kv_length


def test_defaults_and_recipe_names() -> None:
    settings = ExportSettings(lora_ranks=(8, 64))
    assert settings.kv_length >= max(settings.prefill_lengths)
    assert ExportSettings(quantize="int8").litert_quantize == "dynamic_int8"
    assert ExportSettings().litert_quantize == "none"
    assert set(QUANTIZATIONS) >= {"none", "int8"}
    assert ExportSettings(lora_ranks=(16, 8), batch_sizes=(2,)).batch_ranks == (8, 16)  # every slot by default
    assert ExportSettings(lora_ranks=(16, 8), batch_sizes=(2,), batch_lora_ranks=(8,)).batch_ranks == (8,)


@pytest.mark.parametrize("kernel, layout, op_form", [
    ("auto", "transposed", True), ("auto", "default", False), ("auto", "grouped", True), ("native", "transposed", True),
    ("native", "grouped", True),
    ("xnnpack", "transposed", False), ("xnnpack", "default", False),
])
def test_which_exports_get_the_attention_op_form(kernel: str, layout: str, op_form: bool) -> None:
    """By default (auto) the op form goes beside the standard one where the kernel reads the
    layout (transposed, grouped); litert-torch's default layout keeps the standard form alone."""
    assert ExportSettings().attention_kernel == "auto"
    assert ExportSettings(attention_kernel=kernel, kv_layout=layout).op_form is op_form


@pytest.mark.parametrize("context, kv_length", [(8192, 4096), (131072, 4096), (2048, 2048), (256, 256), (None, 4096)])
def test_the_default_kv_length_is_the_models_context_up_to_4096(context: int | None, kv_length: int) -> None:
    assert default_kv_length(context) == kv_length


@pytest.mark.parametrize("settings, windows", [
    ({}, (1024,)), ({"kv_length": 2048}, (1024,)), ({"kv_length": 1024}, ()), ({"kv_length": 256}, ()),
    ({"kv_length": 4096, "prefill_lengths": (2048,)}, ()), ({"kv_length": 4096, "prefill_windows": ()}, ()),
    ({"kv_length": 4096, "prefill_windows": (128,)}, (128,)),
])
def test_a_cache_longer_than_1024_gets_a_prefill_window_of_1024_unless_told(settings: dict, windows: tuple) -> None:
    assert ExportSettings(**settings).prefill_windows == windows


@pytest.mark.parametrize("kv_length, lengths", [
    (1024, (32, 128, 512)), (4096, (32, 128, 512)), (512, (32, 128)), (256, (32, 128)), (64, (32,)), (16, (8,)),
    (2, (1,)),
])
def test_default_prefill_lengths_scale_with_the_kv_length(kv_length: int, lengths: tuple[int, ...]) -> None:
    assert ExportSettings(kv_length=kv_length).prefill_lengths == lengths  # a small cache alone is not refused
    assert ExportSettings(kv_length=kv_length, prefill_lengths=(2,)).prefill_lengths == (2,)


@pytest.mark.parametrize("fields, match", [
    ({"lora_ranks": (8, 0)}, r"lora_ranks=\(8, 0\): every value must be >= 1"),
    ({"lora_ranks": (-4,)}, "lora_ranks"),
    ({"lora_ranks": (8, 8)}, "repeat"),
    ({"lora_ranks": [8]}, "expected a tuple of integers"),
    ({"lora_ranks": (8.0,)}, "expected a tuple of integers"),
    ({"prefill_lengths": ()}, "at least one prefill length"),
    ({"prefill_lengths": (32, 2048), "kv_length": 1024}, r"\[2048\] exceed kv_length=1024"),
    ({"kv_length": 1}, "kv_length=1"),
    ({"quantize": "int3"}, "quantize='int3': expected one of none, int8"),
    ({"kv_layout": "sideways"}, "kv_layout='sideways'"),
    ({"batch_sizes": (1, 4)}, r"batch_sizes=\(1, 4\): a batch has at least 2 rows"),
    ({"batch_sizes": (4, 4)}, "repeat"),
    ({"lora_ranks": (8,), "batch_lora_ranks": (16,)}, r"batch_lora_ranks \[16\] are not LoRA rank slots \[8\]"),
    ({"attention_windows": (128, 1024), "kv_length": 1024},
     r"attention_windows \[1024\] are not shorter than kv_length=1024"),
    ({"attention_windows": (0,)}, r"attention_windows=\(0,\): every value must be >= 1"),
    ({"lora_targets": "mlp"}, "lora_targets='mlp': expected one of attention, all-linear"),
    ({"prefill_windows": (1024,), "kv_length": 1024},
     r"prefill_windows \[1024\] are not shorter than kv_length=1024: prefill already attends"),
    ({"prefill_windows": (16, 128), "prefill_lengths": (32, 128)},
     r"prefill_windows \[16\] are shorter than every prefill length \[32, 128\]"),
])
def test_bad_fields_are_refused_by_name(fields: dict, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        ExportSettings(**fields)
