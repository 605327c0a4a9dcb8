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
old one is removed once no process uses it.

XNNPACK rewrites in place a file it cannot load, truncating it under any process that
maps it. So a file is built under a name of its own and renamed into place once the
model compiled and its data is on disk: a published file is complete and never written
again. Of processes that build at once, the first to finish publishes its whole file. A
published file whose size is not the one recorded at publishing (a copy of the directory
cut short) is not given to XNNPACK: it goes, once unused, and a new file is built.

By default (:data:`WeightCacheDir.USER`) the files live in the user's cache directory,
``$RUNTIME_CACHE/xnnpack`` (``~/.cache/runtime/xnnpack``), and a model opens with its
weights packed in memory, as without a cache, where no file can be written there: the
directory cannot be made or written, its disk has no room, or it is in memory (tmpfs), where
a file would hold the model's size of memory after the process ends and runs no faster.
Deleting the directory is safe: a process that maps a file keeps its pages.

The directory is bounded (``max_bytes``, by default :data:`DEFAULT_MAX_BYTES` or
``$RUNTIME_WEIGHT_CACHE_MAX_SIZE``): every open drops the files whose model file is gone or
changed since (a ``.source`` file beside each one records the model it was packed from),
then the least recently used files until the rest fit; so too when the disk has no room
for a new file, before the open gives up on writing one. A file is "used" when a model opens
from it and when that model closes (its access time is set then; the modification time
stays the file's writing). A file in use is never removed: each process that opens a
model from a file holds a shared ``flock`` on it until the model closes, and removal takes
an exclusive one without waiting, skipping the file when that fails. On Linux removing a
mapped file would not break the process that maps it (the pages live until unmapped) but
would free no disk space, and a file removed between the check that it exists and
XNNPACK's open would make XNNPACK write a new file in place under that name. So lookups,
publishing and removals take the directory's ``.lock`` in turn: a file found is locked
before anyone can remove it, and a file is published only where none is (two builders:
the first publishes, the second's file is dropped once its model has mapped it). Files in
use may hold the directory above its cap until their models close, a model whose packed
weights alone exceed the cap included: its file serves it until another model is opened.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from glob import escape
from importlib.metadata import version
from pathlib import Path

from runtime.errors import (
    FailedPreconditionError, InvalidArgumentError, NotFoundError, PermissionDeniedError, ResourceExhaustedError,
)
from runtime.util.cache_dir import foreign_writer, runtime_cache_dir
from runtime.util.page_advice import read_again_in_huge_pages

log = logging.getLogger(__name__)

SUFFIX = ".xnnpack"
_BUILDING = ".building"  # a file being written: f"{published name}.{pid}.{random}{_BUILDING}"
_HEADROOM = 1.25  # free space asked for, times the model's size (packed int4 weights take more than the file)
IN_MEMORY = ":memory:"  # XNNPACK's name for a weight cache without a file
_SOURCE = ".source"  # beside a published file: f"{its name}{_SOURCE}", the model it was packed from (JSON)
_SIZE = "packed_bytes"  # in a .source beside the model's identity: the size the file was published with
_LOCK = ".lock"  # the directory's lock: lookups, publishing and removals take it in turn
DEFAULT_MAX_BYTES = 5 * 2**30
"""The directory's default cap, 5 GiB: the packed weights of the few models one switches
between (about nine SmolLM2-135M f32 files of 539 MB, three 1.5 GB int8 1B models, or one
4 GiB f32 1B model), the size ccache ships with; files of deleted models go regardless."""
MAX_SIZE_ENV = "RUNTIME_WEIGHT_CACHE_MAX_SIZE"
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs"})


class WeightCacheDir(Enum):
    """Where packed weights are kept when no directory is named."""

    USER = "the user's cache directory"
    """``$RUNTIME_CACHE/xnnpack`` (``$XDG_CACHE_HOME/runtime/xnnpack``,
    ``~/.cache/runtime/xnnpack``), used where a file can be written there (see the module)."""


@dataclass(frozen=True)
class ModelIdentity:
    """What a file's name digests: the model file's resolved path, which model of it, and
    the file's size, modification time, inode and device."""

    path: str
    part: str
    size: int
    mtime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, model_file: str | os.PathLike[str], part: str = "") -> ModelIdentity:
        """``NotFoundError`` when ``model_file`` does not exist."""
        source = Path(model_file)
        try:
            stat = source.stat()
        except OSError as exc:
            raise NotFoundError(f"{source}: no such model file" if isinstance(exc, FileNotFoundError)
                                else f"{source}: cannot read the model file: {exc.strerror}") from None
        return cls(os.path.realpath(source), part, stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_dev)

    def gone(self) -> bool:
        """Whether no file has this identity any more (removed, replaced or changed since);
        a model file that cannot be read counts as present."""
        try:
            return ModelIdentity.of(self.path, self.part) != self
        except NotFoundError as exc:
            return "no such model file" in str(exc)


@dataclass
class WeightCacheUse:
    """What one model opened with: ``path``, the file given to XNNPACK (or :data:`IN_MEMORY`),
    held in use (a shared lock) until :meth:`release`."""

    path: str
    _fd: int | None = field(default=None, repr=False)

    def release(self) -> None:
        """Marks the file used now and lets it be removed; releasing twice is harmless."""
        fd, self._fd = self._fd, None
        if fd is not None:
            _touch(fd)
            os.close(fd)


@dataclass(frozen=True)
class WeightCacheEntry:
    """One published file of a cache directory."""

    name: str
    nbytes: int
    last_used: float  # seconds since the epoch: when a model last opened from it or closed
    model: str | None  # the model file it was packed from (None: not recorded, written by an older runtime)
    in_use: bool  # a process has a model open from it
    model_gone: bool  # that model file is gone or changed: the file is dropped once no process uses it


@dataclass(frozen=True)
class WeightCacheStats:
    """What a weight cache directory holds, least recently used first, and what this engine
    opened from it."""

    directory: str
    max_bytes: int | None  # the cap (None: unbounded)
    entries: tuple[WeightCacheEntry, ...]
    file: str | None = None  # this engine's file; None: its weights were packed in memory

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries)

    def describe(self) -> str:
        """A few lines for people: the directory, its total against the cap, and every file."""
        cap = "unbounded" if self.max_bytes is None else f"cap {_mib(self.max_bytes)}"
        lines = [f"weight cache {self.directory}: {len(self.entries)} file(s), {_mib(self.nbytes)} ({cap})"]
        for entry in self.entries:
            notes = [note for note, on in (("in use", entry.in_use), ("model gone", entry.model_gone)) if on]
            used = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.last_used))
            lines.append(f"    {entry.name:<48} {_mib(entry.nbytes):>10}  used {used}  "
                         f"{entry.model or 'model not recorded'}{''.join(f' [{n}]' for n in notes)}")
        return "\n".join(lines)


