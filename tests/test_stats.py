"""Tests for runtime.engine.stats."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest

from conftest import MODEL_FILES, MODELS, adapter_path
from runtime import Engine, EngineSettings, LoraSource, Lru, SessionConfig
from runtime.engine.stats import AdapterStats, EngineStats, ResidentStats, SessionStats
from runtime.errors import DataLossError
from runtime.util.latency import LatencySummary

# torch_r4 holds, per layer, q/o: a 64x4 + b 4x64 and k/v: a 64x4 + b 4x32, float32, 2 layers;
# in the rank-4 slot its buffers have exactly that size.
R4_BYTES = 2 * (2 * (64 * 4 + 4 * 64) + 2 * (64 * 4 + 4 * 32)) * 4
NO_LATENCY = LatencySummary(0, 0.0, 0.0)


def engine_stats(resident=(), **overrides) -> EngineStats:
    fields = dict(
        adapters=(), resident=tuple(resident), load=NO_LATENCY, materialize=NO_LATENCY, switch=NO_LATENCY,
        residency_hits=0, residency_misses=0, evictions=0, sessions=(),
    )
    fields.update(overrides)
    return EngineStats(**fields)


# -- the dataclasses ------------------------------------------------------------------


def test_resident_bytes_of_nothing_is_zero():
    assert engine_stats().resident_bytes == 0


# -- what Engine.stats() reports --------------------------------------------------------


@pytest.fixture
def engine():
    with Engine(MODEL_FILES["default"]) as engine:
        yield engine


def test_a_fresh_engine_reports_nothing(engine):
    stats = engine.stats()
    assert isinstance(stats, EngineStats)
    # The weight cache: tests/test_weight_cache.py; the signature groups open with the plain one.
    assert dataclasses.replace(stats, weight_cache=None, compiled_groups=()) == engine_stats()
    assert stats.compiled_groups == ("plain",) and stats.group_compile.count == 0
    assert stats.resident_bytes == 0


def test_resident_bytes_are_the_slot_buffers_of_every_resident_blend(engine):
    """Each resident blend holds every LoRA input of its slot, padded to the slot's rank,
    whatever the adapters' own ranks: counted here from the model's signature inputs."""
    slot_buffers = {slot.rank: sum(np.zeros(spec.shape, spec.dtype).nbytes for spec in inputs.values())
                    for slot, inputs in engine.spec.lora_slots.items()}
    assert slot_buffers[4] == R4_BYTES  # torch_r4's own tensors fill the rank-4 slot exactly
    alone = engine.create_session(SessionConfig(lora_path=adapter_path("torch_r4")))
    blend = engine.create_session(SessionConfig(loras=[LoraSource(path=adapter_path("litertlm_r4"), scale=0.5),
                                                       LoraSource(path=adapter_path("torch_r4"))]))
    alone.run_prefill([1])
    assert engine.stats().resident_bytes == slot_buffers[4]
    blend.run_prefill([1])  # summed rank 8: the rank-16 slot
    stats = engine.stats()
    assert sorted((r.slot_rank, r.nbytes) for r in stats.resident) == [(4, slot_buffers[4]), (16, slot_buffers[16])]
    assert stats.resident_bytes == slot_buffers[4] + slot_buffers[16]
    blend.close()
    alone.close()


def test_a_registered_adapter_is_listed_but_not_resident(engine):
    lora_id = engine.register_adapter(LoraSource(path=adapter_path("torch_r4")))
    stats = engine.stats()
    assert stats.adapters == (
        AdapterStats(
            lora_id=lora_id, source=str(adapter_path("torch_r4")), format="tflite", rank=4, targets="attention",
            tensor_bytes=R4_BYTES, resident_bytes=0, sessions=0,
        ),
    )
    assert stats.resident == () and stats.resident_bytes == 0
    assert stats.load.count == 1 and stats.load.p50_ms > 0
    assert stats.materialize.count == 0
    assert (stats.residency_hits, stats.residency_misses) == (0, 0)


def test_registering_again_loads_nothing_more(engine):
    source = LoraSource(path=adapter_path("torch_r4"))
    engine.register_adapter(source)
    engine.register_adapter(source)
    stats = engine.stats()
    assert len(stats.adapters) == 1 and stats.load.count == 1


def test_runs_materialize_once_then_hit(engine):
    with engine.create_session(SessionConfig(lora_path=adapter_path("torch_r4"), lora_scale=0.5)) as session:
        session.run_prefill([1, 2, 3])  # the miss: materializes
        for token in (4, 5, 6):
            session.run_decode(token)  # hits
        stats = engine.stats()
    (adapter,) = stats.adapters
    assert stats.resident == (ResidentStats(blend=((adapter.lora_id, 0.5),), slot_rank=4, nbytes=R4_BYTES),)
    assert adapter.resident_bytes == R4_BYTES == stats.resident_bytes
    assert adapter.sessions == 1
    assert (stats.residency_misses, stats.residency_hits, stats.evictions) == (1, 3, 0)
    assert stats.materialize.count == 1 and stats.materialize.p99_ms >= stats.materialize.p50_ms > 0


def test_session_counters_after_prefill_and_decode(engine):
    session = engine.create_session(SessionConfig(lora_path=adapter_path("torch_r4")))
    lora_id = session.lora_ids[0]
    (empty,) = engine.stats().sessions
    assert empty == SessionStats(session.session_id, (lora_id,), 0, 0, 0, None, 0.0)
    session.run_prefill([1, 2, 3, 4])
    session.run_prefill([5, 6])
    session.run_decode(7)
    session.run_decode(8)
    (stats,) = engine.stats().sessions
    assert (stats.position, stats.prompt_tokens, stats.decode_tokens) == (8, 6, 2)
    assert stats.time_to_first_token_s is None  # only generate() measures it
    assert stats.decode_tokens_per_s > 0
    assert stats == session.stats()


def test_generate_counts_prompt_and_new_tokens_and_time_to_first_token(engine):
    session = engine.create_session(SessionConfig(lora_path=adapter_path("torch_r4")))
    result = session.generate([1, 2, 3], max_new_tokens=5)
    (stats,) = engine.stats().sessions
    assert len(result.tokens) == 5
    # 4 decode steps for 5 tokens (the first from the prefill); the last, left pending, counts in the position
    assert (stats.prompt_tokens, stats.decode_tokens, stats.position) == (3, 4, 8)
    assert stats.time_to_first_token_s == result.time_to_first_token_seconds > 0
    session.reset()  # the position goes back; the counters keep the work done
    (after_reset,) = engine.stats().sessions
    assert after_reset.position == 0 and after_reset.prompt_tokens == 3 and after_reset.decode_tokens == 4


def test_base_model_sessions_use_no_adapter(engine):
    with engine.create_session() as session:
        session.run_prefill([1, 2])
        stats = engine.stats()
    assert stats.sessions[0].lora_ids == () and stats.sessions[0].prompt_tokens == 2
    assert stats.adapters == () and stats.resident == ()
    assert (stats.residency_hits, stats.residency_misses) == (0, 0)


def test_sessions_are_listed_by_id_and_closed_ones_disappear(engine):
    config = SessionConfig(lora_path=adapter_path("torch_r4"))
    first, second, third = (engine.create_session(config) for _ in range(3))
    assert [s.session_id for s in engine.stats().sessions] == sorted(
        [first.session_id, second.session_id, third.session_id]
    )
    assert engine.stats().adapters[0].sessions == 3
    second.close()
    stats = engine.stats()
    assert [s.session_id for s in stats.sessions] == [first.session_id, third.session_id]
    assert stats.adapters[0].sessions == 2
    first.close()
    third.close()
    stats = engine.stats()
    assert stats.sessions == () and stats.adapters[0].sessions == 0


def test_a_blend_of_two_adapters_is_one_resident_entry(engine):
    loras = [LoraSource(path=adapter_path("litertlm_r4"), scale=0.5), LoraSource(path=adapter_path("torch_r4"))]
    with engine.create_session(SessionConfig(loras=loras)) as session:
        session.run_prefill([1, 2])
        stats = engine.stats()
        ids = session.lora_ids
    by_id = {adapter.lora_id: adapter for adapter in stats.adapters}
    (resident,) = stats.resident
    assert resident.blend == ((ids[0], 0.5), (ids[1], 1.0))
    assert resident.slot_rank == 16  # summed rank 8 fits the rank-16 slot, not the rank-4 one
    assert resident.nbytes > R4_BYTES
    # Each adapter counts the blend's buffers it is part of.
    assert by_id[ids[0]].resident_bytes == by_id[ids[1]].resident_bytes == resident.nbytes
    assert stats.sessions[0].lora_ids == tuple(ids)


def test_one_adapter_at_two_scales_is_resident_twice(engine):
    path = adapter_path("torch_r4")
    a = engine.create_session(SessionConfig(lora_path=path, lora_scale=1.0))
    b = engine.create_session(SessionConfig(lora_path=path, lora_scale=0.25))
    a.run_prefill([1])
    b.run_prefill([1])
    stats = engine.stats()
    (adapter,) = stats.adapters
    assert sorted(r.blend for r in stats.resident) == [((adapter.lora_id, 0.25),), ((adapter.lora_id, 1.0),)]
    assert adapter.resident_bytes == 2 * R4_BYTES == stats.resident_bytes
    assert adapter.sessions == 2 and stats.residency_misses == 2


def test_an_in_memory_adapter_is_labelled_and_counted(engine):
    blob = adapter_path("torch_r4").read_bytes()
    lora_id = engine.register_adapter(LoraSource(buffer=blob))
    (adapter,) = engine.stats().adapters
    assert adapter.lora_id == lora_id
    assert adapter.source == f"<in-memory buffer of {len(blob)} bytes>"
    assert adapter.tensor_bytes == R4_BYTES and adapter.rank == 4


def test_alternating_sessions_count_switches(engine):
    a = engine.create_session(SessionConfig(lora_path=adapter_path("torch_r4")))
    b = engine.create_session(SessionConfig(lora_path=adapter_path("litertlm_r4")))
    a.run_prefill([1])
    a.run_decode(2)  # same session and adapter: no switch
    assert engine.stats().switch.count == 0
    b.run_prefill([1])  # switch 1
    a.run_decode(3)  # switch 2
    a.run_decode(4)
    assert engine.stats().switch.count == 2


def test_unloading_removes_the_adapter_and_its_buffers(engine):
    with engine.create_session(SessionConfig(lora_path=adapter_path("torch_r4"))) as session:
        session.run_prefill([1, 2])
        lora_id = session.lora_ids[0]
    assert engine.stats().resident_bytes == R4_BYTES  # kept resident after the session (KeepAll)
    engine.unload_adapter(lora_id)
    stats = engine.stats()
    assert stats.adapters == () and stats.resident == () and stats.resident_bytes == 0
    assert stats.load.count == 1 and stats.residency_misses == 1  # history is kept


def test_a_failed_materialization_is_a_miss(engine, tmp_path):
    """An adapter whose file no longer reads at its first use: the materialization was timed
    but not counted as a miss, so misses and materializations disagreed and the failures
    were invisible in the residency counters."""
    directory = tmp_path / "qkvo_r4"
    shutil.copytree(MODELS / "peft" / "qkvo_r4", directory)
    lora_id = engine.register_adapter(LoraSource(path=directory))
    (directory / "adapter_model.safetensors").unlink()
    for attempt in (1, 2):
        with engine.create_session(SessionConfig(adapters={lora_id: 1.0})) as session:
            with pytest.raises(DataLossError, match="adapter_model.safetensors: cannot be read any more"):
                session.run_prefill([1, 2])
        stats = engine.stats()
        assert (stats.residency_misses, stats.residency_hits, stats.materialize.count) == (attempt, 0, attempt)
        assert stats.resident == ()


def test_evictions_under_an_lru_policy():
    settings = EngineSettings(lora_residency=Lru(max_resident=1))
    with Engine(MODEL_FILES["default"], settings) as engine:
        a = engine.create_session(SessionConfig(lora_path=adapter_path("torch_r4")))
        b = engine.create_session(SessionConfig(lora_path=adapter_path("litertlm_r4")))
        a.run_prefill([1])
        b.run_prefill([1])  # evicts a's buffers
        stats = engine.stats()
        assert stats.evictions == 1 and stats.residency_misses == 2
        assert [r.blend for r in stats.resident] == [((b.lora_ids[0], 1.0),)]
        by_id = {adapter.lora_id: adapter for adapter in stats.adapters}
        assert by_id[a.lora_ids[0]].resident_bytes == 0
        assert by_id[b.lora_ids[0]].resident_bytes == stats.resident_bytes > 0
        a.run_decode(2)  # a miss again, and evicts b's
        stats = engine.stats()
        assert (stats.evictions, stats.residency_misses, stats.residency_hits) == (2, 3, 0)
