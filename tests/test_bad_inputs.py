"""The catalogue of bad inputs: each gets a typed StatusError naming the file, the tensor and
what was expected; none crashes, registers anything half-way, or disturbs other sessions."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import threading
import time

import ai_edge_litert.schema_py_generated as schema
import numpy as np
import pytest

from conftest import MODEL_FILES, MODELS, adapter_path
from runtime import Engine, EngineSettings, LoraSource, Sampler, SessionConfig
from runtime.errors import (
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    StatusError,
    UnimplementedError,
)
from runtime.adapters.lora_data import LoraData
from runtime.adapters.lora_writer import serialize_lora_tensors

PEFT = MODELS / "peft"
GOOD = adapter_path("torch_r4").read_bytes()
EXTERNAL = adapter_path("litertlm_r4").read_bytes()


@pytest.fixture(scope="module")
def engine():
    with Engine(MODEL_FILES["default"]) as engine:
        yield engine


@pytest.fixture(scope="module")
def witness(engine):
    """A session on another adapter whose output must never change."""
    session = engine.create_session(SessionConfig(lora_path=adapter_path("litertlm_r4")))
    expected = session.run_prefill([1, 2, 3])
    return session, expected


def _patched(blob: bytes, at: int, value: bytes) -> bytes:
    return blob[:at] + value + blob[at + len(value):]


def _tensor_field(blob: bytes, name: str, what: str) -> int:
    data = LoraData.create_from_buffer(blob)
    info = data.tensor_info(name)
    if what == "shape":
        return blob.find(np.asarray(info.shape, np.int32).tobytes())
    raise AssertionError(what)


def _buffer_offset_field(blob: bytes) -> int:
    """Byte position of the last tensor's Buffer.offset (uint64) in a LiteRT-LM style file."""
    data = LoraData.create_from_buffer(blob)
    last = data.tensor_info(data.get_all_tensor_names()[-1])
    return blob.find(struct.pack("<Q", last.offset))


def _peft_dir(tmp_path, config=None, weights=None):
    target = tmp_path / "peft"
    shutil.copytree(PEFT / "qkvo_r4", target)
    if config is not None:
        (target / "adapter_config.json").write_text(config)
    if weights is not None:
        (target / "adapter_model.safetensors").write_bytes(weights)
    return target


