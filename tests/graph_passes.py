"""What the tests of the float16 storage passes share (test_kv_cache_precision.py,
test_lora_precision.py): a committed fixture through a pass, then optionally its decode
attention's op form, written to a file; the fixtures so converted once per module."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
from ai_edge_litert import schema_py_generated as schema

from runtime.executor import kernels
from runtime.util import flatbuffer_model
from runtime.util.attention_rewrite import rewrite_attention

GraphPass = Callable[[schema.ModelT], dict[str, int]]
needs_kernel = pytest.mark.skipif(kernels.compiler() is None or not {"-mavx2", "-mfma"} <= set(kernels.isa_flags()),
                                  reason="the op form runs only with a C compiler on a CPU with AVX2 and FMA")


def through(graph_pass: GraphPass, source: Path, out: Path, attention: str | None = None) -> dict[str, int]:
    """``source`` through ``graph_pass``, then its op form (``attention`` "both" beside the
    standard form, "native" in its place, None not at all), written to ``out``; the pass's counts."""
    model = flatbuffer_model.unpack(source.read_bytes())
    counts = graph_pass(model)
    if attention is not None:
        rewrite_attention(model, keep_standard=attention == "both")
    out.write_bytes(flatbuffer_model.pack(model))
    return counts


def converted(graph_pass: GraphPass, fixtures: Mapping[str, Path], folder: Path) -> dict[str, Path]:
    """Each of ``fixtures`` through ``graph_pass`` (standard form only) into ``folder``."""
    paths = {}
    for name, source in fixtures.items():
        paths[name] = folder / f"{name}.tflite"
        through(graph_pass, source, paths[name])
    return paths
