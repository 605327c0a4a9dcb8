"""BatchScheduler: steps submitted from many threads run together, in batches.

No thread of its own: the first caller to arrive while no batch is being formed, and a
runner (an executor) is free, leads. It waits, briefly, for the callers the previous batch
served, or its share of the callers that announced a stream of steps
(:meth:`BatchScheduler.streaming`), whichever are more, to come back with their next step
(continuous batching: a decoding session submits again as soon as it has sampled), takes
up to ``max_batch`` waiting steps (no more than its share while other runners are free),
and runs them as one batch outside the lock; meanwhile the lead passes to a caller still
waiting, who forms the next batch for the next free runner. Each caller gets its own
result. A caller alone never waits: the previous batch had one row, and that row is here.
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
    ``max_running``: batches that may run at once (one per executor).
    """

    max_batch: int
    max_wait_s: float = 0.002
    max_running: int = 1


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
        self._leading = False  # a caller is forming a batch
        self._running = 0  # batches formed and not finished
        # Rows of the latest batch of each runner: the callers that will come back.
        self._recent: deque[int] = deque(maxlen=policy.max_running)
        self._streaming = 0  # callers inside streaming(): they will submit again soon

    def submit(self, item: Item) -> Result:
        """Runs ``item`` in the next batch that has room and returns its result (or
        raises its error)."""
        with self._lock:
            free = self._running < self._policy.max_running
            alone = (free and not self._leading and not self._waiting and self._streaming <= 1
                     and (not self._recent or self._recent[-1] <= 1))
            if alone:  # the batch it would lead has one row, this one: no ticket, no wait
                self._running += 1
                self._recent.append(1)
            else:
                ticket: _Ticket[Item, Result] = _Ticket(item)
                self._waiting.append(ticket)
                if self._leading or not free:
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
        """Runs a batch of ``item`` alone (nothing waited in the queue ahead of it) and
        hands the lead to a caller queued meanwhile, if any."""
        try:
            (outcome,) = self._outcomes([item])
        finally:
            self._finish()  # whatever happens: callers queued meanwhile must not hang
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

    def _hand_lead(self) -> None:
        """Under the lock: makes the first caller waiting the leader, when none leads and
        a runner is free."""
        if self._waiting and not self._leading and self._running < self._policy.max_running:
            successor = self._waiting[0]
            self._leading = successor.lead = True
            successor.wake.set()

    def _finish(self) -> None:
        """A batch has run: its runner is free for the next."""
        with self._lock:
            self._running -= 1
            self._hand_lead()

    def _lead(self) -> None:
        """Forms one batch and passes the lead on, then runs the batch."""
        policy = self._policy
        with self._lock:
            # The callers known to come back, spread over the runners: this batch's share.
            known = max(sum(self._recent), self._streaming)
            expected = min(max(-(-known // policy.max_running), 1), policy.max_batch)
            deadline = time.perf_counter() + policy.max_wait_s
            while len(self._waiting) < expected:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._arrived.wait(left)
            # More than the share only when fewer runners are free than would take the rest.
            spread = -(-len(self._waiting) // (policy.max_running - self._running))
            count = min(len(self._waiting), policy.max_batch, max(expected, spread))
            batch = [self._waiting.popleft() for _ in range(count)]
            self._recent.append(count)
            self._running += 1
            self._leading = False
            self._hand_lead()
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
        self._finish()
