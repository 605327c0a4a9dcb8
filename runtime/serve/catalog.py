"""AdapterCatalog: the names requests use for adapters, and loading and unloading them safely.

Adapters found in ``--adapters DIR`` at start are registered under their file name
without suffix (``uppercase.tflite`` -> ``uppercase``) or their directory name (a PEFT
directory); one that cannot be registered is skipped and listed with the reason (or, in
strict mode, stops the start). Over HTTP an adapter is loaded from a path that must
resolve inside that directory (no ``..``, no symlink leading out, nothing but regular
files), or downloaded from an allowed URL (see :mod:`runtime.serve.download`) into a
temporary file renamed into the directory once its SHA-256 matched.

Each name keeps the engine's id of the adapter registered (and checked) when it was
loaded: a request runs with that id and never goes back to the path. A file changed
after it was loaded is refused until it is loaded again. A request holds a
:class:`Lease` on the adapters it runs with; unloading a leased adapter is refused.
Registering and unloading run one at a time: the engine gives the same file the same id,
so two names loaded from one file at once would share an id that unloading either frees.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from runtime import Engine, LoraSource
from runtime.errors import (
    AlreadyExistsError,
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    StatusError,
)
from runtime.framework.lora_source import check_sha256
from runtime.serve.download import DownloadPolicy, download
from runtime.adapters.adapter_formats import GGUF, TFLITE, AdapterKey, AdapterOrigin, detect_format
from runtime.adapters.peft_data import CONFIG_FILE, WEIGHTS_FILE

log = logging.getLogger("runtime.serve")

ADAPTER_SUFFIXES = (".tflite", ".gguf")
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class CatalogEntry:
    """One named adapter: where it was loaded from, the engine's id, rank and targets
    (attention or all-linear) of what was registered, the identity of its files then, how
    long registering it took."""

    name: str
    path: Path
    lora_id: int
    rank: int
    targets: str
    key: AdapterKey  # the files' identity when registered (see AdapterOrigin)
    load_seconds: float
    created: int  # when it was registered (Unix time)


class AdapterNotFoundError(NotFoundError):
    """A request names an adapter that is not loaded: ``name``."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name


@dataclass(frozen=True)
class Skipped:
    """An entry of the adapters directory that could not be registered at start, and why."""

    file: str
    reason: str


@dataclass(frozen=True)
class AdapterFile:
    """An adapter in the adapters directory: its file, the name it would be loaded as,
    and the name it is loaded as (``None``: not loaded)."""

    file: str
    name: str
    loaded: str | None


class Lease:
    """The adapters one request runs with; none of them can be unloaded until :meth:`release`."""

    def __init__(self, entries: dict[str, CatalogEntry], on_release: Callable[[Iterable[str]], None]) -> None:
        self.entries = entries
        self._on_release = on_release
        self._released = False

    def adapters(self, weights: Iterable[tuple[str, float]]) -> dict[int, float]:
        """``(name, scale)`` pairs of leased adapters as a SessionConfig's ``adapters``."""
        return {self.entries[name].lora_id: scale for name, scale in weights}

    def release(self) -> None:
        """Lets the adapters go; releasing twice is harmless."""
        if not self._released:
            self._released = True
            self._on_release(list(self.entries))


