"""Tests for runtime.engine.session: fidelity on prefill and decode, isolation, misuse."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from conftest import MODEL_FILES, adapter_deltas, adapter_path
from reference_model import reference_logits
from runtime import Engine, EngineSettings, LoraSource, SamplerConfig, SessionConfig
from runtime.components.sampler import Sampler
from runtime.errors import FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError

TOL = 1e-4
PROMPT = [5, 17, 42, 200, 3, 99, 250, 7, 1, 64, 128]
CONTINUATION = [11, 22, 33, 44, 55, 66, 77, 88]


@pytest.fixture(scope="module", params=["default", "transposed", "grouped"])
def engine(request):
    with Engine(MODEL_FILES[request.param]) as engine:
        yield engine


def run_prefill_and_decodes(session):
    rows = [session.run_prefill(PROMPT)]
    rows += [session.run_decode(token) for token in CONTINUATION]
    return np.stack(rows)


def expected_rows(weights, lora=None):
    return reference_logits(weights, PROMPT + CONTINUATION, lora=lora)[len(PROMPT) - 1 :]


@pytest.mark.parametrize(
    "adapter,scale",
    [
        ("torch_r4", 1.0),  # litert-torch names, f32 inline
        ("litertlm_r4", 0.8),  # LiteRT-LM names, f16 at offsets, layout converted
        ("mediapipe_r4", 1.0),
        ("torch_r4_bf16", 1.0),
        ("torch_r16", 1.0),
        ("litertlm_r8_layer0", 1.0),  # rank 8 zero-padded into the r16 slot, one layer
        ("torch_r4_layer1_qv", 1.3),  # only some layers and projections
    ],
)
def test_adapter_fidelity_on_prefill_and_decode(engine, weights, adapter, scale):
    with engine.create_session(SessionConfig(lora_path=adapter_path(adapter), lora_scale=scale)) as session:
        got = run_prefill_and_decodes(session)
    expected = expected_rows(weights, adapter_deltas(adapter, scale))
    np.testing.assert_allclose(got, expected, atol=TOL)
    # The adapter really changes the output (so the check above could fail).
    assert np.abs(expected - expected_rows(weights)).max() > 0.05


def test_base_session_matches_reference(engine, weights):
    with engine.create_session() as session:
        np.testing.assert_allclose(run_prefill_and_decodes(session), expected_rows(weights), atol=TOL)


def test_in_memory_adapter_equals_file(engine):
    blob = adapter_path("litertlm_r4").read_bytes()
    with engine.create_session(SessionConfig(lora_buffer=blob)) as from_memory:
        with engine.create_session(SessionConfig(lora_path=adapter_path("litertlm_r4"))) as from_file:
            np.testing.assert_array_equal(run_prefill_and_decodes(from_memory), run_prefill_and_decodes(from_file))


def test_zero_adapter_and_zero_scale_give_base_logits(engine):
    with engine.create_session() as base:
        expected = run_prefill_and_decodes(base)
    with engine.create_session(SessionConfig(lora_path=adapter_path("torch_r4_zero"))) as zero:
        np.testing.assert_array_equal(run_prefill_and_decodes(zero), expected)
    with engine.create_session(SessionConfig(lora_path=adapter_path("torch_r4"), lora_scale=0.0)) as off:
        assert off.blend == ()
        np.testing.assert_array_equal(run_prefill_and_decodes(off), expected)


def test_generate_and_clone(engine, weights):
    config = SessionConfig(lora_path=adapter_path("torch_r4"))
    with engine.create_session(config) as session:
        result = session.generate(PROMPT, max_new_tokens=6)
        assert len(result.tokens) == 6 and result.prompt_tokens == len(PROMPT)
        assert result.stop_reason == "max_new_tokens"
        assert session.position == len(PROMPT) + 6
        ref = reference_logits(weights, PROMPT + result.tokens, lora=adapter_deltas("torch_r4"))
        assert result.tokens == [int(np.argmax(row)) for row in ref[len(PROMPT) - 1 : -1]]
        clone = session.clone()
        assert clone.position == session.position and clone.lora_ids == session.lora_ids
        a, b = session.run_decode(9), clone.run_decode(9)
        np.testing.assert_array_equal(a, b)
        clone.close()
        stopped = session.generate([1, 2], max_new_tokens=20, stop_tokens=[int(np.argmax(session.run_decode(3)))])
        assert stopped.stop_reason in ("stop_token", "max_new_tokens")


def test_a_generations_last_token_is_written_by_the_next_call(engine, weights):
    """No step computes the logits after a generation's last token (nobody reads them);
    whatever runs the session next writes it first, so every way on is exact."""
    lora = adapter_deltas("torch_r4")
    config = SessionConfig(lora_path=adapter_path("torch_r4"))

    with engine.create_session(config) as session:
        before = engine.stats().invokes
        session.run_prefill(PROMPT)
        prefill_runs = engine.stats().invokes - before

    def generated(session):
        before = engine.stats().invokes
        tokens = session.generate(PROMPT, max_new_tokens=5).tokens
        assert engine.stats().invokes - before == prefill_runs + 4  # 4 decode steps for 5 tokens
        assert session.position == len(PROMPT) + 5 and session.stats().position == len(PROMPT) + 5
        return tokens

    def expected(tokens):
        return reference_logits(weights, tokens, lora=lora)[-1]

    with engine.create_session(config) as session:
        tokens = generated(session)
        np.testing.assert_allclose(session.run_decode(9), expected(PROMPT + tokens + [9]), atol=TOL)
        clone = session.clone()
        np.testing.assert_allclose(clone.run_decode(4), expected(PROMPT + tokens + [9, 4]), atol=TOL)
        clone.close()
    with engine.create_session(config) as session:
        tokens = generated(session)
        np.testing.assert_allclose(session.run_prefill([8, 6]), expected(PROMPT + tokens + [8, 6]), atol=TOL)
    with engine.create_session(config) as session:
        tokens = generated(session)
        clone = session.clone()  # the clone holds the pending token too
        more = clone.generate([8], max_new_tokens=3).tokens
        ref = reference_logits(weights, PROMPT + tokens + [8] + more, lora=lora)
        assert more == [int(np.argmax(row)) for row in ref[len(PROMPT) + 5 : -1]]
        clone.close()
        (row,) = engine.decode_together([(session, 2)])
        np.testing.assert_allclose(row, expected(PROMPT + tokens + [2]), atol=TOL)
        assert session.position == len(PROMPT) + 6
    with engine.create_session(config) as session:
        generated(session)
        session.reset()  # the pending token goes with the rest
        assert session.position == 0
        np.testing.assert_allclose(session.run_prefill([8, 6]), expected([8, 6]), atol=TOL)


def test_generate_with_seeded_sampler_is_reproducible(engine):
    config = SessionConfig(sampler=SamplerConfig(temperature=1.0, top_k=20, seed=7))
    outputs = []
    for _ in range(2):
        with engine.create_session(config) as session:
            outputs.append(session.generate(PROMPT, max_new_tokens=10).tokens)
    assert outputs[0] == outputs[1]


def test_isolation_under_concurrency(engine):
    blobs = [adapter_path(n).read_bytes() for n in ("torch_r16", "litertlm_r4")]
    configs = [
        SessionConfig(lora_path=adapter_path("torch_r4")),
        SessionConfig(lora_buffer=blobs[0]),
        SessionConfig(lora_path=adapter_path("mediapipe_r4"), lora_scale=0.5),
        SessionConfig(lora_buffer=blobs[1]),
        SessionConfig(),
        SessionConfig(lora_path=adapter_path("torch_r4"), lora_scale=2.0),
        SessionConfig(lora_buffer=blobs[0], lora_scale=0.3),
        SessionConfig(),
    ]
    prompts = [np.random.default_rng(i).integers(0, 256, 5 + 3 * i).tolist() for i in range(8)]
    steps = 12

    def run_alone(index):
        with engine.create_session(configs[index]) as session:
            return session.generate(prompts[index], max_new_tokens=steps).tokens

    alone = [run_alone(i) for i in range(8)]
    sessions = [engine.create_session(c) for c in configs]
    results: dict[int, list[int]] = {i: [] for i in range(8)}
    errors = []

    def worker(indices, seed):
        rng = random.Random(seed)
        try:
            logits = {i: sessions[i].run_prefill(prompts[i]) for i in indices}
            pending = list(indices) * steps
            rng.shuffle(pending)
            for i in pending:
                token = int(np.argmax(logits[i]))
                results[i].append(token)
                logits[i] = sessions[i].run_decode(token)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=([t, t + 4], t)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i in range(8):
        assert results[i] == alone[i], f"session {i} diverged"
        sessions[i].close()


def test_switching_adapters_needs_reset(engine, weights):
    with engine.create_session(SessionConfig(lora_path=adapter_path("torch_r4"))) as session:
        session.run_prefill(PROMPT)
        with pytest.raises(FailedPreconditionError, match="reset=True"):
            session.set_adapters([LoraSource(path=adapter_path("litertlm_r4"))])
        with pytest.raises(InvalidArgumentError):
            session.set_adapters([LoraSource(path=adapter_path("wrong_hidden_r4"))], reset=True)
        assert session.position == len(PROMPT)  # a failed switch changes nothing
        session.set_adapters([LoraSource(path=adapter_path("litertlm_r4"))], reset=True)
        assert session.position == 0
        got = run_prefill_and_decodes(session)
    np.testing.assert_allclose(got, expected_rows(weights, adapter_deltas("litertlm_r4")), atol=TOL)


def test_generate_s_bad_token_ids_name_their_argument(engine):
    """A stop token or prompt id outside the vocabulary (``runtime generate --stop-token 300``)
    was 'token id 300 is outside the vocabulary', not saying which argument held it."""
    with engine.create_session() as session:
        with pytest.raises(InvalidArgumentError, match=r"^INVALID_ARGUMENT: stop_tokens: token id 300 is outside"):
            session.generate([1, 2], max_new_tokens=2, stop_tokens=[5, 300])
        with pytest.raises(InvalidArgumentError, match=r"^INVALID_ARGUMENT: stop_tokens must be integers, got 5"):
            session.generate([1, 2], max_new_tokens=2, stop_tokens=5)
        with pytest.raises(InvalidArgumentError, match=r"^INVALID_ARGUMENT: prompt: token id -1 is outside"):
            session.generate([1, -1], max_new_tokens=2)
        assert session.position == 0  # refused before anything ran


def test_errors(engine):
    with pytest.raises(InvalidArgumentError, match="input size 48, expected 64"):
        engine.create_session(SessionConfig(lora_path=adapter_path("wrong_hidden_r4")))
    with pytest.raises(InvalidArgumentError, match=r"rank 32 exceeds every LoRA slot"):
        engine.create_session(SessionConfig(lora_path=adapter_path("torch_r32")))
    session = engine.create_session()
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        session.run_prefill([1, 256])
    with pytest.raises(InvalidArgumentError, match="integers"):
        session.run_decode(1.5)
    with pytest.raises(ResourceExhaustedError, match="exceeds the KV cache of 64"):
        session.generate(list(range(60)), max_new_tokens=10)
    assert session.position == 0  # refused before anything ran
    session.run_prefill(list(range(60)))
    with pytest.raises(ResourceExhaustedError):
        session.run_prefill(list(range(5)))
    assert session.position == 60
    session.run_decode(1)  # still usable
    session.close()
    session.close()
    for call in (lambda: session.run_decode(1), lambda: session.run_prefill([1]), session.clone, lambda: session.position):
        with pytest.raises(FailedPreconditionError, match="closed"):
            call()


def test_a_full_kv_cache_is_refused_naming_the_flag_that_gives_more(engine):
    """Every other refusal a re-export fixes names its flag (--verify-lengths,
    --score-lengths, --lora-ranks); the KV cache's said only how many positions it holds."""
    hint = r"positions \(a model exported with a larger --kv-length holds more\)"
    with engine.create_session() as session, engine.create_session() as other:
        with pytest.raises(ResourceExhaustedError, match=f"exceeds the KV cache of 64 {hint}"):
            session.generate(list(range(60)), max_new_tokens=10)
        with pytest.raises(ResourceExhaustedError, match=f"exceeds the KV cache of 64 {hint}"):
            session.score(list(range(65)), decode_steps=True)
        with pytest.raises(ResourceExhaustedError, match=f"would exceed the KV cache of 64 {hint}"):
            session.run_prefill(list(range(65)))
        session.run_prefill(list(range(64)))
        with pytest.raises(ResourceExhaustedError, match=f"would exceed the KV cache of 64 {hint}"):
            session.run_decode(1)
        with pytest.raises(ResourceExhaustedError, match=f"would exceed the KV cache of 64 {hint}"):
            engine.decode_together([(session, 1), (other, 1)])


