"""ExecutorPool: the executors of one model, lent out one run (or one batch) at a time.

One executor, or several copies of the model (``EngineSettings(executors=N)``) whose runs
go on at once (each run releases the GIL). KV caches and adapter buffers are made by the
first executor and bound to whichever runs.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from runtime.errors import InvalidArgumentError
from runtime.executor.litert_executor import LlmExecutor
from runtime.executor.model_spec import ModelSpec


class ExecutorPool:
    """Lends out the executors of one model; thread-safe.

    The executor given back last is lent first: a session stepping alone stays on one
    executor (its binding and that model copy's weights stay warm) instead of alternating.
    """

    def __init__(self, executors: LlmExecutor | Sequence[LlmExecutor]) -> None:
        """``executors``: one executor, or a pool of executors of the same model."""
        self.executors: tuple[LlmExecutor, ...] = (
            (executors,) if isinstance(executors, LlmExecutor) else tuple(executors))
        if not self.executors:
            raise InvalidArgumentError("an executor pool needs at least one executor")
        self.primary = self.executors[0]
        self._idle: queue.LifoQueue[LlmExecutor] | None = None
        if len(self.executors) > 1:
            self._idle = queue.LifoQueue()
            for each in self.executors:
                self._idle.put(each)

    @property
    def spec(self) -> ModelSpec:
        """The model's signatures, slots and sizes (the same for every executor)."""
        return self.primary.spec

    def take(self) -> LlmExecutor:
        """An idle executor (waiting for one), or the only executor; :meth:`give_back` it."""
        return self._idle.get() if self._idle is not None else self.primary

    def give_back(self, executor: LlmExecutor) -> None:
        """Returns an executor :meth:`take` lent."""
        if self._idle is not None:
            self._idle.put(executor)

    @contextmanager
    def borrow(self) -> Iterator[LlmExecutor]:
        """``with pool.borrow() as executor:`` one executor for the block."""
        executor = self.take()
        try:
            yield executor
        finally:
            self.give_back(executor)

    def invoke_totals(self) -> tuple[int, float]:
        """Signature runs so far on all executors, and the seconds spent inside them."""
        return (sum(e.invokes for e in self.executors), sum(e.invoke_seconds for e in self.executors))

    def close(self) -> None:
        """Closes every executor."""
        for executor in self.executors:
            executor.close()
