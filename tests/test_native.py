"""Tests for runtime.executor.native: LiteRT's C API through ctypes."""

from __future__ import annotations

import mmap
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from ai_edge_litert import schema_py_generated as schema

from conftest import MODEL_FILES, adapter_path
from graph_passes import needs_kernel
from runtime import Engine, EngineSettings, SessionConfig
from runtime.errors import InvalidArgumentError, UnimplementedError
from runtime.executor.native import HostBuffer, NativeModel, _tensor_info, tensor_info
from runtime.util import flatbuffer_model
from runtime.util.attention_rewrite import LINEAR_ROWS, custom_codes, rewrite_attention
from runtime.util.page_advice import advise_huge_pages


def _decode_model() -> tuple[NativeModel, object]:
    model = NativeModel(MODEL_FILES["default"], num_threads=1, weight_cache=":memory:", name="test model")
    signature = model.signatures["decode"]
    inputs = [HostBuffer(info) for info in signature.inputs.values()]
    outputs = [HostBuffer(info) for info in signature.outputs.values()]
    return model, model.prepare(signature.index, inputs, outputs)


def test_a_run_lets_other_python_threads_work():
    model, prepared = _decode_model()
    spins, done = [0], threading.Event()

    def spin() -> None:
        while not done.is_set():
            spins[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    during = []
    deadline = time.monotonic() + 10  # a busy machine may leave the spinner without a core for a while
    try:
        while not sum(during) and time.monotonic() < deadline:
            before = spins[0]
            model.run(prepared)  # with the GIL held (as the wheel's own binding does) nothing spins here
            during.append(spins[0] - before)
    finally:
        done.set()
        spinner.join()
        model.close()
    assert sum(during) > 0, f"no spin during any of {len(during)} runs"


def test_executors_share_an_adapter_in_runs_at_the_same_time():
    """The library locks a tensor buffer for a run: two executors binding the same
    adapter buffer at once each need a handle of their own."""
    config = SessionConfig(lora_path=adapter_path("torch_r4"))
    steps = 400

    def decode_all(session) -> list[np.ndarray]:
        out = []
        for i in range(steps):
            if session.position == session.kv_length:
                session.reset()
            out.append(session.run_decode(i % 200 + 1))
        return out

    with Engine(MODEL_FILES["default"], EngineSettings(batch_wait_s=None)) as engine:
        with engine.create_session(config) as session:
            alone = decode_all(session)
    with Engine(MODEL_FILES["default"], EngineSettings(executors=2, batch_wait_s=None)) as engine:
        sessions = [engine.create_session(config) for _ in range(2)]
        results: list = [None, None]
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, decode_all(sessions[i])))
                   for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for result in results:
        assert result is not None and len(result) == steps
        for got, expected in zip(result, alone):
            np.testing.assert_array_equal(got, expected)


def test_buffers_are_zeroed_aligned_host_memory():
    model, _ = _decode_model()
    info = model.signatures["decode"].inputs["kv_cache_k_0"]
    buffer = HostBuffer(info)
    assert buffer.array.shape == info.shape and buffer.array.dtype == np.float32
    assert buffer.array.ctypes.data % 64 == 0 and not buffer.array.any()
    values = np.arange(buffer.array.size, dtype=np.float32)
    buffer.write(values)  # as many elements, flat
    np.testing.assert_array_equal(buffer.array, values.reshape(info.shape))
    model.close()


def test_a_tensor_type_laid_out_otherwise_is_refused_naming_the_tensor():
    raw = bytearray(256)
    raw[0:4] = (1).to_bytes(4, "little")  # float32
    raw[4] = 2  # rank 2
    raw[8:16] = np.array([3, 4], np.int32).tobytes()
    assert _tensor_info("x", bytes(raw), "m.tflite").shape == (3, 4)
    raw[8:16] = np.array([3, -1], np.int32).tobytes()
    with pytest.raises(UnimplementedError, match="m.tflite: tensor 'x' reads as element type 1, rank 2, dims"):
        _tensor_info("x", bytes(raw), "m.tflite")
    raw[0:4] = (99).to_bytes(4, "little")
    with pytest.raises(UnimplementedError, match="install ai-edge-litert 2.3"):
        _tensor_info("x", bytes(raw), "m.tflite")


def test_a_file_that_is_no_model_is_refused_naming_it(tmp_path):
    path = tmp_path / "junk.tflite"
    path.write_bytes(b"not a flatbuffer at all" * 10)
    with pytest.raises(InvalidArgumentError, match="junk.tflite: cannot load the model"):
        NativeModel(path, num_threads=1, weight_cache=":memory:", name=str(path))


def test_a_model_whose_metadata_points_past_4_gb_is_refused_naming_it(tmp_path):
    # Found by fuzzing model files: the flatbuffers package refuses a table position past
    # 2**32 with TypeError, which escaped the check for the runtime's attention forms.
    raw = bytearray(MODEL_FILES["transposed"].read_bytes())
    root = schema.Model.GetRootAs(raw, 0)
    metadata = root._tab.Vector(root._tab.Offset(16))  # Model.metadata's first element
    raw[metadata:metadata + 4] = (2**32 - 16).to_bytes(4, "little")
    path = tmp_path / "far.tflite"
    path.write_bytes(raw)
    with pytest.raises(InvalidArgumentError, match="far.tflite: cannot load the model"):
        NativeModel(path, num_threads=1, weight_cache=":memory:", name=str(path))


