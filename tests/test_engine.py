"""Tests for runtime.engine.engine: adapters, sessions and closing."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from conftest import MODEL_FILES, MODELS, adapter_path, gate_group_view
from runtime import Engine, EngineSettings, LoraSource, Lru, OnlyActive, SessionConfig
from runtime.errors import DataLossError, FailedPreconditionError, InvalidArgumentError, NotFoundError
from runtime.executor.litert_executor import LlmExecutor
from runtime.executor.weight_cache import survey


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


def test_an_adapter_rewritten_in_place_with_the_same_size_and_mtime_is_another_adapter(tmp_path):
    """``cp -p new.safetensors adapter/`` rewrites the file in place (same inode) with the
    same size and, from the source, the same modification time: the registry gave the new
    contents the old adapter's id, and that id read them at its first use. The inode's
    change time (which no tool sets) tells the rewrite apart."""
    from safetensors.numpy import load_file

    directory = tmp_path / "qkvo_r4"
    shutil.copytree(MODELS / "peft" / "qkvo_r4", directory)
    weights = directory / "adapter_model.safetensors"
    other = tmp_path / "other.safetensors"
    raw = bytearray(weights.read_bytes())
    header = 8 + int.from_bytes(raw[:8], "little")  # then the tensors' bytes, float32 all
    np.frombuffer(raw, np.float32, offset=header)[:] *= 2  # the same header: the same size
    other.write_bytes(raw)
    before = weights.stat()
    os.utime(other, ns=(before.st_atime_ns, before.st_mtime_ns))
    with Engine(MODEL_FILES["default"], EngineSettings(num_threads=1)) as engine:
        old_id = engine.register_adapter(LoraSource(path=directory))
        time.sleep(0.01)  # past a tick of the kernel's coarse clock (before Linux 6.13, ctime's resolution)
        subprocess.run(["cp", "-p", str(other), str(weights)], check=True)
        after = weights.stat()
        assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
        new_id = engine.register_adapter(LoraSource(path=directory))
        assert new_id != old_id
        with engine.create_session(SessionConfig(adapters={old_id: 1.0})) as session:
            with pytest.raises(DataLossError, match="adapter_model.safetensors: .*modified after it was opened"):
                session.run_prefill([1, 2, 3])  # its file no longer holds what was registered
        with engine.create_session(SessionConfig(adapters={new_id: 1.0})) as session:
            doubled = session.run_prefill([1, 2, 3])
        with engine.create_session(SessionConfig(loras=[LoraSource(buffer=load_file(other), peft_config=json.loads(
                (directory / "adapter_config.json").read_text()))])) as session:
            assert (session.run_prefill([1, 2, 3]) == doubled).all()  # the new contents, under the new id


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
        for scale in (1.0, 0.0):  # an unknown id is refused even at a scale that leaves it out of the blend
            with pytest.raises(NotFoundError, match="LoRA id 99"):
                engine.create_session(SessionConfig(adapters={99: scale}))
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


@pytest.mark.parametrize(("kwargs", "expected"), [
    ({"settings": {"num_threads": 1}}, "settings=.*expected an EngineSettings"),
    ({"settings": EngineSettings}, "settings=.*expected an EngineSettings"),
    ({"model_path": 5}, "model_path=5, expected a model file path"),
    ({"model_path": None}, "model_path=None, expected a model file path"),
    ({"model_path": str(MODEL_FILES["default"]).encode()}, "model_path=b.*expected a model file path"),
    ({"tokenizer": 5}, "tokenizer=5, expected a Tokenizer"),
    ({"chat_template": 5}, "chat_template=5, expected a ChatTemplate"),
], ids=["settings dict", "settings class", "path int", "path None", "path bytes", "tokenizer int", "template int"])
def test_an_engines_arguments_of_the_wrong_kind_are_refused_before_the_model_opens(kwargs, expected):
    """Settings and paths of the wrong kind were an AttributeError or TypeError; a tokenizer
    or chat template of the wrong kind was taken, and failed at the first text prompt."""
    arguments = {"model_path": MODEL_FILES["default"], **kwargs}
    model_path = arguments.pop("model_path")
    with pytest.raises(InvalidArgumentError, match=expected):
        Engine(model_path, **arguments)


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


@pytest.mark.parametrize("bad", [True, 1.0, "1", None, 0], ids=["True", "1.0", "'1'", "None", "0"])
def test_an_adapter_id_that_is_not_one_is_refused_and_unloads_nothing(bad):
    """``unload_adapter(True)`` and ``unload_adapter(1.0)`` unloaded adapter 1 (equal keys
    of the registry's dicts), and ``adapter("1")`` answered that id 1 is not registered."""
    with Engine(MODEL_FILES["default"]) as engine:
        lora_id = engine.register_adapter(LoraSource(path=adapter_path("torch_r4")))
        assert lora_id == 1
        for call in (engine.unload_adapter, engine.adapter):
            with pytest.raises(InvalidArgumentError, match=r"lora_id=.*, expected an adapter id \(an int >= 1\)"):
                call(bad)
        assert engine.adapter_ids() == [lora_id]


@pytest.mark.parametrize("config", ["x", {"lora_path": "a.tflite"}, SessionConfig], ids=["str", "dict", "the class"])
def test_a_session_config_that_is_not_one_is_refused(config):
    """Was an AttributeError (or TypeError) from reading its sources."""
    with Engine(MODEL_FILES["default"]) as engine:
        with pytest.raises(InvalidArgumentError, match="create_session takes a SessionConfig"):
            engine.create_session(config)


# -- signature groups compiled ahead of an adapter's first request --------------------


def _eventually(condition: Callable[[], bool], limit_s: float = 60.0) -> bool:
    """Polls ``condition`` until it holds or ``limit_s`` passes (a bound, not a timing)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _compile_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("runtime-group-compile")]


def _count_prepares(monkeypatch) -> list[str]:
    """The groups ``LlmExecutor.prepare`` is asked for from now on."""
    asked: list[str] = []
    real = LlmExecutor.prepare

    def counted(executor: LlmExecutor, group: str) -> None:
        asked.append(group)
        real(executor, group)

    monkeypatch.setattr(LlmExecutor, "prepare", counted)
    return asked


def test_registering_an_adapter_compiles_its_slots_group_in_the_background(tmp_path, monkeypatch):
    asked = _count_prepares(monkeypatch)
    with Engine(MODEL_FILES["transposed"], EngineSettings(weight_cache_dir=tmp_path)) as engine:
        assert engine.stats().compiled_groups == ("plain",)
        r4 = engine.register_adapter(LoraSource(path=adapter_path("torch_r4")))
        # No request: the rank-4 slot's groups compile by themselves (its decode's, then its longer prefill's).
        slot_groups = ("lora_r4", "lora_r4_prefill32")
        assert _eventually(lambda: set(slot_groups) <= set(engine.stats().compiled_groups)), \
            engine.stats().compiled_groups
        assert engine.stats().compiled_groups == ("plain", *slot_groups)
        engine.register_adapter(LoraSource(path=adapter_path("litertlm_r4")))  # its slot is compiled: nothing to do
        with pytest.raises(InvalidArgumentError, match="rank 32 exceeds every LoRA slot"):
            engine.register_adapter(LoraSource(path=adapter_path("torch_r32")))  # refused as before
        with engine.create_session(SessionConfig(adapters={r4: 1.0})) as session:
            session.run_prefill([5, 17, 42])
        stats = engine.stats()
    assert stats.compiled_groups == ("plain", *slot_groups) and stats.group_compile.count == 2
    assert asked == list(slot_groups)
    assert not _compile_threads()


def test_a_request_racing_the_background_compile_waits_for_it(tmp_path, monkeypatch):
    compiling, release = gate_group_view(monkeypatch, "decode_lora_r4")
    with Engine(MODEL_FILES["transposed"], EngineSettings(weight_cache_dir=tmp_path)) as engine:
        (executor,) = engine._resources.pool.executors
        # Counts who asks for the group's lock: the background compile holds it, the request waits on it.
        lock, arrived = executor._group_locks["lora_r4"], []

        class Counted:
            def __enter__(self) -> None:
                arrived.append(threading.current_thread().name)
                lock.acquire()

            def __exit__(self, *exc_info: object) -> None:
                lock.release()

        monkeypatch.setitem(executor._group_locks, "lora_r4", Counted())
        r4 = engine.register_adapter(LoraSource(path=adapter_path("torch_r4")))
        assert compiling.wait(60)
        results: list[object] = []

        def request() -> None:
            try:
                with engine.create_session(SessionConfig(adapters={r4: 1.0})) as session:
                    results.append(session.run_prefill([5, 17, 42]))
            except BaseException as exc:  # noqa: BLE001 - asserted below
                results.append(exc)

        thread = threading.Thread(target=request)
        thread.start()
        try:
            assert _eventually(lambda: len(arrived) == 2), arrived  # the request waits while the group compiles
        finally:
            release.set()
            thread.join(60)
        assert len(results) == 1 and not isinstance(results[0], BaseException), results
        stats = engine.stats()
    assert arrived[0].startswith("runtime-group-compile") and arrived[1] == thread.name
    # Compiled once (the slot's longer prefill compiles after it, in the background too).
    assert stats.compiled_groups[:2] == ("plain", "lora_r4")
    assert stats.group_compile.count == len(stats.compiled_groups) - 1


def test_closing_during_a_background_compile_is_clean(tmp_path, monkeypatch, caplog):
    viewing, release = gate_group_view(monkeypatch, "decode_lora_r4")
    real_close = LlmExecutor.close

    def closed_then_compiled(executor: LlmExecutor) -> None:
        real_close(executor)
        release.set()  # the gated compile goes on after its executor closed

    monkeypatch.setattr(LlmExecutor, "close", closed_then_compiled)
    engine = Engine(MODEL_FILES["transposed"], EngineSettings(weight_cache_dir=tmp_path))
    try:
        engine.register_adapter(LoraSource(path=adapter_path("torch_r4")))
        assert viewing.wait(60)
        with caplog.at_level(logging.DEBUG, logger="runtime.engine.engine"):
            engine.close()  # joins the background compile
    finally:
        release.set()
        engine.close()
    assert not _compile_threads()
    assert any("'lora_r4' was not compiled ahead" in record.getMessage() and "closed" in record.getMessage()
               for record in caplog.records), caplog.text
    (published,) = survey(tmp_path).entries  # the group's compile let go of the weight cache file too
    assert not published.in_use


def test_with_compile_all_registering_compiles_nothing(tmp_path, monkeypatch):
    asked = _count_prepares(monkeypatch)
    with Engine(MODEL_FILES["transposed"], EngineSettings(weight_cache_dir=tmp_path, compile="all")) as engine:
        opened = engine.stats().compiled_groups
        engine.register_adapter(LoraSource(path=adapter_path("torch_r4")))
        engine.register_adapter(LoraSource(path=adapter_path("torch_r16")))
        assert not _compile_threads()
        stats = engine.stats()
    assert stats.compiled_groups == opened == tuple(engine.spec.groups) and stats.group_compile.count == 0
    assert asked == []


def test_a_tokenizer_that_does_not_read_fails_the_open_naming_its_file(tmp_path, monkeypatch):
    """The tokenizer is read beside the model's compile: its error is the open's, the
    executors opened meanwhile are closed and no thread is left behind."""
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    closed, close = [], LlmExecutor.close
    monkeypatch.setattr(LlmExecutor, "close", lambda self: (closed.append(self), close(self)))
    before = threading.active_count()
    with pytest.raises(InvalidArgumentError, match="tokenizer.json: not a valid tokenizer.json"):
        Engine(MODEL_FILES["default"], EngineSettings(num_threads=1, executors=2), tokenizer=bad)
    assert len(closed) == 2
    assert threading.active_count() == before
