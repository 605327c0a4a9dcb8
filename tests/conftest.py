"""Shared fixtures: paths to the committed test models and adapters."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

MODELS = Path(__file__).resolve().parent / "models"
ADAPTERS = MODELS / "adapters"


def adapter_path(name: str) -> Path:
    """Path of a committed adapter fixture, e.g. ``adapter_path("torch_r4")``."""
    return ADAPTERS / f"{name}.tflite"


@pytest.fixture(scope="session")
def adapter_manifest() -> dict:
    return json.loads((ADAPTERS / "MANIFEST.json").read_text())


@pytest.fixture(scope="session")
def expected_tensors() -> dict[str, np.ndarray]:
    with np.load(ADAPTERS / "expected.npz") as data:
        return {key: data[key] for key in data.files}
