"""Tests for runtime.serve.choices through the server: prompt lists, n and best_of, echo and
logprobs (what lm-eval's local-completions sends), chat logprobs, penalties and logit
bias, each answer compared with the engine offline."""

from __future__ import annotations

import json
import shutil
import urllib.request

import numpy as np
import pytest

pytest.importorskip("uvicorn")

from runtime import ByteTokenizer, Engine, SamplerConfig, SessionConfig, LoraSource  # noqa: E402
from runtime.components.tokenizer import SentencePieceTokenizer  # noqa: E402
from runtime.serve.app import ServeSettings  # noqa: E402
from runtime.serve.logprobs import log_softmax  # noqa: E402
from test_serve import (  # noqa: E402
    ADAPTERS, DEMO, MODEL, NEWLINE, TEMPLATE, TINY_MODEL, Served, start_server, stop_server, stream_status,
)

ROOT_MODELS = TINY_MODEL.parent


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The demo model, its adapters, echo by decode steps (it has no prefill logits)."""
    adapters = tmp_path_factory.mktemp("adapters")
    for name in ADAPTERS:
        shutil.copy(DEMO / "adapters" / f"{name}.tflite", adapters)
    engine = Engine(MODEL, tokenizer=ByteTokenizer(stop_token_ids=[NEWLINE]), chat_template=TEMPLATE)
    server, thread, url = start_server(engine, adapters, ServeSettings("demo", max_concurrent=8, max_prompts=4,
                                                                       score_by_decode=True))
    yield Served(url, engine, adapters)
    stop_server(server, thread)
    engine.close()


@pytest.fixture(scope="module")
def offline():
    engine = Engine(MODEL, tokenizer=ByteTokenizer(stop_token_ids=[NEWLINE]))
    yield engine
    engine.close()


def session(engine, adapter=None):
    loras = [LoraSource(path=DEMO / "adapters" / f"{adapter}.tflite")] if adapter else []
    return engine.create_session(SessionConfig(loras=loras))


def offline_logprobs(engine, tokens, adapter=None) -> np.ndarray:
    """log-softmax of the engine's logits after each token (decode steps: the reference)."""
    with session(engine, adapter) as s:
        return log_softmax(s.score(tokens, decode_steps=True))


def ok(served, path, body):
    status, answer = served.call(path, body, key=None)
    assert status == 200, answer
    return answer


@pytest.mark.parametrize("adapter", [None, *ADAPTERS])
def test_lm_eval_s_loglikelihood_request_equals_the_engine_s_log_softmax(served, offline, adapter):
    """lm-eval's payload: token-id lists, echo, logprobs 1, max_tokens 1; one choice per
    prompt in order, the prompt's logprobs (the first null) and the generated token's."""
    prompts = [list(b"hello world\nHELLO"), list(b"green tea\ngreen")]
    answer = ok(served, "/v1/completions", {"model": adapter or "demo", "prompt": prompts, "temperature": 0,
                                            "max_tokens": 1, "logprobs": 1, "echo": True, "seed": 1234})
    assert [choice["index"] for choice in answer["choices"]] == [0, 1]
    for prompt, choice in zip(prompts, answer["choices"]):
        logprobs = choice["logprobs"]
        reference = offline_logprobs(offline, prompt, adapter)
        greedy = int(np.argmax(reference[-1]))
        tokens = prompt + [greedy]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        expected = [float(reference[i - 1][tokens[i]]) for i in range(1, len(tokens))]
        np.testing.assert_allclose(logprobs["token_logprobs"][1:], expected, rtol=0, atol=1e-9)
        assert logprobs["tokens"] == [bytes([t]).decode("utf-8", "replace") for t in tokens]
        assert logprobs["text_offset"] == list(range(len(tokens)))
        for position, top in enumerate(logprobs["top_logprobs"][1:], start=1):
            best = int(np.argmax(reference[position - 1]))
            assert max(top.values()) == pytest.approx(float(reference[position - 1][best]), abs=1e-9)
        assert choice["text"] == bytes(tokens).decode()
    assert answer["usage"]["prompt_tokens"] == sum(map(len, prompts))


