"""Batched decode: sessions stepping together equal each session run alone.

The committed test models carry ``decode_batch{2,4}[_attend{16,32}]_lora_r{4,16}`` signatures. Each case
runs the same sessions twice, on an engine without batching (each step alone) and through
the batched path, and compares every row's logits and greedy tokens.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from batching import greedy_alone, greedy_together
from conftest import MODEL_FILES, adapter_path
from runtime import (
    Engine,
    EngineSettings,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    LoraSource,
    ResourceExhaustedError,
    SessionConfig,
)
from runtime.executor.litert_executor import LlmExecutor

TOLERANCE = 1e-4
R4, OTHER_R4, R16 = adapter_path("torch_r4"), adapter_path("litertlm_r4"), adapter_path("torch_r16")

# Sessions of mixed kinds: rank-4 adapters, rank-16 ones, blends, the base model.
MIXED = [
    SessionConfig(lora_path=R4),
    SessionConfig(),
    SessionConfig(lora_path=OTHER_R4, lora_scale=0.5),
    SessionConfig(lora_path=R16),
    SessionConfig(loras=[LoraSource(path=R4, scale=0.7), LoraSource(path=OTHER_R4, scale=0.3)]),
    SessionConfig(lora_path=R4),
    SessionConfig(),
]


def prompt(row: int) -> list[int]:
    """Prompts of different lengths: the rows sit at different positions, on both sides of
    the models' attention windows (16 and 32 positions)."""
    return [(7 * row + 3 * i) % 250 + 1 for i in range(2 + 5 * (row % 8))]


def alone(model, configs, steps: int) -> list[tuple[list[int], list[np.ndarray]]]:
    """Greedy tokens and logits per session, each stepping by itself (no batching)."""
    return greedy_alone(model, configs, prompt, steps)


def prefilled(engine: Engine, configs) -> tuple[list, list[int]]:
    """A session per config, its prompt prefilled, and each one's greedy next token."""
    sessions = [engine.create_session(config) for config in configs]
    return sessions, [int(np.argmax(s.run_prefill(prompt(row)))) for row, s in enumerate(sessions)]


@pytest.mark.parametrize("layout", sorted(MODEL_FILES))
def test_every_row_of_a_batch_equals_its_session_alone(layout):
    model, steps = MODEL_FILES[layout], 6
    expected = alone(model, MIXED, steps)
    with Engine(model) as engine:
        sessions = [engine.create_session(config) for config in MIXED]
        logits = [s.run_prefill(prompt(row)) for row, s in enumerate(sessions)]
        invokes = engine.stats().invokes
        tokens, batched = greedy_together(engine, sessions, logits, steps)
        for step, logits in enumerate(batched):
            for row, (_, seen) in enumerate(expected):
                assert np.abs(logits[row] - seen[step]).max() <= TOLERANCE, (layout, row, step)
        # the rank-4 rows are padded into the rank-16 slot of the rank-16 row and the blend (zeros:
        # exact), base rows join with zero LoRA: all 7 run as one batch of 4 and one of 3 (padded to 4)
        assert (engine.stats().invokes - invokes) == 2 * steps
        assert tokens == [t for t, _ in expected]
        assert [s.position for s in sessions] == [len(prompt(row)) + steps for row in range(len(sessions))]
        assert dict(engine.stats().decode_batches) == {len(MIXED): steps}
        for s in sessions:
            s.close()