def test_one_session_refuses_a_concurrent_second_call(engine):
    with engine.create_session() as session:
        session._lock.acquire()  # as if another thread were inside a call
        try:
            with pytest.raises(FailedPreconditionError, match="being used by another call"):
                session.run_decode(1)
        finally:
            session._lock.release()
        session.run_decode(1)


@pytest.mark.parametrize("call", ["clone", "reset", "score", "run_decode", "generate"])
def test_a_call_from_inside_the_sessions_own_call_says_so(engine, call):
    """Cloning (or any call) from the session's own ``on_token`` callback, mid-generation,
    was refused as 'being used by another call': there is no other call, the caller's own
    generation holds it. The generation ends with the error; the session goes on after."""
    calls = {"clone": lambda s: s.clone(), "reset": lambda s: s.reset(), "score": lambda s: s.score([1]),
             "run_decode": lambda s: s.run_decode(1), "generate": lambda s: s.generate([1], 1)}
    with engine.create_session() as session:
        def on_token(token: int) -> None:
            calls[call](session)

        with pytest.raises(FailedPreconditionError, match=r"session \d+ is inside its own call \(from its on_token "
                                                          r"callback\?\): make this call after that one returns"):
            session.generate([1, 2, 3], max_new_tokens=4, on_token=on_token)
        with session.clone() as copy:
            assert copy.position == session.position == 3


