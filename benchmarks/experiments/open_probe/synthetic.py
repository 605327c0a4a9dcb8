#!/usr/bin/env python3
"""A stand-in for SmolLM2's 56-signature export, made from a smaller export by copying
its LoRA signatures' subgraphs (the weights are the same buffers, stored once).

    python3 -m benchmarks.experiments.open_probe.synthetic --model SMALL.tflite --out BIG.tflite --signatures 56

Exporting the real 56 signatures (``tools/build_smollm2.py``: 3 prefill lengths, 4 attention
windows, rank slots 8/16/64 on attention and all-linear) takes ~500 s on a quiet box and
did not progress past 2 signatures in 6 minutes on this loaded one, so the open is measured
on this stand-in: the source's signatures, then copies of its ``*_lora_r*`` subgraphs named
``{key}_copy{n}`` until ``--signatures`` are there. Every copy is a subgraph of its own, as
LiteRT parses and compiles it; buffer numbers are unchanged, so the source's XNNPACK weight
cache file serves the copy. Attention-only LoRA subgraphs have fewer ops than all-linear
ones: the stand-in's open is, if anything, cheaper than the real model's.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import flatbuffers
from ai_edge_litert import schema_py_generated as schema

from runtime.util.flatbuffer_model import pack_aligned as _pack_aligned


def replicate(source: bytes, total: int) -> bytes:
    """``source`` with LoRA subgraphs copied until it has ``total`` signatures."""
    model = schema.ModelT.InitFromPackedBuf(source, 0)
    lora = [sig for sig in model.signatureDefs if b"_lora_r" in sig.signatureKey]
    if not lora:
        raise ValueError("the source has no LoRA signature to copy")
    n = 0
    while len(model.signatureDefs) < total:
        original = lora[n % len(lora)]
        sig = copy.copy(original)
        sig.signatureKey = original.signatureKey + f"_copy{n // len(lora)}".encode()
        model.subgraphs.append(model.subgraphs[original.subgraphIndex])  # packed again: a subgraph of its own
        sig.subgraphIndex = len(model.subgraphs) - 1
        model.signatureDefs.append(sig)
        n += 1
    builder = flatbuffers.Builder(1 << 20)
    packer = schema.BufferT.Pack
    schema.BufferT.Pack = _pack_aligned  # weights 64-byte aligned, as the exporter writes them
    try:
        builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    finally:
        schema.BufferT.Pack = packer
    return bytes(builder.Output())


def main() -> None:
    """Writes the stand-in."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--signatures", type=int, default=56)
    args = parser.parse_args()
    start = time.perf_counter()
    data = replicate(Path(args.model).read_bytes(), args.signatures)
    Path(args.out).write_bytes(data)
    print(f"wrote {args.out}: {len(data):,} bytes, {args.signatures} signatures, {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
