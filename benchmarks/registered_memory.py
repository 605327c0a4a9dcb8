#!/usr/bin/env python3
"""What one registered (not resident) adapter keeps in memory, at a real model's shapes.

Registering parses an adapter's metadata and checks it against the model's LoRA slots; no
weight is read. This registers ``--adapters`` distinct rank-R ``.tflite`` adapters of
SmolLM2-135M's attention shapes (30 layers, q/k/v/o, hidden 576, 3 KV heads of 64) against
those slots, without the model itself, and prints the growth per adapter of the Python
objects kept (tracemalloc) and of the process's RSS (which adds the allocator's slack and
the mapped file's metadata pages)::

    python3 benchmarks/registered_memory.py [--adapters 300] [--rank 8]

The adapter files are written once into a temporary directory (3.5 MB each at rank 8).
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np

from measure import rss_bytes  # benchmarks/measure.py, beside this script
from runtime.components.lora_manager import LoraManager
from runtime.util.adapter_formats import AdapterOrigin
from runtime.util.lora_util import Convention, lora_input_name
from runtime.util.lora_writer import serialize_lora_tensors
from runtime.util.signature_names import LoraSlot
from runtime.util.tensor_spec import TensorSpec

LAYERS, HIDDEN, KV_OUT = 30, 576, 192  # SmolLM2-135M: 9 heads and 3 KV heads of 64
FANS = {"q": (HIDDEN, HIDDEN), "k": (HIDDEN, KV_OUT), "v": (HIDDEN, KV_OUT), "o": (HIDDEN, HIDDEN)}


def slot_inputs(rank: int) -> dict[str, TensorSpec]:
    """The LoRA inputs of SmolLM2's rank-``rank`` attention slot."""
    inputs = {}
    for layer in range(LAYERS):
        for projection, (fan_in, fan_out) in FANS.items():
            for side, shape in (("a", (fan_in, rank)), ("b", (rank, fan_out))):
                name = lora_input_name(Convention.LITERT_TORCH, layer, projection, side)
                inputs[name] = TensorSpec(name, shape, np.dtype(np.float32))
    return inputs


class _Unallocated:
    """Registering allocates no buffer; one that asked would fail the measurement."""

    def __call__(self, slot: LoraSlot, name: str) -> None:
        raise AssertionError(f"registering allocated {name} of slot {slot}")


def main() -> int:
    """Prints the per-adapter growth."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--adapters", type=int, default=300)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    slot = LoraSlot(args.rank)
    inputs = slot_inputs(args.rank)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        paths = []
        for index in range(args.adapters + 1):
            path = Path(folder) / f"adapter{index}.tflite"
            tensors = {name: rng.standard_normal(spec.shape).astype(np.float32) for name, spec in inputs.items()}
            path.write_bytes(serialize_lora_tensors(tensors, external_data=True))
            paths.append(path)
        manager = LoraManager({slot: inputs}, _Unallocated())
        manager.load_lora(0, AdapterOrigin.of_file(paths[0]).open())  # first use of the code paths
        gc.collect()
        tracemalloc.start()
        python_before, rss_before = tracemalloc.get_traced_memory()[0], rss_bytes()
        for lora_id, path in enumerate(paths[1:], start=1):
            manager.load_lora(lora_id, AdapterOrigin.of_file(path).open())
        gc.collect()
        python = (tracemalloc.get_traced_memory()[0] - python_before) / args.adapters
        rss = (rss_bytes() - rss_before) / args.adapters
        tracemalloc.stop()
    print(f"{args.adapters} registered rank-{args.rank} adapters of SmolLM2-135M's attention shapes "
          f"({LAYERS * len(FANS) * 2} tensors each), per adapter:")
    print("| what | KiB |\n|---|---:|")
    print(f"| Python objects kept (tracemalloc) | {python / 1024:.1f} |")
    print(f"| RSS growth | {rss / 1024:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