def test_a_lower_rank_adapter_joins_a_higher_rank_batch_zero_padded():
    configs = [SessionConfig(lora_path=R4), SessionConfig(lora_path=R16), SessionConfig(lora_path=OTHER_R4)]
    expected = alone(MODEL_FILES["default"], configs, 3)
    with Engine(MODEL_FILES["default"]) as engine:
        sessions, tokens = prefilled(engine, configs)
        for step in range(3):
            invokes = engine.stats().invokes
            logits = engine.decode_together(list(zip(sessions, tokens)))
            assert engine.stats().invokes - invokes == 1  # one run of the rank-16 batch, not a rank-4 one besides
            for row, (_, seen) in enumerate(expected):
                assert np.abs(logits[row] - seen[step]).max() <= TOLERANCE, (row, step)
            tokens = [int(np.argmax(out)) for out in logits]
        # the rank-4 adapters now also hold rank-16 buffers; alone, they run in their own slot again
        assert sorted(a.slot_rank for a in engine.stats().resident) == [4, 4, 16, 16, 16]
        invokes = engine.stats().invokes
        sessions[0].run_decode(tokens[0])
        assert engine.stats().invokes - invokes == 1
        for s in sessions:
            s.close()


def test_rows_that_change_places_or_adapters_between_batches_stay_exact():
    """A batch's LoRA inputs are stacked over its rows and refilled where a row's adapter
    changed: rows swapping places while others stay, fewer rows (padding), a session
    re-targeted to another adapter while the rest stay, all equal each session stepping alone."""
    configs = [SessionConfig(lora_path=R4), SessionConfig(lora_path=R16), SessionConfig(lora_path=OTHER_R4),
               SessionConfig()]
    with Engine(MODEL_FILES["default"]) as engine, \
            Engine(MODEL_FILES["default"], EngineSettings(batch_wait_s=None)) as alone_engine:
        pairs = [(engine.create_session(config), alone_engine.create_session(config)) for config in configs]
        for row, (batched, single) in enumerate(pairs):
            batched.run_prefill(prompt(row))
            single.run_prefill(prompt(row))

        def step(rows: list[int]) -> None:
            tokens = [(17 * row + pairs[row][1].position) % 250 + 1 for row in rows]
            invokes = engine.stats().invokes
            got = engine.decode_together([(pairs[row][0], token) for row, token in zip(rows, tokens)])
            assert engine.stats().invokes - invokes == 1  # every row in one batched run
            for row, token, logits in zip(rows, tokens, got):
                assert np.abs(logits - pairs[row][1].run_decode(token)).max() <= TOLERANCE, (rows, row)

        step([0, 1, 2, 3])
        step([3, 1, 2, 0])  # the middle rows stay; the base session takes the rank-4 adapter's row
        step([2, 0, 3])  # three rows in the 4-row batch: the last one pads
        step([3, 2, 1, 0])
        for session in pairs[0]:  # the rank-16 row keeps the batch in its slot: one row changes
            session.set_adapters([LoraSource(path=OTHER_R4)], reset=True)
            session.run_prefill(prompt(0))
        step([3, 2, 1, 0])
        step([3, 2, 1, 0])
        for batched, single in pairs:
            batched.close()
            single.close()


@pytest.fixture
def slow_steps(monkeypatch):
    """Every decode run takes 2 ms more (asleep, without the GIL), as at real size: on
    the tiny model a whole generation otherwise fits in one of Python's thread turns
    and sessions on threads would rarely meet in a batch."""
    for name in ("decode", "_invoke_batch"):
        real = getattr(LlmExecutor, name)

        def slowed(self, *args, _real=real, **kwargs):
            time.sleep(0.002)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(LlmExecutor, name, slowed)


