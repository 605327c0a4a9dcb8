"""Tests for runtime.engine.speculative: Turbo LoRA's draft heads in generate(), lossless.

The fixtures (tools/build_turbo_fixtures.py) are the tiny GQA model exported with verify4
signatures in both KV layouts (and verify4_attend16: a generation's verifies run in the
16-position window first, then over the whole cache) and PEFT adapters carrying the qkvo_r4 LoRA plus draft heads:
random (drafts mostly rejected), trained on TRAINED_PROMPTS' continuations (mostly kept),
LoRAX's multi-layer layout, and heads of the wrong width.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
import shutil
import threading

import numpy as np
import pytest

from conftest import MODEL_FILES, MODELS
from runtime import Engine, EngineSettings, LoraSource, SessionConfig
from runtime.engine.speculative import AcceptanceGate, SpeculationPolicy
from runtime.errors import FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError

TURBO = MODELS / "turbo"
LAYOUTS = {"default": TURBO / "default.tflite", "transposed": TURBO / "transposed.tflite"}
TRAINED_PROMPTS = json.loads((TURBO / "trained_heads" / "training.json").read_text())["prompts"]
ALWAYS = SpeculationPolicy(probe_verifies=10_000)  # heads never switch themselves off
OTHER_PROMPTS = [[9, 8, 7], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109]]


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def engine(request):
    with Engine(LAYOUTS[request.param], EngineSettings(speculation=ALWAYS)) as engine:
        yield engine


def _generate(engine: Engine, source: LoraSource, prompt: list[int], **kwargs):
    with engine.create_session(SessionConfig(loras=[source])) as session:
        result = session.generate(prompt, **kwargs)
        return result, session.position, session.stats().speculation


@pytest.mark.parametrize("heads", ["trained_heads", "random_heads", "lorax_heads"])
def test_greedy_output_is_identical_to_the_same_lora_without_heads(engine, heads):
    for prompt in TRAINED_PROMPTS + OTHER_PROMPTS:
        for max_new in (1, 2, 5, 40):
            plain, plain_position, plain_stats = _generate(
                engine, LoraSource(path=TURBO / heads, heads=False), prompt, max_new_tokens=max_new)
            turbo, turbo_position, _ = _generate(engine, LoraSource(path=TURBO / heads), prompt, max_new_tokens=max_new)
            assert turbo.tokens == plain.tokens, (heads, prompt, max_new)
            assert turbo_position == plain_position  # every generated token is in the context, as plainly
            assert turbo.stop_reason == plain.stop_reason
            assert plain_stats.verifies == 0


def test_the_first_step_drafts_from_the_prompts_last_hidden_state(engine):
    """The prompt's last tokens run as a verify (a prefill returns no hidden states), so
    the first step after the prompt already carries a draft; the tokens stay plain's."""
    for prompt in (TRAINED_PROMPTS[0], [9], OTHER_PROMPTS[1]):  # a short prompt goes through verify whole
        turbo, position, stats = _generate(engine, LoraSource(path=TURBO / "trained_heads"), prompt, max_new_tokens=2)
        plain, plain_position, _ = _generate(engine, LoraSource(path=TURBO / "trained_heads", heads=False), prompt,
                                             max_new_tokens=2)
        assert (turbo.tokens, position) == (plain.tokens, plain_position)
        assert stats.verifies == 1 and stats.drafted == 1, stats


def test_trained_heads_keep_most_drafts_and_random_ones_few(engine):
    before = engine.stats().speculation
    for prompt in TRAINED_PROMPTS:
        _generate(engine, LoraSource(path=TURBO / "trained_heads"), prompt, max_new_tokens=40)
    stats = engine.stats().speculation
    tokens, verifies = stats.tokens - before.tokens, stats.verifies - before.verifies
    assert tokens / verifies > 2.5  # of at most 4 per verify forward
    _, _, random_stats = _generate(engine, LoraSource(path=TURBO / "random_heads"), OTHER_PROMPTS[1],
                                   max_new_tokens=40)
    assert random_stats.tokens_per_verify < 2
    assert len(random_stats.accepted) == 3 and random_stats.drafted > 0


def test_stop_tokens_end_generation_where_plain_decoding_does(engine):
    prompt = TRAINED_PROMPTS[0]
    reference, _, _ = _generate(engine, LoraSource(path=TURBO / "trained_heads", heads=False), prompt,
                                max_new_tokens=40)
    for stop in (reference.tokens[3], reference.tokens[10], reference.tokens[-1]):
        plain, plain_position, _ = _generate(engine, LoraSource(path=TURBO / "trained_heads", heads=False), prompt,
                                             max_new_tokens=40, stop_tokens=[stop])
        streamed: list[int] = []
        turbo, turbo_position, _ = _generate(engine, LoraSource(path=TURBO / "trained_heads"), prompt,
                                             max_new_tokens=40, stop_tokens=[stop], on_token=streamed.append)
        assert turbo.tokens == plain.tokens == streamed
        assert turbo.stop_reason == plain.stop_reason == "stop_token"
        assert turbo_position == plain_position


