"""Output files written all or nothing: each under a temporary name beside its target,
renamed into place only when every one of them is complete."""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from pathlib import Path

from runtime.errors import InvalidArgumentError, NotFoundError


def check_targets(targets: list[Path], sources: Sequence[Path] = ()) -> None:
    """Checks every target can be written: an existing, writable directory holds it, it is
    not itself a directory, no two targets are the same file, and none would replace an
    input of ``sources`` (a source file, or a file inside a source directory)."""
    resolved = [target.resolve() for target in targets]
    if len(set(resolved)) != len(resolved):
        raise InvalidArgumentError(f"the outputs {', '.join(map(str, targets))} name the same file")
    for target, where in zip(targets, resolved):
        if not target.parent.is_dir():
            raise NotFoundError(f"{target}: the output directory {target.parent} does not exist")
        if target.is_dir():
            raise InvalidArgumentError(f"{target}: is a directory, expected a file name")
        if not os.access(target.parent, os.W_OK):
            raise InvalidArgumentError(f"{target}: the output directory {target.parent} is not writable")
        for source in sources:
            if where == source.resolve() or (target.exists() and source.is_dir()
                                              and where.is_relative_to(source.resolve())):
                raise InvalidArgumentError(f"{target}: would replace {'' if where == source.resolve() else 'a file of '}"
                                           f"the input {source}; expected an output that is not an input")


class PendingOutputs:
    """Temporary files for ``targets``; :meth:`commit` renames them all into place, leaving
    the context without committing (an error) removes them."""

    def __init__(self, targets: list[Path], sources: Sequence[Path] = ()) -> None:
        """Checks the targets against each other and the inputs ``sources``
        (:func:`check_targets`) before anything is created."""
        check_targets(targets, sources)
        self.targets = list(targets)
        self._temporary: dict[Path, Path] = {}
        self._scratch: list[Path] = []

    def temporary(self, target: Path) -> Path:
        """The temporary file that becomes ``target`` on commit."""
        if target not in self._temporary:
            self._temporary[target] = self._create(target)
        return self._temporary[target]

    def scratch(self, beside: Path, suffix: str) -> Path:
        """A temporary file next to ``beside`` that is removed whatever happens."""
        path = self._create(beside.with_suffix(suffix))
        self._scratch.append(path)
        return path

    def commit(self) -> None:
        """Renames every temporary file into place and removes the scratch files."""
        missing = [target for target in self.targets if target not in self._temporary]
        if missing:
            raise InvalidArgumentError(f"nothing was written for {', '.join(map(str, missing))}")
        for target, temporary in self._temporary.items():
            os.replace(temporary, target)
        self._temporary.clear()
        self._remove(self._scratch)
        self._scratch.clear()

    def __enter__(self) -> PendingOutputs:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._remove(list(self._temporary.values()) + self._scratch)
        self._temporary.clear()
        self._scratch.clear()

    @staticmethod
    def _create(target: Path) -> Path:
        while True:  # a fresh name, created with the umask's permissions (mkstemp would make it private)
            path = target.parent / f".{target.name}.{secrets.token_hex(4)}.partial"
            try:
                path.touch(exist_ok=False)
                return path
            except FileExistsError:
                continue

    @staticmethod
    def _remove(paths: list[Path]) -> None:
        for path in paths:
            path.unlink(missing_ok=True)