def test_echo_with_max_tokens_0_scores_the_prompt_alone(served, offline):
    answer = ok(served, "/v1/completions", {"model": "json", "prompt": "green tea\n", "max_tokens": 0,
                                            "echo": True, "logprobs": 0})
    choice = answer["choices"][0]
    assert choice["text"] == "green tea\n" and answer["usage"]["completion_tokens"] == 0
    reference = offline_logprobs(offline, list(b"green tea\n"), "json")
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"][1:],
                               [reference[i - 1][t] for i, t in enumerate(b"green tea\n") if i], atol=1e-9)


def test_a_list_of_prompts_answers_each_in_order_as_offline(served, offline):
    prompts = ["hello world\n", "green tea\n", "the cat sat\n"]
    answer = ok(served, "/v1/completions", {"model": "uppercase", "prompt": prompts, "max_tokens": 20,
                                            "temperature": 0})
    for prompt, choice in zip(prompts, answer["choices"]):
        with session(offline, "uppercase") as s:
            assert choice["text"] == s.generate(prompt, 20).text
    assert answer["usage"]["prompt_tokens"] == sum(map(len, prompts))


def test_n_choices_are_seeded_runs_and_generated_logprobs_are_the_model_s(served, offline):
    body = {"model": "demo", "prompt": "hello world\n", "max_tokens": 8, "temperature": 1.5, "seed": 7, "n": 3,
            "logprobs": 2}
    first, again = ok(served, "/v1/completions", body), ok(served, "/v1/completions", body)
    assert first["choices"] == again["choices"]
    one = ok(served, "/v1/completions", {**body, "n": 1})
    assert one["choices"][0]["text"] == first["choices"][0]["text"]
    for index, choice in enumerate(first["choices"]):
        assert choice["index"] == index
        with session(offline) as s:
            result = s.generate("hello world\n", 8, sampler=SamplerConfig(temperature=1.5, seed=7 + index))
        assert choice["text"] == result.text
        reference = offline_logprobs(offline, list(b"hello world\n") + result.tokens)
        expected = [reference[len(b"hello world\n") - 1 + i][t] for i, t in enumerate(result.tokens)]
        np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], expected, atol=1e-9)
        assert all(len(top) in (2, 3) for top in choice["logprobs"]["top_logprobs"])
    assert first["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in first["choices"])


def test_best_of_answers_the_run_with_the_highest_logprob(served):
    body = {"model": "demo", "prompt": "green tea\n", "max_tokens": 6, "temperature": 2.0, "seed": 3}
    runs = ok(served, "/v1/completions", {**body, "n": 4, "logprobs": 0})["choices"]
    best = max(runs, key=lambda c: sum(c["logprobs"]["token_logprobs"]))
    answer = ok(served, "/v1/completions", {**body, "best_of": 4})
    assert [c["text"] for c in answer["choices"]] == [best["text"]] and answer["choices"][0]["logprobs"] is None
    assert answer["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in runs)


def test_chat_logprobs_and_n(served, offline):
    body = {"model": "no_vowels", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 20,
            "temperature": 0, "logprobs": True, "top_logprobs": 2, "n": 2}
    answer = ok(served, "/v1/chat/completions", body)
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    with session(offline, "no_vowels") as s:
        result = s.generate("hello world\n", 20)
    reference = offline_logprobs(offline, list(b"hello world\n") + result.tokens, "no_vowels")
    for choice in answer["choices"]:
        assert choice["message"]["content"] == result.text
        content = choice["logprobs"]["content"]
        assert [item["token"] for item in content] == [chr(t) for t in result.tokens]
        np.testing.assert_allclose([item["logprob"] for item in content],
                                   [reference[11 + i][t] for i, t in enumerate(result.tokens)], atol=1e-9)
        assert all(len(item["top_logprobs"]) == 2 for item in content)
        assert content[0]["top_logprobs"][0]["token"] == content[0]["token"]  # greedy: the top one


def test_logit_bias_and_penalties_are_the_core_sampler_s(served, offline):
    body = {"model": "demo", "prompt": "hello world\n", "max_tokens": 12, "temperature": 0,
            "logit_bias": {str(ord("l")): -100}, "presence_penalty": 1.5, "frequency_penalty": 0.5}
    answer = ok(served, "/v1/completions", body)
    with session(offline) as s:
        expected = s.generate("hello world\n", 12, sampler=SamplerConfig(
            logit_bias={ord("l"): -100.0}, presence_penalty=1.5, frequency_penalty=0.5))
    assert answer["choices"][0]["text"] == expected.text and "l" not in expected.text


def test_streams_of_several_choices_equal_the_whole_answers(served):
    body = {"model": "json", "prompt": ["hello world\n", "green tea\n"], "max_tokens": 30, "temperature": 0,
            "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(served.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    texts: dict[int, str] = {}
    finished, usage = set(), None
    with urllib.request.urlopen(request, timeout=30) as response:
        for line in response.read().decode().splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                if choice["finish_reason"]:
                    finished.add(choice["index"])
    whole = ok(served, "/v1/completions", {**body, "stream": False, "stream_options": None})
    assert texts == {c["index"]: c["text"] for c in whole["choices"]} and finished == {0, 1, 2, 3}
    assert usage == whole["usage"]


def test_timings_are_the_server_s_own(served):
    answer = ok(served, "/v1/completions", {"model": "demo", "prompt": "hello world\n", "max_tokens": 12,
                                            "temperature": 0})
    timings = answer["timings"]
    assert timings["prompt_n"] == 12 and timings["predicted_n"] == answer["usage"]["completion_tokens"] - 1
    assert timings["predicted_per_second"] > 0 and timings["prompt_ms"] > 0


def test_bad_choices_name_the_field(served):
    good = {"model": "demo", "prompt": "hi\n", "max_tokens": 4}
    for extra, param in [({"prompt": ["a"] * 5}, "prompt"), ({"n": 9}, "n"), ({"best_of": 9}, "best_of"),
                         ({"prompt": [[1], [999]]}, "prompt.1"), ({"logprobs": 21}, "logprobs"),
                         ({"max_tokens": 0}, "max_tokens"), ({"n": 2, "best_of": 3, "stream": True}, "best_of"),
                         ({"logit_bias": {"x": 1}}, "logit_bias"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
                         ({"max_tokens": 300, "echo": True}, "max_tokens")]:
        status, body = served.call("/v1/completions", {**good, **extra}, key=None)
        assert (status, body["error"]["param"]) == (400, param), (extra, body)
    assert served.wait_until_idle() < 5


@pytest.mark.parametrize("model,prefill_logits", [("gqa_transposed", True), ("gqa_default", False)])
def test_echo_runs_the_prefill_s_logits_or_names_what_to_export(model, prefill_logits):
    """A model exported with --prefill-logits scores a prompt in prefill chunks (equal to
    decode steps); one without gets a 400 naming the flag, unless --score-by-decode."""
    engine = Engine(ROOT_MODELS / f"{model}.tflite", tokenizer=ByteTokenizer())
    assert engine.spec.prefill_has_logits == prefill_logits
    server, thread, url = start_server(engine, None, ServeSettings(model))
    try:
        served = Served(url, engine, ROOT_MODELS)
        prompt = [5, 17, 42, 200, 3, 99, 250, 7, 1, 64, 128, 9, 9, 31]
        status, answer = served.call("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1,
                                                         "echo": True, "logprobs": 1}, key=None)
        if not prefill_logits:
            assert (status, answer["error"]["param"]) == (400, "echo")
            message = answer["error"]["message"]
            assert all(flag in message for flag in ("--score-lengths", "--prefill-logits", "--score-by-decode"))
            return
        assert status == 200, answer
        reference = offline_logprobs(engine, prompt)
        np.testing.assert_allclose(answer["choices"][0]["logprobs"]["token_logprobs"][1:len(prompt)],
                                   [reference[i - 1][t] for i, t in enumerate(prompt) if i], atol=1e-4)
    finally:
        stop_server(server, thread)
        engine.close()


def test_the_tokenizer_endpoints_answer_what_lm_eval_s_remote_tokenizer_reads(served):
    """GET /tokenizer_info, POST /tokenize {prompt, add_special_tokens} and messages, POST
    /detokenize, exactly as lm-eval 0.4.13's RemoteTokenizer calls them."""
    with urllib.request.urlopen(served.url + "/tokenizer_info", timeout=10) as response:
        info = json.loads(response.read())
    assert info["eos_token"] == "\n" and info["bos_token"] is None and info["chat_template"] == TEMPLATE
    assert info["model_max_length"] == served.engine.spec.kv_length
    answer = ok(served, "/tokenize", {"prompt": "hi\n", "add_special_tokens": False})
    assert answer["tokens"] == [104, 105, 10] and answer["count"] == 3
    assert ok(served, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})["tokens"] == [NEWLINE]
    chat = ok(served, "/tokenize", {"messages": [{"role": "user", "content": "hi"}], "return_token_strs": True})
    assert chat["tokens"] == [104, 105, 10] and chat["token_strs"] == ["h", "i", "\n"]
    assert ok(served, "/detokenize", {"tokens": [104, 105]}) == {"prompt": "hi"}
    status, body = served.call("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, key=None)
    assert (status, body["error"]["param"]) == (400, "add_special_tokens")


def test_a_stream_with_echo_sends_the_prompt_first_and_the_logprobs_when_the_choice_ends(served):
    body = {"model": "uppercase", "prompt": "green tea\n", "max_tokens": 12, "temperature": 0, "echo": True,
            "logprobs": 1}
    request = urllib.request.Request(served.url + "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        chunks = [json.loads(line[6:]) for line in response.read().decode().splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    whole = ok(served, "/v1/completions", body)["choices"][0]
    assert chunks[0]["choices"][0]["text"] == "green tea\n"
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == whole["text"]
    assert [chunk["choices"][0]["logprobs"] for chunk in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["logprobs"] == whole["logprobs"]


@pytest.fixture(scope="module")
def pieces(tmp_path_factory):
    """A SentencePiece tokenizer of 17 pieces (the characters of a short text, '▁' for the
    space) serving the tiny model's 256 ids: ids 17-255 are the model's alone, as Gemma
    3's last 64 of 262,208 are. The tiny model's random weights sample them mostly."""
    sentencepiece = pytest.importorskip("sentencepiece")
    folder = tmp_path_factory.mktemp("pieces")
    (folder / "text.txt").write_text("hello world the cat sat on the mat\n" * 50)
    sentencepiece.SentencePieceTrainer.train(input=str(folder / "text.txt"), model_prefix=str(folder / "sp"),
                                             vocab_size=17, model_type="char", minloglevel=2)
    engine = Engine(TINY_MODEL, tokenizer=SentencePieceTokenizer(folder / "sp.model"))
    server, thread, url = start_server(engine, None, ServeSettings("tiny", score_by_decode=True))
    yield Served(url, engine, folder)
    stop_server(server, thread)
    engine.close()


def test_ids_the_model_has_past_its_tokenizer_are_refused_from_clients_and_add_no_text_when_sampled(pieces):
    assert (pieces.engine.spec.vocab_size, pieces.engine.tokenizer.vocab_size) == (256, 17)
    for path, body, param in [
            ("/detokenize", {"tokens": [16, 17]}, "tokens.1"),
            ("/v1/completions", {"model": "tiny", "prompt": [5, 200], "max_tokens": 1, "echo": True}, "prompt"),
            ("/v1/completions", {"model": "tiny", "prompt": [[5], [5, 200]]}, "prompt.1"),
            ("/v1/completions", {"model": "tiny", "prompt": "the cat", "logit_bias": {"200": 100}}, "logit_bias"),
            ("/v1/completions", {"model": "tiny", "prompt": "the cat", "stop_token_ids": [2, 17]}, "stop_token_ids.1")]:
        status, answer = pieces.call(path, body, key=None)
        assert (status, answer["error"]["param"]) == (400, param), answer
        assert "[0, 17)" in answer["error"]["message"]
    assert ok(pieces, "/detokenize", {"tokens": [7, 6, 8, 8, 9]}) == {"prompt": "hello"}
    with pieces.engine.create_session() as s:
        expected = s.generate("the cat", 12)
    assert any(token >= 17 for token in expected.tokens)  # what this test is about
    body = {"model": "tiny", "prompt": "the cat", "max_tokens": 12, "temperature": 0, "logprobs": 2}
    answer = ok(pieces, "/v1/completions", body)
    assert answer["choices"][0]["text"] == expected.text
    assert answer["usage"]["completion_tokens"] == len(expected.tokens)
    status, events = stream_status(pieces, "/v1/completions", body)
    chunks = [json.loads(line[6:]) for line in events.splitlines() if line.startswith("data: {")]
    assert status == 200 and "".join(c["choices"][0]["text"] for c in chunks) == expected.text


def test_token_texts_add_up_to_the_answer_when_pieces_read_otherwise_alone(pieces):
    """SentencePiece drops a piece's leading space when it is decoded alone ('▁' alone is
    ''): a token's text is what it adds to the text before it, so the texts add up to the
    answer, the offsets are right, and each alternative reads as it would there."""
    answer = ok(pieces, "/v1/completions", {"model": "tiny", "prompt": "the cat sat", "max_tokens": 6,
                                            "temperature": 0, "echo": True, "logprobs": 3})
    choice = answer["choices"][0]
    logprobs, prompt = choice["logprobs"], pieces.engine.tokenizer.encode("the cat sat")
    assert "".join(logprobs["tokens"]) == choice["text"] and choice["text"].startswith("the cat sat")
    assert logprobs["tokens"][:len(prompt)] == ["", "t", "h", "e", " ", "c", "a", "t", " ", "s", "a", "t"]
    assert logprobs["text_offset"] == [len("".join(logprobs["tokens"][:i])) for i in range(len(logprobs["tokens"]))]
    for text, top in zip(logprobs["tokens"][1:], logprobs["top_logprobs"][1:]):
        assert text in top  # the token itself is among its alternatives, reading the same


def test_a_character_split_over_tokens_reads_whole_with_its_last_token_and_bytes_are_each_token_s(served):
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0,
            "logprobs": True, "top_logprobs": 3, "logit_bias": {"195": 100, "169": 100}}  # 'é' is C3 A9
    choice = ok(served, "/v1/chat/completions", body)["choices"][0]
    content = choice["logprobs"]["content"]
    assert choice["message"]["content"] == "é" and [item["token"] for item in content] == ["", "é"]
    assert [item["bytes"] for item in content] == [[0xC3], [0xA9]]
    replacement = list("\ufffd".encode())
    assert all(alternative["bytes"] != replacement for item in content for alternative in item["top_logprobs"])
    echo = ok(served, "/v1/completions", {"model": "demo", "prompt": "héllo", "max_tokens": 0, "echo": True,
                                          "logprobs": 0})["choices"][0]["logprobs"]
    assert (echo["tokens"], echo["text_offset"]) == (["h", "", "é", "l", "l", "o"], [0, 1, 1, 2, 3, 4])


def test_a_context_overflow_and_an_empty_prompt_name_the_field_to_fix(served):
    """The prompt when it alone leaves no room (or holds no token), with its index in a
    list; else the token limit the request gave (the prompt, when it gave none)."""
    chat, long = {"model": "demo", "messages": [{"role": "user", "content": "hello"}]}, "x" * 300
    for path, body, param in [
            ("/v1/chat/completions", {**chat, "max_completion_tokens": 300}, "max_completion_tokens"),
            ("/v1/chat/completions", {**chat, "max_tokens": 300}, "max_tokens"),
            ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": long}]}, "messages"),
            ("/v1/completions", {"model": "demo", "prompt": long, "max_tokens": 0, "echo": True}, "prompt"),
            ("/v1/completions", {"model": "demo", "prompt": ["hi", long], "max_tokens": 0, "echo": True}, "prompt.1"),
            ("/v1/completions", {"model": "demo", "prompt": ["hi", "x" * 250], "max_tokens": 10}, "max_tokens"),
            ("/v1/completions", {"model": "demo", "prompt": ["hi", "x" * 250]}, "prompt.1"),  # 16 by default
            ("/v1/completions", {"model": "demo", "prompt": ""}, "prompt"),
            ("/v1/completions", {"model": "demo", "prompt": []}, "prompt"),
            ("/v1/completions", {"model": "demo", "prompt": [[]]}, "prompt.0"),
            ("/v1/completions", {"model": "demo", "prompt": ["a", ""]}, "prompt.1")]:
        for stream in (False, True):
            status, answer = served.call(path, {**body, "stream": stream}, key=None)
            assert (status, answer["error"]["param"]) == (400, param), (body, stream, answer)
    assert served.wait_until_idle() < 5


def test_an_unknown_adapter_is_named_where_the_request_names_it(served):
    good = {"model": "demo", "prompt": "hi\n", "max_tokens": 2}
    for extra, param in [({"lora": [{"name": "nope"}]}, "lora.0"),
                         ({"lora": [{"name": "json"}, {"name": "nope"}]}, "lora.1"),
                         ({"model": "nope"}, "model"), ({"model": "demo::nope"}, "model"),
                         ({"model": "nope", "lora": [{"name": "json"}]}, "model")]:
        status, body = served.call("/v1/completions", {**good, **extra}, key=None)
        assert (status, body["error"]["param"], body["error"]["code"]) == (404, param, "model_not_found"), body


def test_base_and_adapter_names_an_adapter_wherever_a_model_is_named(served):
    """``demo::json`` names the adapter for generation, and so for the tokenizer endpoints
    and the model card; a wrong base or adapter is a 404, nothing after '::' a 400."""
    assert ok(served, "/tokenize", {"model": "demo::json", "prompt": "hi", "add_special_tokens": False})["tokens"] == [
        104, 105]
    assert ok(served, "/detokenize", {"model": "demo::json", "tokens": [104, 105]}) == {"prompt": "hi"}
    status, card = served.call("/v1/models/demo::json", key=None)
    assert (status, card["id"], card["parent"]) == (200, "json", "demo")
    for model, status in [("demo::nope", 404), ("other::json", 404), ("demo::", 400), ("nope", 404)]:
        for path, body in [("/tokenize", {"model": model, "prompt": "hi"}),
                           ("/detokenize", {"model": model, "tokens": [104]}), (f"/v1/models/{model}", None)]:
            got, answer = served.call(path, body, key=None)
            assert (got, answer["error"]["param"]) == (status, "model"), (path, answer)


def test_tokenize_adds_the_bos_unless_told_not_to_while_completions_encode_text_as_given(pieces):
    """What docs/serving.md says of /tokenize: vLLM's add_special_tokens default counts a
    BOS that a completion's text prompt (encoded as `runtime generate` does) has not."""
    usage = ok(pieces, "/v1/completions", {"model": "tiny", "prompt": "the cat", "max_tokens": 1})["usage"]
    plain = ok(pieces, "/tokenize", {"prompt": "the cat", "add_special_tokens": False})
    assert plain["count"] == usage["prompt_tokens"]
    bos = pieces.engine.tokenizer.encode("", add_special_tokens=True)
    assert ok(pieces, "/tokenize", {"prompt": "the cat"})["tokens"] == [*bos, *plain["tokens"]] and len(bos) == 1
