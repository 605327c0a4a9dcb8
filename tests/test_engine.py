"""Tests for runtime.engine.engine: adapters, sessions and closing."""

from __future__ import annotations

import pytest

from conftest import MODEL_FILES, adapter_path
from runtime import Engine, EngineSettings, LoraSource, Lru, OnlyActive, SessionConfig
from runtime.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError


def test_register_unload_and_sessions():
    with Engine(MODEL_FILES["default"], EngineSettings(num_threads=1)) as engine:
        lora_id = engine.register_adapter(LoraSource(path=adapter_path("torch_r4")))
        assert engine.register_adapter(LoraSource(path=adapter_path("torch_r4"))) == lora_id
        session = engine.create_session(SessionConfig(lora_path=adapter_path("torch_r4")))
        assert session.lora_ids == [lora_id]
        with pytest.raises(FailedPreconditionError, match="live session"):
            engine.unload_adapter(lora_id)
        session.close()
        engine.unload_adapter(lora_id)
        assert engine.adapter_ids() == []
        with pytest.raises(NotFoundError):
            engine.unload_adapter(lora_id)


def test_sessions_take_registered_adapters_by_id(tmp_path):
    import shutil

    path = tmp_path / "adapter.tflite"
    shutil.copy(adapter_path("torch_r4"), path)
    with Engine(MODEL_FILES["default"], EngineSettings(num_threads=1)) as engine:
        lora_id = engine.register_adapter(LoraSource(path=path))
        by_path = engine.create_session(SessionConfig(lora_path=path, lora_scale=0.5))
        expected = by_path.run_prefill([1, 2, 3])
        by_path.close()
        path.write_bytes(b"rewritten: no longer an adapter")  # the id keeps what was registered
        by_id = engine.create_session(SessionConfig(adapters={lora_id: 0.5}))
        assert by_id.blend == ((lora_id, 0.5),)
        assert (by_id.run_prefill([1, 2, 3]) == expected).all()
        by_id.set_adapters(adapters={}, reset=True)
        assert by_id.lora_ids == []
        with pytest.raises(NotFoundError, match="LoRA id 99"):
            engine.create_session(SessionConfig(adapters={99: 1.0}))
        with pytest.raises(InvalidArgumentError, match="adapters"):
            SessionConfig(adapters={"a": 1.0})
        with pytest.raises(InvalidArgumentError, match=r"adapters\[1\]"):
            SessionConfig(adapters={1: float("nan")})
        assert engine.stats().adapters[0].sessions == 0  # by_id switched away; the failures pinned nothing
        by_id.close()
        engine.unload_adapter(lora_id)


def test_close_closes_sessions_and_refuses_work():
    engine = Engine(MODEL_FILES["default"])
    session = engine.create_session()
    session.run_prefill([1, 2, 3])
    engine.close()
    engine.close()
    assert session.closed
    with pytest.raises(FailedPreconditionError):
        session.run_decode(1)
    with pytest.raises(FailedPreconditionError, match="engine is closed"):
        engine.create_session()


def test_config_errors():
    with pytest.raises(InvalidArgumentError):
        SessionConfig(lora_path="a", lora_buffer=b"b")
    with pytest.raises(InvalidArgumentError):
        LoraSource()
    with pytest.raises(InvalidArgumentError):
        LoraSource(path="a", scale=float("inf"))
    with pytest.raises(NotFoundError):
        Engine("/nonexistent/model.tflite")


def _alternate(engine, steps=6):
    a = engine.create_session(SessionConfig(lora_path=adapter_path("torch_r4")))
    b = engine.create_session(SessionConfig(lora_path=adapter_path("litertlm_r4")))
    la, lb = a.run_prefill([1, 2, 3]), b.run_prefill([4, 5, 6])
    out = []
    for _ in range(steps):
        ta, tb = int(la.argmax()), int(lb.argmax())
        out.append((ta, tb))
        la, lb = a.run_decode(ta), b.run_decode(tb)
    return out, a, b


@pytest.mark.parametrize("policy", [Lru(max_resident=1), OnlyActive(), Lru(max_resident=None, max_bytes=1)])
def test_residency_policies_evict_without_changing_results(policy):
    with Engine(MODEL_FILES["default"]) as keep_all:
        expected, _, _ = _alternate(keep_all)
    with Engine(MODEL_FILES["default"], EngineSettings(lora_residency=policy)) as engine:
        got, a, b = _alternate(engine)
        stats = engine.stats()
        assert got == expected
        assert stats.evictions > 0 and stats.residency_misses > 2
        assert len(stats.resident) <= 1


