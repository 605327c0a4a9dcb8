"""Tests for runtime.executor.litert_executor against the numpy reference."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

from conftest import MODEL_FILES, MODELS, adapter_deltas, adapter_path, gate_group_view
from reference_model import reference_logits
from runtime.components.lora import LoRA, plan_adapter
from runtime.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from runtime.executor import litert_executor
from runtime.executor.batch_plan import DecodeRow, plan_decode
from runtime.executor.litert_executor import Binding, DecodeStep, ExecutorSettings, LlmExecutor, prefill_chunks
from runtime.executor.weight_cache import WeightCacheFile, survey
from runtime.adapters.lora_data import LoraData
from runtime.util.signature_names import LoraSlot

TOL = 1e-4


@pytest.fixture(scope="module", params=["default", "transposed", "grouped"])
def executor(request):
    executor = LlmExecutor(MODEL_FILES[request.param])
    yield executor
    executor.close()


def tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


@pytest.mark.parametrize("length", [1, 2, 7, 8, 9, 20, 32, 33, 45, 63])
def test_prefill_chunking_matches_reference(executor, weights, length):
    prompt = tokens(length, seed=length)
    binding = executor.bind(executor.create_kv_cache())
    logits = executor.prefill(binding, prompt, 0)
    expected = reference_logits(weights, prompt)
    assert logits.shape == (256,) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, expected[-1], atol=TOL)


def test_prefill_then_decode_and_continue(executor, weights):
    seq = tokens(30, seed=3)
    binding = executor.bind(executor.create_kv_cache())
    executor.prefill(binding, seq[:10], 0)
    logits = executor.prefill(binding, seq[10:21], 10)  # appending to existing context
    expected = reference_logits(weights, seq)
    np.testing.assert_allclose(logits, expected[20], atol=TOL)
    for pos in range(21, 30):
        logits = executor.decode(binding, seq[pos], pos)
        np.testing.assert_allclose(logits, expected[pos], atol=TOL)


def test_rank_4_adapter_in_rank_16_slot(executor, weights):
    plan = plan_adapter(LoraData.create_from_file_path(adapter_path("torch_r4")), {LoraSlot(16): executor.spec.slot_inputs(LoraSlot(16))})
    lora = LoRA([(plan, 1.0)], LoraSlot(16), executor.spec.slot_inputs(LoraSlot(16)), lambda n: executor.create_lora_buffer(LoraSlot(16), n))
    binding = executor.bind(executor.create_kv_cache(), lora.buffers, LoraSlot(16))
    seq = tokens(14, seed=4)
    expected = reference_logits(weights, seq, lora=adapter_deltas("torch_r4"))
    np.testing.assert_allclose(executor.prefill(binding, seq[:6], 0), expected[5], atol=TOL)
    for pos in range(6, 14):
        np.testing.assert_allclose(executor.decode(binding, seq[pos], pos), expected[pos], atol=TOL)


def bind_in_r16_slot(executor: LlmExecutor, adapter: str | None) -> tuple[Binding, dict | None]:
    """A fresh KV cache bound to ``adapter`` (a fixture's name) in the rank-16 slot, or to
    no LoRA; and the adapter's deltas for the reference."""
    if adapter is None:
        return executor.bind(executor.create_kv_cache()), None
    slot = LoraSlot(16)
    plan = plan_adapter(LoraData.create_from_file_path(adapter_path(adapter)), {slot: executor.spec.slot_inputs(slot)})
    lora = LoRA([(plan, 1.0)], slot, executor.spec.slot_inputs(slot), lambda n: executor.create_lora_buffer(slot, n))
    return executor.bind(executor.create_kv_cache(), lora.buffers, slot), adapter_deltas(adapter)


@pytest.mark.parametrize("adapter", [None, "torch_r4"])
def test_decode_across_its_attention_windows_matches_reference(executor, weights, adapter):
    """Positions 0-15 run decode_attend16, 16-31 decode_attend32, the rest the whole
    cache: every step's logits are the reference's, at each window's edges too."""
    assert executor.spec.windows(None) == executor.spec.windows(LoraSlot(16)) == (16, 32)
    binding, deltas = bind_in_r16_slot(executor, adapter)
    seq = tokens(64, seed=9)
    expected = reference_logits(weights, seq, lora=deltas)
    for pos in range(64):
        np.testing.assert_allclose(executor.decode(binding, seq[pos], pos), expected[pos], atol=TOL,
                                   err_msg=f"position {pos}")


def test_a_context_moves_between_window_caches_both_ways(executor, weights):
    """Each window's signatures take a cache of its own length: a context that grew from
    the 16-position window into the 32 one and on to the whole cache, then was rewound to
    position 10 (a rejected draft, a reused prefix), runs in the 16 window again and every
    step equals the reference of the context it holds; the buffers it left hold no data."""
    binding = executor.bind(executor.create_kv_cache())
    first, second = tokens(40, seed=21), tokens(40, seed=22)
    expected = reference_logits(weights, first)
    for pos in range(40):
        np.testing.assert_allclose(executor.decode(binding, first[pos], pos), expected[pos], atol=TOL)
    assert binding.kv.length == executor.spec.kv_length
    rewound = first[:10] + second[10:30]
    expected = reference_logits(weights, rewound)
    for pos in range(10, 30):
        np.testing.assert_allclose(executor.decode(binding, rewound[pos], pos), expected[pos], atol=TOL,
                                   err_msg=f"position {pos}")
    assert binding.kv.length == 32
    if sys.platform.startswith("linux"):  # released pages read as zeros there
        for length in (16, executor.spec.kv_length):
            assert not any(buffer.array.any() for buffer in binding.kv.at(length).values()), length


@pytest.mark.parametrize("adapter", [None, "torch_r4"])
def test_prefill_chunks_attend_over_the_shortest_window_that_holds_them(executor, weights, adapter, monkeypatch):
    """A chunk whose last token lies below 16 runs a prefill attending over 16 positions,
    below 32 over 32, past that the whole cache (padded chunks too): the logits are the
    reference's either way, and each window is used."""
    ran = []
    run_filled = executor._run_filled
    monkeypatch.setattr(executor, "_run_filled", lambda run: ran.append(run.signature.key) or run_filled(run))
    binding, deltas = bind_in_r16_slot(executor, adapter)
    suffix = "" if adapter is None else "_lora_r16"
    seq = tokens(60, seed=11)
    expected = reference_logits(weights, seq, lora=deltas)
    for start, end in ((0, 9), (9, 20), (20, 60)):  # chunks ending at 7 and 8 | 16 and 19 | 51 and 59
        np.testing.assert_allclose(executor.prefill(binding, seq[start:end], start), expected[end - 1], atol=TOL,
                                   err_msg=f"tokens {start}-{end - 1}")
    prefills = {key for key in ran if key.startswith("prefill")}
    assert {f"prefill_8_attend16{suffix}", f"prefill_8_attend32{suffix}", f"prefill_32{suffix}"} <= prefills, ran
    assert not any("attend" in key for key in ran[ran.index(f"prefill_32{suffix}"):]), ran


def test_kv_copy_is_independent(executor, weights):
    seq = tokens(12, seed=5)
    original = executor.bind(executor.create_kv_cache())
    executor.prefill(original, seq[:8], 0)
    copy = executor.bind(executor.copy_kv_cache(original.kv, 8))
    executor.decode(original, 1, 8)  # diverge the original
    expected = reference_logits(weights, seq)
    np.testing.assert_allclose(executor.decode(copy, seq[8], 8), expected[8], atol=TOL)


def test_a_kv_copy_holds_the_positions_asked_for_and_zeros_after(executor, weights):
    """A context rewound to position 5 (a rejected draft) is copied as it reads: its first 5
    positions, none of the 8 written before; the copy's steps are the rewound context's."""
    seq, other = tokens(12, seed=5), tokens(12, seed=6)
    original = executor.bind(executor.create_kv_cache())
    executor.prefill(original, seq[:8], 0)
    copy = executor.bind(executor.copy_kv_cache(original.kv, 5))
    for name, buffer in copy.kv.at(copy.kv.length).items():
        axis = executor.spec.kv_position_axis(name)
        past = buffer.array[(slice(None),) * axis + (slice(5, None),)]
        assert not past.any(), name
    rewound = seq[:5] + other[5:]
    expected = reference_logits(weights, rewound)
    np.testing.assert_allclose(executor.decode(copy, rewound[5], 5), expected[5], atol=TOL)
    with pytest.raises(InvalidArgumentError, match="copying 65 positions"):
        executor.copy_kv_cache(original.kv, 65)


def test_context_overflow_leaves_the_cache_usable(executor, weights):
    seq = tokens(64, seed=6)
    binding = executor.bind(executor.create_kv_cache())
    executor.prefill(binding, seq[:60], 0)
    with pytest.raises(ResourceExhaustedError, match="exceed the KV cache of 64"):
        executor.prefill(binding, seq[60:64] + [1], 60)
    with pytest.raises(ResourceExhaustedError):
        executor.decode(binding, 1, 64)
    expected = reference_logits(weights, seq)
    np.testing.assert_allclose(executor.prefill(binding, seq[60:64], 60), expected[63], atol=TOL)


def test_bad_arguments(executor):
    binding = executor.bind(executor.create_kv_cache())
    with pytest.raises(InvalidArgumentError):
        executor.prefill(binding, [], 0)
    with pytest.raises(InvalidArgumentError):
        executor.decode(binding, 1, -1)
    with pytest.raises(NotFoundError):
        executor.create_lora_buffer(LoraSlot(4), "kv_cache_k_0")
    with pytest.raises(InvalidArgumentError):
        executor.bind(binding.kv, lora_slot=LoraSlot(4))


def test_missing_and_invalid_model_files(tmp_path):
    with pytest.raises(NotFoundError):
        LlmExecutor(tmp_path / "missing.tflite")
    bogus = tmp_path / "bogus.tflite"
    bogus.write_bytes(b"not a model at all")
    with pytest.raises(InvalidArgumentError, match="cannot load"):
        LlmExecutor(bogus)
    with pytest.raises(InvalidArgumentError):
        ExecutorSettings(num_threads=-1)


def test_closed_executor_refuses_work():
    executor = LlmExecutor(MODEL_FILES["default"])
    binding = executor.bind(executor.create_kv_cache())
    executor.close()
    executor.close()
    with pytest.raises(FailedPreconditionError):
        executor.decode(binding, 1, 0)
    with pytest.raises(FailedPreconditionError):
        executor.create_kv_cache()


def test_each_step_returns_a_fresh_logits_array():
    executor = LlmExecutor(MODEL_FILES["transposed"])
    binding = executor.bind(executor.create_kv_cache())
    first = executor.decode(binding, 7, 0)
    kept = first.copy()
    second = executor.decode(binding, 8, 1)
    assert first is not second and not np.shares_memory(first, second)
    np.testing.assert_array_equal(first, kept)  # the later step did not overwrite it
    assert not np.array_equal(first, second)
    executor.close()


@pytest.mark.parametrize("count, room, expected", [
    (127, 1024, [128]),  # one padded run, not prefill_32 four times: the same positions in one pass
    (100, 1024, [128]),
    (511, 1024, [512]),
    (1000, 1024, [512, 512]),
    (60, 1024, [32, 32]),  # not a padded prefill_128: 68 positions more to save one run
    (32, 1024, [32]),
    (5, 1024, [32]),
    (40, 60, [32, 1, 1, 1, 1, 1, 1, 1, 1]),  # no room to pad the last 8: decode steps
])
def test_a_prompt_is_cut_into_the_runs_that_compute_the_fewest_positions(count, room, expected):
    assert prefill_chunks(count, (32, 128, 512), room) == expected


def test_every_prefill_plan_covers_its_tokens_within_the_cache():
    for lengths in [(32, 128, 512), (8, 128), (5, 7), ()]:
        for room in (1, 9, 40, 130, 600):
            for count in range(0, room + 1, 3):
                chunks = prefill_chunks(count, lengths, room)
                assert all(chunk in (*lengths, 1) for chunk in chunks)
                *exact, last = chunks or [0]
                assert sum(exact) < count or count == 0  # only the last chunk may be padded
                assert count <= sum(chunks) <= room
                assert sum(chunks) == count or last in lengths  # padding only in a prefill


def test_no_prefill_lengths_means_decode_steps():
    assert prefill_chunks(3, (), 100) == [1, 1, 1]


# -- compiling signature groups on demand ---------------------------------------------


def _on_demand(tmp_path, name: str = "transposed", **settings) -> LlmExecutor:
    """An executor of a committed model with a weight cache file in ``tmp_path`` (groups
    compile apart only over a file: in memory each would pack its own weights)."""
    path = MODEL_FILES[name] if name in MODEL_FILES else name
    return LlmExecutor(path, ExecutorSettings(**settings), weight_cache=WeightCacheFile.for_model(tmp_path, path))


@pytest.mark.parametrize("name", ["transposed", "default"])  # default: composites, renumbered in its views
def test_on_demand_opens_the_plain_group_and_compiles_a_slot_on_its_first_binding(tmp_path, weights, name):
    executor = _on_demand(tmp_path, name)
    try:
        assert executor.compiled_groups == ("plain",)
        assert len(executor.spec.signatures) == 36  # the spec knows every signature all the same
        seq = tokens(30, seed=11)
        binding = executor.bind(executor.create_kv_cache())
        expected = reference_logits(weights, seq)
        np.testing.assert_allclose(executor.prefill(binding, seq[:20], 0), expected[19], atol=TOL)
        for pos in range(20, 30):  # across the plain decode's windows (16, 32) and the whole cache
            np.testing.assert_allclose(executor.decode(binding, seq[pos], pos), expected[pos], atol=TOL)
        assert executor.compiled_groups == ("plain",)
        lora_binding, deltas = bind_in_r16_slot(executor, "torch_r4")
        assert executor.compiled_groups == ("plain", "lora_r16")
        expected = reference_logits(weights, seq, lora=deltas)
        np.testing.assert_allclose(executor.prefill(lora_binding, seq[:9], 0), expected[8], atol=TOL)
        for pos in range(9, 20):
            np.testing.assert_allclose(executor.decode(lora_binding, seq[pos], pos), expected[pos], atol=TOL)
        # One published weight cache file serves both groups; nothing is left half-built.
        assert len(list(tmp_path.glob("*.xnnpack"))) == 1
        assert not list(tmp_path.glob("*.building"))
    finally:
        executor.close()
    with pytest.raises(FailedPreconditionError):
        executor.bind(executor.create_kv_cache())


def test_a_longer_prefill_compiles_its_group_when_a_prompt_first_needs_it(tmp_path, weights):
    """The plain group holds decode and the shortest prefill (8): a short prompt runs with
    nothing else compiled; the first prompt a prefill_32 serves compiles that length's group."""
    executor = _on_demand(tmp_path)
    try:
        seq = tokens(40, seed=12)
        expected = reference_logits(weights, seq)
        np.testing.assert_allclose(executor.prefill(executor.bind(executor.create_kv_cache()), seq[:8], 0),
                                   expected[7], atol=TOL)
        assert executor.compiled_groups == ("plain",)
        assert 32 in prefill_chunks(40, executor.spec.prefill_lengths, executor.spec.kv_length)
        np.testing.assert_allclose(executor.prefill(executor.bind(executor.create_kv_cache()), seq, 0),
                                   expected[39], atol=TOL)
        assert executor.compiled_groups == ("plain", "plain_prefill32")
    finally:
        executor.close()


def test_a_batch_size_compiles_on_its_first_batch(tmp_path):
    executor = _on_demand(tmp_path)
    whole = LlmExecutor(MODEL_FILES["transposed"], ExecutorSettings(compile="all"))
    try:
        slot = LoraSlot(4)
        results = {}
        for name, each in (("on-demand", executor), ("all", whole)):
            plan = plan_adapter(LoraData.create_from_file_path(adapter_path("torch_r4")),
                                {slot: each.spec.slot_inputs(slot)})
            lora = LoRA([(plan, 1.0)], slot, each.spec.slot_inputs(slot), lambda n: each.create_lora_buffer(slot, n))
            bindings = [each.bind(each.create_kv_cache(), lora.buffers, slot) for _ in range(2)]
            for binding, seed in zip(bindings, (1, 2)):
                each.prefill(binding, tokens(5, seed), 0)
            steps = [DecodeStep(binding, token, 5) for binding, token in zip(bindings, (7, 9))]
            plan_ = plan_decode(each.spec, [DecodeRow(slot, 5), DecodeRow(slot, 5)])
            assert [run.signature.key for run in plan_.runs] == ["decode_batch2_attend16_lora_r4"]
            if each is executor:
                assert executor.compiled_groups == ("plain", "lora_r4")
            results[name] = each.run_decode_plan(plan_, steps)
        assert executor.compiled_groups == ("plain", "lora_r4", "batch2_lora_r4")
        for got, expected in zip(results["on-demand"], results["all"]):
            np.testing.assert_array_equal(got, expected)
    finally:
        executor.close()
        whole.close()


def test_verify_steps_compile_their_group_when_first_run(tmp_path):
    path = MODELS / "turbo" / "transposed.tflite"
    executor = LlmExecutor(path, weight_cache=WeightCacheFile.for_model(tmp_path, path))
    whole = LlmExecutor(path, ExecutorSettings(compile="all"))
    try:
        assert executor.compiled_groups == ("plain",)
        seq = tokens(12, seed=5)
        outputs = []
        for each in (executor, whole):
            binding = each.bind(each.create_kv_cache())
            each.prefill(binding, seq[:6], 0)
            outputs.append(each.verify(binding, seq[6:9], 6))  # a window's verify4 (positions 6..9 < 16)
            outputs.append(each.verify(binding, seq[6:10], 14))  # past the window: the whole cache's
        assert executor.compiled_groups == ("plain", "verify")
        for got, expected in zip(outputs[:2], outputs[2:]):
            np.testing.assert_array_equal(got[0], expected[0])
            np.testing.assert_array_equal(got[1], expected[1])
    finally:
        executor.close()
        whole.close()


def test_models_that_cannot_be_viewed_and_compile_all_open_whole(tmp_path, monkeypatch):
    everything = _on_demand(tmp_path / "b", compile="all")
    in_memory = LlmExecutor(MODEL_FILES["transposed"])  # no weight cache file
    monkeypatch.setattr(litert_executor, "view_refusal", lambda header, source: f"{source}: its ops ['WHILE'] ...")
    refused = _on_demand(tmp_path / "a")  # as a model with control flow would be
    try:
        for executor in (refused, everything, in_memory):
            assert executor.compiled_groups == tuple(executor.spec.groups)
    finally:
        for executor in (refused, everything, in_memory):
            executor.close()
    with pytest.raises(InvalidArgumentError, match="compile='eager'"):
        ExecutorSettings(compile="eager")


def test_concurrent_first_uses_of_a_group_compile_it_once(tmp_path, monkeypatch):
    compiled: list[str] = []
    real = litert_executor.NativeModel

    def counted(*args, **kwargs):
        compiled.append(kwargs["name"])
        time.sleep(0.05)  # the first compile is still going when the others ask
        return real(*args, **kwargs)

    monkeypatch.setattr(litert_executor, "NativeModel", counted)
    executor = _on_demand(tmp_path)
    try:
        barrier = threading.Barrier(4)
        results: list[np.ndarray | BaseException] = []
        seq = tokens(6, seed=9)

        def first_use() -> None:
            try:
                barrier.wait()
                binding, _ = bind_in_r16_slot(executor, "torch_r4")
                results.append(executor.prefill(binding, seq, 0))
            except BaseException as exc:  # noqa: BLE001 - reported below
                results.append(exc)

        threads = [threading.Thread(target=first_use) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert all(isinstance(result, np.ndarray) for result in results), results
        assert len(results) == 4
        for result in results[1:]:
            np.testing.assert_array_equal(result, results[0])
        assert sum("decode_lora_r16," in name or name.endswith("decode_lora_r16)") for name in compiled) == 1
        assert executor.compiled_groups == ("plain", "lora_r16")
    finally:
        executor.close()


def test_other_sessions_run_while_a_group_compiles(tmp_path, monkeypatch, weights):
    real = litert_executor.NativeModel
    compiling, release = threading.Event(), threading.Event()

    def gated(*args, **kwargs):
        if "lora_r16" in kwargs["name"]:
            compiling.set()
            release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(litert_executor, "NativeModel", gated)
    executor = _on_demand(tmp_path)
    try:
        plain = executor.bind(executor.create_kv_cache())
        slot_thread = threading.Thread(target=bind_in_r16_slot, args=(executor, "torch_r4"))
        slot_thread.start()
        assert compiling.wait(30)
        seq = tokens(12, seed=2)
        logits = executor.prefill(plain, seq, 0)  # while the slot's group is being compiled
        assert executor.compiled_groups == ("plain",)
        release.set()
        slot_thread.join(60)
        assert executor.compiled_groups == ("plain", "lora_r16")
        np.testing.assert_allclose(logits, reference_logits(weights, seq)[-1], atol=TOL)
    finally:
        release.set()
        executor.close()


def test_prepare_compiles_a_group_once_before_any_step_needs_it(tmp_path, weights):
    executor = _on_demand(tmp_path)
    try:
        executor.prepare("plain")  # compiled at open: nothing to do
        assert executor.compiled_groups == ("plain",) and executor.group_compile.summary().count == 0
        executor.prepare("lora_r16")
        assert executor.compiled_groups == ("plain", "lora_r16")
        binding, deltas = bind_in_r16_slot(executor, "torch_r4")  # binds in the prepared group
        seq = tokens(6, seed=4)
        np.testing.assert_allclose(executor.prefill(binding, seq, 0), reference_logits(weights, seq, lora=deltas)[-1],
                                   atol=TOL)
        executor.prepare("lora_r16")
        assert executor.group_compile.summary().count == 1
        with pytest.raises(NotFoundError, match="no signature group 'lora_r64'"):
            executor.prepare("lora_r64")
    finally:
        executor.close()
    with pytest.raises(FailedPreconditionError, match="closed"):
        executor.prepare("batch2_lora_r4")


def test_closing_while_a_group_compiles_drops_the_compiled_group(tmp_path, monkeypatch):
    viewing, release = gate_group_view(monkeypatch, "decode_lora_r16")
    executor = _on_demand(tmp_path)
    outcome: list[BaseException | None] = []

    def prepare() -> None:
        try:
            executor.prepare("lora_r16")
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            outcome.append(exc)

    thread = threading.Thread(target=prepare)
    thread.start()
    try:
        assert viewing.wait(30)
        executor.close()  # while the group compiles
    finally:
        release.set()
        thread.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], FailedPreconditionError), outcome
    assert executor.compiled_groups == ("plain",)
    # The weight cache file is no longer held by this process: the group's use went with it.
    (entry,) = survey(tmp_path).entries
    assert not entry.in_use


def test_a_closed_executor_refuses_to_stop_profiling():
    """Closing while recording frees the profiler with the compiled model: stopping after
    that is refused, not a call into freed memory (it crashed the process)."""
    executor = LlmExecutor(MODEL_FILES["default"], ExecutorSettings(profile_ops=True))
    executor.start_profiling()
    executor.close()
    with pytest.raises(FailedPreconditionError, match="executor is closed"):
        executor.stop_profiling()
    with pytest.raises(FailedPreconditionError, match="executor is closed"):
        executor.start_profiling()
