"""Tests for runtime.framework.resource_management.batch_scheduler: steps from many threads run together."""

from __future__ import annotations

import threading
import time

import pytest

from runtime.framework.resource_management.batch_scheduler import BatchPolicy, BatchScheduler


class Recorder:
    """A run_batch that squares its items (after ``delay`` seconds) and records each batch."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.batches: list[list[int]] = []
        self.lock = threading.Lock()

    def __call__(self, items):
        with self.lock:
            self.batches.append(list(items))
        time.sleep(self.delay)
        return [i * i for i in items]


def drive(scheduler, callers: int, steps: int) -> dict[int, list[int]]:
    """``callers`` threads, each submitting ``steps`` items one after another."""
    results: dict[int, list[int]] = {c: [] for c in range(callers)}
    barrier = threading.Barrier(callers)

    def run(caller: int) -> None:
        barrier.wait()
        for step in range(steps):
            results[caller].append(scheduler.submit(caller * 1000 + step))

    threads = [threading.Thread(target=run, args=(c,)) for c in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_a_lone_caller_runs_one_row_at_a_time_without_waiting():
    recorder = Recorder()
    waits = []
    scheduler = BatchScheduler(recorder, BatchPolicy(max_batch=8, max_wait_s=10.0),
                               on_batch=lambda rows, w: waits.extend(w))
    assert [scheduler.submit(i) for i in range(5)] == [0, 1, 4, 9, 16]
    assert recorder.batches == [[0], [1], [2], [3], [4]]
    assert max(waits) < 1.0  # a 10 s wait for others would show here


def test_concurrent_callers_share_batches_and_each_gets_its_own_result():
    recorder = Recorder(delay=0.005)  # long enough for the others to queue behind a batch
    scheduler = BatchScheduler(recorder, BatchPolicy(max_batch=8, max_wait_s=0.5))
    results = drive(scheduler, callers=6, steps=20)
    for caller, got in results.items():
        assert got == [(caller * 1000 + s) ** 2 for s in range(20)]
    assert max(len(b) for b in recorder.batches) == 6
    assert len(recorder.batches) < 6 * 20 / 2  # most steps ran in company
    for batch in recorder.batches:  # one row per caller per batch, in each caller's order
        assert len({item // 1000 for item in batch}) == len(batch)


def test_callers_stepping_back_to_back_get_every_result_in_order():
    """No delay anywhere: a caller is back with its next step while the leader of its last
    batch may still be waking the others; no step may miss its wake, run twice or take
    another's result."""
    recorder = Recorder()
    scheduler = BatchScheduler(recorder, BatchPolicy(max_batch=4, max_wait_s=0.0005))
    results = drive(scheduler, callers=8, steps=300)
    for caller, got in results.items():
        assert got == [(caller * 1000 + s) ** 2 for s in range(300)]
    assert sum(len(b) for b in recorder.batches) == 8 * 300


def test_batches_never_exceed_max_batch():
    recorder = Recorder(delay=0.003)
    scheduler = BatchScheduler(recorder, BatchPolicy(max_batch=3, max_wait_s=0.2))
    results = drive(scheduler, callers=7, steps=6)
    assert all(len(got) == 6 for got in results.values())
    assert max(len(b) for b in recorder.batches) == 3


def test_a_batch_does_not_wait_longer_than_the_bound_for_stragglers():
    recorder = Recorder(delay=0.05)  # the others queue behind the first caller's batch
    waits: list[float] = []
    scheduler = BatchScheduler(recorder, BatchPolicy(max_batch=4, max_wait_s=0.3),
                               on_batch=lambda rows, w: waits.append(max(w)))
    drive(scheduler, callers=4, steps=1)
    assert len(recorder.batches[-1]) > 1  # the last batch had several rows
    recorder.delay = 0.0
    start = time.perf_counter()
    assert scheduler.submit(7) == 49  # alone now: waits for the others once, then runs
    took = time.perf_counter() - start
    assert 0.3 <= took < 5.0
    assert scheduler.submit(8) == 64  # the previous batch had one row: no wait now
    assert waits[-1] < 0.3


def test_a_failing_batch_fails_every_row_and_the_scheduler_goes_on():
    calls = []

    def run_batch(items):
        calls.append(list(items))
        if len(calls) == 1:
            raise RuntimeError("invoke failed")
        return [i + 1 for i in items]

    scheduler = BatchScheduler(run_batch, BatchPolicy(max_batch=4))
    with pytest.raises(RuntimeError, match="invoke failed"):
        scheduler.submit(1)
    assert scheduler.submit(2) == 3


def test_an_error_for_one_row_reaches_only_that_caller():
    def run_batch(items):
        return [ValueError(f"row {i}") if i == 13 else i for i in items]

    scheduler = BatchScheduler(run_batch, BatchPolicy(max_batch=4))
    with pytest.raises(ValueError, match="row 13"):
        scheduler.submit(13)
    assert scheduler.submit(12) == 12


def test_a_wrong_number_of_results_is_an_error_for_every_row():
    scheduler = BatchScheduler(lambda items: [], BatchPolicy(max_batch=2))
    with pytest.raises(RuntimeError, match="returned 0 results for 1 rows"):
        scheduler.submit(1)


def test_statistics_see_every_batch_and_every_rows_wait():
    sizes: list[int] = []
    waits: list[float] = []
    recorder = Recorder(delay=0.002)

    def on_batch(rows, row_waits):
        sizes.append(rows)
        waits.extend(row_waits)

    scheduler = BatchScheduler(recorder, BatchPolicy(max_batch=8, max_wait_s=0.1), on_batch=on_batch)
    drive(scheduler, callers=3, steps=5)
    assert sum(sizes) == 15 == len(waits)
    assert sizes == [len(b) for b in recorder.batches]


def test_a_step_that_arrives_during_a_batch_waits_for_it_in_the_queue():
    waits: list[float] = []
    recorder = Recorder(delay=0.6)
    scheduler = BatchScheduler(recorder, BatchPolicy(max_batch=8, max_wait_s=0.0),
                               on_batch=lambda rows, row_waits: waits.extend(row_waits))
    first = threading.Thread(target=scheduler.submit, args=(1,))
    first.start()
    while not recorder.batches:  # the first step's batch is running
        time.sleep(0.001)
    assert scheduler.submit(2) == 4
    first.join(10)
    assert recorder.batches == [[1], [2]]
    # The first ran at once; the second, arriving a moment into the first's 0.6 s batch,
    # waited in the queue for most of it.
    assert waits[0] < 0.3 < waits[1]  # margins for a loaded machine
