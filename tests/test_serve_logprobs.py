"""Tests for runtime.serve.logprobs: float64 log-softmax and OpenAI's two logprobs shapes."""

from __future__ import annotations

import numpy as np
import pytest

from runtime import ByteTokenizer
from runtime.serve.logprobs import chat_logprobs, completion_logprobs, log_softmax, token_logprobs
from runtime.serve.token_texts import TokenReader, TokenText

LOGITS = np.array([[0.5, 3.0, 2.0, -1.0], [1.0, 1.0, 4.0, 0.0]], np.float32)


def everywhere(texts: dict[int, str]):
    """A reader by which each token reads the same at every position."""
    return lambda _, token: TokenText(texts[token], texts[token].encode())


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
    shaped = completion_logprobs(entries, everywhere(texts), [0, 1, 2])
    assert shaped["tokens"] == ["a", "bc", "b"] and shaped["text_offset"] == [0, 1, 3]
    assert shaped["token_logprobs"][0] is None and shaped["top_logprobs"][0] is None
    assert shaped["top_logprobs"][1] == {"bc": pytest.approx(shaped["token_logprobs"][1])}
    # two tokens of one text: the likelier logprob is kept, so max() is still the greedy one's
    shaped = completion_logprobs(token_logprobs(LOGITS[:1], [3], 1), everywhere(texts), [3])
    assert shaped["top_logprobs"][0] == {"bc": pytest.approx(np.log(np.exp(3) / np.exp(LOGITS[0]).sum()), abs=1e-6),
                                         "b": pytest.approx(shaped["token_logprobs"][0])}


def test_the_chat_object_has_bytes_and_the_asked_number_of_alternatives():
    shaped = chat_logprobs(token_logprobs(LOGITS, [3, 2], 2), everywhere({0: "a", 1: "é", 2: "c", 3: "d"}), 1)
    first = shaped["content"][0]
    assert first["token"] == "d" and first["bytes"] == [100] and len(first["top_logprobs"]) == 1
    assert first["top_logprobs"][0]["token"] == "é" and first["top_logprobs"][0]["bytes"] == [0xC3, 0xA9]


def test_token_texts_add_up_to_the_answer_and_a_split_character_reads_whole_at_its_last_byte():
    prompt, generated = list("hé".encode()), [*"llo ✓".encode(), 300]  # 300: an id past the bytes
    read = TokenReader(ByteTokenizer(), [prompt, generated])
    texts = [read(position, token) for position, token in enumerate(prompt + generated)]
    assert [t.text for t in texts] == ["h", "", "é", "l", "l", "o", " ", "", "", "✓", ""]
    assert [t.bytes for t in texts] == [bytes([token]) for token in prompt + generated[:-1]] + [b""]
    # an alternative reads as it would in that place: completing the character, or not yet
    assert read(2, 0xAA).text == "ê" and read(1, ord("a")).text == "a" and read(1, 0xE2).text == ""
    assert read(1, 0xE2).bytes == b"\xe2"
    # a character still incomplete at the end is the answer's U+FFFD, on the last token
    cut = TokenReader(ByteTokenizer(), [[104, 0xE2, 0x9C]])
    assert [cut(i, t).text for i, t in enumerate([104, 0xE2, 0x9C])] == ["h", "", "\ufffd"]
