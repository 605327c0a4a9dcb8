"""The OpenAI-compatible server (runtime.serve), driven by the real ``openai`` client against
servers started on free loopback ports, on the bundled demo model.

Every greedy answer is compared with what ``Session.generate`` gives offline, on another
engine of the same model, for the same request; never with fixed strings (the demo model
may be retrained).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.server
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from runtime import ByteTokenizer, Engine, EngineSettings, LoraSource, SamplerConfig, SessionConfig  # noqa: E402
from runtime.cli.main import build_parser  # noqa: E402
from runtime.errors import StatusError  # noqa: E402
from runtime.serve.app import ServeSettings, create_app  # noqa: E402
from runtime.serve.catalog import AdapterCatalog  # noqa: E402
from runtime.serve.connection import uvicorn_config  # noqa: E402
from runtime.serve.download import DownloadPolicy  # noqa: E402
from runtime.adapters.lora_data import LoraData  # noqa: E402
from runtime.adapters.lora_writer import serialize_lora_tensors  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEMO = Path(str(resources.files("runtime") / "demo_assets"))
MODEL = DEMO / "model.tflite"
NEWLINE = 10
KEY = "test-key-0123"
TEMPLATE = '{{ messages[-1].content + "\\n" }}'  # the demo's prompt format: the line, then a newline
ADAPTERS = ("uppercase", "no_vowels", "json")
PROMPTS = ("hello world\n", "the cat sat\n", "green tea\n")
TINY_MODEL = ROOT / "tests" / "models" / "gqa_default.tflite"  # random weights, vocab 256, KV 64
TINY_ADAPTER_DIR = ROOT / "tests" / "models" / "adapters"
TINY_ADAPTERS = ("torch_r4", "litertlm_r4")


@dataclass
class Served:
    """A server running in a thread of this process."""

    url: str
    engine: Engine
    adapters: Path

    def client(self, key: str = KEY, **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=30, **options)

    def call(self, path: str, body: object = None, *, key: str | None = KEY, raw: bytes | None = None,
             method: str | None = None, content_type: str = "application/json") -> tuple[int, dict]:
        """A request without the openai client: status and JSON body."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        request = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", content_type)
        if key is not None:
            request.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                status, payload = response.status, response.read()
        except urllib.error.HTTPError as error:
            status, payload = error.code, error.read()
        try:
            return status, json.loads(payload)
        except json.JSONDecodeError:
            return status, {"text": payload.decode(errors="replace")}

    def live_sessions(self) -> int:
        return len(self.engine.stats().sessions)

    def wait_until_idle(self, seconds: float = 5.0) -> float:
        """Seconds until the server's engine has no live session (fails past ``seconds``)."""
        started = time.perf_counter()
        while self.live_sessions():
            assert time.perf_counter() - started < seconds, f"{self.live_sessions()} sessions still open"
            time.sleep(0.005)
        return time.perf_counter() - started


