"""LoRA slot inputs shaped like the test models', for component tests without a model."""

from __future__ import annotations

import numpy as np

from runtime.adapters.lora_util import Convention, lora_input_name
from runtime.util.signature_names import LoraSlot
from runtime.util.tensor_spec import TensorSpec

FAN = {"q": (64, 64), "k": (64, 32), "v": (64, 32), "o": (64, 64)}
MLP_FAN = {"gate": (64, 128), "up": (64, 128), "down": (128, 64)}


def slot_inputs(rank: int, convention: Convention = Convention.LITERT_TORCH, layers: int = 2,
                mlp: bool = False) -> dict[str, TensorSpec]:
    """The LoRA inputs a model of the test shapes has for one rank slot (with ``mlp``: an
    all-linear slot, the feed-forward's gate/up/down too)."""
    specs = {}
    fans = {**FAN, **MLP_FAN} if mlp else FAN
    for layer in range(layers):
        for proj, (fan_in, fan_out) in fans.items():
            a_shape = (fan_in, rank) if convention is Convention.LITERT_TORCH else (rank, fan_in)
            for side, shape in (("a", a_shape), ("b", (rank, fan_out))):
                name = lora_input_name(convention, layer, proj, side)
                specs[name] = TensorSpec(name, shape, np.dtype(np.float32))
    return specs


class ArrayBuffer:
    """A stand-in for a TensorBuffer: keeps what is written."""

    def __init__(self, spec: TensorSpec) -> None:
        self.spec = spec
        self.array: np.ndarray | None = None

    def write(self, data_array: np.ndarray) -> None:
        assert data_array.shape == self.spec.shape and data_array.dtype == self.spec.dtype
        self.array = data_array.copy()


def allocator(slots: dict[LoraSlot, dict[str, TensorSpec]]):
    """``allocate(slot, name)`` over :class:`ArrayBuffer`, counting allocations."""
    calls = []

    def allocate(slot: LoraSlot, name: str) -> ArrayBuffer:
        calls.append((slot, name))
        return ArrayBuffer(slots[slot][name])

    allocate.calls = calls
    return allocate