class _Stop(Exception):
    """What a caller's ``on_token`` raises to end a generation (a stop string seen)."""


def test_a_generation_stopped_from_on_token_inside_a_kept_draft_leaves_plain_decodings_context(engine):
    """Raising from ``on_token`` is how a caller stops a generation (a stop string): the
    session holds what plain decoding's would, every streamed token before the one it
    raised on. Stopping on a kept draft left the session where its verify run started,
    without the trunk's token and the drafts before it that the caller had been given, so
    the conversation went on from another context than plain decoding's."""
    prompt = TRAINED_PROMPTS[0]
    for stop_at in range(1, 12):
        outcomes = []
        for heads in (True, False):
            with engine.create_session(SessionConfig(loras=[LoraSource(path=TURBO / "trained_heads",
                                                                       heads=heads)])) as session:
                streamed: list[int] = []

                def on_token(token: int) -> None:
                    streamed.append(token)
                    if len(streamed) == stop_at:
                        raise _Stop

                with pytest.raises(_Stop):
                    session.generate(prompt, max_new_tokens=20, on_token=on_token)
                outcomes.append((streamed, session.position, session.generate([3, 4], max_new_tokens=8).tokens))
        assert outcomes[0] == outcomes[1], stop_at
        assert outcomes[0][1] == len(prompt) + stop_at - 1


def test_speculation_stats_count_what_a_generation_ended_inside_a_kept_draft_gave(engine):
    """A stop token, ``max_new_tokens`` or ``on_token`` raising on a kept draft ends the
    generation there. The stats counted the trunk's token after it (never made) for a stop,
    nothing of the run (its kept drafts streamed to the caller) for a raise, and the drafts
    after the end as proposed and rejected: decode tokens are what was streamed after the
    first (the prefill's), as plainly, and each verify run gives its kept drafts plus the
    trunk's token unless the generation ended on a kept draft."""
    prompt = TRAINED_PROMPTS[0]
    reference = _generate(engine, LoraSource(path=TURBO / "trained_heads", heads=False), prompt,
                          max_new_tokens=20)[0].tokens
    ends = [{"stop_at": n} for n in range(2, 12)] + [{"stop_tokens": [reference[n]]} for n in (3, 7, 10)] + [
        {"max_new_tokens": n} for n in (3, 7, 10)]
    for end in ends:
        with engine.create_session(SessionConfig(loras=[LoraSource(path=TURBO / "trained_heads")])) as session:
            streamed: list[int] = []
            stop_at = end.get("stop_at")

            def on_token(token: int) -> None:
                streamed.append(token)
                if len(streamed) == stop_at:
                    raise _Stop

            try:
                session.generate(prompt, max_new_tokens=end.get("max_new_tokens", 20),
                                 stop_tokens=end.get("stop_tokens", ()), on_token=on_token)
            except _Stop:
                pass
            stats = session.stats()
        spec = stats.speculation
        assert stats.decode_tokens == spec.tokens + spec.plain_steps == len(streamed) - 1, (end, spec)
        ended_on_draft = spec.tokens - sum(spec.accepted) - spec.verifies  # 0, or -1: the last run gave no trunk token
        assert ended_on_draft in (0, -1), (end, spec)
        assert spec.drafted >= sum(spec.accepted) and spec.acceptance_rate > 0.5, (end, spec)


def test_a_session_goes_on_after_a_speculative_generation_as_after_a_plain_one(engine):
    outputs = []
    for heads in (True, False):
        with engine.create_session(SessionConfig(loras=[LoraSource(path=TURBO / "trained_heads", heads=heads)])) as s:
            first = s.generate(TRAINED_PROMPTS[1], max_new_tokens=20).tokens
            outputs.append((first, s.generate([3, 4], max_new_tokens=20).tokens, s.position))
    assert outputs[0] == outputs[1]


def test_a_blend_uses_no_heads_and_stats_say_so(engine):
    before = engine.stats().speculation.blends_without_heads
    loras = [LoraSource(path=TURBO / "trained_heads", scale=0.5), LoraSource(path=MODELS / "peft" / "qkvo_r4",
                                                                              scale=0.5)]
    with engine.create_session(SessionConfig(loras=loras)) as session:
        session.generate(TRAINED_PROMPTS[0], max_new_tokens=8)
        assert session.stats().speculation.verifies == 0
    assert engine.stats().speculation.blends_without_heads == before + 1


