"""The decode hot path's calls into ai-edge-litert, with arguments prepared once.

``TensorBuffer.write``/``read`` and ``CompiledModel.run_by_name``/``run_by_index``
normalize and convert their arguments on every call: for one decode step of a small
model that was ~25 us of Python, more than the runtime's own work. They end in three
pybind functions (write a buffer, read a buffer, run a signature with capsule lists);
this module calls those with capsules and arrays prepared when a binding is built.

These are private names of ai-edge-litert 2.3.x. If they are missing (another version),
every call falls back to the public API, which gives the same results, only slower.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from ai_edge_litert.compiled_model import CompiledModel
from ai_edge_litert.tensor_buffer import TensorBuffer

try:  # pragma: no cover - depends on the installed wheel's layout
    from ai_edge_litert import _pywrap_litert_tensor_buffer_wrapper as _tb
except ImportError:  # pragma: no cover
    _tb = None


class FastPath:
    """Writes, reads and runs with prepared arguments; falls back to the public API."""

    def __init__(self, model: CompiledModel) -> None:
        self._model = model
        wrapper = getattr(model, "_model", None)
        self._run_by_index = getattr(wrapper, "RunByIndex", None)
        self._write = getattr(_tb, "WriteTensorBuffer", None)
        self._read = getattr(_tb, "ReadTensorToBuffer", None)

    @property
    def direct(self) -> bool:
        """Whether the private fast calls are in use."""
        return None not in (self._run_by_index, self._write, self._read)

    def write_int32(self, buffer: TensorBuffer, array: np.ndarray) -> None:
        """Copies a contiguous int32 array into ``buffer``."""
        if self._write is not None:
            self._write(buffer.capsule, array.reshape(-1), "int32")
        else:
            buffer.write(array)

    def read_float32(self, buffer: TensorBuffer, out: np.ndarray) -> np.ndarray:
        """Fills the contiguous float32 array ``out`` from ``buffer`` and returns it."""
        if self._read is not None:
            self._read(buffer.capsule, out.reshape(-1), "float32")
            return out
        out.reshape(-1)[:] = buffer.read(out.size, np.float32)
        return out

    def prepare(self, inputs: Sequence[TensorBuffer], outputs: Sequence[TensorBuffer]) -> tuple[Any, Any]:
        """What :meth:`run` takes for these buffers, built once per binding."""
        if self._run_by_index is not None:
            return [b.capsule for b in inputs], [b.capsule for b in outputs]
        return list(inputs), list(outputs)

    def run(self, signature_index: int, prepared: tuple[Any, Any]) -> None:
        """Runs signature ``signature_index`` with arguments from :meth:`prepare`."""
        inputs, outputs = prepared
        if self._run_by_index is not None:
            self._run_by_index(signature_index, inputs, outputs)
        else:
            self._model.run_by_index(signature_index, inputs, outputs)