def test_a_model_whose_names_are_not_utf8_is_refused_naming_it(tmp_path):
    # Found by fuzzing model files: a name's bytes escaped as UnicodeDecodeError.
    path = tmp_path / "names.tflite"
    path.write_bytes(MODEL_FILES["transposed"].read_bytes().replace(b"input_pos", b"\xffnput_pos"))
    with pytest.raises(InvalidArgumentError, match="names.tflite: the name of input 1 of a signature is not UTF-8"):
        NativeModel(path, num_threads=1, weight_cache=":memory:", name=str(path))


@pytest.mark.parametrize("name", ["default", "transposed"])
def test_a_tensor_type_made_from_a_shape_is_the_librarys_own(name):
    # Buffers of a signature group not compiled yet are made from the spec; they must bind as
    # the library's own would once the group compiles: the very same bytes.
    model = NativeModel(MODEL_FILES[name], num_threads=1, weight_cache=":memory:", name=name)
    try:
        infos = [info for signature in model.signatures.values()
                 for info in (*signature.inputs.values(), *signature.outputs.values())]
        assert len(infos) > 500
        for info in infos:
            assert tensor_info(info.name, info.shape, info.dtype) == info
    finally:
        model.close()
    with pytest.raises(InvalidArgumentError, match="tensor 'x': \\[2\\] complex64"):
        tensor_info("x", (2,), np.complex64)


def _mapping_flags(path) -> list[str]:
    """The VmFlags of this process's mappings of ``path`` (Linux's /proc/self/smaps)."""
    flags, current = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if re.match(r"[0-9a-f]+-[0-9a-f]+$", fields[0]):
            current = fields[5] if len(fields) > 5 else None
        elif fields[0] == "VmFlags:" and current == str(path):
            flags.append(" ".join(fields[1:]))
    return flags


def _huge_page_advice_taken() -> bool:
    """Whether this system shows mappings' flags and takes the advice for 2 MB pages."""
    if not Path("/proc/self/smaps").exists():
        return False
    with mmap.mmap(-1, 1 << 21) as probe:
        return advise_huge_pages(probe)


def _op_form_file(tmp_path) -> Path:
    """The transposed fixture with both forms of decode attention (the op form's float32 linear
    layers read their weights from the model's mapping)."""
    model = flatbuffer_model.unpack(MODEL_FILES["transposed"].read_bytes())
    rewrite_attention(model, keep_standard=True)
    path = tmp_path / "both.tflite"
    flatbuffer_model.write(model, path)
    assert LINEAR_ROWS in custom_codes(path.read_bytes())
    return path


@needs_kernel
def test_a_model_whose_steps_read_its_weights_in_place_has_its_file_read_again_in_huge_pages(tmp_path, monkeypatch):
    """The engine asks for such a model's file in 2 MB pages (tests/test_page_advice.py: what
    that does) before any of its views maps it; a model whose weights XNNPACK reads from its
    packed copy, or shown in the standard form, is not asked for."""
    from runtime.executor import litert_executor
    asked = []

    def read_again(path):
        path = Path(path)
        with open("/proc/self/maps") as maps:  # (start-end perms offset device inode path)
            private = [line for line in maps if line.rstrip().endswith(str(path)) and line.split()[1][3] == "p"]
        asked.append((path, private))

    monkeypatch.setattr(litert_executor, "read_again_in_huge_pages", read_again)
    both, plain = _op_form_file(tmp_path), tmp_path / "plain.tflite"
    plain.write_bytes(MODEL_FILES["transposed"].read_bytes())
    for path in (both, plain):
        with Engine(path, EngineSettings(weight_cache_dir=tmp_path / "cache")) as engine:
            with engine.create_session(SessionConfig()) as session:
                session.generate([1, 2, 3], 2)
    assert asked == [(both, [])]
    monkeypatch.setattr(litert_executor.kernels, "attention_form_here", lambda name: (False, "the standard form"))
    with Engine(both, EngineSettings(weight_cache_dir=tmp_path / "cache")):
        pass
    assert len(asked) == 1


@pytest.mark.skipif(not _huge_page_advice_taken(), reason="no /proc/self/smaps or transparent huge pages here")
@needs_kernel
def test_a_model_whose_steps_read_its_weights_in_place_is_mapped_for_huge_pages(tmp_path):
    """A model running the float32 linear layers' op is mapped asking for 2 MB pages ("hg"),
    opened whole or through the engine's views; a model whose weights XNNPACK reads from its
    packed copy is not (the advice would bring weights no step reads into memory)."""
    both, plain = _op_form_file(tmp_path), tmp_path / "plain.tflite"
    plain.write_bytes(MODEL_FILES["transposed"].read_bytes())
    for path, advised in ((both, True), (plain, False)):
        model = NativeModel(path, num_threads=1, weight_cache=":memory:", name=str(path))
        try:
            assert model.attention_kernel == advised
            flags = _mapping_flags(path)
            assert flags and all(("hg" in entry.split()) == advised for entry in flags), (path, flags)
        finally:
            model.close()
        with Engine(path) as engine:
            with engine.create_session(SessionConfig()) as session:
                session.generate([1, 2, 3], 2)
            flags = _mapping_flags(path)
            assert flags and all(("hg" in entry.split()) == advised for entry in flags), (path, flags)
