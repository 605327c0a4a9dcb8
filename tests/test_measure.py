"""Tests for benchmarks/measure.py: each measurement runs on the test model and reports
what it measured (exact where the quantity is known, e.g. the bytes of a rank slot)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from benchmarks import measure
from conftest import MODEL_FILES, WorkClock, adapter_path
from runtime import Engine, InvalidArgumentError, LoraSource


R4 = LoraSource(path=adapter_path("torch_r4"))
R16 = LoraSource(path=adapter_path("torch_r16"))
# The test model's rank-4 slot: per layer q/o a,b = 64x4 + 4x64, k/v a,b = 64x4 + 4x32 (float32), 2 layers.
R4_SLOT_BYTES = 2 * (2 * (64 * 4 + 4 * 64) + 2 * (64 * 4 + 4 * 32)) * 4
R16_SLOT_BYTES = 4 * R4_SLOT_BYTES


@pytest.fixture(scope="module")
def engine():
    with Engine(MODEL_FILES["default"]) as shared:
        yield shared


def test_rss_bytes_sees_memory_being_touched():
    before = measure.rss_bytes()
    block = np.ones(64 << 20, np.uint8)  # 64 MiB, every page written
    assert measure.rss_bytes() - before >= 48 << 20
    del block


def test_cold_switch_reports_each_adapters_buffer_bytes():
    (r4_bytes, _), (r16_bytes, _) = measure.bench_cold_switch(MODEL_FILES["default"], [R4, R16], 2)
    assert (r4_bytes, r16_bytes) == (R4_SLOT_BYTES, R16_SLOT_BYTES)


def test_random_adapter_files_are_distinct_and_fit(engine, tmp_path):
    paths = measure.random_adapter_files(engine, tmp_path, 3, rank=4)
    assert len({hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}) == 3
    ids = [engine.register_adapter(LoraSource(path=p)) for p in paths]
    assert len(set(ids)) == 3
    assert {a.rank for a in engine.stats().adapters if a.lora_id in ids} == {4}
    for lora_id in ids:
        engine.unload_adapter(lora_id)


def test_memory_walks_every_adapter_under_lru4_and_unloads_them():
    out = measure.bench_memory(MODEL_FILES["default"], rank=4, count=measure.RESIDENT_PROBE + 4, cycles=200)
    assert out["slot_float32_bytes"] == R4_SLOT_BYTES
    assert out["resident_after_walk"] == 4
    assert out["growth_per_switch_bytes"] < 4096  # a leaked slot buffer per cycle would be ~100 KiB
    assert {"registered_per_adapter_bytes", "resident_first_adapter_bytes", "resident_per_adapter_bytes",
            "rss_all_registered_used_once_lru4_bytes", "after_unload_bytes"} <= set(out)
    # A registration keeps its table of projections: some Python objects, far below the adapter's tensors.
    assert 0 < out["registered_python_per_adapter_bytes"] < out["tensor_bytes_per_adapter"] / 4


def test_concurrency_rig_gives_each_session_its_own_adapter_and_counts_tokens(monkeypatch):
    rig = measure.ConcurrencyRig(MODEL_FILES["default"], [4, 16, 4], executors=2)
    try:
        assert len({session.lora_ids[0] for session in rig.sessions}) == 3
        ranks = {a.lora_id: a.rank for a in rig.engine.stats().adapters}
        assert [ranks[session.lora_ids[0]] for session in rig.sessions] == [4, 16, 4]
        assert rig.engine.settings.executors == 2
        before = [session.stats().decode_tokens for session in rig.sessions]

        def state():
            return [(s.stats().prompt_tokens, s.stats().decode_tokens - b) for s, b in zip(rig.sessions, before)]

        # One second per reading (the threads' runs are not ordered against the clock's first
        # reading); what had happened at each reading is recorded.
        clock = WorkClock(lambda: len(clock.readings) + 1, record=state)
        monkeypatch.setattr(measure, "time", clock)
        assert rig.tokens_per_second(2, steps=8) == 18.0  # 2 sessions x (8 + 1) tokens in 1 s
        # The clock stopped after every step of both sessions, and only the first two ran.
        assert clock.records[-1] == [(0, 9), (0, 9), (0, 0)]
        # From a position: the prompt is in before the clock starts, the steps follow it.
        clock.records.clear()
        assert rig.tokens_per_second(1, steps=4, first=2, position=40) == 5.0
        assert clock.records[0][2][0] == 40 and clock.records[-1][2] == (40, 5)
        assert rig.sessions[2].position == 45
        with pytest.raises(InvalidArgumentError, match="60 prompt tokens and 5 steps exceed the KV cache of 64"):
            rig.tokens_per_second(1, steps=4, position=60)
    finally:
        rig.close()


def test_a_lone_step_reports_the_graphs_share_of_it(monkeypatch):
    rig = measure.ConcurrencyRig(MODEL_FILES["default"], [4])
    try:
        invokes = rig.engine.stats().invokes
        monkeypatch.setattr(measure, "time", WorkClock(lambda: rig.engine.stats().invokes))  # 1 s a model run
        step, graph = rig.lone_step(steps=3)
        assert step == 1.0  # per step: one run, the 4 steps' runs all timed
        assert rig.engine.stats().invokes - invokes == 4
        assert 0 < graph < 0.25  # the runs' own wall time, not the faked clock's
    finally:
        rig.close()


def test_the_lone_ratio_discounts_each_engines_own_graph_time():
    # Graphs of 12 and 10 ms, both engines 1 ms outside them: as if on the same graph, equal.
    assert measure.discounted_lone_ratio((0.013, 0.012), (0.011, 0.010)) == pytest.approx(1.0)
    # 0.5 ms more of the runtime's own work per step on the batching engine.
    assert measure.discounted_lone_ratio((0.0135, 0.012), (0.011, 0.010)) == pytest.approx(0.011 / 0.0115)


def test_batch_memory_compares_rss_growth_with_what_the_sessions_hold():
    out = measure.batch_memory(MODEL_FILES["default"], 4, rank=4)
    kv_bytes = 4 * 64 * 2 * 16 * 4  # per session, the test model's caches
    assert out["kv_and_adapter_bytes"] == 3 * (kv_bytes + R4_SLOT_BYTES)  # three more caches and adapters
    assert out["sessions"] == 4


def test_batch_fidelity_runs_sessions_together_and_alone():
    out = measure.batch_fidelity(MODEL_FILES["default"], 4, steps=3, rank=4)
    assert out["max_abs_logit_diff"] <= 1e-5 and out["greedy_identical"] is True


def test_spread_summarizes_rounds():
    assert measure.spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "rounds": 4}


def test_peak_rss_is_at_least_the_current_rss():
    assert measure.rss_bytes("VmHWM") >= measure.rss_bytes() > 0
    assert measure.rss_bytes("NoSuchField") == 0


def test_prefill_seconds_prefills_from_an_empty_context(engine, monkeypatch):
    with engine.create_session() as session:
        session.run_decode(1)
        monkeypatch.setattr(measure, "time", WorkClock(lambda: session.stats().prompt_tokens))  # 1 s a prompt token
        assert measure.prefill_seconds(session, 12) == 12.0  # the whole prompt timed, nothing else
        assert session.position == 12


def test_register_seconds_registers_and_unloads_each_time(monkeypatch):
    with Engine(MODEL_FILES["default"]) as engine:
        clock = WorkClock(lambda: len(engine.stats().adapters))  # the clock reads the adapters registered now
        monkeypatch.setattr(measure, "time", clock)
        # Each timed block holds one registration and no unload: from 0 adapters to 1.
        assert measure.register_seconds(engine, R16, repeats=3) == 1.0
        assert clock.readings == [0, 1] * 3
        assert engine.stats().load.count == 3
        assert engine.stats().adapters == ()


def test_load_cost_times_loading_and_the_first_step_apart(monkeypatch):
    opened: list[Engine] = []

    class Opened(Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            opened.append(self)

    # 1000 s per engine opened, 1 s per model run: the two timed blocks apart.
    monkeypatch.setattr(measure, "Engine", Opened)
    monkeypatch.setattr(measure, "time", WorkClock(lambda: 1000 * len(opened) + sum(e.stats().invokes for e in opened)))
    out = measure.load_cost(MODEL_FILES["default"])
    assert (out["load_s"], out["first_decode_s"]) == (1000.0, 1.0)
    assert out["peak_rss_bytes"] >= out["rss_bytes"] > out["rss_before_bytes"]
