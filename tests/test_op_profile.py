"""Tests for Engine.profile_ops: LiteRT's op profiler over the runs of a block of code."""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest

from conftest import MODEL_FILES
from tflite_ops import signature_graphs
from runtime import Engine, EngineSettings
from runtime.errors import FailedPreconditionError

STEPS = 3


@pytest.fixture(scope="module")
def engine():
    with Engine(MODEL_FILES["transposed"], EngineSettings(profile_ops=True)) as engine:
        yield engine


def test_a_recording_counts_every_op_of_every_decode_step(engine):
    session = engine.create_session()
    session.run_prefill([5, 17, 42])
    with engine.profile_ops() as recording:
        assert recording.profile is None
        for token in range(STEPS):
            session.run_decode(token + 1)
    profile = recording.profile
    assert profile.runs == STEPS
    by_name = {op.name: op for op in profile.ops}
    linears = Counter(kind for kind, _ in signature_graphs(MODEL_FILES["transposed"])["decode"].operators)[
        "FULLY_CONNECTED"]
    assert linears > 0
    assert by_name["Fully Connected (NC, F32) GEMM"].count == STEPS * linears
    assert by_name["Fully Connected (NC, F32) GEMM"].kernel == "XNNPACK"
    assert by_name["DYNAMIC_UPDATE_SLICE"].kernel == "TFLite"  # the interpreter's own kernel
    assert 0 < sum(op.milliseconds for op in profile.ops) <= profile.run_milliseconds
    table = profile.table(steps=STEPS).splitlines()
    assert table[0].startswith(f"{STEPS} runs,")
    assert f"| Fully Connected (NC, F32) GEMM | XNNPACK | {linears} |" in "\n".join(table)


def test_recorded_runs_compute_what_unrecorded_runs_do(engine):
    def logits() -> np.ndarray:
        session = engine.create_session()
        session.run_prefill([5, 17, 42])
        return np.stack([session.run_decode(token) for token in (1, 2)])

    plain = logits()
    with engine.profile_ops():
        recorded = logits()
    np.testing.assert_array_equal(recorded, plain)


def test_a_second_recording_at_once_is_refused_and_the_first_goes_on(engine):
    session = engine.create_session()
    session.run_prefill([5, 17, 42])
    with engine.profile_ops() as recording:
        with pytest.raises(FailedPreconditionError, match="recorded already"):
            with engine.profile_ops():
                pass
        session.run_decode(1)
    assert recording.profile.runs == 1
    with engine.profile_ops() as again:  # the refused one left nothing half-started
        session.run_decode(2)
    assert again.profile.runs == 1


def test_runs_from_other_threads_are_recorded_too(engine):
    sessions = [engine.create_session() for _ in range(2)]
    for session in sessions:
        session.run_prefill([5, 17, 42])
    invokes = engine.stats().invokes
    with engine.profile_ops() as recording:
        threads = [threading.Thread(target=lambda s=session: [s.run_decode(t) for t in range(STEPS)])
                   for session in sessions]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    runs = engine.stats().invokes - invokes  # steps that met ran as one batched run
    assert STEPS <= runs <= 2 * STEPS
    assert recording.profile.runs == runs


def test_an_engine_opened_without_the_setting_cannot_record():
    with Engine(MODEL_FILES["transposed"]) as engine:
        with pytest.raises(FailedPreconditionError, match="profile_ops"):
            with engine.profile_ops():
                pass
