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

from collections.abc import Callable, Sequence
from functools import partial
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

    def __init__(self, model: CompiledModel, *, direct: bool = True) -> None:
        """``direct=False`` uses the public API only (as with another ai-edge-litert)."""
        self._model = model
        wrapper = getattr(model, "_model", None)
        self._run_by_index = getattr(wrapper, "RunByIndex", None) if direct else None
        self._write = getattr(_tb, "WriteTensorBuffer", None) if direct else None
        self._read = getattr(_tb, "ReadTensorToBuffer", None) if direct else None

    @property
    def direct(self) -> bool:
        """Whether the private fast calls are in use."""
        return None not in (self._run_by_index, self._write, self._read)

    def writer(self, buffer: TensorBuffer, array: np.ndarray) -> Callable[[], None]:
        """A call copying ``array`` (contiguous int32, which the caller updates in place)
        into ``buffer``: everything but the copy is done here, once."""
        if self._write is not None:
            return partial(self._write, buffer.capsule, array.reshape(-1), "int32")
        return partial(buffer.write, array)

    def reader(self, buffer: TensorBuffer) -> Callable[[np.ndarray], None]:
        """A call filling a contiguous float32 array of ``buffer``'s size from it."""
        if self._read is not None:
            read, capsule = self._read, buffer.capsule
            return lambda out: read(capsule, out, "float32")

        def read_public(out: np.ndarray) -> None:
            out[...] = np.asarray(buffer.read(out.size, np.float32)).reshape(out.shape)
        return read_public

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