@dataclass(frozen=True)
class WeightCacheFile:
    """The packed-weight file of one model: ``path``, in a directory of such files.

    ``path`` is ``{model stem}.{digest of the model's path}.{digest of its
    identity}.xnnpack``; files of the same model path with another identity are stale.
    ``fallback_to_memory``: where no new file can be written, the weights are packed in
    memory instead of the open being refused. ``max_bytes``: the directory's cap (``None``:
    unbounded).
    """

    path: Path
    fallback_to_memory: bool = False
    max_bytes: int | None = DEFAULT_MAX_BYTES
    model: ModelIdentity | None = field(default=None, compare=False)

    @classmethod
    def for_model(cls, directory: str | os.PathLike[str], model_file: str | os.PathLike[str],
                  part: str = "", *, fallback_to_memory: bool = False,
                  max_bytes: int | None = DEFAULT_MAX_BYTES) -> WeightCacheFile:
        """The file for the model stored in ``model_file`` (``part``: which model of the
        file, for a file holding several, e.g. a bundle's section). ``NotFoundError``
        when ``model_file`` does not exist."""
        model = ModelIdentity.of(model_file, part)
        identity = (model.path, part, model.size, model.mtime_ns, model.inode, model.device, version("ai-edge-litert"))
        name = f"{Path(model_file).stem}.{_digest(model.path, part)[:8]}.{_digest(*identity)[:16]}{SUFFIX}"
        return cls(Path(directory) / name, fallback_to_memory, max_bytes, model)

    @property
    def _model_prefix(self) -> str:
        """What the names of every file of this model path start with."""
        return self.path.name.rsplit(".", 2)[0] + "."

    @contextmanager
    def open_for(self, model_bytes: int) -> Iterator[WeightCacheUse]:
        """What to give XNNPACK for a model of ``model_bytes`` (its ``path``): the published
        file if there is one; else a new file, published (and this model's stale files
        removed) when the block completes, removed when it raises. The caller releases the
        use when its model closes. Files of gone models, then the least recently used ones,
        are removed until the directory fits its cap (counted from the files' sizes once
        written: a model's packed weights may take a sixth of its file, or more than it).

        ``InvalidArgumentError`` when the directory is a file, ``PermissionDeniedError``
        when a new file cannot be made in the directory or when another user could have
        written it or the published file (:func:`foreign_writer`: XNNPACK trusts what it
        reads there), ``ResourceExhaustedError`` when the directory's disk has no room for it
        (XNNPACK aborts the process when a write fails); with ``fallback_to_memory``,
        :data:`IN_MEMORY` instead, and also where the directory is in memory.
        """
        why = foreign_writer(self.path.parent)
        if why is not None:
            refusal = PermissionDeniedError(f"{why}: the weight cache {self.path.name} is not used there; set "
                                            "RUNTIME_CACHE to a directory only you can write")
            if not self.fallback_to_memory:
                raise refusal
            log.info("%s; the model's weights are packed in memory", refusal.args[0])
            yield WeightCacheUse(IN_MEMORY)
            return
        with _locked(self.path.parent):
            found = _open_locked(self.path)
            if found is not None and foreign_writer(self.path, os.fstat(found)) is not None:
                os.close(found)  # another user's file under this model's name: built anew beside it
                found = None
                _remove_unless_used(self.path)
            if found is not None and not _whole(self.path, found):  # XNNPACK would rewrite it in place
                os.close(found)
                found = None
                _remove_unless_used(self.path)  # one in use stays: this model's file is not published
        if found is not None:
            use = WeightCacheUse(str(self.path), found)
            try:
                read_again_in_huge_pages(self.path)  # before XNNPACK maps it: an int8 step reads all of it
                _touch(found)
                with _locked(self.path.parent):
                    trim(self.path.parent, self.max_bytes)
                yield use
            except BaseException:
                use.release()
                raise
            return
        try:
            use = self._start_building(model_bytes)
        except (InvalidArgumentError, PermissionDeniedError, ResourceExhaustedError) as exc:
            if not self.fallback_to_memory:
                raise
            log.info("%s; the model's weights are packed in memory", exc)
            yield WeightCacheUse(IN_MEMORY)
            return
        building = Path(use.path)
        try:
            yield use
            with open(building, "rb") as written:
                os.fsync(written.fileno())
            with _locked(self.path.parent):
                if not self.path.exists():  # else another process published first: its file stays, in use
                    self._write_source(os.fstat(use._fd).st_size)
                    os.replace(building, self.path)
                use.path = str(self.path)
                self._remove_stale()
                trim(self.path.parent, self.max_bytes)
            read_again_in_huge_pages(use.path)  # what XNNPACK's writes left, for the next opens
        except BaseException:
            use.release()
            raise
        finally:
            building.unlink(missing_ok=True)

    def _start_building(self, model_bytes: int) -> WeightCacheUse:
        """Makes the empty file that XNNPACK will write, once the directory is known to hold it,
        held in use from the start (the lock goes with the file when it is renamed): a file
        being written that no process holds is a killed build's, whatever pid its name gives."""
        directory = self.path.parent
        if self.fallback_to_memory and _file_system_type(directory) in _MEMORY_FILE_SYSTEMS:
            raise ResourceExhaustedError(f"{directory}: in memory (tmpfs), no weight cache is written there")
        if directory.exists() and not directory.is_dir():  # (mkdir would say only "File exists")
            raise InvalidArgumentError(f"{directory}: is a file, not a directory: expected a directory to keep the "
                                       f"weight cache {self.path.name} in")
        try:
            directory.mkdir(mode=0o755, parents=True, exist_ok=True)  # whatever the umask: see foreign_writer
            free, needed = shutil.disk_usage(directory).free, int(model_bytes * _HEADROOM)
            if free < needed:  # room made from the least recently used files no process has open, if they hold it
                with _locked(directory):
                    files = [(path, stat.st_size) for path, stat in _published(directory)]
                    if sum(size for path, size in files if not _in_use(path)) >= needed - free:
                        trim(directory, sum(size for _, size in files) - (needed - free))
                free = shutil.disk_usage(directory).free
            if free < needed:  # checked before any file is made: nothing to remove when refused
                raise ResourceExhaustedError(
                    f"{directory}: {free / 2**20:.0f} MiB free, the weight cache {self.path.name} needs about "
                    f"{needed / 2**20:.0f} MiB; free some space or open the model without a weight cache directory")
            building = directory / f"{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}{_BUILDING}"
            with _locked(directory):  # made and held at once: no removal sees it unheld
                fd = os.open(building, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o644)
                fcntl.flock(fd, fcntl.LOCK_SH)
        except OSError as exc:
            raise PermissionDeniedError(
                f"{directory}: cannot write the weight cache {self.path.name} there: {exc.strerror}") from None
        return WeightCacheUse(str(building), fd)

    def _write_source(self, nbytes: int) -> None:
        """Records beside the file which model it was packed from, so that it goes with that
        model, and its size, ``nbytes``, so that a copy cut short is known (:func:`_whole`)."""
        if self.model is None:
            return
        source = self.path.with_name(self.path.name + _SOURCE)
        partial = source.with_name(f"{source.name}.{os.getpid()}.{secrets.token_hex(4)}{_BUILDING}")
        try:
            partial.write_text(json.dumps({**vars(self.model), _SIZE: nbytes}))
            os.replace(partial, source)
        except OSError as exc:  # the file is still good: it only goes by its last use
            partial.unlink(missing_ok=True)
            log.info("%s: cannot record its model: %s", source, exc.strerror)

    def _remove_stale(self) -> None:
        """Removes this model path's files of other identities, and files being written that
        no process holds (killed builds'), where no process uses them."""
        for other in self.path.parent.glob(escape(self._model_prefix) + "*"):
            if other == self.path:
                continue
            if other.name.endswith((SUFFIX, _BUILDING)):
                _remove_unless_used(other)

    def stats(self, in_memory: bool = False) -> WeightCacheStats:
        """What the directory holds; ``in_memory``: this engine packed its weights in memory."""
        report = survey(self.path.parent, self.max_bytes)
        return WeightCacheStats(report.directory, report.max_bytes, report.entries,
                                None if in_memory else str(self.path))