def test_sessions_on_threads_batch_and_equal_their_runs_alone(slow_steps):
    steps = 12
    expected = alone(MODEL_FILES["transposed"], MIXED * 2, steps)
    results: dict[int, list[int]] = {}
    with Engine(MODEL_FILES["transposed"], EngineSettings(batch_wait_s=0.05)) as engine:
        start = threading.Barrier(len(MIXED) * 2)

        def work(row: int, config: SessionConfig) -> None:
            with engine.create_session(config) as session:
                first = session.run_prefill(prompt(row))
                start.wait()
                generated = session.generate([int(np.argmax(first))], max_new_tokens=steps, stop_tokens=())
                results[row] = [int(np.argmax(first))] + generated.tokens[:-1]

        threads = [threading.Thread(target=work, args=(row, config)) for row, config in enumerate(MIXED * 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stats = engine.stats()
    assert [results[row] for row in range(len(threads))] == [t for t, _ in expected]
    # steps - 1 decode steps each: a generation's last token is left pending, not run.
    assert sum(rows * count for rows, count in stats.decode_batches) == len(threads) * (steps - 1)
    assert max(rows for rows, _ in stats.decode_batches) > 1  # steps did run together
    assert stats.queue_wait.count == len(threads) * (steps - 1)


def test_a_session_alone_runs_as_without_batching():
    with Engine(MODEL_FILES["default"]) as engine, engine.create_session(SessionConfig(lora_path=R4)) as session:
        session.generate([5, 6, 7], max_new_tokens=10, stop_tokens=())
        stats = engine.stats()
    assert dict(stats.decode_batches) == {1: 9}  # 10 tokens: the first from the prefill, the last left pending
    assert stats.invokes == 2 + 9  # prefill (its last token decoded: no logits on prefill), one run per step


def test_a_failing_run_fails_every_row_and_the_sessions_go_on(monkeypatch):
    configs = MIXED[:4]
    expected = alone(MODEL_FILES["default"], configs, 2)
    with Engine(MODEL_FILES["default"]) as engine:
        sessions, tokens = prefilled(engine, configs)
        real = LlmExecutor._invoke_batch

        def broken(self, *args, **kwargs):
            raise InternalError("running 'decode_batch4_lora_r4' failed: injected")

        monkeypatch.setattr(LlmExecutor, "_invoke_batch", broken)
        with pytest.raises(InternalError, match="injected"):
            engine.decode_together(list(zip(sessions, tokens)))
        assert [s.position for s in sessions] == [len(prompt(row)) for row in range(len(sessions))]
        monkeypatch.setattr(LlmExecutor, "_invoke_batch", real)
        logits = engine.decode_together(list(zip(sessions, tokens)))
        for row, (_, seen) in enumerate(expected):
            assert np.abs(logits[row] - seen[0]).max() <= TOLERANCE
        for s in sessions:
            s.close()


def test_a_row_without_room_refuses_the_whole_step_before_anything_runs():
    with Engine(MODEL_FILES["default"]) as engine:
        full, other = engine.create_session(), engine.create_session(SessionConfig(lora_path=R4))
        full.run_prefill([3] * full.kv_length)
        other.run_prefill([3, 4])
        with pytest.raises(ResourceExhaustedError, match=f"session {full.session_id}: .*KV cache of 64"):
            engine.decode_together([(other, 5), (full, 5)])
        assert (full.position, other.position) == (64, 2)


def test_decode_together_refuses_what_it_cannot_run():
    with Engine(MODEL_FILES["default"]) as engine, Engine(MODEL_FILES["default"]) as another:
        session, stranger = engine.create_session(), another.create_session()
        with pytest.raises(InvalidArgumentError, match="one session twice"):
            engine.decode_together([(session, 1), (session, 2)])
        with pytest.raises(InvalidArgumentError, match="another engine"):
            engine.decode_together([(session, 1), (stranger, 2)])
        with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
            engine.decode_together([(session, 10_000)])
        session.close()
        with pytest.raises(FailedPreconditionError, match="closed"):
            engine.decode_together([(session, 1)])


def test_closing_a_session_between_steps_leaves_the_others_exact():
    configs = MIXED[:4]
    expected = alone(MODEL_FILES["default"], configs, 3)
    with Engine(MODEL_FILES["default"]) as engine:
        sessions, tokens = prefilled(engine, configs)
        logits = engine.decode_together(list(zip(sessions, tokens)))
        sessions[1].close()
        live = [0, 2, 3]
        logits = engine.decode_together([(sessions[row], int(np.argmax(logits[row]))) for row in live])
        for got, row in zip(logits, live):
            assert np.abs(got - expected[row][1][1]).max() <= TOLERANCE
        for row in live:
            sessions[row].close()
