"""BatchScheduler: steps submitted from many threads run together, in batches.

No thread of its own: the first caller to arrive while no batch is being formed leads. It
waits, briefly, for the callers the previous batch served, or the callers that announced
a stream of steps (:meth:`BatchScheduler.streaming`), whichever are more, to come back with
their next step (continuous batching: a decoding session submits again as soon as it has sampled),
takes up to ``max_batch`` waiting steps, runs them as one batch outside the lock, hands
each caller its own result, and passes the lead to a caller still waiting. A caller alone
never waits: the previous batch had one row, and that row is here.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass(frozen=True)
class BatchPolicy:
    """How batches are formed.

    ``max_batch``: rows in one batch at most. ``max_wait_s``: how long a batch waits for
    the callers of the previous batch to come back before it runs without them.
    """

    max_batch: int
    max_wait_s: float = 0.002


class _Ticket(Generic[Item, Result]):
    """One submitted step: its item, and the result or error once its batch ran."""

    __slots__ = ("item", "result", "error", "done", "lead", "wake", "queued_at", "waited_s")

    def __init__(self, item: Item) -> None:
        self.item = item
        self.result: Result | None = None
        self.error: BaseException | None = None
        self.done = False
        self.lead = False
        self.wake: threading.Event | None = None  # made only for a caller that has to wait
        self.queued_at = time.perf_counter()
        self.waited_s = 0.0


class BatchScheduler(Generic[Item, Result]):
    """Runs ``run_batch(items)`` over the steps that callers of :meth:`submit` wait on.

    ``run_batch`` returns one entry per item, in order: a result, or an exception for
    that row alone; if it raises, every row of the batch gets the exception.
    ``on_batch(rows, waits)`` is told each batch's size and its rows' queue waits (for
    statistics). Thread-safe.
    """

    def __init__(
        self,
        run_batch: Callable[[Sequence[Item]], Sequence[Result | BaseException]],
        policy: BatchPolicy,
        on_batch: Callable[[int, Sequence[float]], None] | None = None,
    ) -> None:
        self._run_batch = run_batch
        self._policy = policy
        self._on_batch = on_batch
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._waiting: deque[_Ticket[Item, Result]] = deque()
        self._leading = False
        self._last_rows = 0  # size of the previous batch: how many callers to wait for
        self._streaming = 0  # callers inside streaming(): they will submit again soon

    def submit(self, item: Item) -> Result:
        """Runs ``item`` in the next batch that has room and returns its result (or
        raises its error)."""
        with self._lock:
            alone = not self._leading and self._last_rows <= 1 and self._streaming <= 1
            if alone:  # the batch it would lead has one row, this one: no ticket, no wait
                self._leading = True
                self._last_rows = 1
            else:
                ticket: _Ticket[Item, Result] = _Ticket(item)
                self._waiting.append(ticket)
                if self._leading:
                    ticket.wake = threading.Event()
                    self._arrived.notify()
                else:
                    self._leading = ticket.lead = True
        if alone:
            return self._run_alone(item)
        while not ticket.done:
            if ticket.lead:
                self._lead()
            else:
                ticket.wake.wait()
                ticket.wake.clear()
        if ticket.error is not None:
            raise ticket.error
        return ticket.result  # type: ignore[return-value]

    @contextmanager
    def streaming(self) -> Iterator[None]:
        """Announces, for the block, a caller that will submit step after step (a
        generation loop): batches wait for it as for a caller of the previous batch."""
        with self._lock:
            self._streaming += 1
        try:
            yield
        finally:
            with self._lock:
                self._streaming -= 1

    def _run_alone(self, item: Item) -> Result:
        """Runs a batch of ``item`` alone (the caller leads; nothing waits in the queue
        ahead of it) and passes the lead on."""
        try:
            (outcome,) = self._outcomes([item])
        finally:
            self._pass_lead()  # whatever happens: callers queued meanwhile must not hang
        if self._on_batch is not None:
            self._on_batch(1, (0.0,))
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _outcomes(self, items: list[Item]) -> Sequence[Result | BaseException]:
        """``run_batch(items)``: a result or an error per row; if it raises (or returns
        the wrong number of rows), the error for every row."""
        try:
            outcomes = self._run_batch(items)
            if len(outcomes) != len(items):
                raise RuntimeError(f"run_batch returned {len(outcomes)} results for {len(items)} rows")
        except BaseException as exc:
            outcomes = [exc] * len(items)
        return outcomes

    def _pass_lead(self) -> None:
        """Hands the lead to the first caller waiting, or gives it up."""
        with self._lock:
            if self._waiting:
                successor = self._waiting[0]
                successor.lead = True
                successor.wake.set()
            else:
                self._leading = False

    def _lead(self) -> None:
        """Forms and runs one batch, then passes the lead on (or gives it up)."""
        policy = self._policy
        with self._lock:
            expected = min(max(self._last_rows, self._streaming, 1), policy.max_batch)
            deadline = time.perf_counter() + policy.max_wait_s
            while len(self._waiting) < expected:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._arrived.wait(left)
            count = min(len(self._waiting), policy.max_batch)
            batch = [self._waiting.popleft() for _ in range(count)]
            self._last_rows = count
        started = time.perf_counter()
        for ticket in batch:
            ticket.waited_s = started - ticket.queued_at
        outcomes = self._outcomes([t.item for t in batch])
        if self._on_batch is not None:
            self._on_batch(len(batch), [t.waited_s for t in batch])
        for ticket, outcome in zip(batch, outcomes):
            if isinstance(outcome, BaseException):
                ticket.error = outcome
            else:
                ticket.result = outcome
            ticket.lead = False
            ticket.done = True
            if ticket.wake is not None:
                ticket.wake.set()
        self._pass_lead()
