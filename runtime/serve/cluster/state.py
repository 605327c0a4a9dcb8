"""The one catalogue every replica reads, and what the replicas report back.

:class:`ClusterState` runs as one Ray actor: the ingress publishes the catalogue to it
(each adapter's name, file and SHA-256) whenever an adapter is registered or unloaded;
each replica reads an entry when it loads an adapter (checking the file's digest) and
syncs every half second (it gets the catalogue's version back and drops adapters that
were unloaded or replaced, and leaves its numbers for ``/metrics``).
:class:`ClusterCatalog` is the ingress's :class:`~runtime.serve.catalog.AdapterCatalog`
that publishes: every check of the catalogue (paths inside the adapters directory, URLs
allowed, SHA-256 pins, files changed since registration) stays the one of one process.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

from runtime.adapters.peft_data import WEIGHTS_FILE
from runtime.serve.catalog import AdapterCatalog, CatalogEntry

STATE_ACTOR = "runtime-cluster-state"
REPORT_KEEP_S = 60.0  # a replica silent for longer is gone (replaced, or its node lost): its numbers are dropped


class ClusterState:
    """The catalogue (name -> ``{"path", "sha256"}``) and the replicas' reports; a Ray actor."""

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, str]] = {}
        self._version = 0
        self._reports: dict[str, tuple[float, dict]] = {}

    def publish(self, entries: dict[str, dict[str, str]]) -> int:
        """Replaces the catalogue; returns its new version."""
        self._entries = dict(entries)
        self._version += 1
        return self._version

    def entry(self, name: str) -> dict[str, str] | None:
        """One adapter's file and digest, or ``None`` if it is not in the catalogue."""
        return self._entries.get(name)

    def sync(self, replica: str, report: dict) -> tuple[int, dict[str, dict[str, str]]]:
        """Keeps a replica's numbers; returns the catalogue's version and entries (which
        the replica applies at once: its report shows that version from now on)."""
        self._reports[replica] = (time.time(), {**report, "catalogue_version": self._version})
        return self._version, self._entries

    def reports(self) -> dict[str, tuple[float, dict]]:
        """Each replica's last numbers and when they came (Unix time), for the replicas
        heard from in the last ``REPORT_KEEP_S``: Ray Serve names a replacement anew, so
        the numbers of every replica that ever ran would otherwise stay on ``/metrics``."""
        now = time.time()
        self._reports = {replica: report for replica, report in self._reports.items()
                         if now - report[0] < REPORT_KEEP_S}
        return dict(self._reports)


def file_sha256(path: Path) -> str:
    """The SHA-256 a :class:`~runtime.LoraSource` checks: of the file, or of a PEFT
    directory's safetensors file."""
    target = path / WEIGHTS_FILE if path.is_dir() else path
    digest = hashlib.sha256()
    with open(target, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class ClusterCatalog(AdapterCatalog):
    """An adapter catalogue that publishes each change to every replica (``publish``
    takes the whole catalogue as name -> ``{"path", "sha256"}``).

    An adapter is published before the ingress lists it (so a request for a listed adapter
    finds it in the replicas' catalogue, with its digest) and withdrawn after the ingress
    dropped it; changes are published one at a time, each whole, in the order they were made."""

    def __init__(self, *args, publish: Callable[[dict[str, dict[str, str]]], None], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._publish = publish
        self._published: dict[str, dict[str, str]] = {}  # replaced whole, never changed in place
        self._publishing = threading.Lock()

    def digest(self, name: str) -> str:
        """The SHA-256 of adapter ``name``'s file when it was registered."""
        return self._published[name]["sha256"]

    def unload(self, name: str) -> CatalogEntry:
        entry = super().unload(name)
        self._change(name, None)
        return entry

    def _register(self, name: str, path: Path, sha256: str | None = None) -> CatalogEntry:
        self._change(name, {"path": str(path), "sha256": file_sha256(path)})
        try:
            return super()._register(name, path, sha256)
        except BaseException:
            self._change(name, None)
            raise

    def _change(self, name: str, entry: dict[str, str] | None) -> None:
        """Publishes the catalogue with ``name`` set to ``entry`` (``None``: removed)."""
        with self._publishing:
            published = {key: value for key, value in self._published.items() if key != name}
            if entry is not None:
                published[name] = entry
            self._publish(published)
            self._published = published
