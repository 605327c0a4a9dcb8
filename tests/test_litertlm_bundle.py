"""Tests for runtime.util.litertlm_bundle with bundles written by litert-lm-builder."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import threading
import tracemalloc

import numpy as np
import pytest
from litert_lm_builder import litertlm_builder as builder
from litert_lm_builder.runtime.proto import llm_metadata_pb2

from conftest import MODEL_FILES, adapter_path
from runtime import Engine, EngineSettings, SessionConfig
from runtime.errors import DataLossError, InvalidArgumentError, NotFoundError, StatusError
from runtime.util.litertlm_bundle import LitertLmBundle, LlmMetadata, is_litertlm


@pytest.fixture(scope="module")
def hf_json(tmp_path_factory):
    """A word-level tokenizer.json whose ids fit the test model's 256-token vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "</s>", "hello", "world", "adapter", "session", "runtime"] + [f"w{i}" for i in range(100)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def build_bundle(path, model, tokenizer_json=None, llm_metadata=None, texts=()):
    bundle = builder.LitertLmFileBuilder()
    bundle.add_system_metadata(builder.Metadata(key="Authors", value="runtime tests", dtype=builder.DType.STRING))
    bundle.add_tflite_model(str(model), builder.TfLiteModelType.PREFILL_DECODE)
    if tokenizer_json is not None:
        bundle.add_hf_tokenizer(str(tokenizer_json))
    if llm_metadata is not None:
        metadata_file = path.with_suffix(".pb")
        metadata_file.write_bytes(llm_metadata.SerializeToString())
        bundle.add_llm_metadata(str(metadata_file), additional_metadata=[
            builder.Metadata(key=key, value=value, dtype=builder.DType.STRING) for key, value in texts] or None)
    with open(path, "wb") as stream:
        bundle.build(stream)
    return path


# A chat template in the shape of Llama 3's: it inserts the bos token's text itself.
CHAT_TEMPLATE = "{{ bos_token + ' ' }}{% for m in messages %}{{ m['content'] + ' ' }}{% endfor %}session"


@pytest.fixture(scope="module")
def chat_bundle_path(tmp_path_factory, hf_json):
    """A bundle as ``runtime export`` writes it: LlmMetadata with start and stop tokens, the
    chat template and the bos/eos texts."""
    metadata = llm_metadata_pb2.LlmMetadata(max_num_tokens=64, jinja_prompt_template=CHAT_TEMPLATE)
    metadata.start_token.token_ids.ids.append(2)
    for stop in (3, 4):
        metadata.stop_tokens.add().token_ids.ids.append(stop)
    metadata.stop_tokens.add().token_ids.ids.extend([5, 6])  # a two-token stop sequence: not a stop token id
    metadata.stop_tokens.add().token_str = "</s>"
    return build_bundle(tmp_path_factory.mktemp("chat") / "chat.litertlm", MODEL_FILES["default"], hf_json,
                        metadata, texts=[("bos_token", "hello"), ("eos_token", "</s>")])


@pytest.fixture(scope="module")
def bundle_path(tmp_path_factory, hf_json):
    return build_bundle(tmp_path_factory.mktemp("bundle") / "model.litertlm", MODEL_FILES["default"], hf_json)


def test_reads_sections_zero_copy(bundle_path, hf_json):
    assert is_litertlm(bundle_path) and not is_litertlm(MODEL_FILES["default"])
    with LitertLmBundle(bundle_path) as bundle:
        assert bundle.version[0] == 1
        assert bundle.system_metadata["Authors"] == "runtime tests"
        assert [s.data_type for s in bundle.sections] == ["tflite_model", "hf_tokenizer_zlib"]
        section = bundle.model_section()
        with bundle.section_bytes(section) as view:
            assert bytes(view) == MODEL_FILES["default"].read_bytes()
        assert section.begin % (16 * 1024) == 0
        assert bundle.tokenizer() == ("hf", hf_json.read_bytes())
        with pytest.raises(NotFoundError, match="no tf_lite_embedder model section"):
            bundle.model_section("tf_lite_embedder")


def test_bundle_runs_like_the_bare_model(bundle_path, tmp_path):
    prompt = [5, 17, 42, 200, 3, 99]
    config = SessionConfig(lora_path=adapter_path("torch_r4"))
    results = []
    cache = tmp_path / "weight-cache"
    for model, settings in ((bundle_path, EngineSettings()), (MODEL_FILES["default"], EngineSettings()),
                            (bundle_path, EngineSettings(weight_cache_dir=cache)),
                            (bundle_path, EngineSettings(weight_cache_dir=cache))):
        with Engine(model, settings) as engine, engine.create_session(config) as session:
            results.append(np.stack([session.run_prefill(prompt), session.run_decode(7)]))
    for result in results[1:]:
        np.testing.assert_array_equal(results[0], result)
    assert {f.name.split(".")[0] for f in cache.iterdir() if f.name != ".lock"} == {bundle_path.stem}  # named after the bundle


