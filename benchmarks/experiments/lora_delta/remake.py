#!/usr/bin/env python3
"""An export carrying both forms of decode attention, made again with this branch's pass, so
its op form also runs the LoRA deltas as ``odml_runtime.lora_delta``: the "after" file to
time beside the "before" one (the same weights, the same attention op; only the deltas differ).

    python3 -m benchmarks.experiments.lora_delta.remake BEFORE.tflite AFTER.tflite

The op forms are cut off (the standard view, :func:`select_attention_form`), the pairing
metadata and the attention op's code dropped, and the pass run again with ``keep_standard``.
"""

from __future__ import annotations

import sys
import time

from runtime.util import flatbuffer_model
from runtime.util.attention_rewrite import DECODE_ATTENTION, FORMS_METADATA, attention_forms, rewrite_attention
from runtime.util.model_view import select_attention_form


def main() -> int:
    source, target = sys.argv[1:3]
    start = time.perf_counter()
    data = bytearray(open(source, "rb").read())
    forms = attention_forms(data)
    if forms:
        select_attention_form(data, forms, op_form=False)
    model = flatbuffer_model.unpack(bytes(data))
    if forms:
        model.subgraphs = model.subgraphs[:min(forms.values())]
        model.metadata = [e for e in model.metadata if e.name not in (FORMS_METADATA, FORMS_METADATA.encode())]
        codes = [c.customCode for c in model.operatorCodes]
        assert codes[-1] in (DECODE_ATTENTION, DECODE_ATTENTION.encode()), "the attention op's code is not the last"
        model.operatorCodes.pop()
    counts = rewrite_attention(model, keep_standard=True)
    with open(target, "wb") as out:
        out.write(flatbuffer_model.pack(model))
    print(f"{target}: attention ops in {sum(1 for c in counts.values() if c)} decode signatures, "
          f"{time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
