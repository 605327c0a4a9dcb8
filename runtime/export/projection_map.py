"""Where each base projection's weight lies in the exported model: the exporter's map for
the runtime, which rebuilds R-only LoRA-XS factors (and DoRA's norms) from the base weights.

litert-torch fuses and reorders projections (q/k/v into one ``qkv_projection``, rows
interleaved by KV group in some families), and the converter names tensors after module
paths that merge when tensors are shared. So the map does not rely on names: for each
Hugging Face projection ``model.layers.{L}.{self_attn,mlp}.{proj}.weight`` ``[out, in]``
it finds the decoder weight holding its rows (equal bytes, row by row) and records that
tensor's shape, the rows (in the Hugging Face order, as ``[start, count]`` runs) and a
few probe values at fixed positions, by which the runtime picks the tensor out of the
``.tflite`` (whatever its name, and after quantization within its scale). Written as the
model's ``runtime.projections`` metadata (JSON; see :mod:`runtime.util.model_weights`).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
from torch import nn

METADATA_NAME = "runtime.projections"
FORMAT_VERSION = 1
PROBES = 8
_HF_WEIGHT = re.compile(r"(?:.*\.)?layers\.(?P<layer>0|[1-9][0-9]*)\.(?:self_attn|mlp)\."
                        r"(?P<proj>q|k|v|o|gate|up|down)_proj\.weight")


def projection_map(hf_model: nn.Module, decoder: nn.Module) -> dict[str, Any]:
    """The map for every attention and MLP projection of ``hf_model`` found among the
    weights of the same layer of ``decoder`` (a projection whose rows are nowhere is left
    out: the runtime then says so by name)."""
    blocks = list(decoder.transformer_blocks)
    candidates = [[p.detach().float().numpy() for p in block.parameters() if p.dim() == 2] for block in blocks]
    row_index: dict[int, dict[int, int]] = {}  # id of a candidate -> row hash -> row
    projections = {}
    for name, parameter in hf_model.state_dict().items():
        match = _HF_WEIGHT.fullmatch(name)
        if match is None or parameter.dim() != 2 or int(match["layer"]) >= len(blocks):
            continue
        weight = parameter.detach().float().numpy()
        for candidate in candidates[int(match["layer"])]:
            if candidate.shape[1] != weight.shape[1] or candidate.shape[0] < weight.shape[0]:
                continue
            index = row_index.setdefault(id(candidate), {hash(row.tobytes()): i for i, row in enumerate(candidate)})
            rows = [index.get(hash(row.tobytes())) for row in weight]
            if None not in rows and np.array_equal(candidate[rows], weight):
                projections[f"{match['layer']}.{match['proj']}"] = {
                    "shape": list(candidate.shape),
                    "rows": _runs(rows),
                    "probe": _probe(candidate),
                }
                break
    return {"version": FORMAT_VERSION, "projections": projections}


def metadata_json(mapping: dict[str, Any]) -> str:
    """The map as the metadata's text."""
    return json.dumps(mapping, separators=(",", ":"), sort_keys=True)


def _runs(rows: list[int]) -> list[list[int]]:
    """``[start, count]`` runs of consecutive row indices, in order."""
    runs: list[list[int]] = []
    for row in rows:
        if runs and runs[-1][0] + runs[-1][1] == row:
            runs[-1][1] += 1
        else:
            runs.append([row, 1])
    return runs


def _probe(weight: np.ndarray) -> list[list[float]]:
    """``[flat index, value]`` at positions spread over the tensor (fixed by its size)."""
    positions = np.random.default_rng(weight.size).choice(weight.size, size=min(PROBES, weight.size), replace=False)
    flat = weight.reshape(-1)
    return [[int(i), float(flat[i])] for i in sorted(positions)]
