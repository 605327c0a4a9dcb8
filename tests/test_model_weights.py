"""Tests for runtime.util.model_weights without torch: the committed family exports carry
the exporter's map (exactness against the checkpoint is tests/test_export.py's)."""

from __future__ import annotations

import pytest

from conftest import MODEL_FILES, MODELS
from runtime.errors import FailedPreconditionError, NotFoundError
from runtime.util.model_weights import ModelWeights

LLAMA = MODELS / "families" / "llama" / "model.tflite"


def test_every_projection_of_the_export_is_found_with_its_shape():
    weights = ModelWeights.open(LLAMA, "llama")
    hidden, kv, intermediate = 64, 2 * 16, 128  # tools/build_family_fixtures.py's small shapes
    expected = {"q": (hidden, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, hidden),
                "gate": (intermediate, hidden), "up": (intermediate, hidden), "down": (hidden, intermediate)}
    for layer in range(3):
        for projection, shape in expected.items():
            assert weights.shape(layer, projection) == shape
            assert weights.weight(layer, projection).shape == shape
    q, k = weights.weight(0, "q"), weights.weight(0, "k")
    assert q.dtype.name == "float32" and q.flags.writeable and not (q[:kv] == k).all()  # k's rows, not q's


def test_a_model_without_the_map_or_a_projection_outside_it_is_named(tmp_path):
    # an export made before the map: the same bytes with the map's metadata under another name
    data = MODEL_FILES["default"].read_bytes()
    assert data.count(b"runtime.projections") == 1
    older = tmp_path / "older.tflite"
    older.write_bytes(data.replace(b"runtime.projections", b"runtime.elsewhere__"))
    with pytest.raises(FailedPreconditionError, match="no runtime.projections metadata.*export it again"):
        ModelWeights.open(older, "older.tflite")
    with pytest.raises(NotFoundError, match="llama: .* no weight for layer 3 projection 'q'"):
        ModelWeights.open(LLAMA, "llama").weight(3, "q")
    with pytest.raises(NotFoundError, match="cannot read the model"):
        ModelWeights.open(LLAMA.parent / "missing.tflite", "missing")
