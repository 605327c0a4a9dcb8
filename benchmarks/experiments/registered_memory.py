#!/usr/bin/env python3
"""What one registered (not resident) adapter keeps in memory, at a real model's shapes, per format.

Registering parses an adapter's metadata and checks it against the model's LoRA slots; no
weight is read. This registers ``--adapters`` distinct rank-R adapters of SmolLM2-135M's
shapes (30 layers, hidden 576, 3 KV heads of 64, MLP 1536) against those slots, without
the model itself, in every format the runtime reads from a file:

| format | projections | slot |
|---|---|---|
| ``.tflite`` LoRA | q/k/v/o | attention |
| PEFT directory | q/k/v/o | attention |
| PEFT directory | q/k/v/o/gate/up/down | all-linear |
| PEFT DoRA directory | q/k/v/o/gate/up/down | DoRA |
| GGUF LoRA | q/k/v/o | attention |
| GGUF LoRA | q/k/v/o/gate/up/down | all-linear |

and prints, per format, the growth per adapter of the Python objects kept (tracemalloc)
and of the process's RSS (which adds the allocator's slack and the mapped files' pages),
each format in a fresh process that only registers (memory freed by writing the files or by
another format's run would be reused and hide growth),
and what first use then costs: the median time to materialize one registered adapter into
numpy buffers of its slot (not DoRA's: its output scales need the model's weights)::

    python3 -m benchmarks.experiments.registered_memory [--adapters 200] [--rank 8] [--formats peft,gguf]

Registration reads no weight, so the files hold zero weights (DoRA magnitudes: ones) and
are written sparse: only their headers take disk space.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import json
import struct
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.measure import rss_bytes
from runtime.components.lora_manager import LoraManager
from runtime.adapters.adapter_formats import AdapterOrigin
from runtime.adapters.lora_util import DORA_SIDE, MLP_PROJECTIONS, Convention, lora_input_name
from runtime.adapters.lora_writer import serialize_lora_tensors
from runtime.util.signature_names import ALL_LINEAR, ATTENTION, DORA, LoraSlot
from runtime.util.tensor_spec import TensorSpec

LAYERS, HIDDEN, KV_OUT, MLP = 30, 576, 192, 1536  # SmolLM2-135M: 9 heads and 3 KV heads of 64
FANS = {"q": (HIDDEN, HIDDEN), "k": (HIDDEN, KV_OUT), "v": (HIDDEN, KV_OUT), "o": (HIDDEN, HIDDEN),
        "gate": (HIDDEN, MLP), "up": (HIDDEN, MLP), "down": (MLP, HIDDEN)}
GGUF_NAMES = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
              "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}
HEAD_DIM = 64  # undoes llama.cpp's q/k row order in GGUF adapters
BLOCK = 1 << 16  # sparse writing: blocks of zeros are skipped
FIRST_USES = 5  # adapters materialized for the first-use median


@dataclass(frozen=True)
class Format:
    """One row of the table: how its adapter files are written and which slot takes them."""

    name: str
    targets: str  # the slot kind: ATTENTION, ALL_LINEAR or DORA
    suffix: str  # "" for a PEFT directory, else the file's extension
    write: Callable[[Path, int], None]  # writes one adapter of the given rank at the path


def projections(targets: str) -> tuple[str, ...]:
    """The projections of a slot kind."""
    return tuple(p for p in FANS if targets != ATTENTION or p not in MLP_PROJECTIONS)


def slot_inputs(rank: int, targets: str) -> dict[str, TensorSpec]:
    """The LoRA inputs of SmolLM2's rank-``rank`` slot of kind ``targets``."""
    inputs = {}
    for layer in range(LAYERS):
        for projection in projections(targets):
            fan_in, fan_out = FANS[projection]
            sides = [("a", (fan_in, rank)), ("b", (rank, fan_out))]
            if targets == DORA:
                sides.append((DORA_SIDE, (fan_out,)))
            for side, shape in sides:
                name = lora_input_name(Convention.LITERT_TORCH, layer, projection, side)
                inputs[name] = TensorSpec(name, shape, np.dtype(np.float32))
    return inputs