def start_server(engine: Engine, adapters: Path | None, settings: ServeSettings, **catalog_options):
    catalog = AdapterCatalog(engine, adapters, reserved_names=[settings.model_name], **catalog_options)
    catalog.scan()
    server = uvicorn.Server(uvicorn_config(create_app(engine, catalog, settings), settings, log_level="critical"))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{listener.getsockname()[1]}"


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one series on a Prometheus page (labels in any order)."""
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        metric_name, _, label_text = series.partition("{")
        if metric_name == name and dict(re.findall(r'(\w+)="([^"]*)"', label_text)) == labels:
            return float(value)
    return None


def stop_server(server, thread) -> None:
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    adapters = tmp_path_factory.mktemp("adapters")
    for name in ADAPTERS:
        shutil.copy(DEMO / "adapters" / f"{name}.tflite", adapters)
    engine = Engine(MODEL, EngineSettings(prefix_cache_bytes=1 << 20), tokenizer=ByteTokenizer(stop_token_ids=[NEWLINE]),
                    chat_template=TEMPLATE)  # a prefix cache, as `runtime serve` has by default
    server, thread, url = start_server(engine, adapters, ServeSettings("demo", api_key=KEY, max_concurrent=8),
                                       downloads=DownloadPolicy.of(["127.0.0.1"], max_bytes=200_000))
    yield Served(url, engine, adapters)
    stop_server(server, thread)
    engine.close()


class SlowByteTokenizer(ByteTokenizer):
    """Byte tokens, no stop token, and decoding that takes 50 ms: a generation lasts long
    enough for a test to act while it runs."""

    def decode(self, ids):
        time.sleep(0.05)
        return super().decode(ids)


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    """A server on the tiny test model (rank slots 4 and 16, so two rank-4 adapters blend)
    whose generations take ~50 ms a token, at most 2 running, no chat template."""
    adapters = tmp_path_factory.mktemp("slow_adapters")
    for name in TINY_ADAPTERS:
        shutil.copy(TINY_ADAPTER_DIR / f"{name}.tflite", adapters)
    engine = Engine(TINY_MODEL, tokenizer=SlowByteTokenizer())
    server, thread, url = start_server(engine, adapters, ServeSettings("slow", max_concurrent=2))
    yield Served(url, engine, adapters)
    stop_server(server, thread)
    engine.close()


def reference(model: Path, adapters: Path, stop_token_ids=(), chat_template=None):
    """Session.generate on another engine of the same model: the reference answers."""
    engine = Engine(model, tokenizer=ByteTokenizer(stop_token_ids=stop_token_ids), chat_template=chat_template)

    def generate(prompt, loras=(), max_tokens=16, **sampler):
        sources = [LoraSource(path=adapters / f"{name}.tflite", scale=scale) for name, scale in loras]
        with engine.create_session(SessionConfig(loras=sources)) as session:
            return session.generate(prompt, max_tokens, sampler=SamplerConfig(**sampler))

    generate.engine = engine
    return generate


@pytest.fixture(scope="module")
def offline():
    generate = reference(MODEL, DEMO / "adapters", [NEWLINE], TEMPLATE)
    yield generate
    generate.engine.close()


@pytest.fixture(scope="module")
def offline_tiny():
    generate = reference(TINY_MODEL, TINY_ADAPTER_DIR)
    yield generate
    generate.engine.close()


# -- answers equal offline ---------------------------------------------------------


def test_models_lists_the_base_and_every_adapter_with_its_parent(served):
    models = {m.id: m for m in served.client().models.list().data}
    assert set(models) == {"demo", *ADAPTERS}
    assert models["demo"].model_extra["parent"] is None
    for name in ADAPTERS:
        assert models[name].model_extra["parent"] == "demo"
        assert models[name].model_extra["root"] == str(served.adapters / f"{name}.tflite")


@pytest.mark.parametrize("model,loras", [("demo", ()), ("uppercase", [("uppercase", 1.0)]),
                                         ("demo::no_vowels", [("no_vowels", 1.0)]), ("json", [("json", 1.0)])])
def test_completion_equals_offline(served, offline, model, loras):
    client = served.client()
    for prompt in PROMPTS:
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=48, temperature=0)
        expected = offline(prompt, loras, 48)
        choice = answer.choices[0]
        assert choice.text == expected.text
        assert choice.finish_reason == ("stop" if expected.stop_reason == "stop_token" else "length")
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(prompt.encode()),
                                                                                len(expected.tokens))
        assert answer.model == model


def test_completion_from_token_ids_and_hitting_max_tokens(served, offline):
    ids = list(b"the cat sat\n")
    answer = served.client().completions.create(model="uppercase", prompt=ids, max_tokens=3, temperature=0)
    expected = offline(ids, [("uppercase", 1.0)], 3)
    assert answer.choices[0].text == expected.text and answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 3


def test_chat_equals_offline_through_the_template(served, offline):
    messages = [{"role": "system", "content": "joined to the user turn"}, {"role": "user", "content": "green tea"}]
    answer = served.client().chat.completions.create(model="demo::uppercase", messages=messages, temperature=0)
    prompt = offline.engine.chat_template.render(messages)
    assert prompt == "joined to the user turn\n\ngreen tea\n"  # the demo's template renders the last message only
    expected = offline(prompt, [("uppercase", 1.0)], 256 - len(prompt.encode()))  # default: the rest of the context
    assert answer.choices[0].message.content == expected.text
    assert answer.choices[0].message.role == "assistant"
    assert answer.usage.prompt_tokens == len(prompt.encode())


def test_streaming_completion_and_chat_equal_offline(served, offline):
    client = served.client()
    chunks = list(client.completions.create(model="json", prompt="green tea\n", max_tokens=60, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    expected = offline("green tea\n", [("json", 1.0)], 60)
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert len(pieces) > 2, "the text came in one piece, not streamed"
    assert "".join(pieces) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(expected.tokens) and not chunks[-1].choices

    stream = client.chat.completions.create(model="no_vowels", messages=[{"role": "user", "content": "my blue kite"}],
                                            max_tokens=40, temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == offline("my blue kite\n", [("no_vowels", 1.0)], 40).text


def test_a_blend_per_request_equals_offline(slow, offline_tiny):
    client = slow.client()
    prompt = [5, 17, 42]
    blend = [{"name": "torch_r4", "scale": 0.6}, {"name": "litertlm_r4", "scale": -0.4}]
    answer = client.completions.create(model="slow", prompt=prompt, max_tokens=6, temperature=0,
                                       extra_body={"lora": blend})
    expected = offline_tiny(prompt, [("torch_r4", 0.6), ("litertlm_r4", -0.4)], 6)
    assert answer.choices[0].text == expected.text and answer.usage.completion_tokens == 6
    assert expected.tokens != offline_tiny(prompt, [], 6).tokens  # the blend changes the answer
    # the model's adapter at scale 1 plus the lora list
    answer = client.completions.create(model="litertlm_r4", prompt=prompt, max_tokens=6, temperature=0,
                                       extra_body={"lora": [{"name": "torch_r4", "scale": 0.5}]})
    assert answer.choices[0].text == offline_tiny(prompt, [("litertlm_r4", 1.0), ("torch_r4", 0.5)], 6).text


def test_a_blend_beyond_the_models_rank_slots_is_refused(served):
    with pytest.raises(openai.BadRequestError, match="rank 16"):  # the demo model has rank-8 slots only
        served.client().completions.create(model="demo", prompt="hi\n", max_tokens=4, extra_body={
            "lora": [{"name": "uppercase", "scale": 0.5}, {"name": "json", "scale": 0.5}]})


def test_seeded_sampling_equals_offline(served, offline):
    client = served.client()
    for seed in (1, 2, 3):
        answer = client.completions.create(model="uppercase", prompt="the cat sat\n", max_tokens=20,
                                           temperature=1.3, top_p=0.95, seed=seed)
        expected = offline("the cat sat\n", [("uppercase", 1.0)], 20, temperature=1.3, top_p=0.95, seed=seed)
        assert answer.choices[0].text == expected.text


def test_stop_strings_end_the_text_before_them(served, offline):
    client = served.client()
    full = offline("hello world\n", [("json", 1.0)], 60).text
    stop = full[8:11]  # a stop string that appears part-way through the answer
    cut = full[: full.index(stop)]
    answer = client.completions.create(model="json", prompt="hello world\n", max_tokens=60, temperature=0,
                                       stop=[stop, "never appears"])
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == (cut, "stop")
    streamed = client.completions.create(model="json", prompt="hello world\n", max_tokens=60, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut


# -- adapters over HTTP ------------------------------------------------------------


def test_load_use_and_unload_an_adapter_from_a_path(served, offline):
    shutil.copy(DEMO / "adapters" / "uppercase.tflite", served.adapters / "shout.tflite")
    status, card = served.call("/v1/load_lora_adapter", {"lora_name": "shout", "lora_path": "shout.tflite"})
    assert status == 200 and (card["id"], card["parent"]) == ("shout", "demo")
    client = served.client()
    assert "shout" in {m.id for m in client.models.list().data}
    answer = client.completions.create(model="demo::shout", prompt="green tea\n", max_tokens=30, temperature=0)
    assert answer.choices[0].text == offline("green tea\n", [("uppercase", 1.0)], 30).text
    assert served.call("/v1/unload_lora_adapter", {"lora_name": "shout"}) == (
        200, {"id": "shout", "object": "model", "deleted": True})
    with pytest.raises(openai.NotFoundError, match="shout"):
        client.completions.create(model="shout", prompt="green tea\n", max_tokens=3)
    assert served.call("/v1/unload_lora_adapter", {"lora_name": "shout"})[0] == 404


@pytest.fixture(scope="module")
def files_on_loopback(tmp_path_factory):
    """A plain HTTP server on 127.0.0.1 serving a folder: where adapters are downloaded from."""
    folder = tmp_path_factory.mktemp("www")
    handler = functools.partial(_QuietHandler, directory=str(folder))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield folder, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_load_an_adapter_from_a_url(served, offline, files_on_loopback):
    folder, base_url = files_on_loopback
    blob = (DEMO / "adapters" / "no_vowels.tflite").read_bytes()
    (folder / "nv.bin").write_bytes(blob)
    digest = hashlib.sha256(blob).hexdigest()
    status, card = served.call("/v1/load_lora_adapter",
                               {"lora_name": "fetched", "url": f"{base_url}/nv.bin", "sha256": digest})
    assert status == 200, card
    assert (served.adapters / "fetched.tflite").read_bytes() == blob  # renamed into the catalog's folder
    answer = served.client().completions.create(model="fetched", prompt="the cat sat\n", max_tokens=30,
                                                temperature=0)
    assert answer.choices[0].text == offline("the cat sat\n", [("no_vowels", 1.0)], 30).text
    assert served.call("/v1/unload_lora_adapter", {"lora_name": "fetched"})[0] == 200


def test_a_download_that_fails_a_check_leaves_nothing_behind(served, files_on_loopback):
    folder, base_url = files_on_loopback
    blob = (DEMO / "adapters" / "json.tflite").read_bytes()
    (folder / "json.bin").write_bytes(blob)
    (folder / "big.bin").write_bytes(blob + bytes(100_000))  # past the fixture's 200,000-byte cap
    (folder / "text.bin").write_bytes(b"not an adapter at all")
    before = sorted(os.listdir(served.adapters))
    cases = [
        ({"url": f"{base_url}/json.bin", "sha256": "0" * 64}, 400, "is not the sha256 given"),
        ({"url": base_url.replace("127.0.0.1", "localhost") + "/json.bin", "sha256": "0" * 64}, 403,
         "are not allowed"),
        ({"url": f"{base_url}/big.bin", "sha256": hashlib.sha256(blob + bytes(100_000)).hexdigest()}, 400, "cap"),
        ({"url": f"{base_url}/missing.bin", "sha256": "0" * 64}, 400, "HTTP 404"),
        ({"url": f"{base_url}/text.bin", "sha256": hashlib.sha256(b"not an adapter at all").hexdigest()}, 400,
         "neither"),
        ({"url": f"file://{DEMO}/adapters/json.tflite", "sha256": "0" * 64}, 400, "http"),
        ({"url": f"{base_url}/json.bin"}, 400, "sha256"),
        ({"url": f"{base_url}/json.bin", "sha256": "xyz"}, 400, "64 hex"),
    ]
    for fields, status, words in cases:
        got, body = served.call("/v1/load_lora_adapter", {"lora_name": "broken", **fields})
        assert got == status and words in body["error"]["message"], (fields, body)
        assert hashlib.sha256(blob).hexdigest() not in body["error"]["message"]  # nothing about the body
    assert sorted(os.listdir(served.adapters)) == before  # no temporary file, no half-registered adapter
    assert "broken" not in {m.id for m in served.client().models.list().data}


def test_a_request_runs_the_adapter_checked_at_load_never_a_file_changed_since(served, offline):
    shutil.copy(DEMO / "adapters" / "json.tflite", served.adapters / "swapped.tflite")
    assert served.call("/v1/load_lora_adapter", {"lora_name": "swapped", "lora_path": "swapped.tflite"})[0] == 200
    ids = served.engine.adapter_ids()
    request = {"model": "swapped", "prompt": "green tea\n", "max_tokens": 20, "temperature": 0}
    assert served.call("/v1/completions", request)[1]["choices"][0]["text"] == offline("green tea\n", [("json", 1.0)], 20).text
    shutil.copy(DEMO / "adapters" / "uppercase.tflite", served.adapters / "swapped.tflite")
    status, body = served.call("/v1/completions", request)
    assert (status, body["error"]["type"]) == (409, "conflict_error") and "load it again" in body["error"]["message"]
    assert served.engine.adapter_ids() == ids  # nothing registered from the changed file
    assert served.call("/v1/unload_lora_adapter", {"lora_name": "swapped"})[0] == 200
    assert served.call("/v1/load_lora_adapter", {"lora_name": "swapped", "lora_path": "swapped.tflite"})[0] == 200
    expected = offline("green tea\n", [("uppercase", 1.0)], 20).text
    assert served.call("/v1/completions", request)[1]["choices"][0]["text"] == expected
    assert served.call("/v1/unload_lora_adapter", {"lora_name": "swapped"})[0] == 200
    (served.adapters / "swapped.tflite").unlink()


def stream_status(served, path: str, body: dict) -> tuple[int, str]:
    """Status and raw text of a streaming request."""
    request = urllib.request.Request(served.url + path, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_a_lone_surrogate_is_a_400_naming_the_field_streaming_or_not(served):
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi \ud800"}]}
    cases = [("/v1/completions", {"model": "demo", "prompt": "hi \ud800"}, "prompt"),
             ("/v1/completions", {"model": "demo", "prompt": ["\udfff"]}, "prompt.0"),
             ("/v1/chat/completions", chat, "messages.0.content"),
             ("/v1/chat/completions", {"model": "demo", "messages": [
                 {"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, "messages.0.content.0.text"),
             ("/v1/completions", {"model": "demo", "prompt": "hi", "stop": ["\ud800"]}, "stop.0")]
    for path, body, param in cases:
        raw = json.dumps(body).encode()  # json.dumps writes the surrogate as the escape \ud800
        status, answer = served.call(path, raw=raw)
        assert (status, answer["error"]["param"]) == (400, param), answer
        assert "surrogate" in answer["error"]["message"]
        status, text = stream_status(served, path, body)
        assert status == 400 and "surrogate" in text


def test_completions_default_to_16_tokens(slow):
    client = slow.client()
    assert client.completions.create(model="slow", prompt="x", temperature=0).usage.completion_tokens == 16
    prompt = "x" * (slow.engine.spec.kv_length - 15)  # room for 15
    status, body = slow.call("/v1/completions", {"model": "slow", "prompt": prompt})
    assert (status, body["error"]["param"], body["error"]["code"]) == (400, "prompt", "limit_exceeded")
    assert "+ 16 new tokens" in body["error"]["message"]


def test_vllm_sampling_extras_are_applied(served, offline):
    client = served.client()
    request = {"model": "uppercase", "prompt": "green tea\n", "max_tokens": 24, "temperature": 0}
    session_config = SessionConfig(loras=[LoraSource(path=DEMO / "adapters" / "uppercase.tflite")])
    with offline.engine.create_session(session_config) as session:
        no_eos = session.generate("green tea\n", 24, stop_tokens=()).text
    with offline.engine.create_session(session_config) as session:
        at_space = session.generate("green tea\n", 24, stop_tokens=[NEWLINE, ord(" ")]).text
    assert "\n" in no_eos.rstrip("\n")  # it went on past the stop token
    answer = client.completions.create(**request, extra_body={"ignore_eos": True})
    assert answer.choices[0].text == no_eos and answer.usage.completion_tokens == 24
    answer = client.completions.create(**request, extra_body={"stop_token_ids": [ord(" ")]})
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == (at_space, "stop")
    greedy = offline("green tea\n", [("uppercase", 1.0)], 24).text
    sampled = client.completions.create(**{**request, "temperature": 1.0}, seed=3, extra_body={"top_k": 1})
    assert sampled.choices[0].text == greedy  # top_k 1 is greedy at any temperature
    short = offline("hi\n", [], 24)
    assert len(short.tokens) < 8 and short.stop_reason == "stop_token"
    answer = client.completions.create(model="demo", prompt="hi\n", max_tokens=24, temperature=0,
                                       extra_body={"min_tokens": 8})
    assert answer.usage.completion_tokens >= 8 and "\n" not in answer.choices[0].text[:7]
    penalized = client.completions.create(**request, extra_body={"repetition_penalty": 50.0}).choices[0].text
    assert penalized != greedy


def test_fields_not_implemented_are_refused_never_ignored(served):
    good = {"model": "demo", "prompt": "hi\n", "max_tokens": 4}
    for extra, param in [({"min_p": 0.1}, "min_p"), ({"max_completion_tokens": 4}, "max_completion_tokens"),
                         ({"stream_options": {"include_usage": True}}, "stream_options"),
                         ({"min_tokens": 5}, "min_tokens"), ({"top_k": -2}, "top_k"),
                         ({"repetition_penalty": 0}, "repetition_penalty")]:
        status, body = served.call("/v1/completions", {**good, **extra})
        assert (status, body["error"]["param"]) == (400, param), body


def test_errors_name_the_field_and_always_have_a_code(served):
    status, body = served.call("/v1/completions", raw=b"\xff\xfe{")
    assert status == 400 and body["error"]["code"] == "invalid_body"
    status, body = served.call("/v1/chat/completions", {"model": "demo", "messages": [
        {"role": "user", "content": "x" * 300}]})
    assert (status, body["error"]["param"]) == (400, "messages")
    status, body = served.call("/v1/completions", {"model": "uppercase", "prompt": "hi", "max_tokens": 2,
                                                   "lora": [{"name": "json"}]})
    message = body["error"]["message"]
    assert (status, body["error"]["param"]) == (400, "lora")
    assert "'json' (rank 8, attention), 'uppercase' (rank 8, attention) need rank 16" in message and "[" not in message


def huge_adapter(source: Path, target: Path, factor: float = 1e18) -> None:
    """A copy of ``source`` with every weight times ``factor``: finite, and loadable, but
    the model's activations overflow."""
    with LoraData.create_from_file_path(source) as data:
        tensors = {name: data.read_tensor(name).astype(np.float32) * np.float32(factor)
                   for name in data.get_all_tensor_names()}
        rank = data.get_lora_rank()
    target.write_bytes(serialize_lora_tensors(tensors, external_data=False, lora_rank=rank))


