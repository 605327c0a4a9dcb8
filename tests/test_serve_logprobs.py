"""Tests for runtime.serve.logprobs: float64 log-softmax and OpenAI's two logprobs shapes."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.serve.logprobs import chat_logprobs, completion_logprobs, log_softmax, token_logprobs

LOGITS = np.array([[0.5, 3.0, 2.0, -1.0], [1.0, 1.0, 4.0, 0.0]], np.float32)


def test_a_token_s_logprob_is_its_log_softmax_in_float64():
    entries = token_logprobs(LOGITS, [3, 2], 2)
    expected = np.log(np.exp(LOGITS.astype(np.float64)) / np.exp(LOGITS.astype(np.float64)).sum(1, keepdims=True))
    assert entries[0].logprob == pytest.approx(expected[0, 3], abs=1e-12)
    np.testing.assert_allclose(log_softmax(LOGITS), expected, atol=1e-12)
    # the top two, most likely first, and the token itself after them when it is not among them
    assert [t for t, _ in entries[0].top] == [1, 2, 3]
    assert [t for t, _ in entries[1].top] == [2, 0]  # a tie (0 and 1) goes to the lower id; token 2 is first
    assert token_logprobs(LOGITS, [3, 2], 0)[0].top == ()


def test_the_legacy_object_lines_up_tokens_logprobs_tops_and_offsets():
    entries = [None, *token_logprobs(LOGITS, [1, 2], 1)]
    texts = {0: "a", 1: "bc", 2: "b", 3: "b"}
    shaped = completion_logprobs(entries, texts.__getitem__, [0, 1, 2])
    assert shaped["tokens"] == ["a", "bc", "b"] and shaped["text_offset"] == [0, 1, 3]
    assert shaped["token_logprobs"][0] is None and shaped["top_logprobs"][0] is None
    assert shaped["top_logprobs"][1] == {"bc": pytest.approx(shaped["token_logprobs"][1])}
    # two tokens of one text: the likelier logprob is kept, so max() is still the greedy one's
    shaped = completion_logprobs(token_logprobs(LOGITS[:1], [3], 1), texts.__getitem__, [3])
    assert shaped["top_logprobs"][0] == {"bc": pytest.approx(np.log(np.exp(3) / np.exp(LOGITS[0]).sum()), abs=1e-6),
                                         "b": pytest.approx(shaped["token_logprobs"][0])}


def test_the_chat_object_has_bytes_and_the_asked_number_of_alternatives():
    shaped = chat_logprobs(token_logprobs(LOGITS, [3, 2], 2), {0: "a", 1: "é", 2: "c", 3: "d"}.__getitem__, 1)
    first = shaped["content"][0]
    assert first["token"] == "d" and first["bytes"] == [100] and len(first["top_logprobs"]) == 1
    assert first["top_logprobs"][0]["token"] == "é" and first["top_logprobs"][0]["bytes"] == [0xC3, 0xA9]