def write_sparse(path: Path, blob: bytes | bytearray) -> None:
    """Writes ``blob``, skipping (leaving as holes) the blocks that are all zeros."""
    with open(path, "wb") as file:
        for start in range(0, len(blob), BLOCK):
            chunk = blob[start : start + BLOCK]
            if any(chunk):
                file.seek(start)
                file.write(chunk)
        file.truncate(len(blob))


def write_tflite(path: Path, rank: int) -> None:
    """A ``.tflite`` LoRA file of the attention projections (data after the flatbuffer)."""
    tensors = {name: np.zeros(spec.shape, np.float32) for name, spec in slot_inputs(rank, ATTENTION).items()}
    write_sparse(path, serialize_lora_tensors(tensors, external_data=True))


def safetensors_blob(tensors: dict[str, np.ndarray]) -> bytearray:
    """The bytes of a safetensors file holding ``tensors`` (float32), written by hand."""
    header, offset = {}, 0
    for key, array in tensors.items():
        header[key] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    blob = bytearray(struct.pack("<Q", len(text)) + text)
    for array in tensors.values():
        blob += array.tobytes()
    return blob


def peft_writer(targets: str) -> Callable[[Path, int], None]:
    """Writes a PEFT adapter directory (as peft saves one) covering ``targets``' projections."""

    def write(path: Path, rank: int) -> None:
        tensors = {}
        modules = []
        for layer in range(LAYERS):
            for projection in projections(targets):
                fan_in, fan_out = FANS[projection]
                block = "mlp" if projection in MLP_PROJECTIONS else "self_attn"
                module = f"base_model.model.model.layers.{layer}.{block}.{projection}_proj"
                tensors[f"{module}.lora_A.weight"] = np.zeros((rank, fan_in), np.float32)
                tensors[f"{module}.lora_B.weight"] = np.zeros((fan_out, rank), np.float32)
                if targets == DORA:
                    tensors[f"{module}.lora_magnitude_vector"] = np.ones(fan_out, np.float32)
                modules.append(f"{projection}_proj")
        path.mkdir()
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none", "use_dora": targets == DORA,
                  "target_modules": sorted(set(modules)), "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M"}
        (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
        write_sparse(path / "adapter_model.safetensors", safetensors_blob(tensors))

    return write


def gguf_writer(targets: str) -> Callable[[Path, int], None]:
    """Writes a llama.cpp GGUF LoRA (f32) covering ``targets``' projections."""
    from gguf import GGUFWriter

    def write(path: Path, rank: int) -> None:
        writer = GGUFWriter(str(path), "llama")
        writer.add_string("general.type", "adapter")
        writer.add_string("adapter.type", "lora")
        writer.add_float32("adapter.lora.alpha", float(2 * rank))
        for layer in range(LAYERS):
            for projection in projections(targets):
                fan_in, fan_out = FANS[projection]
                name = f"blk.{layer}.{GGUF_NAMES[projection]}.weight"
                writer.add_tensor(f"{name}.lora_a", np.zeros((rank, fan_in), np.float32))
                writer.add_tensor(f"{name}.lora_b", np.zeros((fan_out, rank), np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        write_sparse(path, path.read_bytes())

    return write


FORMATS = {
    "tflite": Format("tflite (attention)", ATTENTION, ".tflite", write_tflite),
    "peft": Format("PEFT (attention)", ATTENTION, "", peft_writer(ATTENTION)),
    "peft-all-linear": Format("PEFT (all-linear)", ALL_LINEAR, "", peft_writer(ALL_LINEAR)),
    "peft-dora": Format("PEFT DoRA (all-linear)", DORA, "", peft_writer(DORA)),
    "gguf": Format("GGUF (attention)", ATTENTION, ".gguf", gguf_writer(ATTENTION)),
    "gguf-all-linear": Format("GGUF (all-linear)", ALL_LINEAR, ".gguf", gguf_writer(ALL_LINEAR)),
}


class _Unallocated:
    """Registering allocates no buffer; one that asked would fail the measurement."""

    def __call__(self, slot: LoraSlot, name: str) -> None:
        raise AssertionError(f"registering allocated {name} of slot {slot}")


class _Buffer:
    """One LoRA input's buffer in numpy memory, standing in for the executor's."""

    def __init__(self, spec: TensorSpec) -> None:
        self.array = np.empty(spec.shape, spec.dtype)

    def write(self, data_array: np.ndarray) -> None:
        """Copies ``data_array`` in."""
        self.array[...] = data_array


def first_use_seconds(paths: list[Path], slot: LoraSlot, inputs: dict[str, TensorSpec]) -> float:
    """Median seconds to materialize each of ``paths`` (registered first) alone in ``slot``."""
    manager = LoraManager({slot: inputs}, lambda _, name: _Buffer(inputs[name]))
    times = []
    for lora_id, path in enumerate(paths):
        manager.load_lora(lora_id, AdapterOrigin.of_file(path).open(head_dim=HEAD_DIM))
        start = time.perf_counter()
        manager.acquire(((lora_id, 1.0),))
        times.append(time.perf_counter() - start)
        manager.release(((lora_id, 1.0),))
    return statistics.median(times[1:])  # the first one also warms the code paths


def measure(name: str, paths: list[Path], rank: int) -> tuple[float, float, float | None]:
    """``(Python bytes, RSS bytes)`` kept per registered adapter of format ``FORMATS[name]``
    (``paths[1:]``; the first one warms the code paths), and the seconds its first use
    takes (``None`` for DoRA). Run in a fresh process that wrote no file: the garbage of
    writing them would be reused and hide growth."""
    fmt = FORMATS[name]
    slot = LoraSlot(rank, fmt.targets)
    manager = LoraManager({slot: slot_inputs(rank, fmt.targets)}, _Unallocated())
    manager.load_lora(0, AdapterOrigin.of_file(paths[0]).open(head_dim=HEAD_DIM))
    gc.collect()
    tracemalloc.start()
    python_before, rss_before = tracemalloc.get_traced_memory()[0], rss_bytes()
    for lora_id, path in enumerate(paths[1:], start=1):
        manager.load_lora(lora_id, AdapterOrigin.of_file(path).open(head_dim=HEAD_DIM))
    gc.collect()
    python = (tracemalloc.get_traced_memory()[0] - python_before) / (len(paths) - 1)
    rss = (rss_bytes() - rss_before) / (len(paths) - 1)
    tracemalloc.stop()
    if fmt.targets == DORA:
        return python, rss, None
    return python, rss, first_use_seconds(paths[: FIRST_USES + 1], slot, slot_inputs(rank, fmt.targets))


def main() -> int:
    """Prints the per-adapter growth, one row per format."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--adapters", type=int, default=200)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"some of {', '.join(FORMATS)}")
    args = parser.parse_args()
    chosen = args.formats.split(",")
    print(f"{args.adapters} registered rank-{args.rank} adapters of SmolLM2-135M's shapes ({LAYERS} layers), "
          "per adapter:\n")
    print("| format | tensors | Python objects kept (tracemalloc), KiB | RSS growth, KiB | first use, ms |\n"
          "|---|---:|---:|---:|---:|")
    for name in chosen:
        fmt = FORMATS[name]
        with tempfile.TemporaryDirectory() as folder, \
                ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as fresh:
            paths = [Path(folder) / f"adapter{index}{fmt.suffix}" for index in range(args.adapters + 1)]
            for path in paths:
                fmt.write(path, args.rank)
            python, rss, first_use = fresh.submit(measure, name, paths, args.rank).result()
        tensors = LAYERS * len(projections(fmt.targets)) * (3 if fmt.targets == DORA else 2)
        first = "n/a (needs the model)" if first_use is None else f"{first_use * 1e3:.1f}"
        print(f"| {fmt.name} | {tensors} | {python / 1024:.1f} | {rss / 1024:.1f} | {first} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