def test_an_adapter_that_makes_non_finite_logits_is_a_4xx_logged_and_marked_unhealthy(served, caplog):
    huge_adapter(DEMO / "adapters" / "json.tflite", served.adapters / "huge.tflite")
    assert served.call("/v1/load_lora_adapter", {"lora_name": "huge", "lora_path": "huge.tflite"})[0] == 200
    try:
        request = {"model": "huge", "prompt": "hi\n", "max_tokens": 4}
        with caplog.at_level("WARNING", logger="runtime.serve"):
            status, body = served.call("/v1/completions", request)
        assert (status, body["error"]["code"], body["error"]["param"]) == (400, "non_finite_logits", "model")
        assert "'huge'" in body["error"]["message"]
        assert any("huge" in record.getMessage() for record in caplog.records)
        status, text = stream_status(served, "/v1/completions", request)
        assert status == 400 and "non_finite_logits" in text  # an error status, not 200 with an error event
        card = served.call("/v1/models/huge")[1]
        assert card["healthy"] is False and "non-finite" in card["problem"]
        assert served.call("/v1/models/json")[1]["healthy"] is True
        metrics = served.call("/metrics")[1]["text"]
        assert metric(metrics, "runtime_adapter_healthy", adapter="huge") == 0
        assert metric(metrics, "runtime_adapter_healthy", adapter="json") == 1
        served.wait_until_idle()
    finally:
        assert served.call("/v1/unload_lora_adapter", {"lora_name": "huge"})[0] == 200
        (served.adapters / "huge.tflite").unlink()


