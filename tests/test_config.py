"""Tests for runtime.engine.config."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import adapter_path
from runtime.components.residency import KeepAll, Lru, OnlyActive
from runtime.components.sampler import SamplerConfig
from runtime.engine.config import EngineSettings, SessionConfig
from runtime.engine.speculative import SpeculationPolicy
from runtime.errors import InvalidArgumentError
from runtime.framework.lora_source import LoraSource

# -- EngineSettings ------------------------------------------------------------------


def test_engine_settings_defaults():
    settings = EngineSettings()
    assert settings.num_threads == 1
    assert settings.lora_residency == KeepAll()
    assert settings.allow_non_finite_weights is False
    assert settings.executors == 1


@pytest.mark.parametrize("policy", [KeepAll(), Lru(max_resident=2), Lru(max_resident=None, max_bytes=0), OnlyActive()])
def test_engine_settings_keep_the_residency_policy(policy):
    assert EngineSettings(lora_residency=policy).lora_residency is policy


@pytest.mark.parametrize("num_threads", [0, 1, 8])
def test_engine_settings_accept_zero_or_more_threads(num_threads):
    assert EngineSettings(num_threads=num_threads).num_threads == num_threads


@pytest.mark.parametrize("num_threads", [-1, -8])
def test_engine_settings_refuse_negative_threads(num_threads):
    with pytest.raises(InvalidArgumentError, match=rf"num_threads={num_threads}, expected an integer >= 0"):
        EngineSettings(num_threads=num_threads)


@pytest.mark.parametrize("executors", [1, 2, 4])
def test_engine_settings_accept_one_or_more_executors(executors):
    assert EngineSettings(executors=executors).executors == executors


@pytest.mark.parametrize("executors", [0, -1])
def test_engine_settings_refuse_fewer_than_one_executor(executors):
    with pytest.raises(InvalidArgumentError, match=rf"executors={executors}, expected an integer >= 1"):
        EngineSettings(executors=executors)


def test_engine_settings_are_revalidated_on_replace():
    settings = EngineSettings(num_threads=2)
    assert dataclasses.replace(settings, executors=3) == EngineSettings(num_threads=2, executors=3)
    with pytest.raises(InvalidArgumentError, match="executors=0"):
        dataclasses.replace(settings, executors=0)


# -- SessionConfig validation --------------------------------------------------------


def test_session_config_defaults_to_the_base_model():
    config = SessionConfig()
    assert config.lora_path is None and config.lora_buffer is None
    assert config.lora_scale == 1.0 and config.loras == ()
    assert config.sampler == SamplerConfig()
    assert config.sources() == []


def test_session_config_refuses_path_and_buffer_together():
    with pytest.raises(InvalidArgumentError, match="lora_path= or lora_buffer=, not both"):
        SessionConfig(lora_path=adapter_path("torch_r4"), lora_buffer=b"bytes")


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf")])
def test_session_config_refuses_non_finite_scales(scale):
    with pytest.raises(InvalidArgumentError, match=r"lora_scale=.*expected a finite number"):
        SessionConfig(lora_path="a", lora_scale=scale)


def test_session_config_checks_the_scale_even_without_an_adapter():
    with pytest.raises(InvalidArgumentError, match="lora_scale=nan"):
        SessionConfig(lora_scale=float("nan"))


@pytest.mark.parametrize(
    "loras",
    [["a.tflite"], (LoraSource(path="a"), "b.tflite"), [{"path": "a"}], [None]],
    ids=["str", "mixed", "dict", "None"],
)
def test_session_config_loras_must_be_lora_sources(loras):
    with pytest.raises(InvalidArgumentError, match="expected LoraSource objects"):
        SessionConfig(loras=loras)


def test_session_config_keeps_its_sampler():
    sampler = SamplerConfig(temperature=0.7, top_k=5, seed=3)
    assert SessionConfig(sampler=sampler).sampler is sampler


def test_session_config_is_revalidated_on_replace():
    config = SessionConfig(lora_path="a")
    with pytest.raises(InvalidArgumentError, match="not both"):
        dataclasses.replace(config, lora_buffer=b"x")


# -- SessionConfig.sources() ---------------------------------------------------------


def test_sources_of_a_path():
    path = adapter_path("torch_r4")
    assert SessionConfig(lora_path=path, lora_scale=0.8).sources() == [LoraSource(path=path, scale=0.8)]


def test_sources_of_a_buffer_carry_the_peft_config():
    state = {"w": np.zeros(2)}
    config = {"r": 4, "lora_alpha": 8}
    (source,) = SessionConfig(lora_buffer=state, lora_scale=0.5, lora_peft_config=config).sources()
    assert source.buffer is state
    assert source.peft_config is config
    assert source.scale == 0.5 and source.path is None


def test_sources_of_bytes_without_peft_config():
    blob = b"\x00" * 8
    (source,) = SessionConfig(lora_buffer=blob).sources()
    assert source.buffer is blob and source.peft_config is None and source.scale == 1.0


def test_sources_of_several_loras_keep_their_order_and_scales():
    a = LoraSource(path=adapter_path("torch_r4"), scale=0.3)
    b = LoraSource(buffer=b"xyz", scale=-1.0)
    assert SessionConfig(loras=[a, b]).sources() == [a, b]
    assert SessionConfig(loras=(b, a)).sources() == [b, a]


def test_sources_put_the_single_adapter_before_the_list():
    listed = LoraSource(path="listed.tflite", scale=2.0)
    sources = SessionConfig(lora_path="single.tflite", lora_scale=0.5, loras=[listed]).sources()
    assert sources == [LoraSource(path="single.tflite", scale=0.5), listed]


def test_lora_scale_applies_only_to_the_single_adapter():
    listed = LoraSource(path="listed.tflite")
    sources = SessionConfig(lora_buffer=b"single", lora_scale=0.1, loras=[listed]).sources()
    assert [s.scale for s in sources] == [0.1, 1.0]


def test_sources_returns_a_fresh_list_each_time():
    config = SessionConfig(loras=[LoraSource(path="a")])
    first = config.sources()
    first.append(LoraSource(path="b"))
    assert config.sources() == [LoraSource(path="a")]


def test_peft_config_without_a_buffer_is_refused():
    for config in ({}, {"lora_path": "a"}):
        with pytest.raises(InvalidArgumentError, match="lora_peft_config goes with a lora_buffer"):
            SessionConfig(lora_peft_config={"r": 4}, **config)


@pytest.mark.parametrize("scale", [True, "1", None, float("nan"), np.float32("inf")])
def test_a_bad_scale_is_refused_when_the_config_is_made(scale):
    with pytest.raises(InvalidArgumentError, match=r"lora_scale=.*expected a finite number"):
        SessionConfig(lora_path="a", lora_scale=scale)


@pytest.mark.parametrize(("kwargs", "field"), [({"lora_path": 5}, "path"), ({"lora_buffer": "a.tflite"}, "buffer"),
                                               ({"lora_buffer": {}, "lora_peft_config": ["r"]}, "peft_config")])
def test_a_single_adapter_that_is_not_one_is_refused_when_the_config_is_made(kwargs, field):
    """Was taken, and the session's creation raised TypeError."""
    with pytest.raises(InvalidArgumentError, match=rf"LoraSource {field}="):
        SessionConfig(**kwargs)