def survey(directory: str | os.PathLike[str], max_bytes: int | None = None) -> WeightCacheStats:
    """What ``directory`` holds, least recently used first (an absent directory holds nothing)."""
    entries = []
    for path, stat in _published(Path(directory)):
        model = _source(path)
        entries.append(WeightCacheEntry(path.name, stat.st_size, stat.st_atime, model and model.path,
                                        _in_use(path), model is not None and model.gone()))
    return WeightCacheStats(str(directory), max_bytes, tuple(entries))


def trim(directory: str | os.PathLike[str], max_bytes: int | None) -> list[Path]:
    """Removes from ``directory`` the files whose model is gone, then the least recently used
    ones until the rest take at most ``max_bytes`` (``None``: no cap), skipping files in use;
    also leftovers: files being written that no process holds (killed builds'), and ``.source`` files
    without theirs. Returns the files removed. The caller holds the directory's lock."""
    directory = Path(directory)
    removed = []
    files = []
    for path, stat in _published(directory):
        model = _source(path)
        if model is not None and model.gone() and _remove_unless_used(path):
            removed.append(path)
        else:
            files.append((path, stat.st_size))
    total = sum(size for _, size in files)
    for path, size in files:  # least recently used first
        if max_bytes is None or total <= max(max_bytes, 0):
            break
        if _remove_unless_used(path):
            removed.append(path)
            total -= size
    for leftover in directory.glob("*" + _SOURCE):
        if not leftover.with_name(leftover.name[:-len(_SOURCE)]).exists():
            _remove_unless_used(leftover)
    # A builder holds its file from its making (a .source is written under the lock): one unheld was killed.
    for leftover in directory.glob("*" + _BUILDING):
        _remove_unless_used(leftover)
    if removed:
        log.info("weight cache %s: removed %s", directory, ", ".join(path.name for path in removed))
    return removed


