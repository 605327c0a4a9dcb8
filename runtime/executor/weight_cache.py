"""XNNPACK's packed weights kept in a file between runs of a model.

Opening a model packs its weight matrices into XNNPACK's layouts (SmolLM2-135M f32: 539 MB
written, about 0.8 s of a 4 s open). Given a file, XNNPACK writes the packed weights there
on the first open and maps them on every later one, and processes that open the same
model share those pages.

XNNPACK's file is not tied to the model it was packed from: its header checks only the
file format and XNNPACK's build, and packed weights are found by the model's buffer
numbers, so a file kept after its model changed would give the new model the old one's
weights. A file here is therefore named after its model's identity: the model file's
resolved path, size, modification time and inode (what Python's bytecode caches key on,
plus the inode, which changes when a file is replaced), which part of the file the model
is, and the ai-edge-litert version. A model changed in place gets a new file, and the
old one is removed.

XNNPACK rewrites in place a file it cannot load, truncating it under any process that
maps it. So a file is built under a name of its own and renamed into place once the
model compiled and its data is on disk: a published file is complete and never written
again. Processes that build at once each publish a whole file; the last rename wins.

By default (:data:`WeightCacheDir.USER`) the files live in the user's cache directory,
``$RUNTIME_CACHE/xnnpack`` (``~/.cache/runtime/xnnpack``), and a model opens with its
weights packed in memory, as without a cache, where no file can be written there: the
directory cannot be made or written, its disk has no room, or it is in memory (tmpfs), where
a file would hold the model's size of memory after the process ends and runs no faster.
Deleting the directory is safe: a process that maps a file keeps its pages.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from glob import escape
from importlib.metadata import version
from pathlib import Path

from runtime.errors import NotFoundError, PermissionDeniedError, ResourceExhaustedError
from runtime.util.cache_dir import runtime_cache_dir

log = logging.getLogger(__name__)

SUFFIX = ".xnnpack"
_BUILDING = ".building"  # a file being written: f"{published name}.{pid}.{random}{_BUILDING}"
_HEADROOM = 1.25  # free space asked for, times the model's size (packed int4 weights take more than the file)
IN_MEMORY = ":memory:"  # XNNPACK's name for a weight cache without a file
_MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs"})


class WeightCacheDir(Enum):
    """Where packed weights are kept when no directory is named."""

    USER = "the user's cache directory"
    """``$RUNTIME_CACHE/xnnpack`` (``$XDG_CACHE_HOME/runtime/xnnpack``,
    ``~/.cache/runtime/xnnpack``), used where a file can be written there (see the module)."""


@dataclass(frozen=True)
class WeightCacheFile:
    """The packed-weight file of one model: ``path``, in a directory of such files.

    ``path`` is ``{model stem}.{digest of the model's path}.{digest of its
    identity}.xnnpack``; files of the same model path with another identity are stale.
    ``fallback_to_memory``: where no new file can be written, the weights are packed in
    memory instead of the open being refused.
    """

    path: Path
    fallback_to_memory: bool = False

    @classmethod
    def for_model(cls, directory: str | os.PathLike[str], model_file: str | os.PathLike[str],
                  part: str = "", *, fallback_to_memory: bool = False) -> WeightCacheFile:
        """The file for the model stored in ``model_file`` (``part``: which model of the
        file, for a file holding several, e.g. a bundle's section). ``NotFoundError``
        when ``model_file`` does not exist."""
        source = Path(model_file)
        try:
            stat = source.stat()
        except OSError as exc:
            raise NotFoundError(f"{source}: no such model file" if isinstance(exc, FileNotFoundError)
                                else f"{source}: cannot read the model file: {exc.strerror}") from None
        where = os.path.realpath(source)
        identity = (where, part, stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_dev, version("ai-edge-litert"))
        name = f"{source.stem}.{_digest(where, part)[:8]}.{_digest(*identity)[:16]}{SUFFIX}"
        return cls(Path(directory) / name, fallback_to_memory)

    @property
    def _model_prefix(self) -> str:
        """What the names of every file of this model path start with."""
        return self.path.name.rsplit(".", 2)[0] + "."

    @contextmanager
    def open_for(self, model_bytes: int) -> Iterator[str]:
        """The path to give XNNPACK for a model of ``model_bytes``: the published file if
        there is one; else a new file, published (and this model's stale files removed)
        when the block completes, removed when it raises.

        ``PermissionDeniedError`` when a new file cannot be made in the directory,
        ``ResourceExhaustedError`` when the directory's disk has no room for it
        (XNNPACK aborts the process when a write fails); with ``fallback_to_memory``,
        :data:`IN_MEMORY` instead, and also where the directory is in memory.
        """
        if self.path.is_file():
            yield str(self.path)
            return
        try:
            building = self._start_building(model_bytes)
        except (PermissionDeniedError, ResourceExhaustedError) as exc:
            if not self.fallback_to_memory:
                raise
            log.info("%s; the model's weights are packed in memory", exc)
            yield IN_MEMORY
            return
        try:
            yield str(building)
            with open(building, "rb") as written:
                os.fsync(written.fileno())
            os.replace(building, self.path)
        finally:
            building.unlink(missing_ok=True)
        self._remove_stale()

    def _start_building(self, model_bytes: int) -> Path:
        """Makes the empty file that XNNPACK will write, once the directory is known to hold it."""
        directory = self.path.parent
        if self.fallback_to_memory and _file_system_type(directory) in _MEMORY_FILE_SYSTEMS:
            raise ResourceExhaustedError(f"{directory}: in memory (tmpfs), no weight cache is written there")
        try:
            directory.mkdir(parents=True, exist_ok=True)
            free, needed = shutil.disk_usage(directory).free, int(model_bytes * _HEADROOM)
            if free < needed:  # checked before any file is made: nothing to remove when refused
                raise ResourceExhaustedError(
                    f"{directory}: {free / 2**20:.0f} MiB free, the weight cache {self.path.name} needs about "
                    f"{needed / 2**20:.0f} MiB; free some space or open the model without a weight cache directory")
            building = directory / f"{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}{_BUILDING}"
            building.touch(exist_ok=False)
        except OSError as exc:
            raise PermissionDeniedError(
                f"{directory}: cannot write the weight cache {self.path.name} there: {exc.strerror}") from None
        return building

    def _remove_stale(self) -> None:
        """Removes this model path's files of other identities, and files whose builder
        process is gone (a process that maps one keeps its pages: removal is safe)."""
        for other in self.path.parent.glob(escape(self._model_prefix) + "*"):
            if other == self.path:
                continue
            if other.name.endswith(SUFFIX) or (other.name.endswith(_BUILDING) and not _alive(other)):
                other.unlink(missing_ok=True)


def weight_cache_file(directory: str | os.PathLike[str] | WeightCacheDir | None, model_file: str | os.PathLike[str],
                      part: str = "") -> WeightCacheFile | None:
    """The file that ``EngineSettings.weight_cache_dir`` (``directory``) asks for, for the
    model in ``model_file`` (``part``: see :meth:`WeightCacheFile.for_model`); ``None``:
    no file, weights packed in memory."""
    if directory is None:
        return None
    if directory is WeightCacheDir.USER:
        return WeightCacheFile.for_model(runtime_cache_dir() / "xnnpack", model_file, part, fallback_to_memory=True)
    return WeightCacheFile.for_model(directory, model_file, part)


def _file_system_type(directory: Path) -> str:
    """The type of the file system that holds ``directory`` (or would, once made), from
    ``/proc/self/mounts``; ``""`` where that cannot be read."""
    where = Path(os.path.realpath(directory))
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return ""
    best, kind = "", ""
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), fields[1])  # "\040": a space
        if len(point) >= len(best) and where.is_relative_to(point):
            best, kind = point, fields[2]
    return kind


def _digest(*parts: object) -> str:
    return hashlib.blake2b("\0".join(map(str, parts)).encode(), digest_size=16).hexdigest()


def _alive(building: Path) -> bool:
    """Whether the process that writes ``building`` (its pid is in the name) still runs."""
    try:
        pid = int(building.name[:-len(_BUILDING)].rsplit(".", 2)[1])
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True
