"""Which format an adapter is in (by content, not by name), opening it, and its identity.

| format | recognised by | reader |
|---|---|---|
| ``.tflite`` LoRA | ``TFL3`` at byte 4 | :class:`runtime.util.lora_data.LoraData` |
| GGUF LoRA | ``GGUF`` at byte 0 | :func:`runtime.util.gguf_data.read_gguf_lora` |
| PEFT | a directory (or its safetensors file) with ``adapter_config.json`` | :func:`runtime.util.peft_data.read_peft_directory` |

In memory: the bytes of a ``.tflite`` LoRA file, or a PEFT state dict (name -> array)
with its config.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from runtime.errors import InvalidArgumentError
from runtime.util.adapter_data import AdapterData
from runtime.util.gguf_data import GGUF_MAGIC, read_gguf_lora
from runtime.util.lora_data import FILE_IDENTIFIER, LoraData
from runtime.util.peft_data import CONFIG_FILE, WEIGHTS_FILE, read_peft_directory, read_peft_state_dict
from runtime.util.scoped_file import ScopedFile

TFLITE, GGUF, PEFT = "tflite", "gguf", "peft"

AdapterBuffer = bytes | bytearray | memoryview | mmap.mmap
# What identifies an adapter: the same key means the same adapter.
AdapterKey = tuple


def detect_format(path: str | os.PathLike[str]) -> str:
    """``"tflite"``, ``"gguf"`` or ``"peft"``, from the content; ``InvalidArgumentError`` otherwise."""
    path = Path(path)
    if _is_peft(path):
        return PEFT
    if path.is_dir():
        raise InvalidArgumentError(f"{path}: a directory without {CONFIG_FILE} is not a PEFT adapter")
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


def open_adapter(path: str | os.PathLike[str], *, head_dim: int | None = None) -> AdapterData:
    """Opens the adapter at ``path`` in whichever format it is."""
    kind = detect_format(path)
    if kind == PEFT:
        return read_peft_directory(_peft_dir(Path(path)))
    if kind == GGUF:
        return read_gguf_lora(path, head_dim=head_dim)
    return LoraData.create_from_file_path(path)


def open_adapter_buffer(
    buffer: AdapterBuffer | Mapping[str, Any], *, peft_config: Mapping[str, Any] | None = None, name: str
) -> AdapterData:
    """An in-memory adapter: ``.tflite`` bytes, or a PEFT state dict with ``peft_config``."""
    if isinstance(buffer, Mapping):
        if peft_config is None:
            raise InvalidArgumentError(f"{name}: a state dict needs its PEFT config (peft_config=)")
        return read_peft_state_dict(buffer, peft_config, name)
    if peft_config is not None:
        raise InvalidArgumentError(f"{name}: peft_config goes with a state dict, not with bytes")
    return LoraData.create_from_buffer(buffer, name=name)


def file_identity(path: str | os.PathLike[str]) -> AdapterKey:
    """Device, inode, size and mtime of the adapter's files: another path or a link to the
    same files gives the same key; rewriting them gives another.

    Called on every session creation and ``set_adapters``, so it makes as few system
    calls as it can: one for a file, four for a PEFT directory.
    """
    name = os.fspath(path)
    first = _stat(name)
    if stat.S_ISDIR(first.st_mode):
        folder = name
    elif name.endswith(".safetensors") and os.path.isfile(os.path.join(os.path.dirname(name), CONFIG_FILE)):
        folder = os.path.dirname(name)
    else:
        return ("file", first.st_dev, first.st_ino, first.st_size, first.st_mtime_ns)
    config = os.path.join(folder, CONFIG_FILE)
    if folder == name and not os.path.exists(config):
        detect_format(Path(name))  # a directory that is not a PEFT adapter: says why
    key: list[Any] = ["file"]
    for file in (config, os.path.join(folder, WEIGHTS_FILE)):
        st = _stat(file)
        key += [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
    return tuple(key)


def _stat(name: str) -> os.stat_result:
    try:
        return os.stat(name)
    except OSError:
        with ScopedFile(name):  # raises the precise status error (missing, no permission...)
            pass
        raise


def buffer_identity(buffer: AdapterBuffer | Mapping[str, Any], peft_config: Mapping[str, Any] | None = None) -> AdapterKey:
    """The SHA-256 of an in-memory adapter's content (and config): same bytes, same key."""
    digest = hashlib.sha256()
    try:
        if isinstance(buffer, Mapping):
            digest.update(json.dumps(peft_config, sort_keys=True, default=str).encode())
            for key in sorted(buffer):
                array = np.ascontiguousarray(buffer[key])
                digest.update(f"{key}|{array.dtype.str}|{array.shape}|".encode())
                digest.update(array.tobytes())
        else:
            digest.update(buffer)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"cannot read the in-memory adapter: {exc}") from None
    return ("blob", digest.hexdigest())


def _is_peft(path: Path) -> bool:
    return (path.is_dir() and (path / CONFIG_FILE).is_file()) or (
        path.suffix == ".safetensors" and (path.parent / CONFIG_FILE).is_file()
    )


def _peft_dir(path: Path) -> Path:
    return path if path.is_dir() else path.parent