def parse_size(text: str, setting: str) -> int | None:
    """Bytes from ``text``: a number with an optional binary unit (``500M``, ``5G``, ``1.5GiB``),
    or ``none`` / ``unlimited`` for no cap. ``InvalidArgumentError`` naming ``setting``."""
    spelled = text.strip().upper().removesuffix("B").removesuffix("I")
    if spelled in ("NONE", "UNLIMITED"):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)", spelled)
    if match is None or float(match[1]) * _UNITS[match[2]] < 1:
        raise InvalidArgumentError(f"{setting}={text!r}: expected a size such as 500M, 5G or 5368709120 bytes, "
                                   "or 'unlimited' (to keep no file, use no weight cache directory)")
    return int(float(match[1]) * _UNITS[match[2]])


def default_max_bytes() -> int | None:
    """``$RUNTIME_WEIGHT_CACHE_MAX_SIZE`` (see :func:`parse_size`), else :data:`DEFAULT_MAX_BYTES`."""
    text = os.environ.get(MAX_SIZE_ENV)
    return DEFAULT_MAX_BYTES if not text else parse_size(text, f"${MAX_SIZE_ENV}")


def weight_cache_file(directory: str | os.PathLike[str] | WeightCacheDir | None, model_file: str | os.PathLike[str],
                      part: str = "", max_bytes: int | None = DEFAULT_MAX_BYTES) -> WeightCacheFile | None:
    """The file that ``EngineSettings.weight_cache_dir`` (``directory``) asks for, for the
    model in ``model_file`` (``part``: see :meth:`WeightCacheFile.for_model`), in a
    directory capped at ``max_bytes``; ``None``: no file, weights packed in memory (also where
    the user has no cache directory for :data:`WeightCacheDir.USER`)."""
    if directory is None:
        return None
    if directory is WeightCacheDir.USER:
        try:
            folder = user_directory()
        except FailedPreconditionError as exc:
            log.info("%s; the model's weights are packed in memory", exc.args[0])
            return None
        return WeightCacheFile.for_model(folder, model_file, part, fallback_to_memory=True, max_bytes=max_bytes)
    return WeightCacheFile.for_model(directory, model_file, part, max_bytes=max_bytes)