class AdapterCatalog:
    """Adapter names -> adapters registered with one engine. Thread-safe."""

    def __init__(
        self,
        engine: Engine,
        directory: str | os.PathLike[str] | None,
        *,
        reserved_names: Iterable[str] = (),
        downloads: DownloadPolicy | None = None,
        draft_heads: bool = True,
    ) -> None:
        """``directory``: the adapters directory (``None``: no loading by path or URL);
        ``reserved_names``: names no adapter may take (the base model's); ``downloads``:
        where URLs may be fetched from (default: nowhere); ``draft_heads``: whether a Turbo
        LoRA is registered with its draft heads (``False``: the LoRA alone, decoded plainly,
        as ``serve --no-draft-heads`` says; what a model without verify signatures needs)."""
        self._engine = engine
        self.directory = None
        if directory is not None:
            if not Path(directory).is_dir():
                raise NotFoundError(f"{directory}: no such adapters directory")
            self.directory = Path(directory).resolve(strict=True)
        self._reserved = frozenset(reserved_names)
        self._downloads = downloads or DownloadPolicy()
        self._draft_heads = draft_heads
        self._entries: dict[str, CatalogEntry] = {}
        self._pending: set[str] = set()  # names being loaded right now
        self._leases: Counter[str] = Counter()
        self._problems: dict[str, str] = {}  # name -> why it is unhealthy
        self.skipped: list[Skipped] = []  # what the start-up scan could not register
        self._lock = threading.Lock()
        # Held while an adapter is registered or unloaded (the engine's ids change), not
        # while one is leased: requests never wait for a load.
        self._changing = threading.Lock()

    # -- reading -------------------------------------------------------------------

    def entries(self) -> list[CatalogEntry]:
        """Every registered adapter, by name."""
        with self._lock:
            return sorted(self._entries.values(), key=lambda entry: entry.name)

    def files(self) -> list[AdapterFile]:
        """The adapters in the adapters directory (what :meth:`scan` would register), and
        the name each is loaded as, if it is."""
        if self.directory is None:
            return []
        loaded = {entry.path: entry.name for entry in self.entries()}
        found = []
        for path in sorted(self.directory.iterdir()):
            try:
                name = _adapter_name(path)
                resolved = path.resolve(strict=True)
            except (StatusError, OSError):
                continue
            if name is not None:
                found.append(AdapterFile(path.name, name, loaded.get(resolved)))
        return found

    def find(self, name: str) -> CatalogEntry | None:
        """The adapter registered as ``name``, or ``None``."""
        with self._lock:
            return self._entries.get(name)

    def problem(self, name: str) -> str | None:
        """Why adapter ``name`` is unhealthy, or ``None`` while it is healthy."""
        with self._lock:
            return self._problems.get(name)

    def mark_unhealthy(self, name: str, reason: str) -> None:
        """Records that adapter ``name`` failed at run time (shown in ``/v1/models`` and
        ``/metrics`` until it is unloaded)."""
        with self._lock:
            if name in self._entries:
                self._problems[name] = reason

    def lease(self, names: Iterable[str]) -> Lease:
        """Holds the adapters ``names`` for one request. :class:`AdapterNotFoundError` names
        an unknown one; ``FailedPreconditionError`` one whose file changed since it was loaded."""
        with self._lock:
            entries = {}
            for name in names:
                if name not in self._entries:
                    raise AdapterNotFoundError(f"adapter {name!r:.140} is not loaded; GET /v1/models lists what is",
                                               name)
                entries[name] = self._entries[name]
        for entry in entries.values():
            _check_unchanged(entry)
        with self._lock:
            missing = [name for name in entries if self._entries.get(name) is not entries[name]]
            if missing:
                raise AdapterNotFoundError(f"adapter {missing[0]!r:.140} was unloaded meanwhile", missing[0])
            self._leases.update(list(entries))
        return Lease(entries, self._release)

    def _release(self, names: Iterable[str]) -> None:
        with self._lock:
            self._leases.subtract(names)
            for name in list(self._leases):
                if self._leases[name] <= 0:
                    del self._leases[name]

    # -- loading -------------------------------------------------------------------

    def scan(self, *, strict: bool = False) -> list[CatalogEntry]:
        """Registers every adapter in the adapters directory (hidden files and files of
        other kinds are left alone). One that cannot be registered is skipped and listed
        in :attr:`skipped` with the reason; with ``strict``, it raises instead, and what it
        registered before is unregistered again."""
        if self.directory is None:
            return []
        found: dict[str, Path] = {}
        loaded = []
        for path in sorted(self.directory.iterdir()):
            try:
                name = _adapter_name(path)
                if name is None:
                    continue
                if name in found:
                    raise AlreadyExistsError(f"{found[name].name} and {path.name} would both be named {name!r}")
                found[name] = path
                loaded.append(self.load_path(name, path.name))
            except (StatusError, OSError) as exc:
                if strict:
                    for entry in loaded:
                        self.unload(entry.name)
                    raise
                self.skipped.append(Skipped(path.name, " ".join(str(exc.args[0] if exc.args else exc).split())))
        return loaded

    def load_path(self, name: str, lora_path: str, sha256: str | None = None) -> CatalogEntry:
        """Registers the adapter at ``lora_path`` (relative to the adapters directory, or
        absolute inside it) as ``name``; with ``sha256``, only if its content has that digest.
        Errors say the field they are about (``lora_name``, ``lora_path``, ``sha256``)."""
        self._reserve(name)
        try:
            with _about("lora_path"):
                path = self._resolve_inside(lora_path)
                with _about("sha256"):
                    digest = None if sha256 is None else check_sha256(sha256, "sha256")
                return self._register(name, path, digest)
        finally:
            self._unreserve(name)

    def load_url(self, name: str, url: str, sha256: str) -> CatalogEntry:
        """Downloads a ``.tflite`` or GGUF adapter and registers it as ``name``; it is
        renamed to ``name`` + suffix in the adapters directory only once its SHA-256 matched.
        Errors say the field they are about (``lora_name``, ``url``, ``sha256``)."""
        with _about("sha256"):
            sha256 = check_sha256(sha256, "sha256")
        with _about("url"):
            if not isinstance(url, str) or not url:
                raise InvalidArgumentError("url must be a non-empty string")
        self._reserve(name)
        try:
            with _about("url"):
                directory = self._require_directory("url")
                temporary = download(url, directory, prefix=name, policy=self._downloads)
                try:
                    suffix = _checked_download(temporary, url, sha256)
                    final = directory / f"{name}{suffix}"
                    with _about("lora_name"):  # the file takes the adapter's name
                        if final.exists() or final.is_symlink():
                            raise AlreadyExistsError(f"{final.name} already exists in the adapters directory")
                    os.replace(temporary, final)
                except BaseException:
                    temporary.unlink(missing_ok=True)
                    raise
                try:
                    return self._register(name, final)
                except BaseException:
                    final.unlink(missing_ok=True)
                    raise
        finally:
            self._unreserve(name)

    def unload(self, name: str) -> CatalogEntry:
        """Unregisters ``name`` and frees its buffers; refused while a request uses it.
        Its file stays in the adapters directory. Errors are about ``lora_name``."""
        with _about("lora_name"), self._changing, self._lock:
            entry = self._entries.get(name)
            if entry is None:
                raise NotFoundError(f"adapter {name!r:.140} is not loaded")
            if self._leases[name] > 0:
                raise FailedPreconditionError(
                    f"adapter {name!r} is used by {self._leases[name]} running request(s); unload it when they end"
                )
            self._engine.unload_adapter(entry.lora_id)
            del self._entries[name]
            self._problems.pop(name, None)
            return entry

    # -- internals -----------------------------------------------------------------

    def _reserve(self, name: str) -> None:
        with _about("lora_name"):
            if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
                raise InvalidArgumentError(f"adapter name {name!r:.140}: use 1-128 letters, digits, '.', '_' or '-', "
                                           "starting with a letter or digit")
            with self._lock:
                if name in self._reserved:
                    raise AlreadyExistsError(f"{name!r} is the base model's name")
                if name in self._entries or name in self._pending:
                    raise AlreadyExistsError(f"adapter {name!r} is already loaded; unload it first")
                self._pending.add(name)

    def _unreserve(self, name: str) -> None:
        with self._lock:
            self._pending.discard(name)

    def _register(self, name: str, path: Path, sha256: str | None = None) -> CatalogEntry:
        """Registers ``path`` with the engine as ``name``; refused when its id is another
        name's already (the same file). One registration or unloading at a time."""
        with self._changing:
            return self._register_alone(name, path, sha256)

    def _register_alone(self, name: str, path: Path, sha256: str | None) -> CatalogEntry:
        key = AdapterOrigin.of_file(path).key
        started = time.perf_counter()
        with _about("sha256", DataLossError if sha256 is not None else ()):  # the bytes are not the digest's
            lora_id = self._engine.register_adapter(LoraSource(path=path, sha256=sha256, heads=self._draft_heads))
        elapsed = time.perf_counter() - started
        with self._lock:
            for other in self._entries.values():
                if other.lora_id == lora_id:
                    raise AlreadyExistsError(f"{path.name} is already loaded as adapter {other.name!r}")
        stats = self._engine.adapter(lora_id)
        if AdapterOrigin.of_file(path).key != key:  # rewritten while it was registered
            self._engine.unload_adapter(lora_id)
            raise DataLossError(f"{path.name} changed while it was being loaded; load it again")
        with self._lock:
            entry = self._entries[name] = CatalogEntry(name, path, lora_id, stats.rank, stats.targets, key, elapsed,
                                                       int(time.time()))
        return entry

    def _require_directory(self, what: str) -> Path:
        if self.directory is None:
            raise FailedPreconditionError(f"loading by {what} needs a server started with --adapters DIR")
        return self.directory

    def _resolve_inside(self, lora_path: str) -> Path:
        """``lora_path`` resolved, if it stays inside the adapters directory and is a
        regular file or a PEFT directory of regular files."""
        directory = self._require_directory("lora_path")
        if not isinstance(lora_path, str) or not lora_path or "\x00" in lora_path:
            raise InvalidArgumentError("lora_path must be a non-empty string without NUL characters")
        given = Path(lora_path)
        if ".." in given.parts:
            raise PermissionDeniedError(f"lora_path {lora_path!r:.200} must not contain '..'")
        path = _inside(directory, given if given.is_absolute() else directory / given, lora_path)
        mode = path.stat().st_mode
        if stat.S_ISDIR(mode):
            for file in (CONFIG_FILE, WEIGHTS_FILE):
                if not (path / file).exists():
                    raise InvalidArgumentError(f"lora_path {lora_path!r:.200} is a directory without {file}")
                _regular(_inside(directory, path / file, f"{lora_path}/{file}"), f"{lora_path}/{file}")
            return path
        return _regular(path, lora_path)