def _within(seconds, call):
    """``call()``'s outcome (its value, or the exception it raised) from another thread;
    fails the test instead of hanging when it has not ended after ``seconds``."""
    outcome = []

    def run():
        try:
            outcome.append(call())
        except Exception as exc:  # handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s (a deadlock?)"
    return outcome[0]


def test_closing_from_inside_an_own_call_is_refused_not_a_hang():
    """Closing a session, or its engine, from the session's own ``on_token`` callback
    raises (out of the generation) instead of waiting on itself forever; the session and
    the engine go on, and close once the call has returned."""
    engine = Engine(MODEL_FILES["default"])  # not a with block: its close would wait on a hung call
    session = engine.create_session()
    for close in (session.close, engine.close):
        def on_token(token, close=close):
            close()

        raised = _within(60, lambda: session.generate([1, 2, 3], max_new_tokens=4, on_token=on_token))
        assert isinstance(raised, FailedPreconditionError) and "inside" in str(raised), raised
        assert not session.closed
    session.reset()
    assert len(session.generate([1, 2, 3], max_new_tokens=4).tokens) == 4
    _within(60, engine.close)
    assert session.closed


def test_sessions_made_while_the_engine_closes_are_closed_with_it():
    """Threads making sessions while the engine closes get either a session that the
    close closed or an error: none is left open, holding its cache and adapter pins."""
    for _ in range(5):
        engine = Engine(MODEL_FILES["default"])
        made, refusals, started = [], [], threading.Barrier(4)

        def make():
            started.wait()
            while True:
                try:
                    made.append(engine.create_session(SessionConfig(lora_path=adapter_path("torch_r4"))))
                except Exception as exc:  # the test reads which
                    refusals.append(exc)
                    return

        threads = [threading.Thread(target=make) for _ in range(3)]
        for thread in threads:
            thread.start()
        started.wait()
        time.sleep(0.01)
        engine.close()
        for thread in threads:
            thread.join(60)
        assert made and all(session.closed for session in made)
        assert all(isinstance(exc, FailedPreconditionError) for exc in refusals), refusals


