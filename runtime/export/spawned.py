"""Export work in processes of its own, started with ``spawn`` (a fresh interpreter that
imports only what its work needs, not a fork of the exporter's memory), each streaming
messages back: the one place that starts them, relays their errors and notices one that
dies."""

from __future__ import annotations

import multiprocessing
import queue
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from runtime.errors import ResourceExhaustedError, StatusError
from runtime.export.measure import process_peak_rss_bytes


@dataclass(frozen=True)
class Work:
    """One process's work: ``run(*args, tell)`` where ``tell(kind, payload)`` sends a
    message back; ``what`` names the process in errors ("the export worker lowering
    decode, prefill_32")."""

    what: str
    run: Callable[..., None]
    args: tuple[Any, ...]


def _main(index: int, work: Work, messages: Any) -> None:
    def tell(kind: str, payload: Any) -> None:
        messages.put((index, kind, payload))

    try:
        work.run(*work.args, tell)
        tell("done", process_peak_rss_bytes())
    except BaseException as exc:  # noqa: BLE001  (everything goes back to the exporter, which raises it)
        tell("error", exc if isinstance(exc, StatusError) else RuntimeError(
            f"{work.what} failed: {type(exc).__name__}: {exc}"))


def run_all(works: Sequence[Work]) -> Iterator[tuple[int, str, Any]]:
    """Runs each of ``works`` in a process of its own, all at once; yields ``(index, kind,
    payload)`` for each message a work sends, then ``(index, "done", its peak RSS in bytes)``
    when it returns. A work's error is raised here (a :class:`StatusError` as it was, any
    other as a ``RuntimeError`` naming the work); a process that dies (the kernel's
    out-of-memory killer) raises :class:`ResourceExhaustedError`. Every process is gone when
    this returns or raises."""
    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    processes = [context.Process(target=_main, args=(index, work, messages), daemon=True,
                                 name=f"export-{index}") for index, work in enumerate(works)]
    for process in processes:
        process.start()
    try:
        running = len(processes)
        while running:
            try:
                index, kind, payload = messages.get(timeout=1.0)
            except queue.Empty:  # check nobody died silently
                _check_alive(processes, works)
                continue
            if kind == "error":
                raise payload
            if kind == "done":
                running -= 1
            yield index, kind, payload
        for process in processes:
            process.join()
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()


def _check_alive(processes: list[Any], works: Sequence[Work]) -> None:
    for process, work in zip(processes, works):
        if process.exitcode not in (None, 0):
            raise ResourceExhaustedError(
                f"{work.what} died with exit code {process.exitcode} (killed for memory?): "
                "give a smaller --jobs or a larger --max-memory")
