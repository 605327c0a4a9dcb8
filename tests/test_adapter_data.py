"""Tests for runtime.adapters.adapter_data."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest

from runtime.errors import (
    DataLossError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
)
from runtime.adapters.adapter_data import (
    MAX_LISTED,
    DerivedLoraData,
    DerivedTensor,
    LazyLoraData,
    refuse_unappliable,
)
from runtime.adapters.lora_data import LoraData
from runtime.adapters.lora_writer import serialize_lora_tensors
from runtime.util.scoped_file import FileWatch

F32 = np.dtype(np.float32)


class Calls:
    """Counts the computations and callbacks a DerivedLoraData makes."""

    def __init__(self) -> None:
        self.computed: list[str] = []
        self.closed = 0
        self.released = 0

    def tensor(self, name: str, array: np.ndarray, dtype: np.dtype = F32, shape=None) -> DerivedTensor:
        def compute() -> np.ndarray:
            self.computed.append(name)
            return array

        return DerivedTensor(tuple(array.shape) if shape is None else shape, np.dtype(dtype), compute)

    def close(self) -> None:
        self.closed += 1

    def release(self) -> None:
        self.released += 1


def torch_pair(rng: np.random.Generator, layer: int, proj: str, rank: int, hidden: int = 8) -> dict[str, np.ndarray]:
    return {
        f"lora_atten_{proj}_a_prime_weight_{layer}": rng.standard_normal((hidden, rank)).astype(np.float32),
        f"lora_atten_{proj}_b_prime_weight_{layer}": rng.standard_normal((rank, hidden)).astype(np.float32),
    }


def derived(arrays: dict[str, np.ndarray], calls: Calls | None = None, **kwargs) -> DerivedLoraData:
    calls = calls or Calls()
    return DerivedLoraData({n: calls.tensor(n, a) for n, a in arrays.items()}, source_name="src.peft", **kwargs)


# -- refuse_unappliable --------------------------------------------------------------


def test_refuse_nothing_is_silent():
    assert refuse_unappliable("a.gguf", []) is None
    assert refuse_unappliable("a.gguf", ()) is None


def test_refuse_lists_source_count_and_names():
    with pytest.raises(InvalidArgumentError) as caught:
        refuse_unappliable("dir/adapter.gguf", ["token_embd.lora_a", "output.lora_b"])
    message = str(caught.value)
    assert message.startswith("INVALID_ARGUMENT: dir/adapter.gguf: cannot apply 2 tensor(s)")
    assert "q/k/v/o and the MLP's gate/up/down only" in message
    assert message.endswith(": token_embd.lora_a, output.lora_b")


def test_refuse_uses_the_separator():
    with pytest.raises(InvalidArgumentError, match=r"cannot apply 2 tensor\(s\).*: up; down$"):
        refuse_unappliable("peft", ["up", "down"], separator="; ")


@pytest.mark.parametrize("count", [MAX_LISTED - 1, MAX_LISTED, MAX_LISTED + 1, 3 * MAX_LISTED])
def test_refuse_lists_at_most_max_listed(count):
    refused = [f"t{i}" for i in range(count)]
    with pytest.raises(InvalidArgumentError) as caught:
        refuse_unappliable("src", refused)
    message = str(caught.value)
    assert f"cannot apply {count} tensor(s)" in message
    listed = message.split("gate/up/down only): ", 1)[1]
    shown = min(count, MAX_LISTED)
    expected = ", ".join(refused[:shown])
    if count > MAX_LISTED:
        expected += f", and {count - MAX_LISTED} more"
    assert listed == expected
    assert f"t{shown - 1}" in message and f"t{shown}," not in message


# -- DerivedLoraData: names and metadata ------------------------------------------------


def test_names_info_and_nbytes_without_computing():
    calls = Calls()
    rng = np.random.default_rng(0)
    arrays = {**torch_pair(rng, 1, "v", 3), **torch_pair(rng, 0, "q", 2)}
    arrays["extra"] = np.zeros((5,), np.float16)
    tensors = {n: calls.tensor(n, a, dtype=a.dtype) for n, a in arrays.items()}
    data = DerivedLoraData(tensors, source_name="src.peft")
    assert data.get_all_tensor_names() == list(arrays)  # insertion order, stable
    assert data.source_name == "src.peft" and data.format_name == "derived"
    for name, array in arrays.items():
        info = data.tensor_info(name)
        assert (info.name, info.shape, info.dtype, info.nbytes) == (name, array.shape, array.dtype, array.nbytes)
        assert (info.offset, info.placement) == (0, "computed")
    assert data.nbytes == sum(a.nbytes for a in arrays.values()) == 8 * 3 * 4 * 2 + 8 * 2 * 4 * 2 + 10
    with pytest.raises(NotFoundError):
        data.tensor_info("lora_atten_q_a_prime_weight_9")
    assert calls.computed == []  # metadata never computes a tensor


def test_constructor_copies_the_mapping():
    calls = Calls()
    tensors = {"a": calls.tensor("a", np.zeros((2,), np.float32))}
    data = DerivedLoraData(tensors, source_name="s", format_name="gguf")
    tensors["b"] = calls.tensor("b", np.zeros((2,), np.float32))
    assert data.get_all_tensor_names() == ["a"]
    assert data.format_name == "gguf"


def test_unknown_tensor_is_not_found():
    calls = Calls()
    data = derived({"lora_atten_q_a_prime_weight_0": np.zeros((4, 2), np.float32)}, calls)
    for method in (data.tensor_info, data.read_tensor):
        with pytest.raises(NotFoundError, match=r"src\.peft: no tensor named 'lora_atten_q_b_prime_weight_0'"):
            method("lora_atten_q_b_prime_weight_0")
    assert calls.computed == []


# -- DerivedLoraData: reading -------------------------------------------------------------


def test_read_computes_on_each_read_and_is_read_only():
    calls = Calls()
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    data = derived({"t": array}, calls)
    first = data.read_tensor("t")
    second = data.read_tensor("t")
    assert calls.computed == ["t", "t"]
    np.testing.assert_array_equal(first, array)
    assert first.dtype == F32 and first.shape == (2, 3)
    assert not first.flags.writeable and not second.flags.writeable
    with pytest.raises(ValueError):
        first[0, 0] = 1.0


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16], ids=["f32", "f16", "bf16"])
def test_read_converts_to_the_announced_dtype(dtype):
    computed = np.array([[0.1, -2.0], [3.5, 1e-3]], np.float64)
    calls = Calls()
    data = DerivedLoraData({"t": calls.tensor("t", computed, dtype=dtype)}, source_name="s")
    array = data.read_tensor("t")
    assert array.dtype == np.dtype(dtype)
    assert array.tobytes() == computed.astype(dtype).tobytes()
    assert data.tensor_info("t").nbytes == array.nbytes


def test_read_accepts_a_nested_list():
    tensor = DerivedTensor((2, 2), F32, lambda: [[1, 2], [3, 4]])
    data = DerivedLoraData({"t": tensor}, source_name="s")
    np.testing.assert_array_equal(data.read_tensor("t"), np.array([[1, 2], [3, 4]], np.float32))


@pytest.mark.parametrize("actual", [(3, 2), (6,), (2, 3, 1)])
def test_read_refuses_a_shape_other_than_announced(actual):
    calls = Calls()
    tensor = calls.tensor("lora_atten_k_a_prime_weight_1", np.zeros(actual, np.float32), shape=(2, 3))
    data = DerivedLoraData({"lora_atten_k_a_prime_weight_1": tensor}, source_name="adapter_dir")
    with pytest.raises(
        InternalError,
        match=rf"adapter_dir: tensor 'lora_atten_k_a_prime_weight_1' came out as \[{', '.join(map(str, actual))}\], "
        r"announced \[2, 3\]",
    ):
        data.read_tensor("lora_atten_k_a_prime_weight_1")


def test_watches_are_checked_before_computing(tmp_path):
    source = tmp_path / "adapter_model.safetensors"
    source.write_bytes(b"x" * 100)
    calls = Calls()
    data = derived({"t": np.ones((2,), np.float32)}, calls, watches=(FileWatch(source),))
    np.testing.assert_array_equal(data.read_tensor("t"), [1.0, 1.0])
    assert calls.computed == ["t"]

    source.write_bytes(b"x" * 10)
    with pytest.raises(DataLossError, match=r"adapter_model\.safetensors: tensor 't': file shrank from 100 to 10"):
        data.read_tensor("t")
    assert calls.computed == ["t"]  # nothing computed from a changed source
    assert data.tensor_info("t").shape == (2,)  # metadata needs no source


def test_every_watch_is_checked(tmp_path):
    first, second = tmp_path / "one.bin", tmp_path / "two.bin"
    first.write_bytes(b"1")
    second.write_bytes(b"2")
    calls = Calls()
    data = derived({"t": np.ones((1,), np.float32)}, calls, watches=[FileWatch(first), FileWatch(second)])
    second.unlink()
    with pytest.raises(DataLossError, match=r"two\.bin"):
        data.read_tensor("t")
    assert calls.computed == []


# -- DerivedLoraData: rank -------------------------------------------------------------------


def test_rank_is_the_largest_a_rank():
    rng = np.random.default_rng(1)
    arrays = {**torch_pair(rng, 0, "q", 2), **torch_pair(rng, 1, "o", 5), **torch_pair(rng, 1, "k", 3)}
    calls = Calls()
    assert derived(arrays, calls).get_lora_rank() == 5
    assert calls.computed == []


def test_rank_reads_the_rank_axis_of_each_convention():
    calls = Calls()
    tensors = {
        # litert-torch a is [in, r]; litert-lm and mediapipe a are [r, in]; b sides are ignored.
        "lora_atten_q_a_prime_weight_0": calls.tensor("a0", np.zeros((8, 2), np.float32)),
        "query_w_prime_left_1": calls.tensor("a1", np.zeros((3, 8), np.float32)),
        "transformer.layer_2.attn.q.w_prime_left": calls.tensor("a2", np.zeros((4, 8), np.float32)),
        "transformer.layer_2.attn.q.w_prime_right": calls.tensor("b2", np.zeros((9, 8), np.float32)),
        "lora_atten_q_b_prime_weight_0": calls.tensor("b0", np.zeros((7, 8), np.float32)),
    }
    assert DerivedLoraData(tensors, source_name="s").get_lora_rank() == 4
    del tensors["transformer.layer_2.attn.q.w_prime_left"]
    assert DerivedLoraData(tensors, source_name="s").get_lora_rank() == 3


def test_rank_ignores_non_lora_names_and_needs_an_a_tensor():
    arrays = {
        "blk.0.attn_q.weight.lora_a": np.zeros((8, 99), np.float32),  # not a LoRA input name
        "lora_atten_q_b_prime_weight_0": np.zeros((4, 8), np.float32),  # b only
    }
    with pytest.raises(NotFoundError, match=r"src\.peft: no LoRA tensors"):
        derived(arrays).get_lora_rank()
    with pytest.raises(NotFoundError, match="no LoRA tensors"):
        DerivedLoraData({}, source_name="src.peft").get_lora_rank()


def test_same_answers_as_lora_data_for_the_same_tensors():
    # Both implement AdapterData: for the same tensors they must agree on everything.
    rng = np.random.default_rng(2)
    arrays = {**torch_pair(rng, 0, "q", 4), **torch_pair(rng, 1, "v", 6)}
    stored = LoraData.create_from_buffer(serialize_lora_tensors(arrays, external_data=False))
    computed = derived(arrays)
    assert computed.get_all_tensor_names() == stored.get_all_tensor_names()
    assert computed.get_lora_rank() == stored.get_lora_rank() == 6
    assert computed.nbytes == stored.nbytes
    for name in arrays:
        a, b = computed.tensor_info(name), stored.tensor_info(name)
        assert (a.shape, a.dtype, a.nbytes) == (b.shape, b.dtype, b.nbytes)
        assert computed.read_tensor(name).tobytes() == stored.read_tensor(name).tobytes()


# -- DerivedLoraData: lifetime -----------------------------------------------------------------


def test_release_memory_calls_release_each_time():
    calls = Calls()
    data = derived({"t": np.zeros((1,), np.float32)}, calls, release=calls.release)
    data.release_memory()
    data.release_memory()
    assert calls.released == 2
    derived({"t": np.zeros((1,), np.float32)}).release_memory()  # without a callback: nothing to do


def test_close_runs_once():
    calls = Calls()
    data = derived({"t": np.zeros((1,), np.float32)}, calls, close=calls.close)
    data.close()
    data.close()
    assert calls.closed == 1
    derived({"t": np.zeros((1,), np.float32)}).close()  # without a callback: nothing to do


def test_context_manager_closes_even_on_error():
    calls = Calls()
    with derived({"t": np.zeros((1,), np.float32)}, calls, close=calls.close) as data:
        assert isinstance(data, DerivedLoraData)
        assert calls.closed == 0
    assert calls.closed == 1
    calls = Calls()
    with pytest.raises(NotFoundError), derived({}, calls, close=calls.close) as data:
        data.read_tensor("missing")
    assert calls.closed == 1


def test_a_failing_close_is_not_retried():
    attempts = []

    def close() -> None:
        attempts.append(1)
        raise OSError("device gone")

    data = DerivedLoraData({}, source_name="s", close=close)
    with pytest.raises(OSError):
        data.close()
    data.close()
    assert attempts == [1]


def test_read_tensor_does_not_freeze_the_producers_array():
    kept = np.zeros((8, 2), np.float32)
    data = DerivedLoraData(
        {"lora_atten_q_a_prime_weight_0": DerivedTensor((8, 2), F32, lambda: kept)}, source_name="src.peft"
    )
    view = data.read_tensor("lora_atten_q_a_prime_weight_0")
    assert not view.flags.writeable
    assert kept.flags.writeable  # the producer's own array stays writable
    kept[0, 0] = 3.0
    assert view[0, 0] == 3.0  # a view, not a copy


def test_rank_of_a_one_dimensional_a_tensor_is_refused_by_name():
    calls = Calls()
    data = DerivedLoraData(
        {"lora_atten_q_a_prime_weight_0": calls.tensor("a", np.zeros(8, np.float32))}, source_name="src.peft"
    )
    with pytest.raises(InvalidArgumentError, match=r"src\.peft.*lora_atten_q_a_prime_weight_0.*\[8\].*2-D"):
        data.get_lora_rank()


# -- LazyLoraData: what a registered PEFT or GGUF adapter is ----------------------------------


def lazy(arrays: dict[str, np.ndarray], builds: list[dict[str, np.ndarray]]) -> LazyLoraData:
    """A LazyLoraData over ``arrays``; each build appends the arrays it serves to ``builds``."""

    def build() -> DerivedLoraData:
        builds.append(arrays)
        return derived(arrays)

    return LazyLoraData.of(build)


def test_lazy_data_answers_metadata_from_its_table_and_builds_once_per_release():
    rng = np.random.default_rng(0)
    arrays = {**torch_pair(rng, 0, "v", 2), **torch_pair(rng, 3, "q", 4)}
    builds: list = []
    data = lazy(arrays, builds)
    assert len(builds) == 1  # registering checks the source once
    assert data.get_all_tensor_names() == list(arrays)
    assert data.tensor_info("lora_atten_q_a_prime_weight_3").shape == (8, 4)
    assert data.get_lora_rank() == 4 and data.nbytes == sum(a.nbytes for a in arrays.values())
    assert len(builds) == 1
    barrier = threading.Barrier(8)
    results = {}

    def read(index: int) -> None:
        barrier.wait()
        results[index] = data.read_tensor("lora_atten_v_b_prime_weight_0")

    threads = [threading.Thread(target=read, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == 2  # one build for eight concurrent first reads
    for array in results.values():
        np.testing.assert_array_equal(array, arrays["lora_atten_v_b_prime_weight_0"])
    data.release_memory()
    data.read_tensor("lora_atten_q_b_prime_weight_3")
    assert len(builds) == 3
    with pytest.raises(NotFoundError, match="src.peft: no tensor named 'lora_atten_k_a_prime_weight_0'"):
        data.read_tensor("lora_atten_k_a_prime_weight_0")
    with pytest.raises(NotFoundError, match="no tensor named 'lora_ff_up_m_prime_weight_3'"):
        data.tensor_info("lora_ff_up_m_prime_weight_3")


def test_lazy_data_refuses_a_source_that_builds_other_tensors():
    rng = np.random.default_rng(0)
    source = [torch_pair(rng, 0, "v", 2)]
    data = LazyLoraData.of(lambda: derived(source[0]))
    source[0] = torch_pair(rng, 0, "v", 3)  # the same names, another rank: what the source reads now
    with pytest.raises(DataLossError, match="src.peft: its tensors are not the ones registered any more"):
        data.read_tensor("lora_atten_v_a_prime_weight_0")