def test_argument_types_are_refused_with_the_runtimes_errors(engine):
    with engine.create_session() as session:
        for bad in (2.5, "3", None):
            with pytest.raises(InvalidArgumentError, match="max_new_tokens"):
                session.generate([1, 2], max_new_tokens=bad)
        assert session.position == 0
        assert len(session.generate([1, 2], max_new_tokens=np.int64(2)).tokens) == 2
    with pytest.raises(InvalidArgumentError, match="LoraSource"):
        engine.register_adapter(str(adapter_path("torch_r4")))
    with pytest.raises(InvalidArgumentError, match="session"):
        engine.decode_together([("not a session", 1)])


def test_an_on_token_that_is_not_callable_is_refused_before_the_prompt_runs(engine):
    """Was a TypeError after the prompt's prefill, which stayed in the context."""
    with engine.create_session() as session:
        with pytest.raises(InvalidArgumentError, match="on_token=5, expected a callable or None"):
            session.generate([1, 2], max_new_tokens=2, on_token=5)
        assert session.position == 0


def test_decode_together_refuses_steps_that_are_not_pairs_and_steps_a_generator(engine):
    """A bare session or a 1-tuple was a raw TypeError or ValueError; a generator of
    steps was read up to find the sessions and then stepped none of them."""
    with engine.create_session() as session:
        for steps in ([session], [(session,)], [(session, 1, 2)]):
            with pytest.raises(InvalidArgumentError, match=r"decode_together steps \(session, token\) pairs"):
                engine.decode_together(steps)
        assert session.position == 0
        (logits,) = engine.decode_together((pair for pair in [(session, 1)]))
        assert logits.shape == (engine.spec.vocab_size,) and session.position == 1