# -- safe by default ----------------------------------------------------------------


def test_keys_are_required_except_for_health(served):
    assert served.call("/health", key=None) == (200, {"status": "ok"})
    for key in (None, "wrong", KEY + "x", ""):
        status, body = served.call("/v1/models", key=key)
        assert (status, body["error"]["code"]) == (401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        served.client(key="wrong").completions.create(model="demo", prompt="hi", max_tokens=2)
    assert served.call("/metrics", key=None)[0] == 401


def test_path_checks_on_load(served, tmp_path):
    outside = tmp_path / "outside.tflite"
    shutil.copy(DEMO / "adapters" / "json.tflite", outside)
    (served.adapters / "escape.tflite").symlink_to(outside)
    (served.adapters / "sub").mkdir(exist_ok=True)
    os.mkfifo(served.adapters / "pipe.tflite")
    try:
        for lora_path, status in [("../outside.tflite", 403), (str(outside), 403), ("escape.tflite", 403),
                                  ("sub/../../outside.tflite", 403), ("pipe.tflite", 403), ("nothing.tflite", 404),
                                  ("sub", 400), ("bad\u0000name", 400)]:
            got, body = served.call("/v1/load_lora_adapter", {"lora_name": "probe", "lora_path": lora_path})
            assert (got, body["error"]["param"]) == (status, "lora_path"), (lora_path, body)
            assert body["error"]["message"]
    finally:
        (served.adapters / "escape.tflite").unlink()
        (served.adapters / "pipe.tflite").unlink()
        (served.adapters / "sub").rmdir()


def test_load_and_unload_errors_name_the_field(served, files_on_loopback):
    folder, base = files_on_loopback
    shutil.copy(DEMO / "adapters" / "json.tflite", served.adapters / "copy.tflite")
    shutil.copy(DEMO / "adapters" / "json.tflite", folder / "copy.tflite")
    other = "0" * 64  # a digest of none of these files
    load = "/v1/load_lora_adapter"
    try:
        for path, body, status, param in [
                (load, {"lora_name": "bad name", "lora_path": "copy.tflite"}, 400, "lora_name"),
                (load, {"lora_name": "demo", "lora_path": "copy.tflite"}, 409, "lora_name"),
                (load, {"lora_name": "json", "lora_path": "copy.tflite"}, 409, "lora_name"),
                (load, {"lora_name": "probe", "lora_path": "copy.tflite", "sha256": "xyz"}, 400, "sha256"),
                (load, {"lora_name": "probe", "lora_path": "copy.tflite", "sha256": other}, 400, "sha256"),
                (load, {"lora_name": "probe", "lora_path": "json.tflite"}, 409, "lora_path"),  # loaded as json
                (load, {"lora_name": "probe", "url": f"{base}/copy.tflite", "sha256": "xyz"}, 400, "sha256"),
                (load, {"lora_name": "probe", "url": f"{base}/copy.tflite", "sha256": other}, 400, "sha256"),
                (load, {"lora_name": "probe", "url": "ftp://127.0.0.1/copy.tflite", "sha256": other}, 400, "url"),
                (load, {"lora_name": "probe", "url": f"{base}/nothing.tflite", "sha256": other}, 400, "url"),
                ("/v1/unload_lora_adapter", {"lora_name": "nope"}, 404, "lora_name")]:
            got, answer = served.call(path, body)
            assert (got, answer["error"]["param"]) == (status, param), (body, answer)
        assert not (served.adapters / "probe.tflite").exists()
    finally:
        (served.adapters / "copy.tflite").unlink()


def _catalogue(served) -> list[tuple[str, dict]]:
    """(description, request) pairs of malformed requests, each answered with a 4xx."""
    completions = "/v1/completions"
    good = {"model": "demo", "prompt": "hi\n", "max_tokens": 4}
    return [
        ("bad JSON", {"path": completions, "raw": b'{"model": "demo", "prompt": '}),
        ("not an object", {"path": completions, "raw": b"[1, 2, 3]"}),
        ("form encoded", {"path": completions, "raw": b"model=demo", "content_type": "application/x-www-form-urlencoded"}),
        ("missing model", {"path": completions, "body": {"prompt": "hi"}}),
        ("model is a number", {"path": completions, "body": {**good, "model": 7}}),
        ("max_tokens as a string", {"path": completions, "body": {**good, "max_tokens": "5"}}),
        ("max_tokens as a float", {"path": completions, "body": {**good, "max_tokens": 5.5}}),
        ("negative max_tokens", {"path": completions, "body": {**good, "max_tokens": -1}}),
        ("zero max_tokens", {"path": completions, "body": {**good, "max_tokens": 0}}),
        ("huge max_tokens", {"path": completions, "body": {**good, "max_tokens": 10**30}}),
        ("huge temperature", {"path": completions, "raw": json.dumps({**good, "temperature": 1e308}).encode()}),
        ("infinite temperature", {"path": completions, "raw": b'{"model": "demo", "prompt": "hi", "temperature": 1e999}'}),
        ("NaN top_p", {"path": completions, "raw": b'{"model": "demo", "prompt": "hi", "top_p": NaN}'}),
        ("temperature as a string", {"path": completions, "body": {**good, "temperature": "hot"}}),
        ("huge seed", {"path": completions, "body": {**good, "seed": 2**70}}),
        ("negative seed", {"path": completions, "body": {**good, "seed": -1}}),
        ("stream as a string", {"path": completions, "body": {**good, "stream": "yes"}}),
        ("prompt as a number", {"path": completions, "body": {**good, "prompt": 5}}),
        ("empty prompt", {"path": completions, "body": {**good, "prompt": ""}}),
        ("token id outside the vocabulary", {"path": completions, "body": {**good, "prompt": [300, 1]}}),
        ("more prompts than --max-prompts", {"path": completions, "body": {**good, "prompt": ["a"] * 65}}),
        ("a token id outside the vocabulary in a list", {"path": completions, "body": {**good, "prompt": [[1], [256]]}}),
        ("n past --max-concurrent", {"path": completions, "body": {**good, "n": 17}}),
        ("logprobs past 20", {"path": completions, "body": {**good, "logprobs": 21}}),
        ("echo on a model without prefill logits", {"path": completions, "body": {**good, "echo": True}}),
        ("best_of below n", {"path": completions, "body": {**good, "n": 2, "best_of": 1}}),
        ("top_logprobs without logprobs", {"path": "/v1/chat/completions", "body": {
            "model": "demo", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}}),
        ("logit_bias outside the vocabulary", {"path": completions, "body": {**good, "logit_bias": {"256": 1}}}),
        ("presence_penalty past 2", {"path": completions, "body": {**good, "presence_penalty": 2.5}}),
        ("five stop strings", {"path": completions, "body": {**good, "stop": ["a", "b", "c", "d", "e"]}}),
        ("empty stop string", {"path": completions, "body": {**good, "stop": [""]}}),
        ("unknown model", {"path": completions, "body": {**good, "model": "gpt-4"}}),
        ("unknown base", {"path": completions, "body": {**good, "model": "other::uppercase"}}),
        ("unknown adapter after ::", {"path": completions, "body": {**good, "model": "demo::nope"}}),
        ("unknown adapter in lora", {"path": completions, "body": {**good, "lora": [{"name": "nope", "scale": 1}]}}),
        ("adapter twice", {"path": completions, "body": {**good, "model": "json", "lora": [{"name": "json"}]}}),
        ("lora scale too large", {"path": completions, "body": {**good, "lora": [{"name": "json", "scale": 1e300}]}}),
        ("lora with a wrong field", {"path": completions, "body": {**good, "lora": [{"id": 0, "scale": 1}]}}),
        ("lora name as a number", {"path": completions, "body": {**good, "lora": [{"name": 3}]}}),
        ("messages as a string", {"path": "/v1/chat/completions", "body": {"model": "demo", "messages": "hi"}}),
        ("no messages", {"path": "/v1/chat/completions", "body": {"model": "demo", "messages": []}}),
        ("unknown role", {"path": "/v1/chat/completions",
                          "body": {"model": "demo", "messages": [{"role": "wizard", "content": "hi"}]}}),
        ("image content", {"path": "/v1/chat/completions", "body": {"model": "demo", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}}),
        ("wrong key", {"path": completions, "body": good, "key": "nope"}),
        ("no key", {"path": completions, "body": good, "key": None}),
        ("unknown endpoint", {"path": "/v1/engines", "body": good}),
        ("GET on a POST endpoint", {"path": completions, "method": "GET"}),
        ("load: both path and url", {"path": "/v1/load_lora_adapter",
                                     "body": {"lora_name": "x", "lora_path": "a", "url": "http://127.0.0.1:1/"}}),
        ("load: a name taken", {"path": "/v1/load_lora_adapter", "body": {"lora_name": "json", "lora_path": "json.tflite"}}),
        ("load: the base's name", {"path": "/v1/load_lora_adapter", "body": {"lora_name": "demo", "lora_path": "json.tflite"}}),
        ("load: a bad name", {"path": "/v1/load_lora_adapter", "body": {"lora_name": "../x", "lora_path": "json.tflite"}}),
        ("load: the same file under a second name",
         {"path": "/v1/load_lora_adapter", "body": {"lora_name": "json2", "lora_path": "json.tflite"}}),
        ("load: traversal", {"path": "/v1/load_lora_adapter", "body": {"lora_name": "x", "lora_path": "../../etc/passwd"}}),
        ("load: not an adapter", {"path": "/v1/load_lora_adapter", "body": {"lora_name": "x", "lora_path": "/etc/passwd"}}),
        ("unload: unknown", {"path": "/v1/unload_lora_adapter", "body": {"lora_name": "nope"}}),
        ("unload: wrong type", {"path": "/v1/unload_lora_adapter", "body": {"lora_name": 5}}),
    ]


def test_malformed_requests_get_a_clear_4xx_and_do_not_disturb_others(served, offline):
    expected = offline("the cat sat\n", [("uppercase", 1.0)], 30).text
    answers: list[str] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def steady_client() -> None:  # good requests all along
        client = served.client()
        try:
            while not stop.is_set():
                request = {"model": "uppercase", "prompt": "the cat sat\n", "max_tokens": 30, "temperature": 0}
                if len(answers) % 2:
                    stream = client.completions.create(**request, stream=True)
                    answers.append("".join(chunk.choices[0].text for chunk in stream))
                else:
                    answers.append(client.completions.create(**request).choices[0].text)
        except BaseException as exc:  # reported below
            failures.append(exc)

    thread = threading.Thread(target=steady_client)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not answers and not failures and time.monotonic() < deadline:
            time.sleep(0.01)
        answered_before = len(answers)
        for description, request in _catalogue(served):
            path = request.pop("path")
            status, body = served.call(path, request.get("body"), key=request.get("key", KEY),
                                       raw=request.get("raw"), method=request.get("method"),
                                       content_type=request.get("content_type", "application/json"))
            assert 400 <= status < 500, (description, status, body)
            error = body.get("error", {})
            assert error.get("message") and error.get("type"), (description, body)
    finally:
        stop.set()
        thread.join(30)
    assert not failures, failures
    assert len(answers) > answered_before > 0 and set(answers) == {expected}
    assert served.call("/health") == (200, {"status": "ok"})
    served.wait_until_idle()


def test_a_json_body_sent_as_another_content_type_is_refused_naming_the_header(served):
    """curl -d sends form encoding unless told: the answer names the header, not the body."""
    request = {"model": "demo", "prompt": "hi", "max_tokens": 1}
    status, body = served.call("/v1/completions", request, content_type="application/x-www-form-urlencoded")
    assert status == 400 and body["error"]["code"] == "unsupported_content_type", body
    assert "Content-Type: application/json (it came with Content-Type: application/x-www-form-urlencoded)" in \
        body["error"]["message"]
    for content_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
        assert served.call("/v1/completions", request, content_type=content_type)[0] == 200, content_type
    status, body = served.call("/v1/completions", [1, 2])  # JSON, but not an object: named as such
    assert status == 400 and "must be a JSON object" in body["error"]["message"]


def test_the_tokenizer_info_endpoint_is_counted_under_its_own_name(served):
    served.call("/tokenizer_info")
    text = served.call("/metrics")[1]["text"]
    assert metric(text, "runtime_requests_total", endpoint="/tokenizer_info", status="200") >= 1


def test_a_body_past_the_cap_gets_413_before_it_is_read(served):
    port = int(served.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                           b"Authorization: Bearer " + KEY.encode() + b"\r\nConnection: close\r\n"
                           b"Content-Length: 2000000\r\n\r\n{")
        answer = connection.makefile("rb").read()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_the_catalogue_answers_with_the_numbers(served):
    status, body = served.call("/v1/completions", {"model": "demo", "prompt": "hi\n", "max_tokens": 10**30})
    message = body["error"]["message"]
    assert status == 400 and "3 prompt" in message and str(10**30) in message and "256" in message
    status, body = served.call("/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": -1})
    assert (status, body["error"]["param"]) == (400, "max_tokens")
    status, body = served.call("/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    assert (status, body["error"]["code"]) == (404, "model_not_found")


def test_chat_without_a_template_is_refused_clearly(slow):
    status, body = slow.call("/v1/chat/completions", {"model": "slow", "messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and "--chat-template" in body["error"]["message"]


def test_a_client_that_goes_away_frees_its_session_at_once(slow):
    client = slow.client()
    stream = client.completions.create(model="torch_r4", prompt="hello\n", max_tokens=50, temperature=0,
                                       stream=True)
    next(iter(stream))
    assert slow.live_sessions() == 1
    stream.close()  # mid-stream: 50 tokens at ~50 ms each would take 2.5 s
    assert slow.wait_until_idle(seconds=1.0) < 1.0
    # the same for a request that does not stream
    with socket.create_connection(("127.0.0.1", int(slow.url.rsplit(":", 1)[1]))) as connection:
        body = json.dumps({"model": "slow", "prompt": "hello\n", "max_tokens": 50}).encode()
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 5
        while not slow.live_sessions():
            assert time.monotonic() < deadline
            time.sleep(0.005)
    assert slow.wait_until_idle(seconds=1.0) < 1.0
    metrics = slow.call("/metrics")[1]["text"]
    for model in ("torch_r4", "slow"):
        assert metric(metrics, "runtime_generations_total", model=model, finish_reason="cancelled") == 1


def test_a_prompt_that_fails_stops_the_other_prompts_of_its_request_at_once(slow):
    def cancelled():
        return metric(slow.call("/metrics")[1]["text"], "runtime_generations_total", model="slow",
                      finish_reason="cancelled") or 0

    before = cancelled()
    # prompt.0 cannot fit the context; prompt.1's 40 tokens at ~50 ms each would take 2 s for nobody
    status, body = slow.call("/v1/completions", {"model": "slow", "prompt": ["x" * 70, "hello\n"], "max_tokens": 40},
                             key=None)
    assert (status, body["error"]["param"]) == (400, "prompt.0")
    assert cancelled() == before + 1
    slow.wait_until_idle()


def test_more_than_max_concurrent_gets_429_and_unloading_in_use_gets_409(slow):
    client = slow.client()
    streams = [client.completions.create(model="torch_r4", prompt="hi\n", max_tokens=50, stream=True)
               for _ in range(2)]
    for stream in streams:
        next(iter(stream))
    with pytest.raises(openai.RateLimitError, match="max-concurrent") as refused:
        client.completions.create(model="slow", prompt="hi\n", max_tokens=2)
    assert refused.value.response.headers["Retry-After"] == "1"
    status, body = slow.call("/v1/unload_lora_adapter", {"lora_name": "torch_r4"})
    assert (status, body["error"]["type"]) == (409, "conflict_error") and "2 running" in body["error"]["message"]
    for stream in streams:
        stream.close()
    slow.wait_until_idle()
    assert client.completions.create(model="slow", prompt="hi\n", max_tokens=2).usage.completion_tokens == 2
    assert slow.call("/v1/unload_lora_adapter", {"lora_name": "torch_r4"})[0] == 200


def test_shutting_down_ends_running_generations_with_a_503_at_once_and_leaves_no_worker(tmp_path):
    shutil.copy(TINY_ADAPTER_DIR / "torch_r4.tflite", tmp_path)
    others = set(threading.enumerate())  # the other servers' workers
    engine = Engine(TINY_MODEL, tokenizer=SlowByteTokenizer())
    server, thread, url = start_server(engine, tmp_path, ServeSettings("slow", max_concurrent=2))
    served = Served(url, engine, tmp_path)
    try:
        chunks = iter(served.client().completions.create(model="torch_r4", prompt="hello\n", max_tokens=50,
                                                         stream=True))
        next(chunks)
        whole = []
        waiting = threading.Thread(target=lambda: whole.append(
            served.call("/v1/completions", {"model": "slow", "prompt": "hello\n", "max_tokens": 50}, key=None)))
        waiting.start()
        deadline = time.monotonic() + 5
        while served.live_sessions() < 2:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        started = time.perf_counter()
        stop_server(server, thread)  # 50 tokens at ~50 ms each would take 2.5 s
        assert not thread.is_alive() and time.perf_counter() - started < 1.0
        with pytest.raises(openai.APIError, match="shutting down"):
            list(chunks)  # an error event ends the stream
        waiting.join()
        status, body = whole[0]
        assert (status, body["error"]["type"], body["error"]["code"]) == (503, "server_error", "unavailable")
        assert not served.live_sessions()
        assert not [t.name for t in set(threading.enumerate()) - others if t.name.startswith("serve-request")]
    finally:
        engine.close()


def test_metrics_report_adapters_and_requests(served):
    before = served.call("/metrics")[1]["text"]
    answer = served.client().completions.create(model="uppercase", prompt="the cat sat\n", max_tokens=5,
                                                temperature=0)
    status, body = served.call("/metrics")
    text = body["text"]
    stats = served.engine.stats()
    assert status == 200

    def grew(name: str, **labels: str) -> float:
        return metric(text, name, **labels) - (metric(before, name, **labels) or 0)

    adapters = {Path(adapter.source).stem: adapter for adapter in stats.adapters}
    uppercase = adapters["uppercase"]
    assert metric(text, "runtime_adapter_resident", adapter="uppercase") == 1
    assert metric(text, "runtime_adapter_resident_bytes", adapter="uppercase") == uppercase.resident_bytes > 0
    assert metric(text, "runtime_adapter_tensor_bytes", adapter="uppercase") == uppercase.tensor_bytes > 0
    assert metric(text, "runtime_adapter_sessions", adapter="json") == 0
    assert metric(text, "runtime_adapter_load_seconds", adapter="no_vowels") > 0
    assert metric(text, "runtime_adapter_switch_total") == stats.switch.count
    assert metric(text, "runtime_adapter_switch_seconds", quantile="0.5") == pytest.approx(stats.switch.p50_ms / 1e3)
    assert metric(text, "runtime_residency_hits_total") == stats.residency_hits
    assert grew("runtime_generated_tokens_total", model="uppercase") == answer.usage.completion_tokens == 5
    assert grew("runtime_prompt_tokens_total", model="uppercase") == answer.usage.prompt_tokens == 12
    assert grew("runtime_generations_total", model="uppercase", finish_reason="length") == 1
    assert grew("runtime_requests_total", endpoint="/v1/completions", status="200") == 1
    assert metric(text, "runtime_running_requests") == 0
    for name in ("runtime_queue_wait_seconds_count", "runtime_time_to_first_token_seconds_count",
                 "runtime_running_requests_at_admission_count", "runtime_decode_tokens_per_second_count"):
        assert grew(name) == 1, name
    # batched decode: the demo model has no batched signatures, so no batches (but the series exist)
    assert "# TYPE runtime_decode_batches_total counter" in text
    assert metric(text, "runtime_decode_batch_wait_seconds", quantile="0.99") == 0


def test_a_request_ending_after_its_adapter_was_unloaded_leaves_no_series_behind(tmp_path):
    """A request records its outcome after its job released the adapter, so an unload can
    come in between: the adapter's series, dropped by the unload, must not come back."""
    from runtime.serve.generation import Outcome
    from runtime.serve.metrics import ServerMetrics

    shutil.copy(DEMO / "adapters" / "uppercase.tflite", tmp_path)
    outcome = Outcome("HI", "length", prompt_tokens=3, completion_tokens=2, queue_wait_s=0.0,
                      time_to_first_token_s=0.01, decode_tokens_per_s=100.0)
    with Engine(MODEL, tokenizer=ByteTokenizer()) as engine:
        catalog = AdapterCatalog(engine, tmp_path, reserved_names=["demo"])
        catalog.scan()
        metrics = ServerMetrics(engine, catalog, "demo", lambda: 0)
        metrics.record(["uppercase"], outcome)
        metrics.record([], outcome)
        assert metric(metrics.render().decode(), "runtime_generated_tokens_total", model="uppercase") == 2
        catalog.unload("uppercase")
        metrics.forget("uppercase")
        metrics.record(["uppercase"], outcome)  # the late request
        page = metrics.render().decode()
        assert 'model="uppercase"' not in page
        assert metric(page, "runtime_generated_tokens_total", model="demo") == 2
        assert metric(page, "runtime_queue_wait_seconds_count") == 3  # the request itself still counts


def test_prompts_beginning_alike_start_from_the_cached_head_and_answer_as_offline(served):
    preamble = "Repeat the line that follows, as the adapter does. "
    before = served.call("/metrics")[1]["text"]
    answers = [served.client().completions.create(model="uppercase", prompt=preamble + line, max_tokens=8,
                                                  temperature=0).choices[0].text for line in PROMPTS]
    text = served.call("/metrics")[1]["text"]

    def grew(name: str) -> float:
        return metric(text, name) - (metric(before, name) or 0)

    assert grew("runtime_prefix_cache_hits_total") >= len(PROMPTS) - 1
    assert grew("runtime_prefix_cache_reused_tokens_total") >= (len(PROMPTS) - 1) * len(preamble)
    assert metric(text, "runtime_prefix_cache_bytes") > 0
    with Engine(MODEL, tokenizer=ByteTokenizer(stop_token_ids=[NEWLINE])) as offline:
        source = LoraSource(path=served.adapters / "uppercase.tflite")
        for line, answer in zip(PROMPTS, answers):
            with offline.create_session(SessionConfig(loras=[source])) as session:
                assert session.generate(preamble + line, 8).text.rstrip("\n") == answer.rstrip("\n")


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A server on the tiny model with short time limits (0.5 s), loopback names only, an
    adapters directory holding one adapter and one file that is not an adapter."""
    adapters = tmp_path_factory.mktemp("guarded_adapters")
    shutil.copy(TINY_ADAPTER_DIR / "torch_r4.tflite", adapters)
    (adapters / "garbage.gguf").write_bytes(b"not a gguf file")
    engine = Engine(TINY_MODEL, tokenizer=ByteTokenizer())
    settings = ServeSettings("tiny", max_concurrent=1, header_timeout_s=0.5, idle_timeout_s=0.5)
    server, thread, url = start_server(engine, adapters, settings)
    yield Served(url, engine, adapters)
    stop_server(server, thread)
    engine.close()


def raw_exchange(served: Served, request: bytes, wait: float = 5.0) -> bytes:
    """Sends ``request`` as it is and returns all the server answers until it closes."""
    with socket.create_connection(("127.0.0.1", int(served.url.rsplit(":", 1)[1])), timeout=wait) as connection:
        connection.sendall(request)
        chunks = []
        while chunk := connection.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_only_loopback_host_names_are_answered_by_default_against_dns_rebinding(guarded):
    head = b"GET /v1/models HTTP/1.1\r\nConnection: close\r\n"
    for host in (b"127.0.0.1", b"localhost:8000", b"[::1]:1"):
        assert raw_exchange(guarded, head + b"Host: " + host + b"\r\n\r\n").startswith(b"HTTP/1.1 200")
    answer = raw_exchange(guarded, head + b"Host: attacker.example\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 403") and b"host_not_allowed" in answer
    body = b'{"lora_name": "x", "lora_path": "torch_r4.tflite"}'
    post = (b"POST /v1/load_lora_adapter HTTP/1.1\r\nHost: attacker.example:" + guarded.url.rsplit(":", 1)[1].encode()
            + b"\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    assert raw_exchange(guarded, post).startswith(b"HTTP/1.1 403")
    assert "x" not in {card["id"] for card in guarded.call("/v1/models")[1]["data"]}


def test_a_page_of_another_site_cannot_call_but_the_servers_own_page_can(guarded):
    port = guarded.url.rsplit(":", 1)[1].encode()
    head = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:" + port + b"\r\nConnection: close\r\n"
    own = raw_exchange(guarded, head + b"Origin: http://127.0.0.1:" + port + b"\r\n\r\n")
    assert own.startswith(b"HTTP/1.1 200")
    for origin in (b"http://attacker.example", b"null", b"http://127.0.0.1.attacker.example:" + port):
        answer = raw_exchange(guarded, head + b"Origin: " + origin + b"\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 403") and b"origin_not_allowed" in answer, origin


def test_half_sent_requests_and_idle_connections_are_closed(guarded):
    started = time.monotonic()
    assert raw_exchange(guarded, b"") == b""  # idle from the start
    assert raw_exchange(guarded, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ") == b""  # half a head
    assert time.monotonic() - started < 3
    answer = raw_exchange(guarded, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                   b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"")
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer  # half a body
    kept = raw_exchange(guarded, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # kept alive, then idle
    assert kept.startswith(b"HTTP/1.1 200") and time.monotonic() - started < 5


def test_vllm_and_llama_server_endpoints(guarded):
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="none", max_retries=0)
    card = client.models.retrieve("torch_r4")
    assert (card.id, card.parent, card.max_model_len) == ("torch_r4", "tiny", guarded.engine.spec.kv_length)
    assert client.models.retrieve("tiny").max_model_len == guarded.engine.spec.kv_length
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    listing = guarded.call("/v1/models")[1]
    assert listing["skipped"] == [{"file": "garbage.gguf", "reason": listing["skipped"][0]["reason"]}]
    assert "garbage.gguf" in listing["skipped"][0]["reason"]
    request = urllib.request.Request(guarded.url + "/health", method="HEAD")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200 and response.read() == b""
    status, tokens = guarded.call("/tokenize", {"model": "torch_r4", "prompt": "héllo"})
    assert status == 200 and tokens == {"count": 6, "max_model_len": guarded.engine.spec.kv_length,
                                        "tokens": list("héllo".encode()), "token_strs": None}
    assert guarded.call("/detokenize", {"tokens": tokens["tokens"]}) == (200, {"prompt": "héllo"})
    status, body = guarded.call("/detokenize", {"tokens": [1, 256]})
    assert (status, body["error"]["param"]) == (400, "tokens.1")
    assert guarded.call("/tokenize", {"model": "nope", "prompt": "x"})[0] == 404


# -- the command -------------------------------------------------------------------


def serve_command(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "runtime", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def test_the_serve_command_refuses_bad_input_with_one_line():
    process = serve_command("--model", str(MODEL))
    out, err = process.communicate(timeout=60)
    assert process.returncode == 2 and err.startswith("error:") and "needs a tokenizer" in err, err
    assert err.count("\n") == 1


@pytest.mark.parametrize("args,words", [
    (["--byte-tokens", "--adapters", "/no/such/dir"], "/no/such/dir"),
    (["--stop-token", "10"], "--stop-token goes with --byte-tokens"),
    (["--byte-tokens", "--chat-template", "/no/such.jinja"], "/no/such.jinja"),
    (["--byte-tokens", "--max-concurrent", "0"], "max_concurrent"),
    (["--byte-tokens", "--port", "70000"], "--port"),
    (["--byte-tokens", "--allowed-hosts", "a/b"], "--allowed-hosts"),
    (["--byte-tokens", "--allow-download-from", "host:99999"], "--allow-download-from"),
    (["--byte-tokens", "--download-timeout", "0"], "download_timeout_s"),
    (["--byte-tokens", "--header-timeout", "0"], "header_timeout_s"),
    (["--byte-tokens", "--prefix-cache-mb", "-1"], "--prefix-cache-mb -1.0: expected 0 or more"),
    (["--byte-tokens", "--prefix-cache-mb", "nan"], "--prefix-cache-mb nan"),
    (["--byte-tokens", "--prefix-cache-mb", "inf"], "--prefix-cache-mb inf"),
])
def test_the_serve_command_checks_its_arguments(args, words):
    parsed = build_parser().parse_args(["serve", "--model", str(MODEL), *args])
    with pytest.raises(StatusError, match=re.escape(words)):
        parsed.run(parsed)


def test_the_serve_command_skips_unreadable_adapters_with_a_warning_unless_strict(tmp_path):
    shutil.copy(DEMO / "adapters" / "json.tflite", tmp_path)
    (tmp_path / "garbage.gguf").write_bytes(b"not an adapter")
    args = ["--model", str(MODEL), "--byte-tokens", "--adapters", str(tmp_path), "--port", "0"]
    process = serve_command(*args)
    try:
        line = process.stdout.readline()
        assert "1 adapters: json" in line
        url = re.search(r"http://127\.0\.0\.1:\d+", line).group(0)
        deadline = time.monotonic() + 20
        while True:  # serving: uvicorn handles SIGINT from here on
            try:
                urllib.request.urlopen(url + "/health", timeout=5).close()
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=20)
    assert process.returncode == 0 and "warning: skipped adapter garbage.gguf: " in err, err
    process = serve_command(*args, "--strict-adapters")
    _, err = process.communicate(timeout=60)
    assert process.returncode == 2 and err.startswith("error:") and "garbage.gguf" in err, err


def test_the_api_key_may_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("RUNTIME_API_KEY", "from-env")
    assert build_parser().parse_args(["serve", "--model", "m"]).api_key == "from-env"
    assert build_parser().parse_args(["serve", "--model", "m", "--api-key", "k"]).api_key == "k"


def test_serve_without_the_extra_says_what_to_install():
    code = ("import sys; sys.modules['uvicorn'] = None; sys.modules['fastapi'] = None\n"
            "import runtime, runtime.cli.main\n"
            f"sys.exit(runtime.cli.main.main(['serve', '--model', {str(MODEL)!r}, '--byte-tokens']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "pip install 'runtime[serve]'" in done.stderr, done.stderr


SERVING_PAGES = {"docs": ROOT / "docs" / "serving.md", "readme": ROOT / "README.md"}


@pytest.mark.parametrize("page", sorted(SERVING_PAGES))
def test_the_serving_examples_run_as_written(page, tmp_path, offline):
    text = SERVING_PAGES[page].read_text()
    if page == "readme":
        text = text.split("## Serving", 1)[1].split("\n## ", 1)[0]
    setup, curl = re.findall(r"```sh\n(.*?)```", text, re.S)
    clients = re.findall(r"```py\n(.*?)```", text, re.S)
    lines = [line.split("  #")[0] for line in setup.replace("\\\n", " ").splitlines() if "pip install" not in line]
    *prepare, serve = lines
    # The recipe's own shell lines, then the path they chose: never inside the checkout.
    chosen = subprocess.run(["bash", "-c", "\n".join(prepare) + '\nprintf %s "$template"'], check=True, cwd=tmp_path,
                            capture_output=True, text=True).stdout
    assert Path(chosen).is_file() and not Path(chosen).resolve().is_relative_to(ROOT)
    command = serve.replace('"$template"', chosen).split() + ["--port", "0"]
    assert command[:3] == ["python3", "-m", "runtime"]
    process = subprocess.Popen([sys.executable, *command[1:]], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                               stderr=subprocess.PIPE)
    try:
        line = process.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+", line).group(0)
        assert "4 adapters: json, no_vowels, uppercase, uppercase_litertlm" in line and "API key required" in line
        if shutil.which("curl"):
            done = subprocess.run(["bash", "-c", curl.replace("http://127.0.0.1:8000", url)], capture_output=True,
                                  text=True, timeout=60, check=True)
            text = json.loads(done.stdout)["choices"][0]["text"]
            assert text == offline("hello world\n", [("uppercase", 1.0)], 32).text
        for client_code in clients:
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(client_code.replace("http://127.0.0.1:8000", url), {})
            chat_prompt = "my blue kite\n"
            assert printed.getvalue().splitlines() == [offline("green tea\n", [("no_vowels", 1.0)], 32).text,
                                                 offline(chat_prompt, [("json", 1.0)], 256 - len(chat_prompt)).text]
        assert len(clients) == (1 if page == "docs" else 0)
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(20) == 0


def test_a_dora_adapter_in_a_blend_is_refused_before_anything_runs(tmp_path):
    """The server asks the engine's slot rule, so a blend the model cannot run (a DoRA
    adapter with another) is a 400 naming both, not a generic error once it runs."""
    family = ROOT / "tests" / "models" / "families" / "llama"
    adapters = tmp_path / "adapters"
    for name in ("adapter", "adapter_dora"):
        shutil.copytree(family / name, adapters / name)
    class AnyIdTokenizer(ByteTokenizer):  # the family model's random weights answer with ids past 255
        def decode(self, ids):
            return "".join(chr(0x100 + token) for token in ids)

    with Engine(family / "model.tflite", tokenizer=AnyIdTokenizer()) as engine:
        server, thread, url = start_server(engine, adapters, ServeSettings("family"))
        try:
            served = Served(url, engine, adapters)
            status, body = served.call("/v1/completions", {"model": "adapter_dora", "prompt": "hi", "max_tokens": 2,
                                                           "lora": [{"name": "adapter", "scale": 0.5}]}, key=None)
            assert (status, body["error"]["code"], body["error"]["param"]) == (400, "no_lora_slot", "lora")
            assert "adapter_dora" in body["error"]["message"] and "cannot be blended" in body["error"]["message"]
            status, body = served.call("/v1/completions", {"model": "adapter_dora", "prompt": "hi", "max_tokens": 2},
                                       key=None)
            assert status == 200 and body["choices"][0]["text"] is not None, body  # alone it runs
        finally:
            stop_server(server, thread)
