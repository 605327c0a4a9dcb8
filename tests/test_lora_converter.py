"""Tests for runtime.components.lora_converter."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import adapter_path
from runtime.components.lora import plan_adapter
from runtime.components.lora_converter import convert_adapter
from runtime.errors import InvalidArgumentError
from runtime.adapters.lora_data import LoraData
from runtime.adapters.lora_util import Convention, to_graph_layout
from runtime.util.signature_names import LoraSlot
from slots import slot_inputs

SLOTS = {LoraSlot(4): slot_inputs(4), LoraSlot(16): slot_inputs(16)}


def graph_pairs(data):
    plan = plan_adapter(data, SLOTS)
    return {
        key: (to_graph_layout(p.a.convention, "a", data.read_tensor(p.a_name)).astype(np.float32),
              to_graph_layout(p.b.convention, "b", data.read_tensor(p.b_name)).astype(np.float32))
        for key, p in plan.pairs.items()
    }


@pytest.mark.parametrize("convention", [Convention.LITERT_LM, Convention.LITERT_TORCH])
def test_round_trip_keeps_the_weights(convention):
    source = LoraData.create_from_file_path(adapter_path("torch_r4"))
    blob = convert_adapter(source, SLOTS, convention, np.dtype(np.float32))
    converted = LoraData.create_from_buffer(blob)
    assert converted.get_lora_rank() == 4
    expected, got = graph_pairs(source), graph_pairs(converted)
    assert expected.keys() == got.keys()
    for key in expected:
        np.testing.assert_array_equal(got[key][0], expected[key][0])
        np.testing.assert_array_equal(got[key][1], expected[key][1])
    placement = {converted.tensor_info(n).placement for n in converted.get_all_tensor_names()}
    assert placement == ({"external"} if convention is Convention.LITERT_LM else {"inline"})


def test_misfit_is_refused_not_written():
    with pytest.raises(InvalidArgumentError, match="input size 48"):
        convert_adapter(LoraData.create_from_file_path(adapter_path("wrong_hidden_r4")), SLOTS,
                        Convention.LITERT_LM, np.dtype(np.float16))
