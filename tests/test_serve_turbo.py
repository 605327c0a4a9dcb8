"""The server with a Turbo LoRA adapter: it speculates with the draft heads without a flag,
answers what plain decoding answers, and /metrics reports the heads' work."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from conftest import MODELS  # noqa: E402
from runtime import ByteTokenizer, Engine, LoraSource, SessionConfig  # noqa: E402
from runtime.serve.app import ServeSettings  # noqa: E402
from test_serve import Served, metric, start_server, stop_server  # noqa: E402

TURBO = MODELS / "turbo"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    adapters = tmp_path_factory.mktemp("turbo_adapters")
    shutil.copytree(TURBO / "trained_heads", adapters / "turbo")
    engine = Engine(TURBO / "default.tflite", tokenizer=ByteTokenizer())
    server, thread, url = start_server(engine, adapters, ServeSettings("tiny", api_key=None))
    yield Served(url, engine, adapters)
    stop_server(server, thread)
    engine.close()


def test_completions_speculate_and_equal_plain_decoding(served):
    prompt = "".join(map(chr, [5, 17, 99]))
    with Engine(TURBO / "default.tflite", tokenizer=ByteTokenizer()) as offline:
        with offline.create_session(SessionConfig(loras=[LoraSource(path=TURBO / "trained_heads", heads=False)])) as s:
            expected = s.generate(prompt, max_new_tokens=24).text
    status, body = served.call("/v1/completions", {"model": "turbo", "prompt": prompt, "max_tokens": 24,
                                                   "temperature": 0}, key=None)
    assert status == 200 and body["choices"][0]["text"] == expected
    page = served.call("/metrics", key=None)[1]["text"]
    assert metric(page, "runtime_speculative_verifies_total") > 0
    assert metric(page, "runtime_speculative_accepted_total", head="0") > 0
    assert metric(page, "runtime_speculative_tokens_per_forward") > 1