@pytest.mark.parametrize("scale", [np.float32(0.5), np.int64(2), np.float64(0.25), 3])
def test_numpy_and_integer_scales_become_floats(scale):
    config = SessionConfig(lora_path="a", lora_scale=scale)
    assert type(config.lora_scale) is float and config.lora_scale == float(scale)
    (source,) = config.sources()
    assert type(source.scale) is float and source.scale == float(scale)


def test_loras_from_a_generator_are_kept():
    config = SessionConfig(loras=(LoraSource(path=name) for name in ("a", "b")))
    assert [s.path for s in config.sources()] == ["a", "b"]
    assert [s.path for s in config.sources()] == ["a", "b"]  # not used up


@pytest.mark.parametrize("loras", [LoraSource(path="a"), "a.tflite", 3], ids=["one source", "a path", "int"])
def test_loras_that_are_not_a_sequence_are_refused(loras):
    with pytest.raises(InvalidArgumentError, match="expected a sequence of LoraSource"):
        SessionConfig(loras=loras)


@pytest.mark.parametrize("policy", ["lru", None, 4, Lru], ids=["str", "None", "int", "the class"])
def test_an_unknown_residency_policy_is_refused_up_front(policy):
    with pytest.raises(InvalidArgumentError, match="residency policy .*expected KeepAll"):
        EngineSettings(lora_residency=policy)


@pytest.mark.parametrize("value", [1.5, True, "2"])
def test_thread_and_executor_counts_must_be_integers(value):
    with pytest.raises(InvalidArgumentError, match="num_threads=.*expected an integer"):
        EngineSettings(num_threads=value)
    with pytest.raises(InvalidArgumentError, match="executors=.*expected an integer"):
        EngineSettings(executors=value)


def test_compile_mode_is_checked():
    assert EngineSettings().compile == "on-demand"
    assert EngineSettings(compile="all").compile == "all"
    with pytest.raises(InvalidArgumentError, match="compile='lazy', expected one of \\['on-demand', 'all'\\]"):
        EngineSettings(compile="lazy")


@pytest.mark.parametrize("policy", [None, "always", SpeculationPolicy], ids=["None", "str", "the class"])
def test_a_speculation_policy_that_is_not_one_is_refused_up_front(policy):
    """Was taken, and the first session of a Turbo adapter failed inside its generation
    with an AttributeError."""
    with pytest.raises(InvalidArgumentError, match="speculation=.*expected a SpeculationPolicy"):
        EngineSettings(speculation=policy)


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("probe_verifies", 0, "an integer >= 1"), ("probe_verifies", 2.5, "an integer >= 1"),
    ("probe_verifies", True, "an integer >= 1"), ("min_accepted_per_verify", -0.5, "a finite number >= 0"),
    ("min_accepted_per_verify", float("nan"), "a finite number >= 0"),
    ("min_accepted_per_verify", "1", "a finite number >= 0"), ("pause_tokens", None, "an integer >= 1"),
    ("pause_tokens", 0, "an integer >= 1"), ("pause_tokens", 1.5, "an integer >= 1"),
    ("max_pause_tokens", -3, "an integer >= 1"), ("max_pause_tokens", 64.0, "an integer >= 1"),
])
def test_a_speculation_policy_refuses_bad_counts_naming_the_field(field, value, expected):
    """Each was taken: a None pause raised TypeError inside the failed probe of the
    adapter's shared gate, after which every generation of the adapter raised again."""
    with pytest.raises(InvalidArgumentError, match=rf"{field}={value!r:.8}.*expected {expected}"):
        SpeculationPolicy(**{field: value})


def test_a_speculation_policy_keeps_its_counts():
    policy = SpeculationPolicy(probe_verifies=2, min_accepted_per_verify=0, pause_tokens=3, max_pause_tokens=3)
    assert (policy.probe_verifies, policy.min_accepted_per_verify, policy.pause_tokens) == (2, 0, 3)
    assert EngineSettings(speculation=policy).speculation is policy
