"""Tests for runtime.bench: each measurement runs on the test model and reports what it
claims to (the right keys, slots, sizes and relations), not how fast this machine is."""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import pytest

from conftest import MODEL_FILES, adapter_path
from runtime import Engine, InvalidArgumentError, LoraSource, SessionConfig
from runtime import bench

R4 = LoraSource(path=adapter_path("torch_r4"))
R16 = LoraSource(path=adapter_path("torch_r16"))
OTHER_R4 = LoraSource(path=adapter_path("litertlm_r4"))


@pytest.fixture(scope="module")
def engine():
    with Engine(MODEL_FILES["default"]) as shared:
        yield shared


def test_median_seconds_takes_the_median_of_the_runs(monkeypatch):
    ticks = itertools.chain.from_iterable((start, start + took) for start, took in [(0, 5), (10, 1), (20, 3)])
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(ticks))
    calls = []
    assert bench.median_seconds(lambda: calls.append(1), 3) == 3
    assert len(calls) == 3


def test_rss_bytes_sees_memory_being_touched():
    before = bench.rss_bytes()
    block = np.ones(64 << 20, np.uint8)  # 64 MiB, every page written
    assert bench.rss_bytes() - before >= 48 << 20
    del block


def test_decode_reports_step_invoke_share_and_the_slot_used(engine):
    configs = {
        "base": SessionConfig(),
        "r4": SessionConfig(loras=[R4]),
        "r16": SessionConfig(loras=[R16]),
        "blend": SessionConfig(loras=[R4, OTHER_R4]),  # summed rank 8: the r16 slot
    }
    out = bench.bench_decode(engine, configs, steps=8, repeats=2)
    assert set(out) == set(configs)
    assert {name: d["slot"] for name, d in out.items()} == {"base": None, "r4": 4, "r16": 16, "blend": 16}
    for d in out.values():
        assert 0 < d["invoke"] < d["step"]
        assert 0 < d["glue_share"] < 1
    assert engine.stats().sessions == ()  # its sessions are closed


