#!/usr/bin/env python3
"""An existing export's decode attention given the runtime's custom-op form, as ``runtime
export`` writes it (no torch needed; docs/kernels.md)::

    python3 tools/attention_kernel.py model.tflite --out model-kernel.tflite \
        [--attention-kernel native] [--kv-cache-dtype float16] [--lora-dtype float16]

Every ``decode*`` signature's (single-row and batched) ``BATCH_MATMUL -> ADD mask ->
SOFTMAX -> BATCH_MATMUL`` over the transposed KV caches becomes one
``odml_runtime.decode_attention`` op per layer and row, each LoRA delta's two matmuls
one ``odml_runtime.lora_delta``, and each float32 linear layer one
``odml_runtime.linear_rows``; prefill and verify signatures stay as they are. ``auto``
(the default, as the export's): the op form is added beside the standard one, sharing every
weight, and the runtime runs the op where its kernel builds, else the standard form.
``native``: the op form replaces the standard one (the file opens only where the kernel
builds). A file that already carries both forms (an export of ``--attention-kernel auto``)
has its op form made again by this version's pass (one made before the LoRA op gets it).
``--kv-cache-dtype float16`` also stores every signature's KV caches in float16, as
``runtime export --kv-cache-dtype float16`` does, and ``--lora-dtype float16`` every LoRA
factor input (A and B) in float16, as ``runtime export --lora-dtype float16`` does. Prints the
ops per signature and the time the passes took. Either file runs its op form in this runtime only; LiteRT-LM needs
standard ops.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's runtime, not an installed one

from runtime.errors import StatusError
from runtime.export.settings import KV_CACHE_DTYPES, LORA_DTYPES
from runtime.util import flatbuffer_model
from runtime.util.attention_rewrite import rewrite_attention, standard_form_only
from runtime.util.kv_cache_precision import kv_caches_to_float16
from runtime.util.lora_precision import lora_factors_to_float16


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="a .tflite export in the transposed KV layout")
    parser.add_argument("--out", type=Path, required=True, help="the .tflite to write (not the input)")
    parser.add_argument("--attention-kernel", choices=("auto", "native"), default="auto",
                        help="auto: both forms, the runtime choosing at open; native: the op form only")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="float32",
                        help="float16: store the KV caches in float16 first (else they keep the type they have)")
    parser.add_argument("--lora-dtype", choices=LORA_DTYPES, default="float32",
                        help="float16: store the LoRA factor inputs in float16 first (else they keep the type they have)")
    args = parser.parse_args()
    if args.out.resolve() == args.model.resolve():
        parser.error("--out must differ from the model (written under a temporary name, then renamed)")
    start = time.perf_counter()
    try:
        model = flatbuffer_model.unpack(args.model.read_bytes(), str(args.model))
    except (OSError, StatusError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        made_again = standard_form_only(model)
        caches = kv_caches_to_float16(model) if args.kv_cache_dtype == "float16" else {}
        factors = lora_factors_to_float16(model) if args.lora_dtype == "float16" else {}
        counts = rewrite_attention(model, keep_standard=args.attention_kernel == "auto")
    except (OSError, StatusError) as exc:
        print(f"error: {args.model}: {exc}", file=sys.stderr)
        return 1
    try:
        written = flatbuffer_model.write(model, args.out)
    except OSError as exc:
        print(f"error: {args.out}: {exc}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    if made_again:
        print(f"{args.model} carried both forms: its op form was made again")
    if caches:
        print(f"KV caches stored in float16: {sum(caches.values())} in {len(caches)} signatures")
    if factors:
        print(f"LoRA factors stored in float16: {sum(factors.values())} in {len(factors)} signatures")
    for key, layers in counts.items():
        print(f"{key}: {layers} attention op(s)")
    print(f"wrote {args.out} ({written:,} bytes) in {seconds:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