@contextmanager
def _about(field: str, kinds: type[StatusError] | tuple[type[StatusError], ...] = StatusError) -> Iterator[None]:
    """Says that the errors of ``kinds`` raised inside are about the request field
    ``field`` (the ``param`` of the HTTP answer), unless a step inside said so already."""
    try:
        yield
    except kinds as exc:
        if exc.field is None:
            exc.field = field
        raise


def _check_unchanged(entry: CatalogEntry) -> None:
    """``FailedPreconditionError`` if the adapter's files are not those it was registered from."""
    try:
        key = AdapterOrigin.of_file(entry.path).key
    except StatusError:
        key = None
    if key != entry.key:
        raise FailedPreconditionError(
            f"adapter {entry.name!r}: its file changed (or went away) since it was loaded; "
            "unload it and load it again to use the new file")


def _checked_download(path: Path, url: str, sha256: str) -> str:
    """The suffix of a downloaded adapter (``.tflite`` or ``.gguf``), once the core checked
    its SHA-256 and its format; the errors tell nothing about the bytes."""
    with _about("sha256"):
        try:
            AdapterOrigin.of_file(path).check_sha256(sha256)
        except DataLossError:
            raise DataLossError(f"url {url!r:.200}: the file's SHA-256 is not the sha256 given; "
                                "the download was discarded") from None
    try:
        kind = detect_format(path)
    except InvalidArgumentError:
        kind = None
    if kind not in (TFLITE, GGUF):
        raise InvalidArgumentError(f"url {url!r:.200}: the file is neither a .tflite LoRA file nor a GGUF LoRA")
    return f".{kind}"


