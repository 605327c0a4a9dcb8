"""The KV caches' layouts a model can be exported in, and the one a model names.

Every layer has a K and a V cache input (``kv_cache_k_{L}``, ``kv_cache_v_{L}``), 4-D, of
``G`` KV groups, ``T`` positions and ``D`` values per head:

- ``default`` (litert-torch's name): K and V ``[1, T, G, D]``;
- ``transposed`` (the exports' default): K ``[1, G, T, D]``, V ``[1, G, D, T]``;
- ``grouped``: K and V ``[1, G, T, D]``, V lying as K does: a decode step reads each
  position's ``D`` values of both caches in one row (kernel_probe/RESULTS.md, sections 20-21).

The runtime's attention kernel reads the last two; Google's LiteRT-LM runs bundles in either.

The shapes alone cannot always tell them apart (``grouped`` from ``transposed`` when
``T == D``, from ``default`` when ``G`` is as large as a prefill), so an export names its
layout in the model's metadata (:data:`KV_LAYOUT_METADATA`); a model exported before that
is read by its shapes, which were unambiguous between the two layouts of the time.
"""

from __future__ import annotations

from runtime.errors import InvalidArgumentError
from runtime.util.flatbuffer_model import READ_ERRORS, metadata_bytes

KV_LAYOUT_DEFAULT = "default"
KV_LAYOUT_TRANSPOSED = "transposed"
KV_LAYOUT_GROUPED = "grouped"
KV_LAYOUTS = (KV_LAYOUT_DEFAULT, KV_LAYOUT_TRANSPOSED, KV_LAYOUT_GROUPED)

KV_LAYOUT_METADATA = "runtime.kv_layout"  # the metadata entry naming the layout (UTF-8 text)


def named_kv_layout(model: bytes | memoryview, source: str = "the model") -> str | None:
    """The layout ``model`` (a ``.tflite``'s bytes) names in its metadata, ``None`` when it
    names none (an export of before 2026-12-08, or bytes that are no ``.tflite``: LiteRT
    refuses those, naming its reason). ``InvalidArgumentError`` naming ``source`` when the
    entry names no layout of :data:`KV_LAYOUTS`."""
    try:
        raw = metadata_bytes(model, KV_LAYOUT_METADATA)
    except READ_ERRORS:
        return None
    if raw is None:
        return None
    text = bytes(raw).rstrip(b"\0").decode("utf-8", errors="replace")
    if text not in KV_LAYOUTS:
        raise InvalidArgumentError(f"{source}: its {KV_LAYOUT_METADATA} metadata names the KV layout {text!r}, "
                                   f"expected one of {', '.join(KV_LAYOUTS)}")
    return text
