"""Tests for runtime.framework.lora_source."""

from __future__ import annotations

import dataclasses
import mmap
from pathlib import Path

import numpy as np
import pytest

from conftest import adapter_path
from runtime.errors import InvalidArgumentError
from runtime.framework.lora_source import LoraSource

DIGEST = "4b1344d9b5db34524b66fe23c3c0c1ffbdde61231e2ffc82ce4b8e5f519d50da"


# -- path or buffer ------------------------------------------------------------------


def test_defaults_for_a_path():
    source = LoraSource(path="adapter.tflite")
    assert (source.path, source.buffer, source.scale, source.peft_config, source.sha256) == (
        "adapter.tflite", None, 1.0, None, None,
    )


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"path": "a.tflite", "buffer": b"bytes"}, {"path": None, "buffer": None}, {"scale": 0.5}],
    ids=["nothing", "both", "both-none", "scale-only"],
)
def test_needs_exactly_one_of_path_or_buffer(kwargs):
    with pytest.raises(InvalidArgumentError, match="exactly one of path= or buffer="):
        LoraSource(**kwargs)


@pytest.mark.parametrize(
    "buffer",
    [b"", b"\x00" * 10, bytearray(3), memoryview(b"abc"), {"w": np.zeros(2)}],
    ids=["empty-bytes", "bytes", "bytearray", "memoryview", "state-dict"],
)
def test_any_buffer_kind_is_accepted_as_given(buffer):
    source = LoraSource(buffer=buffer)
    assert source.buffer is buffer and source.path is None


def test_a_path_like_is_kept_as_given():
    path = adapter_path("torch_r4")
    assert LoraSource(path=path).path is path


@pytest.mark.parametrize("path", [5, True, b"adapter.tflite", ["a.tflite"], ""],
                         ids=["int", "bool", "bytes", "list", "empty"])
def test_a_path_that_is_not_one_is_refused_when_made(path):
    """Each was taken, and registering it raised TypeError (bytes also left an
    AttributeError in a ScopedFile's destructor), or for '' reported '.: is a directory'."""
    with pytest.raises(InvalidArgumentError, match=r"LoraSource path=.*, expected a file or directory path"):
        LoraSource(path=path)


@pytest.mark.parametrize("buffer", [5, "adapter.tflite", [1, 2], np.zeros(4)], ids=["int", "str", "list", "array"])
def test_a_buffer_that_is_not_one_is_refused_when_made(buffer):
    """Was a TypeError ('object of type int has no len()') at registration."""
    with pytest.raises(InvalidArgumentError, match=r"LoraSource buffer=.*, expected the bytes of an adapter file "
                                                   r"or a PEFT state dict"):
        LoraSource(buffer=buffer)


@pytest.mark.parametrize("heads", ["no", 1, None, [True]], ids=["str", "int", "None", "list"])
def test_heads_take_a_bool_only(heads, tmp_path):
    """``heads="no"`` loaded the heads and registered the adapter under another id than
    ``heads=True`` (the id's key holds the value), a list raised TypeError (unhashable)."""
    with pytest.raises(InvalidArgumentError, match=r"LoraSource heads=.*, expected True or False"):
        LoraSource(path="a", heads=heads)
    assert LoraSource(path="a", heads=np.bool_(False)).heads is False


def test_a_peft_config_that_is_not_a_mapping_is_refused():
    with pytest.raises(InvalidArgumentError, match=r"LoraSource peft_config=\['r'\], expected a mapping"):
        LoraSource(buffer={"w": np.zeros(2)}, peft_config=["r"])


# -- scale ---------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [0, 0.0, 1, -2.5, 1e30, np.float64(0.25)])
def test_finite_scales_are_accepted(scale):
    assert LoraSource(path="a", scale=scale).scale == scale


