"""Shared fixtures: paths to the committed test models and adapters."""

from __future__ import annotations

import gc
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

if TYPE_CHECKING:  # annotations only: the helpers below import runtime when called
    from runtime.executor.litert_executor import LlmExecutor
    from runtime.executor.native import NativeModel

# Engines keep packed weights in the user's cache directory by default: the tests' engines,
# and the commands they start, keep theirs in a directory of the session instead.
SESSION_CACHE = os.environ["RUNTIME_CACHE"] = tempfile.mkdtemp(prefix="runtime-tests-cache-")


@pytest.fixture(scope="session", autouse=True)
def remove_the_sessions_cache_directory():
    yield
    shutil.rmtree(SESSION_CACHE, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def collect_engines_while_output_is_captured():
    """Engines left in reference cycles by tests are freed by the garbage collector; when
    that happens after pytest stops capturing, the native library's INFO lines reach the
    terminal. Collecting at the end of the session, still captured, keeps them off."""
    yield
    gc.collect()


MODELS = Path(__file__).resolve().parent / "models"
ADAPTERS = MODELS / "adapters"


MODEL_FILES = {"default": MODELS / "gqa_default.tflite", "transposed": MODELS / "gqa_transposed.tflite",
               "grouped": MODELS / "gqa_grouped.tflite"}


def adapter_path(name: str) -> Path:
    """Path of a committed adapter fixture, e.g. ``adapter_path("torch_r4")``."""
    return ADAPTERS / f"{name}.tflite"


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A runtime cache directory of the test module's own (RUNTIME_CACHE while it runs): the
    native kernels are built once there for the module."""
    path = tmp_path_factory.mktemp("runtime_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RUNTIME_CACHE", str(path))
        yield path


@pytest.fixture
def without_home(monkeypatch: pytest.MonkeyPatch) -> None:
    """No $RUNTIME_CACHE, $XDG_CACHE_HOME nor home directory, as for a container's arbitrary
    uid without $HOME or a passwd entry (where Path.home raises RuntimeError)."""
    for name in ("RUNTIME_CACHE", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)

    def home(cls: type[Path]) -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", classmethod(home))


@pytest.fixture(scope="session")
def adapter_manifest() -> dict:
    return json.loads((ADAPTERS / "MANIFEST.json").read_text())


@pytest.fixture(scope="session")
def expected_tensors() -> dict[str, np.ndarray]:
    with np.load(ADAPTERS / "expected.npz") as data:
        return {key: data[key] for key in data.files}


def adapter_deltas(name: str, scale: float = 1.0) -> dict[tuple[int, str], np.ndarray]:
    """Dense ``[out, in]`` deltas ``scale * (a @ b).T`` of an adapter fixture, for the reference."""
    from runtime.adapters.lora_data import LoraData
    from runtime.adapters.lora_util import parse_lora_input_name, to_graph_layout

    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    with LoraData.create_from_file_path(adapter_path(name)) as data:
        for tensor in data.get_all_tensor_names():
            parsed = parse_lora_input_name(tensor)
            graph = to_graph_layout(parsed.convention, parsed.side, data.read_tensor(tensor))
            pairs.setdefault((parsed.layer, parsed.projection), {})[parsed.side] = graph.astype(np.float64)
    return {key: scale * (p["a"] @ p["b"]).T for key, p in pairs.items()}


@pytest.fixture(scope="session")
def weights() -> dict[str, np.ndarray]:
    from reference_model import load_weights

    return load_weights(MODELS / "gqa_weights.npz")


def pytest_unconfigure(config):
    """The native library logs INFO lines from its destructors at interpreter exit, after
    pytest's summary; keep the summary the last thing the run prints."""
    import atexit
    import os
    import sys

    def mute() -> None:
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    atexit.register(mute)  # runs after pytest has restored its captured file descriptors


class WorkClock:
    """A stand-in for the ``time`` module whose clock reads the work done so far: one second
    per unit of ``work()`` (model runs, registered adapters, ...). A measurement timed with it
    reports the work inside its timed block, so one that also timed its set-up, or divided by
    another count than the work it timed, reads another figure; a clock that merely ticks
    once per reading gives the same figure either way. ``record()``, if given, is called at
    every reading too, its results kept in ``records``: what had happened when the clock was
    read."""

    def __init__(self, work: Callable[[], float], record: Callable[[], object] | None = None) -> None:
        self.work = work
        self.record = record
        self.readings: list[float] = []
        self.records: list[object] = []

    def perf_counter(self) -> float:
        if self.record is not None:
            self.records.append(self.record())
        self.readings.append(float(self.work()))
        return self.readings[-1]


def make_resource_manager(model: Path):
    """A ResourceManager over ``model`` as the engine builds one: one executor, its adapters."""
    from runtime.executor.litert_executor import LlmExecutor
    from runtime.framework.resource_management.adapter_registry import AdapterRegistry
    from runtime.framework.resource_management.executor_pool import ExecutorPool
    from runtime.framework.resource_management.resource_manager import ResourceManager
    from runtime.util.model_weights import ModelWeights

    pool = ExecutorPool(LlmExecutor(model))
    spec = pool.spec
    registry = AdapterRegistry(spec.lora_slots, pool.primary.create_lora_buffer, head_dim=spec.head_dim,
                               base_weights=lambda: ModelWeights.open(model, str(model)))
    return ResourceManager(pool, registry)


def gate_group_view(monkeypatch, signature: str) -> tuple[threading.Event, threading.Event]:
    """Makes the compile of the signature group holding ``signature`` stop before it starts
    (in its view of the model file) until the second event is set; the first is set when it
    gets there. The view, not the compile proper: a compile, like an executor's close, holds
    the lock of the muted fd 2 while it runs."""
    from runtime.util.model_view import ModelFile

    real = ModelFile.view
    viewing, release = threading.Event(), threading.Event()

    def gated(model_file: ModelFile, keys, **kwargs):
        if signature in keys:
            viewing.set()
            release.wait(60)
        return real(model_file, keys, **kwargs)

    monkeypatch.setattr(ModelFile, "view", gated)
    return viewing, release


def run_signature(model: NativeModel, key: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One run of signature ``key`` on ``inputs`` (by name): its outputs, copied."""
    from runtime.executor.native import HostBuffer

    sig = model.signatures[key]
    ins = [HostBuffer(info) for info in sig.inputs.values()]
    for buffer in ins:
        buffer.write(inputs[buffer.info.name])
    outs = [HostBuffer(info) for info in sig.outputs.values()]
    model.run(model.prepare(sig.index, ins, outs))
    return {buffer.info.name: buffer.array.copy() for buffer in outs}


def greedy(executor: LlmExecutor, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """A prompt prefilled, then ``steps`` greedy decode steps: the tokens and each step's logits."""
    binding = executor.bind(executor.create_kv_cache())
    logits = executor.prefill(binding, prompt, 0)
    tokens, every = [], []
    for position in range(len(prompt), len(prompt) + steps):
        token = int(np.argmax(logits))
        tokens.append(token)
        logits = executor.decode(binding, token, position)
        every.append(logits)
    return tokens, every


def step_inputs(model: NativeModel, key: str, position: int, seed: int) -> dict[str, np.ndarray]:
    """Inputs of one run of signature ``key``: random caches in their own type (float32 or
    float16, as a session would have filled them), small random float32 inputs (LoRA), a
    token, the position."""
    rng = np.random.default_rng(seed)
    inputs = {}
    for name, info in model.signatures[key].inputs.items():
        if name == "input_pos":
            inputs[name] = np.full(info.shape, position, info.dtype)
        elif name in ("tokens", "token"):
            inputs[name] = rng.integers(0, 200, info.shape).astype(info.dtype)
        elif name.startswith("kv_cache"):
            inputs[name] = rng.standard_normal(info.shape).astype(info.dtype)
        elif info.dtype == np.float32:
            inputs[name] = (0.05 * rng.standard_normal(info.shape)).astype(np.float32)
        else:
            inputs[name] = np.zeros(info.shape, info.dtype)
    return inputs
