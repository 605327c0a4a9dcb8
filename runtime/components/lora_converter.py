"""Writing any adapter the runtime reads as a ``.tflite`` LoRA file, checked against a model."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np

from runtime.components.lora import SlotInputs, plan_adapter
from runtime.errors import UnimplementedError
from runtime.adapters.adapter_data import AdapterData
from runtime.adapters.lora_util import Convention, to_graph_layout
from runtime.adapters.lora_writer import LoraWeights, serialize_lora_weights
from runtime.util.signature_names import LoraSlot


def convert_adapter(
    data: AdapterData,
    slots: Mapping[LoraSlot, SlotInputs],
    convention: Convention,
    dtype: np.dtype,
    progress: Callable[[Iterable], Iterable] = iter,
) -> bytes:
    """The bytes of a ``.tflite`` LoRA file holding ``data`` in ``convention``.

    The adapter is first checked against the model's slots (so a misfit is refused, not
    written); a DoRA adapter is refused (``UnimplementedError``). ``progress`` wraps the loop over projections (e.g. a progress bar).
    Scales are already folded into ``a`` by the readers; pairs of smaller rank
    are zero-padded to the adapter's largest rank so every tensor has the same rank, as
    LiteRT-LM expects. The file has ``convention``'s customary layout
    (:func:`runtime.adapters.lora_writer.serialize_lora_weights`) in ``dtype``.
    """
    plan = plan_adapter(data, slots)
    if plan.dora is not None:
        raise UnimplementedError(
            f"{data.source_name}: a DoRA adapter (use_dora) cannot be written as a .tflite LoRA file: its output "
            "scales depend on the base weights and the session's scale, which no LoRA file carries; load the PEFT "
            "directory itself")
    weights = {}
    for key, pair in progress(plan.pairs.items()):
        a = to_graph_layout(pair.a.convention, "a", data.read_tensor(pair.a_name)).astype(np.float32)
        b = to_graph_layout(pair.b.convention, "b", data.read_tensor(pair.b_name)).astype(np.float32)
        padded_a = np.zeros((a.shape[0], plan.rank), np.float32)
        padded_b = np.zeros((plan.rank, b.shape[1]), np.float32)
        padded_a[:, : pair.rank], padded_b[: pair.rank] = a, b
        weights[key] = LoraWeights(padded_a, padded_b)
    return serialize_lora_weights(weights, convention, dtype=dtype)
