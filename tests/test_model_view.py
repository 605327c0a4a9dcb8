"""Tests for runtime.util.model_view: copy-on-write views of a model file."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import flatbuffers
import numpy as np
import pytest
from ai_edge_litert import schema_py_generated as schema

from conftest import MODEL_FILES, MODELS
from runtime.errors import DataLossError, FailedPreconditionError, InvalidArgumentError, NotFoundError
from runtime.executor.native import HostBuffer, NativeModel
from runtime.util.model_view import (
    ModelFile, ViewRefused, patch_signatures, signature_details, signature_keys, subgraph_references, view_refusal,
)

VIEWABLE = MODEL_FILES["transposed"]  # one subgraph per signature, no composites
COMPOSITE = MODEL_FILES["default"]  # STABLEHLO_COMPOSITE ops name their decompositions' subgraphs (12 of 48)


@pytest.fixture(scope="module", name="whole")
def whole_fixture():
    model = NativeModel(VIEWABLE, num_threads=1, weight_cache=":memory:", name="whole")
    yield model
    model.close()


def _run(model: NativeModel, key: str, seed: int) -> dict[str, np.ndarray]:
    """Runs ``key`` of ``model`` on inputs drawn from ``seed`` (small values, the tokens and
    positions in range); every output, by name."""
    rng = np.random.default_rng(seed)
    signature = model.signatures[key]
    inputs = []
    for name, info in signature.inputs.items():
        buffer = HostBuffer(info)
        if name == "tokens":
            buffer.write(rng.integers(1, 200, info.shape).astype(info.dtype))
        elif name == "input_pos":
            buffer.write(np.arange(buffer.array.size, dtype=info.dtype).reshape(info.shape) % 8)
        else:
            buffer.write(rng.standard_normal(info.shape).astype(info.dtype) * 0.1)
        inputs.append(buffer)
    outputs = [HostBuffer(info) for info in signature.outputs.values()]
    model.run(model.prepare(signature.index, inputs, outputs))
    return {name: buffer.array.copy() for name, buffer in zip(signature.outputs, outputs)}


@pytest.mark.parametrize("path", [VIEWABLE, COMPOSITE], ids=["plain ops", "composites"])
def test_a_view_runs_its_signatures_exactly_as_the_whole_model(path):
    keys = ["decode_lora_r16", "prefill_8", "decode_batch2_lora_r4"]  # not in the file's order
    view = ModelFile(path).view(keys)
    viewed = NativeModel(view.data, num_threads=1, weight_cache=":memory:", name="view")
    whole = NativeModel(path, num_threads=1, weight_cache=":memory:", name="whole")
    try:
        assert list(viewed.signatures) == keys
        assert [viewed.signatures[k].index for k in keys] == [0, 1, 2]
        for seed, key in enumerate(keys):
            expected, got = _run(whole, key, seed), _run(viewed, key, seed)
            assert list(got) == list(expected)
            for name in expected:
                np.testing.assert_array_equal(got[name], expected[name], err_msg=f"{key} {name}")
    finally:
        viewed.close()
        whole.close()


def test_a_view_patches_a_private_copy_only():
    before = hashlib.sha256(VIEWABLE.read_bytes()).hexdigest()
    view = ModelFile(VIEWABLE).view(["decode"])
    assert list(signature_keys(view.data)) == ["decode"]
    assert 0 < view.patched_bytes <= 64
    assert hashlib.sha256(VIEWABLE.read_bytes()).hexdigest() == before
    assert len(signature_keys(ModelFile(VIEWABLE).header())) == 36  # another mapping sees the whole model


def test_the_header_describes_the_signatures_as_the_library_does(whole):
    header = ModelFile(VIEWABLE).header()
    assert list(signature_keys(header)) == list(whole.signatures)

    def ordered(details: dict) -> list:
        return [(key, list(ins.items()), list(outs.items())) for key, (ins, outs) in details.items()]

    # In the library's order too (the subgraph's, not the signature's own vector, sorted by name).
    assert ordered(signature_details(header)) == ordered(whole.signature_details())
    some = signature_details(header, ["decode", "prefill_32_lora_r4"])
    assert some == {key: whole.signature_details()[key] for key in ("decode", "prefill_32_lora_r4")}
    with pytest.raises(NotFoundError, match="decode_lora_r99"):
        signature_details(header, ["decode", "decode_lora_r99"])


def test_a_model_stored_inside_a_file_is_viewed_at_its_offset(tmp_path, whole):
    data = VIEWABLE.read_bytes()
    begin = 4096 * 3 + 136  # not on a page: the mapping starts at the page before it
    packed = tmp_path / "bundle.bin"
    packed.write_bytes(b"\x07" * begin + data + b"\x09" * 5000)
    stored = ModelFile(packed, begin, begin + len(data))
    assert bytes(stored.header()) == data
    view = stored.view(["decode", "prefill_8"])
    viewed = NativeModel(view.data, num_threads=1, weight_cache=":memory:", name="section")
    try:
        for seed, key in enumerate(["decode", "prefill_8"]):
            expected, got = _run(whole, key, seed), _run(viewed, key, seed)
            for name in expected:
                np.testing.assert_array_equal(got[name], expected[name])
    finally:
        viewed.close()


def test_a_view_keeps_the_decompositions_its_composites_name_and_renumbers_them():
    header = ModelFile(COMPOSITE).header()
    assert subgraph_references(header) == ["STABLEHLO_COMPOSITE"]
    assert view_refusal(header) is None
    original = schema.ModelT.InitFromPackedBuf(COMPOSITE.read_bytes(), 0)
    viewed = schema.ModelT.InitFromPackedBuf(bytes(ModelFile(COMPOSITE).view(["decode", "prefill_8"]).data), 0)

    def decompositions(model: schema.ModelT, subgraph: int) -> list[schema.SubGraphT]:
        return [model.subgraphs[op.builtinOptions2.decompositionSubgraphIndex]
                for op in model.subgraphs[subgraph].operators
                if op.builtinOptions2Type == schema.BuiltinOptions2.StableHLOCompositeOptions]

    def subgraph(model: schema.ModelT, key: str) -> int:
        return next(sig.subgraphIndex for sig in model.signatureDefs if sig.signatureKey.decode() == key)

    before = [sub for key in ("decode", "prefill_8") for sub in decompositions(original, subgraph(original, key))]
    after = [sub for key in ("decode", "prefill_8") for sub in decompositions(viewed, subgraph(viewed, key))]
    assert len(before) == len(after) >= 2
    assert [(sub.name, len(sub.operators)) for sub in after] == [(sub.name, len(sub.operators)) for sub in before]
    # The signatures' own subgraphs, then only the decompositions they name.
    assert len(viewed.subgraphs) == 2 + len({id(sub) for sub in before}) < len(original.subgraphs)


def test_models_with_control_flow_are_refused_with_the_reason(tmp_path):
    model = schema.ModelT.InitFromPackedBuf(COMPOSITE.read_bytes(), 0)
    for code in model.operatorCodes:  # the composites' code made a WHILE: a subgraph reference no view renumbers
        if code.builtinCode == schema.BuiltinOperator.STABLEHLO_COMPOSITE:
            code.builtinCode = code.deprecatedBuiltinCode = schema.BuiltinOperator.WHILE
    builder = flatbuffers.Builder(1 << 20)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    path = tmp_path / "while.tflite"
    path.write_bytes(bytes(builder.Output()))
    assert subgraph_references(ModelFile(path).header()) == ["WHILE"]
    assert "['WHILE']" in view_refusal(ModelFile(path).header(), str(path))
    assert view_refusal(ModelFile(VIEWABLE).header()) is None
    with pytest.raises(ViewRefused, match="WHILE") as caught:
        ModelFile(path).view(["decode"])
    assert isinstance(caught.value, FailedPreconditionError)
    assert str(path) in str(caught.value)


def test_unknown_signatures_and_unreadable_files_are_refused(tmp_path):
    with pytest.raises(NotFoundError, match="decode_lora_r99"):
        ModelFile(VIEWABLE).view(["decode", "decode_lora_r99"])
    with pytest.raises(NotFoundError):
        ModelFile(VIEWABLE).view([])
    with pytest.raises(NotFoundError, match="cannot open"):
        ModelFile(tmp_path / "missing.tflite").header()
    with pytest.raises(InvalidArgumentError, match=f"{tmp_path}: is a directory, expected a model file"):
        ModelFile(tmp_path).header()
    os.mkfifo(tmp_path / "fifo")  # refused, not waited on for a writer
    with pytest.raises(InvalidArgumentError, match="fifo: is not a regular file, expected a model file"):
        ModelFile(tmp_path / "fifo").view(["decode"])
    truncated = tmp_path / "truncated.tflite"
    truncated.write_bytes(VIEWABLE.read_bytes()[:2000])
    with pytest.raises(DataLossError, match="truncated.tflite"):
        signature_details(ModelFile(truncated).header(), source=str(truncated))
    gguf = tmp_path / "model.gguf"  # a GGUF base model given where an export belongs
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(4096))
    with pytest.raises(InvalidArgumentError, match=r"model\.gguf: a GGUF model, .*`runtime export`"):
        ModelFile(gguf).header()
    adapter = tmp_path / "adapter_model.safetensors"  # an adapter given where the model belongs
    adapter.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"__metadata__\":{}}")
    with pytest.raises(InvalidArgumentError, match=r"adapter_model\.safetensors: not a \.tflite model"):
        ModelFile(adapter).view(["decode"])


def test_patching_bytes_in_memory_keeps_the_rest(whole):
    data = bytearray((MODELS / "turbo" / "transposed.tflite").read_bytes())
    original = bytes(data)
    written = patch_signatures(memoryview(data), ["verify4_lora_r8", "decode"])
    changed = sum(a != b for a, b in zip(data, original))
    assert 0 < changed <= written
    assert list(signature_keys(data)) == ["verify4_lora_r8", "decode"]
    assert set(signature_details(data)) == {"verify4_lora_r8", "decode"}


@pytest.mark.parametrize("path", [Path("runtime/demo_assets/model.tflite"), Path("benchmarks/models/bench_f32.tflite")])
def test_the_committed_fixtures_with_rms_norm_composites_view_as_they_run(path):
    keys = list(signature_keys(ModelFile(path).header()))[:2]
    whole = NativeModel(path, num_threads=1, weight_cache=":memory:", name="whole")
    viewed = NativeModel(ModelFile(path).view(keys).data, num_threads=1, weight_cache=":memory:", name="view")
    try:
        for seed, key in enumerate(keys):
            expected, got = _run(whole, key, seed), _run(viewed, key, seed)
            for name in expected:
                np.testing.assert_array_equal(got[name], expected[name], err_msg=f"{key} {name}")
    finally:
        viewed.close()
        whole.close()