def test_bundle_tokenizer_gives_text_in_text_out(bundle_path):
    with Engine(bundle_path) as engine:
        assert engine.tokenizer is not None
        with engine.create_session() as session:
            streamed = []
            result = session.generate("hello world", max_new_tokens=5, on_token=streamed.append)
    assert streamed == result.tokens
    assert result.prompt_tokens == 2  # "hello", "world"
    assert result.text == engine.tokenizer.decode(result.tokens[:-1] if result.stop_reason == "stop_token" else result.tokens)


def cli(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def test_inspect_and_convert_take_a_bundle_as_their_model_as_generate_does(bundle_path, tmp_path):
    """``generate --model`` runs a bundle's model; ``inspect`` called the bundle neither a model
    nor an adapter, and ``inspect --check --model`` and ``convert --model`` refused it."""
    bare, bundled = cli("inspect", MODEL_FILES["default"]), cli("inspect", bundle_path)
    assert bundled.returncode == 0, bundled.stderr
    with LitertLmBundle(bundle_path) as bundle:
        section = bundle.model_section()
    assert f"  bundle: the model at bytes [{section.begin:,}, {section.end:,}); sections tflite_model, " \
           "hf_tokenizer_zlib" in bundled.stdout
    assert set(bare.stdout.splitlines()[1:]) <= set(bundled.stdout.splitlines()[1:])  # the same model described
    fits = cli("inspect", "--check", adapter_path("torch_r4"), "--model", bundle_path)
    assert fits.returncode == 0 and f"fits {bundle_path}" in fits.stdout, fits.stderr
    outs = [tmp_path / "from_bare.tflite", tmp_path / "from_bundle.tflite"]
    for model, out in zip((MODEL_FILES["default"], bundle_path), outs):
        done = cli("convert", adapter_path("torch_r4"), "--model", model, "--out", out)
        assert done.returncode == 0, done.stderr
    assert outs[0].read_bytes() == outs[1].read_bytes()


def test_a_fifo_is_no_bundle_and_is_not_waited_on(tmp_path):
    """``Engine(fifo)`` (``generate --model``, ``inspect``) waited forever for a writer in
    is_litertlm's open, before the refusal of a file that is not a regular one."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    answers: list[bool] = []
    probe = threading.Thread(target=lambda: answers.append(is_litertlm(fifo)), daemon=True)
    probe.start()
    probe.join(10)
    waited = probe.is_alive()
    if waited:  # let the blocked open go before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        probe.join()
    assert not waited and answers == [False]
    with pytest.raises(InvalidArgumentError, match="fifo: is not a regular file, expected a model file"):
        Engine(fifo)


def test_corrupt_bundles(tmp_path, bundle_path):
    blob = bundle_path.read_bytes()
    cases = {
        "short": blob[:20],
        "bad version": blob[:8] + struct.pack("<I", 9) + blob[12:],
        "header end past file": blob[:24] + struct.pack("<Q", len(blob) * 2) + blob[32:],
        "truncated sections": blob[: len(blob) // 2],
    }
    for name, data in cases.items():
        path = tmp_path / f"{name}.litertlm"
        path.write_bytes(data)
        with pytest.raises(StatusError) as info:
            with Engine(path):
                pass
        assert isinstance(info.value, (InvalidArgumentError, DataLossError)), (name, info.value)
        assert str(path) in str(info.value)


def test_a_tokenizer_section_is_inflated_no_further_than_its_declared_size(tmp_path, hf_json):
    """A section declaring 100 bytes of JSON but inflating to 20 MB (corrupt, or a zlib bomb)
    was inflated whole before its size was compared, the memory taken first."""
    big = tmp_path / "tokenizer.json"
    big.write_text(hf_json.read_text()[:-1] + ', "padding": "' + " " * 20_000_000 + '"}')
    path = build_bundle(tmp_path / "bomb.litertlm", MODEL_FILES["default"], big)
    with LitertLmBundle(path) as bundle:
        section = next(s for s in bundle.sections if s.data_type == "hf_tokenizer_zlib")
    blob = bytearray(path.read_bytes())
    blob[section.begin:section.begin + 8] = struct.pack("<Q", 100)
    path.write_bytes(blob)
    with LitertLmBundle(path) as bundle:
        tracemalloc.start()
        try:
            with pytest.raises(DataLossError, match=rf"{path}: tokenizer section 1 inflates to more than 100 bytes"):
                bundle.tokenizer()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 1_000_000
    truncated = build_bundle(tmp_path / "cut.litertlm", MODEL_FILES["default"], hf_json)
    with LitertLmBundle(truncated) as bundle:
        section = next(s for s in bundle.sections if s.data_type == "hf_tokenizer_zlib")
    blob = bytearray(truncated.read_bytes())
    blob[section.begin + 8 + (section.size - 8) // 2:section.end] = bytes(section.end - section.begin - 8
                                                                        - (section.size - 8) // 2)
    truncated.write_bytes(blob)
    with LitertLmBundle(truncated) as bundle, pytest.raises(DataLossError, match=r"tokenizer section 1"):
        bundle.tokenizer()


def test_llm_metadata_is_read(chat_bundle_path, bundle_path):
    with LitertLmBundle(chat_bundle_path) as bundle:
        assert bundle.llm_metadata() == LlmMetadata(
            start_token_ids=(2,), stop_token_ids=(3, 4), chat_template=CHAT_TEMPLATE, max_num_tokens=64,
            bos_token="hello", eos_token="</s>",
        )
    with LitertLmBundle(bundle_path) as bundle:
        assert bundle.llm_metadata() is None


def test_engine_takes_the_bundles_stop_tokens_and_chat_template(chat_bundle_path, bundle_path):
    with Engine(chat_bundle_path) as engine:
        assert engine.tokenizer.stop_token_ids == (3, 4)
        assert engine.chat_template.render([{"role": "user", "content": "w1"}]) == "hello w1 session"
    with Engine(bundle_path) as engine:
        assert engine.chat_template is None
        assert engine.tokenizer.stop_token_ids == (1,)  # "</s>", found in the vocabulary
    with Engine(chat_bundle_path, chat_template="{{ messages[0].content }}") as engine:
        assert engine.chat_template.render([{"role": "user", "content": "w1"}]) == "w1"


def test_generate_sends_the_prompt_through_the_bundles_chat_template(chat_bundle_path):
    def prefilled(*extra):
        done = subprocess.run([sys.executable, "-m", "runtime", "generate", "--model", str(chat_bundle_path),
                               "--prompt", "w1 w2", "--max-new-tokens", "2", *extra],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return int(re.search(r"prefill (\d+) tokens", done.stdout)[1])

    assert prefilled() == 4  # "hello w1 w2 session"
    assert prefilled("--no-chat-template") == 2


def test_a_corrupt_llm_metadata_section_is_data_loss(tmp_path, chat_bundle_path):
    with LitertLmBundle(chat_bundle_path) as bundle:
        section = next(s for s in bundle.sections if s.data_type == "llm_metadata_proto")
    blob = bytearray(chat_bundle_path.read_bytes())
    blob[section.begin : section.begin + 4] = b"\xff\xff\xff\xff"
    path = tmp_path / "corrupt.litertlm"
    path.write_bytes(bytes(blob))
    with pytest.raises(DataLossError, match="LlmMetadata section .* does not parse"):
        with Engine(path):
            pass


def test_a_bundles_signature_groups_compile_over_views_of_its_model_section(tmp_path, hf_json):
    # A model that can be viewed (no composites), at its section's offset inside the bundle.
    bundle = build_bundle(tmp_path / "viewable.litertlm", MODEL_FILES["transposed"], hf_json)
    prompt = [5, 17, 42, 200, 3, 99]
    results = {}
    for mode in ("on-demand", "all"):
        settings = EngineSettings(weight_cache_dir=tmp_path / mode, compile=mode)
        with Engine(bundle, settings) as engine:
            opened = engine.stats().compiled_groups
            with engine.create_session() as plain, engine.create_session(
                    SessionConfig(lora_path=adapter_path("torch_r4"))) as adapted:
                results[mode] = np.stack([plain.run_prefill(prompt), plain.run_decode(7),
                                          adapted.run_prefill(prompt), adapted.run_decode(7)])
            stats = engine.stats()
            results[mode, "groups"] = opened, stats.compiled_groups, stats.group_compile.count
            every_group = tuple(engine.spec.groups)
    assert results["on-demand", "groups"] == (("plain",), ("plain", "lora_r4"), 1)
    opened, after, compiles = results["all", "groups"]
    assert opened == after == every_group and compiles == 0
    np.testing.assert_array_equal(results["on-demand"], results["all"])