@pytest.mark.parametrize(
    "scale", [float("nan"), float("inf"), float("-inf"), True, False, "1.0", None, 1j],
    ids=["nan", "inf", "-inf", "True", "False", "str", "None", "complex"],
)
def test_non_finite_or_non_numeric_scales_are_refused(scale):
    with pytest.raises(InvalidArgumentError, match=r"LoraSource scale=.*expected a finite number"):
        LoraSource(path="a", scale=scale)


def test_scale_message_shows_the_value():
    with pytest.raises(InvalidArgumentError, match=r"scale='2'"):
        LoraSource(buffer=b"x", scale="2")


# -- sha256 --------------------------------------------------------------------------


@pytest.mark.parametrize("digest", [DIGEST, DIGEST.upper(), "0" * 64, "aBcDeF" * 10 + "0123"])
def test_sha256_of_64_hex_digits_is_kept(digest):
    assert LoraSource(path="a", sha256=digest).sha256 == digest


@pytest.mark.parametrize(
    "digest",
    ["", DIGEST[:-1], DIGEST + "0", "g" * 64, DIGEST[:-1] + " ", " " + DIGEST[1:], "sha256:" + DIGEST[:57]],
    ids=["empty", "63", "65", "non-hex", "trailing-space", "leading-space", "prefixed"],
)
def test_malformed_sha256_is_refused(digest):
    with pytest.raises(InvalidArgumentError, match="expected 64 hex digits"):
        LoraSource(path="a", sha256=digest)


def test_sha256_message_names_the_value():
    with pytest.raises(InvalidArgumentError, match=r"sha256='abc'"):
        LoraSource(buffer=b"x", sha256="abc")


# -- peft_config ---------------------------------------------------------------------


def test_peft_config_travels_with_a_state_dict():
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    state = {"base_model.model.layers.0.q_proj.lora_A.weight": np.zeros((4, 64), np.float32)}
    source = LoraSource(buffer=state, peft_config=config, scale=0.5)
    assert source.peft_config is config
    assert source.buffer is state and source.scale == 0.5


def test_peft_config_does_not_replace_the_source():
    with pytest.raises(InvalidArgumentError, match="exactly one of"):
        LoraSource(peft_config={"r": 4})


# -- label ---------------------------------------------------------------------------


def test_label_of_a_path_is_the_path_as_a_string():
    path = adapter_path("torch_r4")
    assert LoraSource(path=path).label == str(path)
    assert LoraSource(path="rel/adapter.gguf").label == "rel/adapter.gguf"
    assert isinstance(LoraSource(path=Path("x")).label, str)


@pytest.mark.parametrize(
    "buffer,length", [(b"", 0), (b"abcd", 4), (bytearray(16640), 16640), (memoryview(b"xyz"), 3)]
)
def test_label_of_bytes_gives_the_length(buffer, length):
    assert LoraSource(buffer=buffer).label == f"<in-memory buffer of {length} bytes>"


def test_label_of_an_mmap_gives_its_length(tmp_path):
    file = tmp_path / "adapter.bin"
    file.write_bytes(b"\x01" * 100)
    with open(file, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        assert LoraSource(buffer=mapped).label == "<in-memory buffer of 100 bytes>"


def test_label_of_a_state_dict_counts_tensors():
    state = {"a": np.zeros(2), "b": np.zeros(3), "c": np.zeros(1)}
    assert LoraSource(buffer=state, peft_config={"r": 1}).label == "<in-memory PEFT state dict of 3 tensors>"


# -- value semantics -----------------------------------------------------------------


def test_compared_by_value():
    source = LoraSource(path="a", scale=0.5)
    assert source == LoraSource(path="a", scale=0.5)
    assert source != LoraSource(path="a", scale=0.25)
    assert hash(source) == hash(LoraSource(path="a", scale=0.5))


def test_replace_revalidates():
    source = LoraSource(path="a")
    assert dataclasses.replace(source, scale=3.0).scale == 3.0
    with pytest.raises(InvalidArgumentError, match="exactly one of"):
        dataclasses.replace(source, buffer=b"x")
    with pytest.raises(InvalidArgumentError, match="finite"):
        dataclasses.replace(source, scale=float("nan"))
