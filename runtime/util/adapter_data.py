"""AdapterData: the one interface every adapter source presents, and a computed implementation.

The ``.tflite`` reader (:class:`runtime.util.lora_data.LoraData`) serves stored bytes.
PEFT and GGUF adapters are presented the same way by :class:`DerivedLoraData`: tensors
named in the litert-torch convention, in graph layout (``a`` ``[in, r]``, ``b``
``[r, out]``), with the adapter's scale already folded into ``a``, each computed from
the source only when it is read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from runtime.errors import InternalError, InvalidArgumentError, NotFoundError
from runtime.util.lora_data import TensorInfo
from runtime.util.lora_util import is_lora_input_name, parse_lora_input_name, rank_axis
from runtime.util.scoped_file import FileWatch


MAX_LISTED = 12


def refuse_unappliable(source: str, refused: Sequence[str], separator: str = ", ") -> None:
    """``InvalidArgumentError`` listing the tensors (up to ``MAX_LISTED``) that no LoRA input
    of the model can take; nothing when ``refused`` is empty."""
    if not refused:
        return
    listed = separator.join(refused[:MAX_LISTED])
    if len(refused) > MAX_LISTED:
        listed += f"{separator}and {len(refused) - MAX_LISTED} more"
    raise InvalidArgumentError(
        f"{source}: cannot apply {len(refused)} tensor(s) (LoRA applies to the attention's q/k/v/o and the "
        f"MLP's gate/up/down only): {listed}"
    )


class AdapterData(Protocol):
    """What the LoRA component needs from an adapter, whatever its file format."""

    source_name: str
    format_name: str

    def get_all_tensor_names(self) -> list[str]:
        """Every tensor name, in a stable order."""

    def tensor_info(self, name: str) -> TensorInfo:
        """Shape, dtype and size of ``name`` (read from metadata only)."""

    def read_tensor(self, name: str) -> np.ndarray:
        """Tensor ``name``, read-only."""

    def get_lora_rank(self) -> int:
        """The adapter's (largest) rank."""

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors."""

    def release_memory(self) -> None:
        """Drops mapped pages of the source from this process, where possible."""

    def close(self) -> None:
        """Releases the source."""


@dataclass(frozen=True)
class DerivedTensor:
    """A tensor computed on demand: its shape and dtype, and how to compute it."""

    shape: tuple[int, ...]
    dtype: np.dtype
    compute: Callable[[], np.ndarray]


class DerivedLoraData:
    """An adapter whose tensors are computed from another source when read."""

    def __init__(
        self,
        tensors: Mapping[str, DerivedTensor],
        *,
        source_name: str,
        close: Callable[[], None] | None = None,
        format_name: str = "derived",
        watches: Sequence[FileWatch] = (),
        release: Callable[[], None] | None = None,
    ) -> None:
        """``watches``: files checked for changes before any tensor is computed;
        ``release``: drops mapped pages of the source (see :meth:`release_memory`)."""
        self.source_name = source_name
        self.format_name = format_name
        self._tensors = dict(tensors)
        self._close = close
        self._watches = tuple(watches)
        self._release = release

    def get_all_tensor_names(self) -> list[str]:
        """Every tensor name, in a stable order."""
        return list(self._tensors)

    def tensor_info(self, name: str) -> TensorInfo:
        """Shape, dtype and size of ``name``; ``NotFoundError`` if absent."""
        tensor = self._require(name)
        nbytes = int(np.prod(tensor.shape)) * tensor.dtype.itemsize
        return TensorInfo(name, tensor.shape, tensor.dtype, 0, nbytes, "computed")

    def read_tensor(self, name: str) -> np.ndarray:
        """Computes tensor ``name``; a read-only array of the announced shape and dtype."""
        tensor = self._require(name)
        for watch in self._watches:
            watch.check(f"tensor {name!r}")
        array = np.asarray(tensor.compute(), dtype=tensor.dtype)
        if array.shape != tensor.shape:
            raise InternalError(
                f"{self.source_name}: tensor {name!r} came out as {list(array.shape)}, "
                f"announced {list(tensor.shape)}"
            )
        array = array.view()  # read-only for our callers, without freezing the producer's array
        array.flags.writeable = False
        return array

    def get_lora_rank(self) -> int:
        """The largest rank over the ``a`` tensors."""
        ranks = []
        for name, tensor in self._tensors.items():
            if not is_lora_input_name(name):
                continue
            parsed = parse_lora_input_name(name)
            if parsed.side != "a":
                continue
            if len(tensor.shape) != 2:
                raise InvalidArgumentError(
                    f"{self.source_name}: tensor {name!r} has shape {list(tensor.shape)}, expected 2-D"
                )
            ranks.append(tensor.shape[rank_axis(parsed.convention, "a")])
        if not ranks:
            raise NotFoundError(f"{self.source_name}: no LoRA tensors")
        return max(ranks)

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors once computed."""
        return sum(self.tensor_info(name).nbytes for name in self._tensors)

    def release_memory(self) -> None:
        """Drops the source's mapped pages from this process, where the source allows it."""
        if self._release is not None:
            self._release()

    def close(self) -> None:
        """Releases the underlying source."""
        if self._close is not None:
            close, self._close = self._close, None
            close()

    def __enter__(self) -> DerivedLoraData:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _require(self, name: str) -> DerivedTensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise NotFoundError(f"{self.source_name}: no tensor named {name!r}") from None
