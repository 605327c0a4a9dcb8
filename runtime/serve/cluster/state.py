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
import time
from collections.abc import Callable
from pathlib import Path

from runtime.adapters.peft_data import WEIGHTS_FILE
from runtime.serve.catalog import AdapterCatalog, CatalogEntry

STATE_ACTOR = "runtime-cluster-state"


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
        """Each replica's last numbers and when they came (Unix time)."""
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
    takes the whole catalogue as name -> ``{"path", "sha256"}``)."""

    def __init__(self, *args, publish: Callable[[dict[str, dict[str, str]]], None], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._publish = publish
        self._digests: dict[str, str] = {}

    def digest(self, name: str) -> str:
        """The SHA-256 of adapter ``name``'s file when it was registered."""
        return self._digests[name]

    def load_path(self, name: str, lora_path: str, sha256: str | None = None) -> CatalogEntry:
        return self._published(super().load_path(name, lora_path, sha256))

    def load_url(self, name: str, url: str, sha256: str) -> CatalogEntry:
        return self._published(super().load_url(name, url, sha256))

    def unload(self, name: str) -> CatalogEntry:
        entry = super().unload(name)
        self._digests.pop(name, None)
        self._send()
        return entry

    def _published(self, entry: CatalogEntry) -> CatalogEntry:
        try:
            self._digests[entry.name] = file_sha256(entry.path)
            self._send()
        except BaseException:
            super().unload(entry.name)
            raise
        return entry

    def _send(self) -> None:
        self._publish({entry.name: {"path": str(entry.path), "sha256": self._digests[entry.name]}
                       for entry in self.entries() if entry.name in self._digests})
