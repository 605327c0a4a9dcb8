"""Tests for runtime.serve.generation: text deltas as tokens come, and one request's job."""

from __future__ import annotations

import re

import pytest

from runtime import ByteTokenizer, Engine, SamplerConfig, SessionConfig
from runtime.errors import FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError
from runtime.serve.generation import GenerationJob, GenerationRequest, TextAssembler

from conftest import MODEL_FILES


def byte_decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def feed(assembler: TextAssembler, text: bytes) -> list[str]:
    return [assembler.add(byte) for byte in text]


def test_an_incomplete_character_is_held_until_it_is_whole():
    assembler = TextAssembler(byte_decode)
    assert feed(assembler, "é!".encode()) == ["", "é", "!"]
    assert assembler.text == "é!"


def test_a_stop_string_across_tokens_ends_the_text_before_it():
    assembler = TextAssembler(byte_decode, ["wor", "zzz"])
    deltas = []
    for byte in b"hello world":
        deltas.append(assembler.add(byte))
        if assembler.stopped:
            break
    assert "".join(deltas) == "hello " == assembler.text
    assert deltas[-3:] == ["", "", ""]  # "w", "o" held as a possible start of "wor", then the stop
    with pytest.raises(FailedPreconditionError):
        assembler.add(ord("x"))


def test_a_held_back_tail_is_sent_when_it_turns_out_not_to_be_a_stop():
    assembler = TextAssembler(byte_decode, ["ab"])
    assert feed(assembler, b"xac") == ["x", "", "ac"]
    assembler = TextAssembler(byte_decode, ["ab"])
    assert feed(assembler, b"xa") == ["x", ""] and assembler.finish() == "a"
    assert assembler.text == "xa" and not assembler.stopped


def test_a_stop_string_inside_one_token_cuts_that_token():
    words = {1: "say ", 2: "hello there", 3: " now"}
    assembler = TextAssembler(lambda ids: "".join(words[i] for i in ids), ["lo t"])
    assert assembler.add(1) == "say "
    assert assembler.add(2) == "hel" and assembler.stopped and assembler.text == "say hel"


@pytest.fixture(scope="module")
def engine():
    with Engine(MODEL_FILES["default"], tokenizer=ByteTokenizer()) as engine:  # KV 64, vocab 256
        yield engine


def job(engine, prompt="hi", max_tokens=4, **kwargs) -> GenerationJob:
    return GenerationJob(engine, GenerationRequest(prompt, max_tokens, SamplerConfig(), (), {}, frozenset()), **kwargs)


def test_a_job_streams_what_generate_gives_and_closes_its_session(engine):
    deltas, closed = [], []
    run = job(engine, [5, 17, 42], 6, on_text=deltas.append, on_close=lambda: closed.append(1))
    run.prepare()
    assert len(engine.stats().sessions) == 1
    outcome = run.run()
    with engine.create_session(SessionConfig()) as session:
        expected = session.generate([5, 17, 42], 6)
    assert outcome.text == "".join(deltas) == expected.text
    assert (outcome.prompt_tokens, outcome.completion_tokens, outcome.finish_reason) == (3, 6, "length")
    assert outcome.time_to_first_token_s > 0 and closed == [1] and not engine.stats().sessions
    run.close()
    assert closed == [1]  # closing twice is harmless


def test_the_context_check_is_the_sessions_and_names_the_numbers(engine):
    for prompt, max_tokens, words in [("hi", 63, "2 prompt + 63 new tokens = 65 exceeds the KV cache of 64"),
                                      ("x" * 64, None, "64 prompt + 1 new tokens = 65 exceeds the KV cache of 64")]:
        run = job(engine, prompt, max_tokens)
        run.prepare()
        with pytest.raises(ResourceExhaustedError, match=re.escape(words)):
            run.run()
        assert not engine.stats().sessions
    with pytest.raises(InvalidArgumentError, match="empty"):
        job(engine, "", 4).prepare()
    assert not engine.stats().sessions


def test_without_max_tokens_a_job_may_fill_the_context(engine):
    run = job(engine, "x" * 60, None)
    run.prepare()
    assert run.run().completion_tokens == 4


def test_a_cancelled_job_stops_before_its_next_step(engine):
    run = job(engine, "hi", 50, on_start=lambda: run.cancel())  # cancelled while it runs
    run.prepare()
    outcome = run.run()
    assert (outcome.finish_reason, outcome.completion_tokens) == ("cancelled", 1)  # no decode after the first token
    assert not engine.stats().sessions


def test_a_job_cancelled_before_it_ran_runs_nothing(engine):
    run = job(engine, "hi", 50)
    run.prepare()
    run.cancel()  # the client went away, or the server shuts down, before a worker took it
    outcome = run.run()
    assert (outcome.finish_reason, outcome.completion_tokens, outcome.text) == ("cancelled", 0, "")
    assert not engine.stats().sessions


def test_a_job_closed_before_it_ran_frees_everything(engine):
    closed = []
    run = job(engine, "hi", 4, on_close=lambda: closed.append(1))
    run.prepare()
    run.close()
    assert closed == [1] and not engine.stats().sessions
    with pytest.raises(FailedPreconditionError):
        run.run()


def test_a_job_closed_while_it_prepared_closes_the_session_it_made(engine):
    run = job(engine, "hi", 4)
    run.close()  # the request went away while prepare() was on its way
    with pytest.raises(FailedPreconditionError, match="ended before it ran"):
        run.prepare()
    assert not engine.stats().sessions