def _dora_dir(tmp_path, length=None, value=1.0):
    """The q/k/v/o r4 PEFT adapter made a DoRA one: ``use_dora`` and a magnitude per module
    (``length`` entries instead of the module's output size, all ``value``)."""
    from safetensors.numpy import load_file, save_file

    target = _peft_dir(tmp_path)
    tensors = load_file(str(target / "adapter_model.safetensors"))
    for key in [k for k in tensors if k.endswith(".lora_B.weight")]:
        size = tensors[key].shape[0] if length is None else length
        tensors[key.replace(".lora_B.weight", ".lora_magnitude_vector")] = np.full(size, value, np.float32)
    save_file(tensors, str(target / "adapter_model.safetensors"))
    config = json.loads((target / "adapter_config.json").read_text())
    (target / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    return target


CATALOGUE = [
    # (case, builder(tmp_path) -> path, error class, message fragment)
    ("empty file", lambda t: _write(t, b""), InvalidArgumentError, "empty"),
    ("directory", lambda t: t, InvalidArgumentError, "without adapter_config.json"),
    ("missing path", lambda t: t / "nope.tflite", NotFoundError, "no such file"),
    ("wrong file identifier", lambda t: _write(t, b"\x10\0\0\0ABCD" + GOOD[8:]), InvalidArgumentError,
     "unknown adapter format"),
    ("truncated to 8 bytes", lambda t: _write(t, GOOD[:8]), StatusError, "x.tflite"),
    ("truncated at 10%", lambda t: _write(t, GOOD[: len(GOOD) // 10]), DataLossError, "x.tflite"),
    ("truncated at 50%", lambda t: _write(t, GOOD[: len(GOOD) // 2]), StatusError, "x.tflite"),
    ("truncated by one byte (data after flatbuffer)", lambda t: _write(t, EXTERNAL[:-1]), DataLossError,
     "past the end"),
    ("root offset out of range", lambda t: _write(t, _patched(GOOD, 0, struct.pack("<I", 1 << 30))),
     DataLossError, "outside the input"),
    ("vtable offset out of range", lambda t: _write(t, _vtable_corrupt(GOOD)), DataLossError, "x.tflite"),
    ("buffer offset+size past the end",
     lambda t: _write(t, _patched(EXTERNAL, _buffer_offset_field(EXTERNAL), struct.pack("<Q", len(EXTERNAL)))),
     DataLossError, "past the end"),
    ("data size not matching shape",
     lambda t: _write(t, _patched(GOOD, _tensor_field(GOOD, "lora_atten_q_a_prime_weight_0", "shape"),
                                  struct.pack("<2i", 64, 5))),
     InvalidArgumentError, "expected 1280 for shape [64, 5]"),
    ("negative dimension",
     lambda t: _write(t, _patched(GOOD, _tensor_field(GOOD, "lora_atten_q_a_prime_weight_0", "shape"),
                                  struct.pack("<2i", -64, 4))),
     InvalidArgumentError, "dimension -64"),
    ("enormous dimensions",
     lambda t: _write(t, _patched(GOOD, _tensor_field(GOOD, "lora_atten_q_a_prime_weight_0", "shape"),
                                  struct.pack("<2i", 1 << 30, 1 << 30))),
     InvalidArgumentError, "expected"),
    ("unsupported dtype", lambda t: _write(t, _int32_tensor()), InvalidArgumentError,
     "unsupported dtype INT32"),
    ("duplicate tensor names", lambda t: _write(t, _duplicate_names()), InvalidArgumentError, "duplicate"),
    ("rank above every slot", lambda t: adapter_path("torch_r32"), InvalidArgumentError,
     "rank 32 exceeds every LoRA slot of the model (slots: r4, r16)"),
    ("adapter for another hidden size", lambda t: adapter_path("wrong_hidden_r4"), InvalidArgumentError,
     "'lora_atten_k_a_prime_weight_0' has shape [48, 4]: input size 48, expected 64"),
    ("adapter for more layers", lambda t: _write(t, _layer(2)), InvalidArgumentError,
     "targets layer 2 projection 'q', which the model has no LoRA input for (layers 0-1"),
    ("tensor no model input takes", lambda t: _write(t, _named("mlp_up_lora_a")), InvalidArgumentError,
     "tensor 'mlp_up_lora_a' is not a LoRA input name"),
    ("PEFT: bad JSON", lambda t: _peft_dir(t, config="{r: 4"), InvalidArgumentError, "not valid JSON"),
    ("PEFT: missing r", lambda t: _peft_dir(t, config=json.dumps({"lora_alpha": 8})), InvalidArgumentError,
     "'r' is None, expected a positive integer"),
    ("PEFT: unknown peft_type", lambda t: _peft_dir(t, config=json.dumps({"r": 4, "peft_type": "PROMPT_TUNING"})),
     InvalidArgumentError, "peft_type 'PROMPT_TUNING' is not supported"),
    ("PEFT: DoRA without magnitudes", lambda t: _peft_dir(t, config=json.dumps({"r": 4, "use_dora": True})),
     InvalidArgumentError, "has no lora_magnitude_vector though the config says use_dora: true"),
    ("PEFT: DoRA magnitude of the wrong length", lambda t: _dora_dir(t, length=63), InvalidArgumentError,
     "k_proj.lora_magnitude_vector' is [63], expected [32] (one DoRA magnitude per output channel of its lora_B)"),
    ("PEFT: DoRA magnitude with NaN", lambda t: _dora_dir(t, value=np.nan), InvalidArgumentError,
     "lora_magnitude_vector' holds NaN or Inf values"),
    ("PEFT: DoRA on a model without DoRA slots", lambda t: _dora_dir(t), InvalidArgumentError,
     "a DoRA adapter (use_dora) needs a model with DoRA slots, which this one has not (slots: r4, r16); "
     "re-export it with --dora-ranks 4"),
    ("PEFT: corrupt safetensors header", lambda t: _peft_dir(t, weights=b"\x08\0\0\0\0\0\0\0{bad json"),
     InvalidArgumentError, "not a readable safetensors file"),
    ("PEFT: MLP-only adapter", lambda t: PEFT / "mlp_only", InvalidArgumentError,
     "12 tensor(s) are on MLP projections, which this model takes no LoRA on (its slots cover q/k/v/o; "
     "re-export it with --lora-targets all-linear): lora_ff_down_a_prime_weight_0"),
    ("GGUF of the wrong general.type", lambda t: PEFT / "not_an_adapter.gguf", InvalidArgumentError,
     "general.type is 'model', expected 'adapter'"),
    ("GGUF truncated", lambda t: _write(t, (PEFT / "qkvo_r4.gguf").read_bytes()[:200]), InvalidArgumentError,
     "not a readable GGUF"),
]


def _write(tmp_path, blob: bytes):
    path = tmp_path / "x.tflite"
    path.write_bytes(blob)
    return path


def _vtable_corrupt(blob: bytes) -> bytes:
    root = struct.unpack_from("<I", blob, 0)[0]
    return _patched(blob, root, struct.pack("<i", -(1 << 28)))


def _int32_tensor() -> bytes:
    """The float16 file with its first tensor's type code changed to INT32."""
    blob = bytearray(EXTERNAL)
    tensor = schema.Model.GetRootAs(blob, 0).Subgraphs(0).Tensors(0)
    type_field = tensor._tab.Offset(6)  # present: FLOAT16 is not the default (FLOAT32)
    blob[tensor._tab.Pos + type_field] = schema.TensorType.INT32
    return bytes(blob)


def _duplicate_names() -> bytes:
    a = np.zeros((64, 4), np.float32)
    blob = serialize_lora_tensors({"lora_atten_q_a_prime_weight_0": a, "lora_atten_q_a_prime_weight_1": a},
                                  external_data=False)
    return blob.replace(b"lora_atten_q_a_prime_weight_1", b"lora_atten_q_a_prime_weight_0")


def _layer(layer: int) -> bytes:
    return serialize_lora_tensors({f"lora_atten_q_a_prime_weight_{layer}": np.zeros((64, 4), np.float32),
                                   f"lora_atten_q_b_prime_weight_{layer}": np.zeros((4, 64), np.float32)},
                                  external_data=False)


def _named(name: str) -> bytes:
    return serialize_lora_tensors({name: np.zeros((64, 4), np.float32)}, external_data=False)


@pytest.mark.parametrize("case,build,error,fragment", CATALOGUE, ids=[c[0] for c in CATALOGUE])
def test_catalogue(engine, witness, tmp_path, case, build, error, fragment):
    path = build(tmp_path)
    before = engine.adapter_ids()
    with pytest.raises(error) as info:
        engine.register_adapter(LoraSource(path=path))
    message = str(info.value)
    assert fragment in message, message
    assert "\n" not in message
    assert engine.adapter_ids() == before  # nothing half-registered
    session, expected = witness
    session.reset()
    np.testing.assert_array_equal(session.run_prefill([1, 2, 3]), expected)


def test_no_permission(engine, tmp_path, monkeypatch):
    path = tmp_path / "secret.tflite"
    path.write_bytes(GOOD)
    real_open = os.open

    def deny(file, *args, **kwargs):
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(os, "open", deny)
    with pytest.raises(PermissionDeniedError, match="secret.tflite: permission denied"):
        engine.register_adapter(LoraSource(path=path))


def test_non_finite_weights_refused_by_default_allowed_by_option(tmp_path):
    a = np.ones((64, 4), np.float32)
    a[3, 1] = np.nan
    path = _write(tmp_path, serialize_lora_tensors(
        {"lora_atten_v_a_prime_weight_1": a, "lora_atten_v_b_prime_weight_1": np.ones((4, 32), np.float32)},
        external_data=False))
    with Engine(MODEL_FILES["default"]) as engine:
        with engine.create_session(SessionConfig(lora_path=path)) as session:
            with pytest.raises(InvalidArgumentError, match="'lora_atten_v_a_prime_weight_1' holds NaN or Inf"):
                session.run_prefill([1, 2])
            assert session.position == 0
        assert engine.stats().resident == ()
    with Engine(MODEL_FILES["default"], EngineSettings(allow_non_finite_weights=True)) as engine:
        with engine.create_session(SessionConfig(lora_path=path)) as session:
            assert np.isnan(session.run_prefill([1, 2])).all()  # what NaN weights give


@pytest.mark.parametrize("kind", ["tflite", "peft", "gguf"])
@pytest.mark.parametrize("change", ["truncate", "rewrite"])
def test_file_changed_after_registration_is_data_loss_not_sigbus(tmp_path, kind, change):
    if kind == "tflite":
        path = _write(tmp_path, EXTERNAL)
        victim = path
    elif kind == "peft":
        path = _peft_dir(tmp_path)
        victim = path / "adapter_model.safetensors"
    else:
        path = tmp_path / "a.gguf"
        shutil.copy(PEFT / "qkvo_r4.gguf", path)
        victim = path
    with Engine(MODEL_FILES["default"]) as engine:
        session = engine.create_session(SessionConfig(lora_path=path))  # registered: parsed, not read
        size = victim.stat().st_size
        time.sleep(0.01)
        with open(victim, "r+b") as f:
            if change == "truncate":
                f.truncate(size // 3)
            else:
                f.seek(size - 8)
                f.write(b"\x7f" * 8)
        with pytest.raises(DataLossError, match="shrank|modified"):
            session.run_prefill([1, 2, 3])
        other = engine.create_session()
        other.run_prefill([1, 2, 3])  # the engine goes on


def test_sha256_checked_before_registration(engine, tmp_path):
    digest = hashlib.sha256(GOOD).hexdigest()
    lora_id = engine.register_adapter(LoraSource(buffer=GOOD, sha256=digest))
    assert lora_id in engine.adapter_ids()
    engine.unload_adapter(lora_id)
    path = _write(tmp_path, GOOD)
    before = engine.adapter_ids()
    with pytest.raises(DataLossError, match="SHA-256 is .*expected 0{64}; nothing was registered"):
        engine.register_adapter(LoraSource(path=path, sha256="0" * 64))
    with pytest.raises(DataLossError):
        engine.register_adapter(LoraSource(buffer=GOOD + b"x", sha256=digest))
    assert engine.adapter_ids() == before
    peft_digest = hashlib.sha256((PEFT / "qkvo_r4" / "adapter_model.safetensors").read_bytes()).hexdigest()
    engine.unload_adapter(engine.register_adapter(LoraSource(path=PEFT / "qkvo_r4", sha256=peft_digest)))
    with pytest.raises(InvalidArgumentError, match="64 hex digits"):
        LoraSource(path=path, sha256="abc")


def test_a_wrong_sha256_is_refused_for_an_adapter_registered_already(engine, tmp_path):
    """The digest a caller gives is checked every time: an adapter registered before
    without one (or with the right one) is not taken for a wrong one."""
    path = _write(tmp_path, GOOD)
    lora_id = engine.register_adapter(LoraSource(path=path))
    wrong = LoraSource(path=path, sha256="0" * 64)
    with pytest.raises(DataLossError, match="SHA-256"):
        engine.register_adapter(wrong)
    with pytest.raises(DataLossError, match="SHA-256"):
        engine.create_session(SessionConfig(loras=(wrong,)))
    assert engine.register_adapter(LoraSource(path=path, sha256=hashlib.sha256(GOOD).hexdigest())) == lora_id
    engine.unload_adapter(lora_id)


def test_a_blend_that_fails_leaves_none_of_its_adapters_registered(engine, witness):
    """A session (or a switch) whose adapters no slot runs together registers nothing:
    the adapters it brought are unregistered again, those it found stay."""
    r16, r4 = LoraSource(path=adapter_path("torch_r16")), LoraSource(path=adapter_path("litertlm_r4"))
    before = engine.adapter_ids()
    with pytest.raises(InvalidArgumentError, match="rank"):
        engine.create_session(SessionConfig(loras=(r16, r4)))  # ranks 16 + 4: no slot
    assert engine.adapter_ids() == before
    session = engine.create_session()
    with pytest.raises(InvalidArgumentError, match="rank"):
        session.set_adapters([r16, r4])
    assert engine.adapter_ids() == before and session.lora_ids == []
    session.close()
    witness_session, expected = witness  # holds litertlm_r4, which stays registered
    assert witness_session.lora_ids[0] in engine.adapter_ids()
    witness_session.reset()
    np.testing.assert_array_equal(witness_session.run_prefill([1, 2, 3]), expected)


def test_set_adapters_mid_generation_is_refused(engine):
    session = engine.create_session(SessionConfig(lora_path=adapter_path("torch_r4")))
    started = threading.Event()

    class SlowSampler(Sampler):
        def sample(self, logits):
            started.set()
            time.sleep(0.05)
            return super().sample(logits)

    worker = threading.Thread(target=lambda: session.generate([1, 2, 3], max_new_tokens=4, sampler=SlowSampler()))
    worker.start()
    started.wait(5)
    with pytest.raises(FailedPreconditionError, match="being used by another call"):
        session.set_adapters([LoraSource(path=adapter_path("litertlm_r4"))], reset=True)
    worker.join()
    assert session.position == 3 + 4
    session.close()
