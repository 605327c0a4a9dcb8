"""Tests for runtime.util.model_weights without torch: the committed family exports carry
the exporter's map (exactness against the checkpoint is tests/test_export.py's)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import MODEL_FILES, MODELS
from runtime import Engine, EngineSettings, SessionConfig
from runtime.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
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


def test_a_base_weight_holding_nan_is_refused_naming_it_and_an_adapter_built_from_it_too(tmp_path):
    # Found by fuzzing model files: an R-only LoRA-XS adapter's SVD of a NaN weight escaped
    # as scikit-learn's ValueError.
    data = bytearray(LLAMA.read_bytes())
    row = ModelWeights.open(LLAMA, "llama").weight(0, "q")[1].tobytes()
    at = data.find(row)
    assert at > 0 and data.count(row) == 1
    data[at:at + 4] = np.float32(np.nan).tobytes()
    broken = tmp_path / "nan.tflite"
    broken.write_bytes(data)
    with pytest.raises(InvalidArgumentError, match="nan.tflite: the base weight of layer 0 projection 'q' holds NaN"):
        ModelWeights.open(broken, "nan.tflite").weight(0, "q")
    with Engine(broken, EngineSettings(weight_cache_dir=None)) as engine:
        for _ in range(2):  # the factors are rebuilt when a session first runs the adapter, each time refused
            with pytest.raises(InvalidArgumentError, match="layer 0 projection 'q' holds NaN"):
                with engine.create_session(SessionConfig(lora_path=LLAMA.parent / "adapter_lora_xs")) as session:
                    session.run_prefill([1, 2, 3])
        with engine.create_session() as session:  # the engine goes on serving
            assert session.run_prefill([1, 2, 3]).shape[-1] == engine.spec.vocab_size
        assert engine.stats().sessions == ()


def test_a_base_weight_whose_svd_overflows_is_refused_for_lora_xs_naming_it(tmp_path):
    # Found by fuzzing model files: finite weights near float32's largest made scipy's SVD
    # raise ValueError (its own steps overflowed) from inside the first decode step.
    data = bytearray(LLAMA.read_bytes())
    row = ModelWeights.open(LLAMA, "llama").weight(0, "q")[1]
    at = data.find(row.tobytes())
    data[at:at + row.nbytes] = np.full_like(row, 3e38).tobytes()
    huge = tmp_path / "huge.tflite"
    huge.write_bytes(data)
    with Engine(huge, EngineSettings(weight_cache_dir=None)) as engine:
        with pytest.raises(InvalidArgumentError, match="huge.tflite: the SVD of the base weight of layer 0 projection "
                                                       "'q', .* overflows \\(its largest magnitude is 3e\\+38\\)"):
            with engine.create_session(SessionConfig(lora_path=LLAMA.parent / "adapter_lora_xs")) as session:
                session.run_prefill([1, 2, 3])
