"""DecodeBatcher: decode steps that sessions request at the same time run together.

A step goes in through :meth:`DecodeBatcher.decode`; a :class:`BatchScheduler` gathers the
steps waiting at that moment; :func:`plan_decode` turns their rows into runs (signature,
rows, rank slot); the resource manager binds each row's own KV cache and adapter buffers
in the slot the plan gives it (nothing copied); the executor runs the plan; each row's
logits go back to the thread that asked. A step alone runs exactly the single-session path.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Protocol

import numpy as np

from runtime.executor.batch_plan import DecodeRow, plan_decode
from runtime.executor.litert_executor import Binding, DecodeStep, LlmExecutor
from runtime.executor.model_spec import ModelSpec
from runtime.components.lora_manager import Blend
from runtime.framework.resource_management.batch_scheduler import BatchPolicy, BatchScheduler
from runtime.framework.resource_management.context_handler import ContextHandler
from runtime.util.latency import LatencyRecorder, LatencySummary
from runtime.util.signature_names import LoraSlot

Step = tuple[ContextHandler, int]  # a context and the token it appends


class BatchResources(Protocol):
    """What the batcher uses of the resource manager whose contexts it steps."""

    spec: ModelSpec

    def row_slot(self, blend: Blend) -> LoraSlot | None:
        """The LoRA slot a row's blend runs in (``None``: none, or its adapter is gone)."""

    def decode_alone(self, context: ContextHandler, token: int) -> np.ndarray:
        """One step of a context by itself."""

    def acquire_executor_with_context_handler(self, context: ContextHandler, executor: LlmExecutor | None = None,
                                              slot: LoraSlot | None = None) -> AbstractContextManager[Binding]:
        """The context's binding on ``executor`` in ``slot``, for the block."""

    def acquire_executor(self) -> AbstractContextManager[LlmExecutor]:
        """One executor for the block."""


class DecodeBatcher:
    """Batches the decode steps of one resource manager's contexts. Thread-safe."""

    def __init__(self, resources: BatchResources, wait_s: float | None) -> None:
        """``wait_s``: how long a batch waits for the sessions of the previous one to come
        back (``None``, or a model without batched signatures: every step runs alone)."""
        self._resources = resources
        spec = resources.spec
        largest = max((s.rows for s in spec.signatures.values()), default=1)
        self._scheduler: BatchScheduler[Step, np.ndarray] | None = None
        if wait_s is not None and largest > 1:
            self._scheduler = BatchScheduler(self._run_together, BatchPolicy(largest, wait_s),
                                             on_batch=self._record_batch)
        self.queue_wait = LatencyRecorder()  # of batched decode steps
        self._batch_sizes: Counter[int] = Counter()  # rows -> batches of that many rows
        self._batch_sizes_lock = threading.Lock()

    def decode(self, context: ContextHandler, token: int) -> np.ndarray:
        """One decode step of ``context`` at its position: the logits for the next token.
        Batched with other sessions' steps when the model allows it (the caller's thread
        waits at most the batch wait for others, and never when it is alone)."""
        if self._scheduler is not None:
            return self._scheduler.submit((context, token))
        return self._resources.decode_alone(context, token)

    def streaming(self) -> AbstractContextManager[None]:
        """``with batcher.streaming():`` around a loop of :meth:`decode` calls (a
        generation): batches being formed wait (briefly) for this caller's next step."""
        return self._scheduler.streaming() if self._scheduler is not None else nullcontext()

    def decode_together(self, steps: Sequence[Step]) -> list[np.ndarray]:
        """One decode step for each ``(context, token)`` at its position, now, in as few
        runs as the model allows; raises the first row's error if any failed."""
        outcomes = self._run_together(steps)
        self._record_batch(len(steps), ())  # no queue: nothing waited
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return outcomes  # type: ignore[return-value]

    def report(self) -> tuple[tuple[tuple[int, int], ...], LatencySummary]:
        """Batches so far: ``(rows, batches)`` by rows, and the steps' wait in the queue."""
        with self._batch_sizes_lock:
            sizes = tuple(sorted(self._batch_sizes.items()))
        return sizes, self.queue_wait.summary()

    def _run_together(self, steps: Sequence[Step]) -> list[np.ndarray | BaseException]:
        """Plans ``steps``, binds every planned row and runs the plan on one executor. A
        row whose adapter cannot be bound (evicted and unloaded meanwhile, say) gets its
        error and the others are planned again without it."""
        resources = self._resources
        if len(steps) == 1:
            context, token = steps[0]
            return [resources.decode_alone(context, token)]
        outcomes: list[np.ndarray | BaseException | None] = [None] * len(steps)
        # One order for the same sessions whatever order they came in: consecutive steps
        # of the same batch reuse the executor's run arguments.
        pending = sorted(range(len(steps)), key=lambda i: id(steps[i][0]))
        with resources.acquire_executor() as executor:
            while pending:
                contexts = [steps[i][0] for i in pending]
                plan = plan_decode(executor.spec, [
                    DecodeRow(resources.row_slot(c.blend), c.position) for c in contexts])
                with ExitStack() as runs:
                    rows, failed = [], []
                    for row, context in enumerate(contexts):
                        try:
                            binding = runs.enter_context(
                                resources.acquire_executor_with_context_handler(context, executor, plan.slots[row]))
                        except Exception as exc:  # this row alone: an unloaded adapter, a closed model
                            outcomes[pending[row]] = exc
                            failed.append(row)
                            continue
                        rows.append(DecodeStep(binding, steps[pending[row]][1], context.position))
                    if failed:
                        pending = [index for row, index in enumerate(pending) if row not in failed]
                        continue
                    for index, outcome in zip(pending, executor.run_decode_plan(plan, rows)):
                        outcomes[index] = outcome
                    pending = []
        return outcomes  # type: ignore[return-value]

    def _record_batch(self, rows: int, waits: Sequence[float]) -> None:
        with self._batch_sizes_lock:
            self._batch_sizes[rows] += 1
        for wait in waits:
            self.queue_wait.record(wait)
