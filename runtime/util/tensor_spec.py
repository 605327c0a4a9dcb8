"""TensorSpec: the name, shape and dtype of one model input or output."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TensorSpec:
    """What a signature expects for one tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        """Bytes a buffer of this shape and dtype holds."""
        return math.prod(self.shape) * self.dtype.itemsize

    def describe(self) -> str:
        """``name [d0, d1] dtype``, for messages and listings."""
        return f"{self.name} {list(self.shape)} {self.dtype.name}"
