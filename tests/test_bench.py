"""Tests for runtime.bench: each measurement runs on the test model and reports what it
claims to (the right keys, slots, sizes and relations), not how fast this machine is."""

from __future__ import annotations

import itertools

import pytest

from conftest import MODEL_FILES, WorkClock, adapter_path
from runtime import Engine, LoraSource, SessionConfig
from runtime import bench
from runtime.errors import InvalidArgumentError

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


def test_switch_measures_each_pattern_and_really_switches(engine):
    before = engine.stats().switch.count
    out = bench.bench_switch(engine, R4, OTHER_R4, steps=8, repeats=2)
    assert set(out) == {"alone", "alternate_same", "alternate_other", "switch"}
    # per repeat: 8 alternating steps of each of the three switching patterns
    # Setting up: into each of the rig's four sessions, and the switcher re-targeted (5).
    # Per repeat, 8 steps of each pattern: alone (1, into its session), alternating with a
    # twin on the same adapter (7: its first step is the same session's), alternating with
    # another adapter (8), re-targeting one session before each step (8).
    assert engine.stats().switch.count - before == 5 + 2 * (1 + 7 + 8 + 8)
    assert engine.stats().sessions == ()


def test_decode_round_times_each_session_and_its_invokes(engine):
    with engine.create_session() as plain, engine.create_session(SessionConfig(loras=[R4])) as adapted:
        out = bench.decode_round(engine, {"plain": plain, "r4": adapted}, steps=6)
        assert set(out) == {"plain", "r4"}
        for step, invoke in out.values():
            assert 0 < invoke < step
        assert adapted.stats().decode_tokens == 6
        assert adapted.position == 6  # from an empty context


def runs(engine):
    """A clock for ``bench``: one second per model run of ``engine`` so far."""
    return WorkClock(lambda: engine.stats().invokes)


def test_timed_decode_after_a_prompt_times_only_the_steps(engine, monkeypatch):
    with engine.create_session() as session:
        clock = runs(engine)
        monkeypatch.setattr(bench, "time", clock)
        before = engine.stats().invokes
        step, invoke = bench.timed_decode(engine, session, steps=4, prompt=10)
        prefill_runs = engine.stats().invokes - before - 4
        assert prefill_runs >= 1  # the prompt ran, and before the clock started:
        assert clock.readings == [before + prefill_runs, before + prefill_runs + 4]
        assert step == 1.0  # one model run per decode step timed, nothing else
        assert 0 < invoke
        assert session.position == 14
        assert session.stats().decode_tokens == 4


def test_switch_rig_rounds_time_every_pattern_per_step(engine, monkeypatch):
    rig = bench.SwitchRig(engine, R4, OTHER_R4)
    try:
        monkeypatch.setattr(bench, "time", runs(engine))
        before = engine.stats().switch.count
        sessions = {"one": rig.one, "twin": rig.twin, "other": rig.other, "switcher": rig.switcher}
        tokens = {name: s.stats().decode_tokens for name, s in sessions.items()}
        out = rig.round(steps=8)
        # Who ran: the lone session 9 steps, then 4 beside its twin (same adapter) and 4 beside
        # the session of the other adapter; the switcher 8, re-targeted before each.
        assert {name: s.stats().decode_tokens - tokens[name] for name, s in sessions.items()} == {
            "one": 9 + 4 + 4, "twin": 4, "other": 4, "switcher": 8}
        assert rig.other.blend != rig.one.blend == rig.twin.blend  # the pairs are what their names say
        # Every pattern's figure is per decode step: exactly one model run each, whatever
        # the pattern does between them (switching adapters runs nothing).
        assert out == {"alone": 1.0, "alternate_same": 1.0, "alternate_other": 1.0, "switch": 1.0}
        # alone: 1 switch into its session; the same adapter alternating: 7 (its first step is
        # the same session's); another adapter: 8; re-targeting one session: 8.
        assert engine.stats().switch.count - before == 1 + 7 + 8 + 8
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


@pytest.mark.parametrize("steps, repeats, match", [
    (0, 2, "--steps 0: expected at least 1"), (-3, 2, "--steps -3: expected at least 1"),
    (8, 0, "--repeats 0: expected at least 1"),
    (65, 2, "--steps 65: a run decodes that many positions from an empty cache, expected at most the model's KV "
            "cache of 64 positions"),
])
def test_quick_table_refuses_what_it_cannot_measure_naming_the_flag(steps, repeats, match):
    with pytest.raises(InvalidArgumentError, match=match):
        bench.quick_table(MODEL_FILES["default"], [], steps=steps, repeats=repeats)