class Clock:
    """A stand-in for the ``time`` module whose clock advances one second per reading."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


def test_switch_measures_each_pattern_and_really_switches(engine):
    before = engine.stats().switch.count
    out = bench.bench_switch(engine, R4, OTHER_R4, steps=8, repeats=2)
    assert set(out) == {"alone", "alternate_same", "alternate_other", "switch"}
    # per repeat: 8 alternating steps of each of the three switching patterns
    assert engine.stats().switch.count - before >= 3 * 8 * 2
    assert engine.stats().sessions == ()


def test_cold_switch_reports_each_adapters_buffer_bytes():
    (r4_bytes, _), (r16_bytes, _) = bench.bench_cold_switch(MODEL_FILES["default"], [R4, R16], 2)
    with Engine(MODEL_FILES["default"]) as engine:
        expected = {rank: sum(spec.nbytes for spec in engine.spec.lora_slot(rank).values()) for rank in (4, 16)}
    assert (r4_bytes, r16_bytes) == (expected[4], expected[16])


def test_random_adapter_files_are_distinct_and_fit(engine, tmp_path):
    paths = bench.random_adapter_files(engine, tmp_path, 3, rank=4)
    assert len({hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}) == 3
    ids = [engine.register_adapter(LoraSource(path=p)) for p in paths]
    assert len(set(ids)) == 3
    assert {a.rank for a in engine.stats().adapters if a.lora_id in ids} == {4}
    for lora_id in ids:
        engine.unload_adapter(lora_id)


def test_memory_walks_every_adapter_under_lru4_and_unloads_them():
    out = bench.bench_memory(MODEL_FILES["default"], rank=4, count=bench.RESIDENT_PROBE + 4, cycles=200)
    with Engine(MODEL_FILES["default"]) as engine:
        slot_bytes = sum(spec.nbytes for spec in engine.spec.lora_slot(4).values())
    assert out["slot_float32_bytes"] == slot_bytes
    assert out["resident_after_walk"] == 4
    assert out["growth_per_switch_bytes"] < 4096  # a leaked slot buffer per cycle would be ~100 KiB
    assert {"registered_per_adapter_bytes", "resident_first_adapter_bytes", "resident_per_adapter_bytes",
            "rss_all_registered_used_once_lru4_bytes", "after_unload_bytes"} <= set(out)


def test_concurrency_rig_gives_each_session_its_own_adapter_and_counts_tokens(monkeypatch):
    rig = bench.ConcurrencyRig(MODEL_FILES["default"], [4, 16, 4], executors=2)
    try:
        assert len({session.lora_ids[0] for session in rig.sessions}) == 3
        ranks = {a.lora_id: a.rank for a in rig.engine.stats().adapters}
        assert [ranks[session.lora_ids[0]] for session in rig.sessions] == [4, 16, 4]
        assert rig.engine.settings.executors == 2
        before = [session.stats().decode_tokens for session in rig.sessions]
        monkeypatch.setattr(bench, "time", Clock())  # the timed block reads as 1 s
        assert rig.tokens_per_second(2, steps=8) == 18.0  # 2 sessions x (8 + 1) tokens in 1 s
        after = [session.stats().decode_tokens for session in rig.sessions]
        assert [a - b for a, b in zip(after, before)] == [9, 9, 0]  # only the first two ran
        # From a position: the prompt is prefilled before the clock starts, the steps follow it.
        assert rig.tokens_per_second(1, steps=4, first=2, position=40) == 5.0
        assert rig.sessions[2].position == 45 and rig.sessions[2].stats().prompt_tokens == 40
        with pytest.raises(InvalidArgumentError, match="60 prompt tokens and 5 steps exceed the KV cache of 64"):
            rig.tokens_per_second(1, steps=4, position=60)
    finally:
        rig.close()


def test_batch_memory_compares_rss_growth_with_what_the_sessions_hold():
    out = bench.batch_memory(MODEL_FILES["default"], 4, rank=4)
    kv_bytes = 4 * 64 * 2 * 16 * 4  # per session, the test model's caches
    with Engine(MODEL_FILES["default"]) as engine:
        slot_bytes = sum(spec.nbytes for spec in engine.spec.lora_slot(4).values())
    assert out["kv_and_adapter_bytes"] == 3 * (kv_bytes + slot_bytes)  # three more caches and adapters
    assert out["sessions"] == 4


def test_batch_fidelity_runs_sessions_together_and_alone():
    out = bench.batch_fidelity(MODEL_FILES["default"], 4, steps=3, rank=4)
    assert out["max_abs_logit_diff"] <= 1e-5 and out["greedy_identical"] is True


def test_spread_summarizes_rounds():
    assert bench.spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "rounds": 4}


def test_peak_rss_is_at_least_the_current_rss():
    assert bench.rss_bytes("VmHWM") >= bench.rss_bytes() > 0
    assert bench.rss_bytes("NoSuchField") == 0


def test_decode_round_times_each_session_and_its_invokes(engine):
    with engine.create_session() as plain, engine.create_session(SessionConfig(loras=[R4])) as adapted:
        out = bench.decode_round(engine, {"plain": plain, "r4": adapted}, steps=6)
        assert set(out) == {"plain", "r4"}
        for step, invoke in out.values():
            assert 0 < invoke < step
        assert adapted.stats().decode_tokens == 6
        assert adapted.position == 6  # from an empty context


def test_timed_decode_after_a_prompt_times_only_the_steps(engine, monkeypatch):
    with engine.create_session() as session:
        monkeypatch.setattr(bench, "time", Clock())  # the timed block reads as 1 s
        step, invoke = bench.timed_decode(engine, session, steps=4, prompt=10)
        assert step == 0.25 and 0 < invoke < step
        assert session.position == 14
        assert session.stats().decode_tokens == 4


def test_prefill_seconds_prefills_from_an_empty_context(engine, monkeypatch):
    with engine.create_session() as session:
        session.run_decode(1)
        monkeypatch.setattr(bench, "time", Clock())
        assert bench.prefill_seconds(session, 12) == 1.0
        assert session.position == 12


def test_register_seconds_registers_and_unloads_each_time(monkeypatch):
    with Engine(MODEL_FILES["default"]) as engine:
        monkeypatch.setattr(bench, "time", Clock())
        assert bench.register_seconds(engine, R16, repeats=3) == 1.0
        assert engine.stats().load.count == 3
        assert engine.stats().adapters == ()


def test_load_cost_reports_times_and_peak_memory():
    out = bench.load_cost(MODEL_FILES["default"])
    assert out["load_s"] > 0 and out["first_decode_s"] > 0
    assert out["peak_rss_bytes"] >= out["rss_bytes"] > out["rss_before_bytes"] > 0


def test_switch_rig_rounds_time_every_pattern(engine):
    rig = bench.SwitchRig(engine, R4, OTHER_R4)
    try:
        before = engine.stats().switch.count
        out = rig.round(steps=8)
        assert set(out) == {"alone", "alternate_same", "alternate_other", "switch"}
        assert all(seconds > 0 for seconds in out.values())
        assert engine.stats().switch.count - before >= 3 * 8
    finally:
        rig.close()
    assert engine.stats().sessions == ()


def test_quick_table_renders_one_line_per_row():
    rows = bench.quick_table(MODEL_FILES["default"], [str(R4.path), str(OTHER_R4.path)], steps=8, repeats=2)
    assert {row.section for row in rows} == {"prefill", "decode", "switch"}
    decode = [row for row in rows if row.section == "decode"]
    assert len(decode) == 4  # base, two adapters, their blend
    assert "slot r4" in decode[1].note and "slot r16" in decode[3].note
    table = bench.render(rows, "title")
    lines = table.splitlines()
    assert lines[0] == "title" and lines[2].startswith("| measurement")
    assert len(lines) == 4 + len(rows)
    assert all(row.what in table for row in rows)