def user_directory() -> Path:
    """Where :data:`WeightCacheDir.USER` keeps the files."""
    return runtime_cache_dir() / "xnnpack"


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Holds ``directory``'s lock (not at all where the lock file cannot be made: a directory
    that is absent or read-only has nothing to publish or remove)."""
    try:
        fd = os.open(directory / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _open_locked(path: Path) -> int | None:
    """``path`` opened and held in use (a shared lock), or ``None`` where there is none."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _remove_unless_used(path: Path) -> bool:
    """Removes ``path`` (and its ``.source``) unless a process holds it in use."""
    with _unused(path) as free:
        if free:
            try:
                path.unlink(missing_ok=True)
                path.with_name(path.name + _SOURCE).unlink(missing_ok=True)
            except OSError as exc:  # a directory this user may read but not write
                log.info("weight cache %s: cannot remove it: %s", path, exc.strerror)
                return False
    return bool(free)


def _in_use(path: Path) -> bool:
    """Whether a process holds ``path`` in use (probed with a lock that is let go at once)."""
    with _unused(path) as free:
        return free is False


@contextmanager
def _unused(path: Path) -> Iterator[bool | None]:
    """Whether no process holds ``path`` in use (then it is held exclusively while the block
    runs), ``None`` where there is no such file."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _published(directory: Path) -> list[tuple[Path, os.stat_result]]:
    """The published files of ``directory`` with their stats, least recently used first."""
    found = []
    for path in directory.glob("*" + SUFFIX):
        try:
            found.append((path, path.stat()))
        except FileNotFoundError:
            continue
    return sorted(found, key=lambda item: (item[1].st_atime_ns, item[0].name))


def _record(path: Path) -> dict:
    """What the ``.source`` beside a published file records (empty where it cannot be read)."""
    try:
        record = json.loads(path.with_name(path.name + _SOURCE).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _source(path: Path) -> ModelIdentity | None:
    """The model a published file was packed from, where recorded."""
    record = _record(path)
    record.pop(_SIZE, None)
    try:
        return ModelIdentity(**record) if record else None
    except TypeError:
        return None


def _whole(path: Path, fd: int) -> bool:
    """Whether the published file ``path``, open as ``fd``, has the size it was written with
    (where recorded: a file of an older runtime, or whose record could not be written, counts
    as whole)."""
    recorded = _record(path).get(_SIZE)
    return not isinstance(recorded, int) or os.fstat(fd).st_size == recorded


def _touch(fd: int) -> None:
    """Marks the open file used now (its access time; its modification time stays)."""
    try:
        stat = os.fstat(fd)
        os.utime(fd, ns=(time.time_ns(), stat.st_mtime_ns))
    except OSError:
        pass  # another user's file: its order stays as it was


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.0f} MiB"


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
