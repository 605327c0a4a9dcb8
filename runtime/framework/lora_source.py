"""LoraSource: where one adapter comes from, and how strongly it is applied."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.errors import InvalidArgumentError
from runtime.adapters.adapter_formats import AdapterBuffer, AdapterOrigin


def check_scale(scale: object, what: str) -> float:
    """``scale`` as a float if it is a finite real number (numpy scalars too, not bools),
    else ``InvalidArgumentError`` naming ``what``."""
    if isinstance(scale, bool | np.bool_) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise InvalidArgumentError(f"{what}={scale!r}, expected a finite number")
    return float(scale)


def check_sha256(digest: object, what: str) -> str:
    """``digest`` in lower case if it is a SHA-256 in hex (64 hex digits), else
    ``InvalidArgumentError`` naming ``what``."""
    if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdefABCDEF" for c in digest):
        raise InvalidArgumentError(f"{what}={digest!r:.80}, expected 64 hex digits (the file's SHA-256)")
    return digest.lower()


@dataclass(frozen=True)
class LoraSource:
    """One adapter for a session, and its ``scale``.

    ``path``: a ``.tflite`` LoRA file, a GGUF LoRA or a PEFT directory (detected by
    content). ``buffer``: the bytes of a ``.tflite`` LoRA file, or a PEFT state dict
    (name -> array) together with ``peft_config`` (the ``adapter_config.json`` dict).
    ``scale`` multiplies the adapter's delta (``W + scale * delta``); 0 turns it off.
    ``sha256``: if given, the hex digest the file (for PEFT: its safetensors file) or
    the buffer must have; checked before anything is registered.
    ``heads``: use the draft heads a Turbo LoRA carries (``medusa_head.*`` tensors) for
    speculative decoding; ``False`` loads the LoRA alone (registered apart from the same
    adapter with heads). A model without verify signatures refuses heads unless ``False``.
    """

    path: str | os.PathLike[str] | None = None
    buffer: AdapterBuffer | Mapping[str, Any] | None = None
    scale: float = 1.0
    peft_config: Mapping[str, Any] | None = None
    sha256: str | None = None
    heads: bool = True

    def __post_init__(self) -> None:
        if (self.path is None) == (self.buffer is None):
            raise InvalidArgumentError("LoraSource takes exactly one of path= or buffer=")
        if self.path is not None and (not isinstance(self.path, str | os.PathLike) or not os.fspath(self.path)
                                      or isinstance(os.fspath(self.path), bytes)):
            raise InvalidArgumentError(f"LoraSource path={self.path!r:.80}, expected a file or directory path (a "
                                       "non-empty str or os.PathLike)")
        if self.buffer is not None and not isinstance(self.buffer, AdapterBuffer | Mapping):
            raise InvalidArgumentError(f"LoraSource buffer={self.buffer!r:.80}, expected the bytes of an adapter "
                                       "file or a PEFT state dict (a mapping of tensor name to array)")
        if self.peft_config is not None and not isinstance(self.peft_config, Mapping):
            raise InvalidArgumentError(f"LoraSource peft_config={self.peft_config!r:.80}, expected a mapping (the "
                                       "adapter_config.json dict)")
        if not isinstance(self.heads, bool | np.bool_):
            raise InvalidArgumentError(f"LoraSource heads={self.heads!r:.40}, expected True or False")
        object.__setattr__(self, "heads", bool(self.heads))  # the registry's key holds it: np.True_ is True
        object.__setattr__(self, "scale", check_scale(self.scale, "LoraSource scale"))
        if self.sha256 is not None:
            check_sha256(self.sha256, "LoraSource sha256")

    @property
    def label(self) -> str:
        """The path, or a short description of the buffer, for messages."""
        if self.path is not None:
            return os.fspath(self.path)
        if isinstance(self.buffer, Mapping):
            return f"<in-memory PEFT state dict of {len(self.buffer)} tensors>"
        return f"<in-memory buffer of {len(self.buffer)} bytes>"

    def origin(self) -> AdapterOrigin:
        """Where the adapter's bytes are and the identity it is registered under (a
        mutable buffer is snapshotted here)."""
        if self.path is not None:
            return AdapterOrigin.of_file(self.path)
        return AdapterOrigin.of_buffer(self.buffer, self.peft_config, name=self.label)
