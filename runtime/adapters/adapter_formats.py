"""What an adapter source is: its format (by content, not by name), how to open it, and
how it is known again (its identity), all decided here.

| format | recognised by | reader |
|---|---|---|
| ``.tflite`` LoRA | ``TFL3`` at byte 4 | :class:`runtime.adapters.lora_data.LoraData` |
| GGUF LoRA | ``GGUF`` at byte 0 | :func:`runtime.adapters.gguf_data.read_gguf_lora` |
| PEFT | a directory (or its safetensors file) with ``adapter_config.json`` | :func:`runtime.adapters.peft_data.read_peft_directory` |

In memory: the bytes of a ``.tflite`` LoRA file, or a PEFT state dict (name -> array)
with its config.

A PEFT adapter is named by its directory or by the safetensors file inside it
(:func:`peft_directory`); everything below goes through that one rule.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime.errors import DataLossError, InvalidArgumentError
from runtime.adapters.adapter_data import AdapterData
from runtime.adapters.gguf_data import read_gguf_lora
from runtime.adapters.lora_data import FILE_IDENTIFIER, LoraData
from runtime.adapters.lora_xs import LoraXsFactors
from runtime.adapters.peft_data import CONFIG_FILE, WEIGHTS_FILE, read_peft_directory, read_peft_state_dict
from runtime.util.gguf_file import GGUF_MAGIC
from runtime.util.scoped_file import ScopedFile

TFLITE, GGUF, PEFT = "tflite", "gguf", "peft"

AdapterBuffer = bytes | bytearray | memoryview | mmap.mmap
# What identifies an adapter: the same key means the same adapter.
AdapterKey = tuple


def peft_directory(path: str | os.PathLike[str]) -> Path | None:
    """The PEFT adapter directory ``path`` names (the directory, or the safetensors file
    in it), or ``None`` when ``path`` is not one. ``InvalidArgumentError`` for a directory
    without ``adapter_config.json``."""
    name = os.fspath(path)
    folder = _peft_folder(name, _stat(name))
    return None if folder is None else Path(folder)


def _peft_folder(name: str, status: os.stat_result) -> str | None:
    """:func:`peft_directory` for a path already stat'ed (the identity's fast path)."""
    if stat.S_ISDIR(status.st_mode):
        if not os.path.isfile(os.path.join(name, CONFIG_FILE)):
            raise InvalidArgumentError(f"{name}: a directory without {CONFIG_FILE} is not a PEFT adapter")
        return name
    folder = os.path.dirname(name) or "."
    if name.endswith(".safetensors") and os.path.isfile(os.path.join(folder, CONFIG_FILE)):
        return folder
    return None


def detect_format(path: str | os.PathLike[str]) -> str:
    """``"tflite"``, ``"gguf"`` or ``"peft"``, from the content; ``InvalidArgumentError`` otherwise."""
    if peft_directory(path) is not None:
        return PEFT
    return _file_format(Path(path))


def _file_format(path: Path) -> str:
    with ScopedFile(path) as scoped:
        head = os.pread(scoped.fileno(), 8, 0)
    if len(head) == 0:
        raise InvalidArgumentError(f"{path}: file is empty")
    if head[:4] == GGUF_MAGIC:
        return GGUF
    if head[4:8] == FILE_IDENTIFIER:
        return TFLITE
    raise InvalidArgumentError(
        f"{path}: unknown adapter format (expected a .tflite LoRA file, a GGUF LoRA or a PEFT directory)"
    )


def open_adapter(path: str | os.PathLike[str], *, head_dim: int | None = None,
                 lora_xs: LoraXsFactors | None = None) -> AdapterData:
    """Opens the adapter at ``path`` in whichever format it is (see :meth:`AdapterOrigin.open`)."""
    return AdapterOrigin.of_file(path).open(head_dim=head_dim, lora_xs=lora_xs)


@dataclass(frozen=True, eq=False)
class AdapterOrigin:
    """Where one adapter comes from, and the ``key`` it is known by again.

    For files, ``key`` is the device, inode, size, modification and change time of the
    adapter's files: another path or a link to the same files gives the same key; rewriting
    them gives another, also in place with the size and modification time kept (``cp -p``):
    the change time, which the kernel sets on every write and no call sets back, moves.
    (It moves on a ``chmod`` or a new hard link too: the same bytes are then registered
    again under a new id, which costs a parse; never new bytes under an old id.) For memory, it is the SHA-256 of the content (and PEFT config): the
    same bytes give the same key. ``path`` is the adapter file or PEFT directory;
    ``buffer`` an in-memory adapter no caller can change any more.
    """

    key: AdapterKey
    name: str
    path: str | None = None
    peft: bool = False
    buffer: AdapterBuffer | Mapping[str, np.ndarray] | None = None
    peft_config: Mapping[str, Any] | None = None

    @classmethod
    def of_file(cls, path: str | os.PathLike[str]) -> AdapterOrigin:
        """The adapter file or PEFT directory at ``path`` (or its safetensors file).

        Run on every session creation and ``set_adapters``, so it makes as few system
        calls as it can: one for a file, four for a PEFT directory.
        """
        name = os.fspath(path)
        first = _stat(name)
        folder = _peft_folder(name, first)
        if folder is None:
            return cls(("file", *_identity(first)), name, name)
        key: list[Any] = ["file"]
        for file in (os.path.join(folder, CONFIG_FILE), os.path.join(folder, WEIGHTS_FILE)):
            key += _identity(_stat(file))
        return cls(tuple(key), folder, folder, peft=True)

    @classmethod
    def of_buffer(
        cls,
        buffer: AdapterBuffer | Mapping[str, Any],
        peft_config: Mapping[str, Any] | None = None,
        *,
        name: str,
    ) -> AdapterOrigin:
        """An in-memory adapter: ``.tflite`` bytes, or a PEFT state dict with ``peft_config``.

        A buffer the caller could change later (bytearray, writable memoryview or mmap, a
        state dict of arrays) is copied once here, so that no registered adapter changes
        behind the sessions' backs; ``bytes`` and read-only views are kept by reference.
        """
        snapshot = _immutable(buffer)
        digest = hashlib.sha256()
        try:
            if isinstance(snapshot, Mapping):
                digest.update(json.dumps(peft_config, sort_keys=True, default=str).encode())
                for tensor in sorted(snapshot):
                    array = np.ascontiguousarray(snapshot[tensor])
                    digest.update(f"{tensor}|{array.dtype.str}|{array.shape}|".encode())
                    digest.update(array.tobytes())
            else:
                digest.update(snapshot)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"{name}: cannot read the in-memory adapter: {exc}") from None
        return cls(("blob", digest.hexdigest()), name, buffer=snapshot, peft_config=peft_config)

    def check_sha256(self, expected: str) -> None:
        """``DataLossError`` unless the adapter's bytes (for PEFT: its safetensors file)
        have the SHA-256 ``expected``."""
        digest = hashlib.sha256()
        what = self.name
        if self.path is not None:
            what = os.path.join(self.path, WEIGHTS_FILE) if self.peft else self.path
            with ScopedFile(what) as scoped, open(scoped.fileno(), "rb", closefd=False) as file:
                for chunk in iter(lambda: file.read(1 << 20), b""):
                    digest.update(chunk)
        elif isinstance(self.buffer, Mapping):
            raise InvalidArgumentError(f"{self.name}: sha256 checks bytes; a state dict has none")
        else:
            digest.update(self.buffer)
        if digest.hexdigest() != expected.lower():
            raise DataLossError(
                f"{what}: SHA-256 is {digest.hexdigest()}, expected {expected.lower()}; nothing was registered"
            )

    def open(self, *, head_dim: int | None = None, lora_xs: LoraXsFactors | None = None,
             heads: bool = False) -> AdapterData:
        """Reads the adapter's metadata (no weights yet) in whichever format it is.
        ``head_dim``: the model's, which GGUF LoRA needs to undo llama's RoPE row order;
        ``lora_xs``: the model's LoRA-XS factors, which an R-only PEFT adapter needs;
        ``heads``: read the draft heads a PEFT adapter carries into ``draft_heads``, in the
        same pass (other formats carry none)."""
        if self.path is None:
            if isinstance(self.buffer, Mapping):
                if self.peft_config is None:
                    raise InvalidArgumentError(f"{self.name}: a state dict needs its PEFT config (peft_config=)")
                return read_peft_state_dict(self.buffer, self.peft_config, self.name, lora_xs, heads=heads)
            if self.peft_config is not None:
                raise InvalidArgumentError(f"{self.name}: peft_config goes with a state dict, not with bytes")
            return LoraData.create_from_buffer(self.buffer, name=self.name)
        if self.peft:
            return read_peft_directory(self.path, lora_xs, heads=heads)
        if _file_format(Path(self.path)) == GGUF:
            return read_gguf_lora(self.path, head_dim=head_dim)
        return LoraData.create_from_file_path(self.path)


def _identity(status: os.stat_result) -> tuple[int, int, int, int, int]:
    """What tells one file's contents from another's without reading them (see :class:`AdapterOrigin`)."""
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns


def _stat(name: str) -> os.stat_result:
    try:
        return os.stat(name)
    except OSError:
        with ScopedFile(name):  # raises the precise status error (missing, no permission...)
            pass
        raise


def _immutable(buffer: AdapterBuffer | Mapping[str, Any]) -> AdapterBuffer | Mapping[str, np.ndarray]:
    """``buffer`` itself if nobody can change it, else a private copy."""
    if isinstance(buffer, bytes) or (isinstance(buffer, memoryview) and buffer.readonly):
        return buffer
    if isinstance(buffer, bytearray | memoryview | mmap.mmap):
        try:
            return bytes(buffer)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"cannot read the in-memory adapter: {exc}") from None
    if isinstance(buffer, Mapping):
        snapshot = {}
        for name, value in buffer.items():
            try:
                array = np.array(value, copy=True)
            except (TypeError, ValueError) as exc:
                raise InvalidArgumentError(f"state dict tensor {name!r} is not an array: {exc}") from None
            array.flags.writeable = False
            snapshot[str(name)] = array
        return snapshot
    raise InvalidArgumentError(
        "expected bytes, bytearray, memoryview, mmap or a state dict for an in-memory adapter, "
        f"got {type(buffer).__name__}"
    )
