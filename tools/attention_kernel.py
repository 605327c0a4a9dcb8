#!/usr/bin/env python3
"""An existing export's decode attention given the runtime's custom-op form, as ``runtime
export`` writes it (no torch needed; docs/kernels.md)::

    python3 tools/attention_kernel.py model.tflite --out model-kernel.tflite [--attention-kernel native]

Every ``decode*`` signature's (single-row and batched) ``BATCH_MATMUL -> ADD mask ->
SOFTMAX -> BATCH_MATMUL`` over the transposed KV caches becomes one
``odml_runtime.decode_attention`` op per layer and row, and each LoRA delta's two matmuls
one ``odml_runtime.lora_delta``; prefill and verify signatures stay as they are. ``auto`` (the default, as the export's): the op form is added beside the
standard one, sharing every weight, and the runtime runs the op where its kernel builds,
else the standard form. ``native``: the op form replaces the standard one (the file opens
only where the kernel builds). Prints the layers rewritten per signature and the time the
pass took. Either file runs its op form in this runtime only; LiteRT-LM needs standard ops.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from runtime.errors import StatusError
from runtime.util.attention_rewrite import rewrite_decode_attention


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="a .tflite export in the transposed KV layout")
    parser.add_argument("--out", type=Path, required=True, help="the .tflite to write (not the input)")
    parser.add_argument("--attention-kernel", choices=("auto", "native"), default="auto",
                        help="auto: both forms, the runtime choosing at open; native: the op form only")
    args = parser.parse_args()
    if args.out.resolve() == args.model.resolve():
        parser.error("--out must differ from the model (written under a temporary name, then renamed)")
    start = time.perf_counter()
    try:
        data, counts = rewrite_decode_attention(args.model.read_bytes(), keep_standard=args.attention_kernel == "auto")
    except (OSError, StatusError) as exc:
        print(f"error: {args.model}: {exc}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    with tempfile.NamedTemporaryFile(dir=args.out.parent, prefix=f".{args.out.name}.", delete=False) as file:
        file.write(data)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(file.name, 0o666 & ~umask)  # a temporary file is private; the model is not
    os.replace(file.name, args.out)
    for key, layers in counts.items():
        print(f"{key}: {layers} attention op(s)")
    print(f"wrote {args.out} ({len(data):,} bytes) in {seconds:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
