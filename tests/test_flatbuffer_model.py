"""A model's object form packed back (runtime.util.flatbuffer_model): the bytes, the file
written whole or not at all, a builder sized once."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import MODELS, run_signature
from runtime.errors import DataLossError, InvalidArgumentError
from runtime.executor.native import NativeModel
from runtime.util import flatbuffer_model
from runtime.util.attention_rewrite import rewrite_attention
from runtime.util.kv_cache_precision import kv_caches_to_float16

ROOT = Path(__file__).resolve().parent.parent
# The passes' fixtures: both attention forms where the caches lie transposed, float16 caches in all.
SOURCES = {"gqa": MODELS / "gqa_transposed.tflite", "gemma3": MODELS / "gemma3" / "model.tflite",
           "default layout": MODELS / "gqa_default.tflite"}


def rewritten(name: str) -> flatbuffer_model.schema.ModelT:
    model = flatbuffer_model.unpack(SOURCES[name].read_bytes())
    kv_caches_to_float16(model)
    if name != "default layout":
        rewrite_attention(model, keep_standard=True)
    return model


@pytest.mark.parametrize("name", SOURCES)
def test_write_puts_the_packed_bytes_in_the_file_and_the_builder_never_grows(name, tmp_path, monkeypatch):
    model = rewritten(name)
    sizes = []
    builder = flatbuffer_model.flatbuffers.Builder

    class Recorded(builder):
        def GrowByteBuffer(self):  # noqa: N802 (flatbuffers' name)
            sizes.append(len(self.Bytes))
            super().GrowByteBuffer()

    monkeypatch.setattr(flatbuffer_model.flatbuffers, "Builder", Recorded)
    out = tmp_path / "out.tflite"
    written = flatbuffer_model.write(model, out)
    assert sizes == []  # sized once: a builder that grows holds two copies of the model meanwhile
    assert out.read_bytes() == flatbuffer_model.pack(model) and written == out.stat().st_size
    assert os.listdir(tmp_path) == ["out.tflite"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask  # a model file, not a private temporary one


def test_a_failed_write_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    model = rewritten("gqa")
    out = tmp_path / "model.tflite"
    out.write_bytes(b"the model before")
    real = tempfile.NamedTemporaryFile

    def full_disk(*args, **kwargs):
        file = real(*args, **kwargs)

        def write(data):
            file.file.write(bytes(data)[:1000])
            raise OSError(28, "No space left on device")
        file.write = write
        return file

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", full_disk)
    with pytest.raises(OSError, match="No space left"):
        flatbuffer_model.write(model, out)
    assert out.read_bytes() == b"the model before" and os.listdir(tmp_path) == ["model.tflite"]


def test_a_truncated_or_foreign_file_is_refused_naming_it(tmp_path):
    """Given bytes that are not a whole .tflite, the pass (and tools/attention_kernel.py over
    it) refuses them naming the file and what was expected, not with a raw struct.error."""
    data = SOURCES["gqa"].read_bytes()
    with pytest.raises(DataLossError, match=r"cut\.tflite: a \.tflite model truncated or corrupt"):
        flatbuffer_model.unpack(data[:3000], "cut.tflite")
    with pytest.raises(InvalidArgumentError, match=r"m\.litertlm: not a \.tflite model \(no TFL3"):
        flatbuffer_model.unpack(b"LITERTLM" + bytes(100), "m.litertlm")
    cut = tmp_path / "cut.tflite"
    cut.write_bytes(data[:3000])
    tool = subprocess.run([sys.executable, str(ROOT / "tools" / "attention_kernel.py"), str(cut), "--out",
                           str(tmp_path / "out.tflite")], capture_output=True, text=True, timeout=120)
    assert tool.returncode == 1 and "Traceback" not in tool.stderr, tool.stderr
    assert f"error: DATA_LOSS: {cut}: a .tflite model truncated or corrupt" in tool.stderr
    assert os.listdir(tmp_path) == ["cut.tflite"]


@pytest.mark.parametrize("break_it, naming", [
    (lambda m: setattr(m.signatureDefs[0].inputs[0], "tensorIndex", 10**6), "entry b'"),
    (lambda m: setattr(m.signatureDefs[0], "subgraphIndex", 999), "subgraph 999 of"),
    (lambda m: setattr(m.subgraphs[0].operators[0], "opcodeIndex", 999), "operator 0: operator code 999 of"),
    (lambda m: setattr(m.subgraphs[0].tensors[0], "buffer", 10**6), "tensor 0: buffer 1000000 of"),
    (lambda m: setattr(m.signatureDefs[0].inputs[0], "name", b"kv_cache_\xc8"), "entry b'kv_cache_\\xc8'"),
], ids=["signature tensor", "signature subgraph", "operator code", "buffer", "name not UTF-8"])
def test_a_model_whose_indices_point_at_nothing_is_refused_naming_them(break_it, naming):
    """A corrupt file that still parses: the passes indexed by it and ended in a raw
    IndexError, AttributeError or UnicodeDecodeError (tools/attention_kernel.py: a traceback)."""
    model = flatbuffer_model.unpack(SOURCES["gqa"].read_bytes())
    break_it(model)
    with pytest.raises(DataLossError, match="broken.tflite: a .tflite model corrupt: ") as info:
        flatbuffer_model.unpack(flatbuffer_model.pack(model), "broken.tflite")
    assert naming in str(info.value)


def test_buffers_are_packed_from_their_arrays_and_lists_alike(tmp_path):
    model = flatbuffer_model.unpack(SOURCES["gqa"].read_bytes())
    as_lists = flatbuffer_model.unpack(SOURCES["gqa"].read_bytes())
    for buffer in as_lists.buffers:
        if buffer.data is not None:
            buffer.data = np.asarray(buffer.data).tolist()
    assert flatbuffer_model.pack(as_lists) == flatbuffer_model.pack(model)


def test_equal_quantization_parameters_are_stored_once_and_the_model_runs_the_same(tmp_path):
    """The quantizer gives every subgraph's weights their own per-channel scales: packed once
    per content, the int8 bench model (184 subgraphs) shrinks, and every tensor reads back the
    parameters it had and every signature gives the same outputs."""
    source = Path(__file__).resolve().parents[1] / "benchmarks" / "models" / "bench_int8.tflite"
    data = source.read_bytes()
    out = tmp_path / "int8.tflite"
    flatbuffer_model.write(flatbuffer_model.unpack(data), out)
    packed = out.read_bytes()
    assert len(packed) < 0.8 * len(data)

    def parameters(model: bytes) -> tuple[list, set[int]]:
        root = flatbuffer_model.schema.Model.GetRootAs(model, 0)
        every, tables = [], set()
        for g in range(root.SubgraphsLength()):
            graph = root.Subgraphs(g)
            for t in range(graph.TensorsLength()):
                q = graph.Tensors(t).Quantization()
                if q is not None and q.ScaleLength():
                    every.append((q.ScaleAsNumpy().tobytes(), q.ZeroPointAsNumpy().tobytes(), q.QuantizedDimension()))
                    tables.add(q._tab.Pos)
        return every, tables

    before, _ = parameters(data)
    after, tables = parameters(packed)
    assert after == before and len(tables) == len(set(after)) < len(after)
    models = [NativeModel(path, num_threads=1, weight_cache=":memory:", name=path.name) for path in (source, out)]
    rng = np.random.default_rng(0)
    for key in ("decode", "decode_lora_r8", "prefill_8"):
        signature = models[0].signatures[key]
        inputs = {name: (rng.integers(0, 8, info.shape) if np.issubdtype(info.dtype, np.integer)
                         else rng.standard_normal(info.shape) * 0.1).astype(info.dtype)
                  for name, info in signature.inputs.items()}
        first, second = (run_signature(model, key, inputs) for model in models)
        assert first.keys() == second.keys() and all(np.array_equal(first[n], second[n]) for n in first)


def test_models_packed_from_several_threads_at_once_are_packed_as_alone():
    """Packing patches the schema's classes for its duration: two packs at once must not see
    each other's (or the original) packers."""
    models = [rewritten(name) for name in SOURCES]
    alone = [flatbuffer_model.pack(model) for model in models]
    results: dict[int, bytes] = {}

    def pack(index: int) -> None:
        results[index] = flatbuffer_model.pack(models[index % len(models)])

    threads = [threading.Thread(target=pack, args=(i,)) for i in range(3 * len(models))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(results[i] == alone[i % len(models)] for i in range(len(threads)))