def test_stats_report_adapters_sessions_and_latencies():
    with Engine(MODEL_FILES["default"]) as engine:
        blob = adapter_path("torch_r16").read_bytes()
        s1 = engine.create_session(SessionConfig(lora_path=adapter_path("torch_r4")))
        s2 = engine.create_session(SessionConfig(lora_buffer=blob))
        s1.generate([1, 2, 3], max_new_tokens=4)
        s2.generate([1, 2], max_new_tokens=3)
        stats = engine.stats()
        by_rank = {a.rank: a for a in stats.adapters}
    # The exact bytes: per layer q/o a,b = 64x4 + 4x64, k/v a,b = 64x4 + 4x32 (float32), 2 layers.
    assert by_rank[4].tensor_bytes == 2 * (2 * (64 * 4 + 4 * 64) + 2 * (64 * 4 + 4 * 32)) * 4
    assert by_rank[4].resident_bytes == by_rank[4].tensor_bytes  # rank 4 in the r4 slot
    assert by_rank[16].format == "tflite" and by_rank[16].sessions == 1
    assert stats.load.count == 2 and stats.materialize.count == 2
    assert stats.switch.count == 1  # s1's runs, then s2's: one switch
    assert stats.residency_misses == 2 and stats.residency_hits > 0
    assert [s.session_id for s in stats.sessions] == [s1.session_id, s2.session_id]
    first = stats.sessions[0]
    # 4 tokens generated: the first from the prefill, 3 decode steps; the last token is
    # pending (no step computes logits nobody reads) but counts in the position.
    assert (first.prompt_tokens, first.decode_tokens, first.position) == (3, 3, 7)
    assert first.time_to_first_token_s > 0 and first.decode_tokens_per_s > 0


def test_executor_pool_runs_sessions_in_parallel_with_isolated_results():
    import threading

    # Two of them share an adapter: its buffers serve runs of both executors at once.
    names = ("torch_r4", "litertlm_r4", "torch_r16", "torch_r4", "torch_r4")
    configs = [SessionConfig(lora_path=adapter_path(name)) for name in names]
    configs.append(SessionConfig())

    def run(engine, config, seed):
        with engine.create_session(config) as session:
            return session.generate([seed, seed + 1, seed + 2], max_new_tokens=20).tokens

    with Engine(MODEL_FILES["default"]) as engine:
        alone = [run(engine, config, i) for i, config in enumerate(configs)]
    with Engine(MODEL_FILES["default"], EngineSettings(executors=2)) as engine:
        results = [None] * len(configs)
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run(engine, configs[i], i)))
                   for i in range(len(configs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results == alone
    with pytest.raises(InvalidArgumentError):
        EngineSettings(executors=0)


def test_chat_template_given_as_source_renders_conversations():
    with Engine(MODEL_FILES["default"], chat_template="{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}") as engine:
        assert engine.chat_template.render([{"role": "user", "content": "hi"}]) == "[user] hi\n"
    with Engine(MODEL_FILES["default"]) as engine:
        assert engine.chat_template is None
    with pytest.raises(InvalidArgumentError):
        Engine(MODEL_FILES["default"], chat_template="{% if %}")


# -- the slot rule, asked of the engine ----------------------------------------------


def test_slot_for_names_the_cheapest_slot_that_runs_the_adapters():
    with Engine(MODEL_FILES["default"]) as engine:
        r4 = engine.register_adapter(LoraSource(path=adapter_path("torch_r4")))
        r4_other = engine.register_adapter(LoraSource(path=adapter_path("litertlm_r4")))
        r16 = engine.register_adapter(LoraSource(path=adapter_path("torch_r16")))
        assert engine.slot_for({}) is None  # the base model
        assert engine.slot_for({r4: 1.0}).rank == 4
        assert engine.slot_for({r4: 0.5, r4_other: 0.5}).rank == 16  # 4 + 4 -> the smallest slot that holds 8
        with engine.create_session(SessionConfig(adapters={r4: 0.5, r4_other: 0.5})) as session:
            session.run_prefill([5, 17])
            (resident,) = engine.stats().resident
            assert resident.slot_rank == engine.slot_for(dict(session.blend)).rank  # the session asked the same rule
        with pytest.raises(InvalidArgumentError, match=r"'small' \(rank 4, attention\), 'big' \(rank 16, attention\) "
                                                       r"need rank 20 together.*slots: r4, r16"):
            engine.slot_for({r4: 1.0, r16: 1.0}, names={r4: "small", r16: "big"})
        with pytest.raises(InvalidArgumentError, match=r"torch_r4.tflite \(rank 4.*torch_r16.tflite \(rank 16"):
            engine.create_session(SessionConfig(adapters={r4: 1.0, r16: 1.0}))  # sessions ask the same rule
        with pytest.raises(NotFoundError, match="LoRA id 99"):
            engine.slot_for({99: 1.0})


def test_the_engine_answers_for_one_adapter():
    with Engine(MODEL_FILES["default"]) as engine:
        lora_id = engine.register_adapter(LoraSource(path=adapter_path("torch_r16")))
        adapter = engine.adapter(lora_id)
        assert (adapter.lora_id, adapter.rank, adapter.format, adapter.sessions) == (lora_id, 16, "tflite", 0)
        assert adapter.source.endswith("torch_r16.tflite") and adapter.tensor_bytes > 0
        with engine.create_session(SessionConfig(adapters={lora_id: 1.0})):
            assert engine.adapter(lora_id).sessions == 1
        assert engine.adapter(lora_id) == next(a for a in engine.stats().adapters if a.lora_id == lora_id)
        engine.unload_adapter(lora_id)
        with pytest.raises(NotFoundError):
            engine.adapter(lora_id)