def test_heads_switch_themselves_off_when_rarely_right_across_generations():
    policy = SpeculationPolicy(probe_verifies=4, min_accepted_per_verify=0.5, pause_tokens=100)
    with Engine(LAYOUTS["default"], EngineSettings(speculation=policy)) as engine:
        source = LoraSource(path=TURBO / "random_heads")
        _, _, first = _generate(engine, source, OTHER_PROMPTS[1], max_new_tokens=40)
        assert first.plain_steps >= 30 and first.verifies <= 6
        paused = [_generate(engine, source, prompt, max_new_tokens=3)[2] for prompt in ([1, 2], [3, 4])]
        assert all(stats.verifies == 0 for stats in paused)  # still in the pause another generation began
        # Another adapter's heads keep their own count.
        _, _, trained = _generate(engine, LoraSource(path=TURBO / "trained_heads"), TRAINED_PROMPTS[0],
                                  max_new_tokens=40)
        assert trained.verifies > 0 and trained.plain_steps == 0


def test_heads_count_in_the_adapters_bytes_and_go_with_unload(engine):
    turbo = engine.register_adapter(LoraSource(path=TURBO / "trained_heads"))
    alone = engine.register_adapter(LoraSource(path=TURBO / "trained_heads", heads=False))
    assert turbo != alone
    stats = {a.lora_id: a for a in engine.stats().adapters}
    assert stats[turbo].draft_heads == 3 and stats[turbo].draft_head_bytes == 3 * (64 * 64 + 64) * 4
    assert stats[turbo].tensor_bytes == stats[alone].tensor_bytes + stats[turbo].draft_head_bytes
    assert stats[alone].draft_heads == 0
    engine.unload_adapter(turbo)
    assert turbo not in {a.lora_id for a in engine.stats().adapters}
    again = engine.register_adapter(LoraSource(path=TURBO / "trained_heads"))
    assert {a.lora_id: a for a in engine.stats().adapters}[again].draft_heads == 3
    engine.unload_adapter(again)
    engine.unload_adapter(alone)


def test_wrong_width_heads_are_refused_and_load_alone_with_heads_false(engine):
    with pytest.raises(FailedPreconditionError, match="--verify-lengths.*heads=False"):
        engine.register_adapter(LoraSource(path=TURBO / "wrong_width_heads"))
    assert all(a.source != str(TURBO / "wrong_width_heads") for a in engine.stats().adapters)
    lora_id = engine.register_adapter(LoraSource(path=TURBO / "wrong_width_heads", heads=False))
    engine.unload_adapter(lora_id)


