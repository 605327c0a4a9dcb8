"""The server with a Turbo LoRA adapter: it speculates with the draft heads without a flag,
answers what plain decoding answers, and /metrics reports the heads' work; on a model
without verify signatures the adapter is refused, naming ``--no-draft-heads``, and served
as a plain LoRA with it."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from conftest import MODEL_FILES, MODELS  # noqa: E402
from runtime import ByteTokenizer, Engine, LoraSource, SamplerConfig, SessionConfig  # noqa: E402
from runtime.serve.app import ServeSettings  # noqa: E402
from test_serve import Served, metric, serve_command, start_server, stop_server  # noqa: E402

TURBO = MODELS / "turbo"
PROMPT = "".join(map(chr, [5, 17, 99]))
NO_VERIFY = MODEL_FILES["default"]  # the same tiny model, exported without verify signatures


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    adapters = tmp_path_factory.mktemp("turbo_adapters")
    shutil.copytree(TURBO / "trained_heads", adapters / "turbo")
    engine = Engine(TURBO / "default.tflite", tokenizer=ByteTokenizer())
    server, thread, url = start_server(engine, adapters, ServeSettings("tiny", api_key=None))
    yield Served(url, engine, adapters)
    stop_server(server, thread)
    engine.close()


def _offline(model, sampler: SamplerConfig | None = None) -> str:
    """What the Turbo adapter's LoRA alone (heads=False) generates for PROMPT, offline."""
    with Engine(model, tokenizer=ByteTokenizer()) as offline:
        with offline.create_session(SessionConfig(loras=[LoraSource(path=TURBO / "trained_heads", heads=False)])) as s:
            return s.generate(PROMPT, max_new_tokens=24, sampler=sampler).text


def test_completions_speculate_and_equal_plain_decoding(served):
    expected = _offline(TURBO / "default.tflite")
    status, body = served.call("/v1/completions", {"model": "turbo", "prompt": PROMPT, "max_tokens": 24,
                                                   "temperature": 0}, key=None)
    assert status == 200 and body["choices"][0]["text"] == expected
    page = served.call("/metrics", key=None)[1]["text"]
    assert metric(page, "runtime_speculative_verifies_total") > 0
    assert metric(page, "runtime_speculative_accepted_total", head="0") > 0
    assert metric(page, "runtime_speculative_tokens_per_forward") > 1


def test_sampled_completions_speculate_and_equal_plain_sampling_with_the_seed(served):
    expected = _offline(TURBO / "default.tflite", SamplerConfig(temperature=0.3, seed=11))
    before = served.engine.stats().speculation.verifies
    status, body = served.call("/v1/completions", {"model": "turbo", "prompt": PROMPT, "max_tokens": 24,
                                                   "temperature": 0.3, "seed": 11}, key=None)
    assert status == 200 and body["choices"][0]["text"] == expected
    assert served.engine.stats().speculation.verifies > before


@pytest.fixture(scope="module")
def turbo_folder(tmp_path_factory):
    adapters = tmp_path_factory.mktemp("turbo_on_a_model_without_verify")
    shutil.copytree(TURBO / "trained_heads", adapters / "turbo")
    return adapters


@pytest.mark.parametrize("draft_heads", [True, False])
def test_a_model_without_verify_signatures_serves_a_turbo_adapter_only_with_no_draft_heads(turbo_folder,
                                                                                             draft_heads):
    engine = Engine(NO_VERIFY, tokenizer=ByteTokenizer())
    server, thread, url = start_server(engine, turbo_folder, ServeSettings("tiny", api_key=None),
                                       draft_heads=draft_heads)
    served = Served(url, engine, turbo_folder)
    try:
        request = {"model": "turbo", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
        if draft_heads:
            skipped = served.call("/v1/models", key=None)[1]["skipped"]
            assert [entry["file"] for entry in skipped] == ["turbo"]
            assert "--verify-lengths" in skipped[0]["reason"] and "--no-draft-heads" in skipped[0]["reason"]
            status, body = served.call("/v1/load_lora_adapter", {"lora_name": "turbo", "lora_path": "turbo"},
                                       key=None)
            assert status == 409 and "--no-draft-heads" in body["error"]["message"], body
            assert served.call("/v1/completions", request, key=None)[0] == 404
            assert engine.adapter_ids() == []
        else:
            status, body = served.call("/v1/completions", request, key=None)
            assert status == 200 and body["choices"][0]["text"] == _offline(NO_VERIFY)
            assert engine.stats().speculation.verifies == 0
    finally:
        stop_server(server, thread)
        engine.close()


def test_the_serve_command_passes_no_draft_heads_to_the_catalog(turbo_folder):
    args = ["--model", str(NO_VERIFY), "--byte-tokens", "--adapters", str(turbo_folder), "--port", "0",
            "--strict-adapters"]
    process = serve_command(*args)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 2 and "--no-draft-heads" in err, err
    process = serve_command(*args, "--no-draft-heads")
    try:
        line = process.stdout.readline()  # printed once every adapter registered (strict: or it exits)
    finally:
        process.kill()
        process.communicate(timeout=20)
    assert "1 adapters: turbo" in line, line