def _inside(directory: Path, path: Path, label: str) -> Path:
    try:
        resolved = path.resolve(strict=True)
    except FileNotFoundError:
        raise NotFoundError(f"lora_path {label!r:.200}: no such file in the adapters directory") from None
    except (OSError, RuntimeError) as exc:  # a symlink loop, a name too long...
        raise InvalidArgumentError(f"lora_path {label!r:.200}: {exc}") from None
    if not resolved.is_relative_to(directory):
        raise PermissionDeniedError(f"lora_path {label!r:.200} leads outside the adapters directory")
    return resolved


def _regular(path: Path, label: str) -> Path:
    if not stat.S_ISREG(path.stat().st_mode):
        raise PermissionDeniedError(f"lora_path {label!r:.200} is not a regular file (a device, FIFO or socket)")
    return path


def _adapter_name(path: Path) -> str | None:
    """The catalog name of a directory entry, or None if it is not an adapter to load;
    ``InvalidArgumentError`` for an adapter whose name is not usable."""
    if path.name.startswith("."):
        return None
    if path.is_dir():
        name = path.name if (path / CONFIG_FILE).exists() else None
    else:
        name = path.stem if path.suffix in ADAPTER_SUFFIXES else None
    if name is not None and not NAME_PATTERN.fullmatch(name):
        raise InvalidArgumentError(f"{path.name}: not a usable adapter name (letters, digits, '.', '_', '-')")
    return name