def test_heads_of_mixed_widths_are_refused_at_register_not_in_a_generation(engine, tmp_path):
    """Head 0 of the model's width and head 2 narrower: the width check read head 0's
    alone, so the adapter registered and its sessions' generations raised numpy's
    ValueError at the first draft."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(TURBO / "trained_heads", tmp_path / "mixed")
    weights = tmp_path / "mixed" / "adapter_model.safetensors"
    state = load_file(weights)
    state["medusa_head.2.linear.weight"] = state["medusa_head.2.linear.weight"][:32, :32].copy()
    state["medusa_head.2.linear.bias"] = state["medusa_head.2.linear.bias"][:32].copy()
    save_file(state, weights)
    before = engine.adapter_ids()
    with pytest.raises(InvalidArgumentError, match=r"draft head 2 block 0: .* \[32, 32\] .*hidden = 64, head 0's"):
        engine.create_session(SessionConfig(loras=[LoraSource(path=tmp_path / "mixed")]))
    assert engine.adapter_ids() == before


def test_a_model_without_verify_signatures_refuses_heads():
    with Engine(MODEL_FILES["default"]) as engine:
        with pytest.raises(FailedPreconditionError, match="--verify-lengths 4.*heads=False"):
            engine.create_session(SessionConfig(loras=[LoraSource(path=TURBO / "trained_heads")]))
        assert engine.adapter_ids() == []
        with engine.create_session(SessionConfig(loras=[LoraSource(path=TURBO / "trained_heads", heads=False)])) as s:
            assert len(s.generate([1, 2, 3], max_new_tokens=4).tokens) == 4


def test_sessions_speculating_from_many_threads_each_match_plain(engine):
    expected = {i: _generate(engine, LoraSource(path=TURBO / "trained_heads", heads=False), p, max_new_tokens=30)[0]
                .tokens for i, p in enumerate(TRAINED_PROMPTS)}
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            got[index] = _generate(engine, LoraSource(path=TURBO / "trained_heads"), TRAINED_PROMPTS[index],
                                   max_new_tokens=30)[0].tokens
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(TRAINED_PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and got == expected


def test_verify_near_the_end_of_the_cache_falls_back_to_plain_steps(engine):
    prompt = list(np.arange(1, 60) % 250 + 1)  # KV length 64: 5 tokens of room
    plain, _, _ = _generate(engine, LoraSource(path=TURBO / "trained_heads", heads=False), prompt, max_new_tokens=5)
    turbo, position, stats = _generate(engine, LoraSource(path=TURBO / "trained_heads"), prompt, max_new_tokens=5)
    assert turbo.tokens == plain.tokens and position == 64 and stats.plain_steps > 0


def test_each_failed_probe_doubles_the_pause_and_a_passing_one_resets_it():
    gate = AcceptanceGate(SpeculationPolicy(probe_verifies=2, min_accepted_per_verify=1.0, pause_tokens=3,
                                            max_pause_tokens=6))

    def pause_after_probe(kept: int) -> int:
        for _ in range(2):
            gate.verified(kept)
        steps = 0
        while not gate.heads_on():
            gate.plain_step()
            steps += 1
        return steps

    assert [pause_after_probe(0) for _ in range(4)] == [3, 6, 6, 6]
    assert pause_after_probe(2) == 0
    assert pause_after_probe(0) == 3


def test_unloading_an_adapter_drops_its_speculation_gate():
    """Each adapter's heads have a gate shared by its sessions; unloading the adapter drops
    it (ids are never reused, so a gate left behind would be kept for nothing, forever)."""
    def gates() -> int:
        gc.collect()
        return sum(isinstance(o, AcceptanceGate) for o in gc.get_objects())

    with Engine(LAYOUTS["default"], EngineSettings(speculation=ALWAYS)) as engine:
        before = gates()
        lora_id = engine.register_adapter(LoraSource(path=TURBO / "trained_heads"))
        with engine.create_session(SessionConfig(adapters={lora_id: 1.0})) as session:
            assert session.generate(TRAINED_PROMPTS[0], max_new_tokens=4).tokens
            assert session.stats().speculation.verifies > 0  # the heads ran, through the adapter's gate
        assert gates() == before + 1
        engine.unload_adapter(lora_id)
        assert gates() == before


def test_a_turbo_adapter_is_read_in_one_pass(monkeypatch):
    """Its LoRA tensors and its draft heads come from one opening of its safetensors file."""
    import safetensors

    opened = []
    real = safetensors.safe_open

    def counting(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", counting)
    with Engine(LAYOUTS["default"]) as engine:
        lora_id = engine.register_adapter(LoraSource(path=TURBO / "trained_heads"))
        assert engine.adapter(lora_id).draft_heads > 0
    assert opened == ["adapter_model.safetensors"]


def test_hidden_states_are_the_lm_heads_input_along_the_tokens(engine):
    """Session.hidden_states (what ``train-turbo --trunk`` trains heads on): verify runs, L
    tokens at a time, whose states give the logits plain prefill and decode steps give."""
    from runtime.util.output_projection import read_output_projection

    lm_head = read_output_projection(LAYOUTS["default"], "verify4", "verify4")
    prompt = OTHER_PROMPTS[1]  # 10 tokens: verify4 runs of 4, 4 and 2
    source = LoraSource(path=TURBO / "trained_heads", heads=False)
    with engine.create_session(SessionConfig(loras=[source])) as session:
        session.run_prefill(prompt[:1])
        states = session.hidden_states(prompt[1:])
        assert states.shape == (9, 64) and session.position == 10
    with engine.create_session(SessionConfig(loras=[source])) as session:
        expected = [session.run_prefill(prompt[:2])] + [session.run_decode(token) for token in prompt[2:]]
    np.testing.assert_allclose(states @ lm_head.T, np.asarray(expected), atol=1e-3)


def test_hidden_states_need_verify_signatures_and_room():
    with Engine(MODEL_FILES["default"]) as engine, engine.create_session() as session:
        with pytest.raises(FailedPreconditionError, match="--verify-lengths"):
            session.hidden_states([1, 2, 3])
    with Engine(LAYOUTS["default"]) as engine, engine.create_session() as session:
        session.run_prefill([7])
        with pytest.raises(ResourceExhaustedError, match=r"do not fit the KV cache of 64 in verify4 runs \(a model "
                                                         r"exported with a larger --kv-length holds more\)"):
            session.hidden_states(list(range(62)))  # the last verify4 run would take positions 61 ... 64
        assert session.hidden_states(list(range(60))).shape == (60, 64)  # the last one 57 ... 60
        session.run_prefill([1, 2, 3])
        # No tokens need no room: refused as a verify run past the cache's end before.
        assert session.hidden_states([]).shape == (0, 64) and session.position == 64
