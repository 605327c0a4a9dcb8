"""Tests for runtime.engine.engine: adapters, sessions and closing."""

from __future__ import annotations

import pytest

from conftest import MODEL_FILES, adapter_path
from runtime import Engine, EngineSettings, LoraSource, SessionConfig
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
