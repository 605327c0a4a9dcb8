#!/usr/bin/env python3
"""How far an R-only LoRA-XS adapter moves when its A and B come from an int8 export.

An R-only adapter stores only ``R``; the runtime rebuilds ``A`` and ``B`` from the model
file's own weights (``TruncatedSVD`` of W, :mod:`runtime.adapters.lora_xs`). An f32 export holds
the checkpoint's W exactly; an int8 export holds it quantized, so its factors differ. For
every attention projection of SmolLM2-135M this prints, at rank 8 with a random R (std
0.01, the scale of a trained one):

- ``|W8 - W| / |W|``: the quantization's own error;
- ``|dW8 - dW| / |dW|`` of the adapter's update ``dW = B R A``, both from the same R;
- how many of the 8 singular vector pairs changed sign (a pair whose sign flips turns the
  update of every R entry that mixes it with another pair).

    python3 tools/build_smollm2.py   # the f32 and int8 exports
    python3 -m benchmarks.experiments.lora_xs_int8 [F32.tflite INT8.tflite]

Writes ``benchmarks/results/lora_xs_int8.json``.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS
from benchmarks.llama_cpp.files import SMOLLM2
from runtime.adapters.lora_xs import LoraXsFactors
from runtime.util.model_weights import ModelWeights

RANK, LAYERS, PROJECTIONS = 8, 30, ("q", "k", "v", "o")


def main() -> int:
    """Prints the per-projection differences and their summary; writes the JSON."""
    paths = [Path(p) for p in sys.argv[1:3]] or [SMOLLM2.ours["f32"], SMOLLM2.ours["int8"]]
    weights = {name: ModelWeights.open(path, str(path)) for name, path in zip(("f32", "int8"), paths)}
    factors = {name: LoraXsFactors(lambda w=w: w) for name, w in weights.items()}
    rng = np.random.default_rng(0)
    rows = []
    for layer in range(LAYERS):
        for projection in PROJECTIONS:
            w32, w8 = (weights[name].weight(layer, projection) for name in ("f32", "int8"))
            r = rng.standard_normal((RANK, RANK)).astype(np.float32) * 0.01
            (a32, b32), (a8, b8) = (factors[name].factors(layer, projection, RANK) for name in ("f32", "int8"))
            delta32, delta8 = b32 @ r @ a32, b8 @ r @ a8
            flips = int(np.sum(np.sum(a32 * a8, axis=1) < 0))
            rows.append({"layer": layer, "projection": projection,
                         "weight_rel": float(np.linalg.norm(w8 - w32) / np.linalg.norm(w32)),
                         "update_rel": float(np.linalg.norm(delta8 - delta32) / np.linalg.norm(delta32)),
                         "sign_flips": flips})
    summary = {
        "projections": len(rows),
        "weight_rel_median": statistics.median(r["weight_rel"] for r in rows),
        "update_rel_median": statistics.median(r["update_rel"] for r in rows),
        "update_rel_max": max(r["update_rel"] for r in rows),
        "projections_with_sign_flips": sum(r["sign_flips"] > 0 for r in rows),
    }
    print(json.dumps(summary, indent=1))
    out = RESULTS / "lora_xs_int8.json"
    out.write_text(json.dumps({"models": [str(p) for p in paths], "rank": RANK, "summary": summary, "rows": rows},
                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