def test_token_ids_from_a_generator_are_checked_as_a_list_is(engine):
    """A generator was read once to convert its items and then found empty by the check
    that they are whole numbers, so 1.5 and 2.7 ran as the tokens 1 and 2."""
    with engine.create_session() as session:
        with pytest.raises(InvalidArgumentError, match=r"must be integers, got \[1.5, 2.7\]"):
            session.run_prefill(t for t in [1.5, 2.7])
        with pytest.raises(InvalidArgumentError, match="must be integers"):
            session.generate((t for t in [1, 2.5]), max_new_tokens=1)
        assert session.position == 0
        session.run_prefill(t for t in [1.0, 2])  # whole numbers, from a generator too
        assert session.position == 2


def test_a_sampler_picking_outside_the_vocabulary_fails_its_own_generation_only():
    """A Sampler subclass returning token 300 (vocabulary 256) sent it to the model: LiteRT
    failed the decode batch it was in ('Embedding Lookup: index out of bounds'), and the
    other session of that batch got the INTERNAL error too."""
    both_sampled = threading.Barrier(2)

    class Synchronized(Sampler):
        """Greedy; its second pick waits for the other session's, so that both sessions'
        next decode steps are submitted together (one batch)."""

        def __init__(self, second: int | None = None) -> None:
            super().__init__()
            self.picks, self.second = 0, second

        def sample(self, logits: np.ndarray) -> int:
            self.picks += 1
            if self.picks == 2:
                both_sampled.wait(10)
                if self.second is not None:
                    return self.second
            return super().sample(logits)

    with Engine(MODEL_FILES["default"], EngineSettings(batch_wait_s=0.25)) as engine:
        with engine.create_session() as session:
            expected = session.generate([4, 5, 6], max_new_tokens=6).tokens
        outcomes: dict[str, object] = {}

        def generate(name: str, sampler: Sampler) -> None:
            try:
                with engine.create_session() as session:
                    outcomes[name] = session.generate([4, 5, 6], max_new_tokens=6, sampler=sampler).tokens
            except Exception as exc:  # the test reads which
                outcomes[name] = exc

        threads = [threading.Thread(target=generate, args=("bad", Synchronized(300))),
                   threading.Thread(target=generate, args=("good", Synchronized()))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert outcomes["good"] == expected
    assert isinstance(outcomes["bad"], InvalidArgumentError), outcomes["bad"]
    assert "returned 300, expected a token id in [0, 256)" in str(outcomes["bad"])


def test_flags_and_counts_take_bools_and_integers_only(engine):
    """``reset="no"`` cleared the session's context and ``decode_steps="no"`` scored by
    decode steps (any truthy value counted as True), and ``max_new_tokens=True`` generated
    one token."""
    with engine.create_session() as session:
        session.run_prefill([1, 2, 3])
        with pytest.raises(InvalidArgumentError, match="reset='no', expected True or False"):
            session.set_adapters(reset="no")
        assert session.position == 3
        with pytest.raises(InvalidArgumentError, match="decode_steps='no', expected True or False"):
            session.score([4, 5], decode_steps="no")
        with pytest.raises(InvalidArgumentError, match="max_new_tokens=True, expected an integer >= 1"):
            session.generate([4], max_new_tokens=True)
        assert session.position == 3
        session.set_adapters(reset=True)
        assert session.position == 0


@pytest.mark.parametrize("adapters", [np.array([1, 2]), [(1, 1.0)], 5], ids=["array", "pairs", "int"])
def test_set_adapters_refuses_adapters_that_are_not_a_mapping(engine, adapters):
    """An array was numpy's ValueError (its truth value read before the check)."""
    with engine.create_session() as session:
        with pytest.raises(InvalidArgumentError, match="adapters=.*expected a mapping of adapter id to scale"):
            session.set_adapters(adapters=adapters, reset=True)


@pytest.mark.parametrize("loras", ["adapter.tflite", [b"bytes"], 5])
def test_set_adapters_refuses_what_is_not_lora_sources_and_keeps_the_old_ones(loras):
    with Engine(MODEL_FILES["default"]) as engine:
        session = engine.create_session(SessionConfig(lora_path=adapter_path("torch_r4")))
        before = session.lora_ids
        with pytest.raises(InvalidArgumentError, match="LoraSource"):
            session.set_adapters(loras)
        assert session.lora_ids == before
        session.run_decode(1)


@pytest.mark.parametrize("decode_steps", [False, True])
def test_score_returns_the_logits_after_every_token(engine, weights, decode_steps):
    """Scoring a prompt gives each position's logits, equal to the reference model's, and
    leaves the session where a prefill would (the next decode step continues from it)."""
    if not engine.spec.prefill_has_logits and not decode_steps:
        with engine.create_session() as session:
            with pytest.raises(FailedPreconditionError, match=r"--score-lengths 128,512. \(or --prefill-logits\)"):
                session.score(PROMPT)
            assert session.position == 0
        return
    with engine.create_session() as session:
        got = session.score(PROMPT, decode_steps=decode_steps)
        assert got.shape == (len(PROMPT), engine.spec.vocab_size) and got.dtype == np.float32
        assert session.position == len(PROMPT)
        after = session.run_decode(CONTINUATION[0])
    expected = reference_logits(weights, PROMPT + CONTINUATION[:1])
    np.testing.assert_allclose(got, expected[: len(PROMPT)], atol=TOL)
    np.testing.assert_allclose(after, expected[len(PROMPT)], atol=TOL)


def test_score_with_an_adapter_and_after_a_generation(engine, weights):
    """The adapter applies to every scored position; a generation's pending token is
    written first."""
    deltas = adapter_deltas("torch_r4")
    with engine.create_session(SessionConfig(lora_path=adapter_path("torch_r4"))) as session:
        result = session.generate(PROMPT, 2, stop_tokens=[])
        got = session.score(CONTINUATION, decode_steps=True)
    tokens = PROMPT + result.tokens + CONTINUATION
    expected = reference_logits(weights, tokens, lora=deltas)[len(PROMPT) + 2:]
    np.testing.assert_allclose(got, expected, atol=TOL)


def test_score_refuses_what_does_not_fit(engine):
    with engine.create_session() as session:
        with pytest.raises(ResourceExhaustedError):
            session.score([1] * (engine.spec.kv_length + 1), decode_steps=True)
        with pytest.raises(InvalidArgumentError):
            session.score([], decode_steps=True)
        assert session.position == 0
