"""Stress: many threads doing random operations on one engine, then every session replayed
alone must give the same tokens (in the kernels' op form, the same logits bit for bit); and
register/unload cycles must not grow memory."""

from __future__ import annotations

import faulthandler
import hashlib
import random
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from conftest import MODEL_FILES, adapter_path

from runtime import Engine, EngineSettings, KeepAll, LoraSource, Lru, OnlyActive, SessionConfig
from runtime.errors import FailedPreconditionError, NotFoundError
from runtime.executor import kernels
from runtime.util.attention_rewrite import rewrite_decode_attention

pytestmark = pytest.mark.slow  # the fast suite: python3 -m pytest -m 'not slow'

THREADS = 8
OPERATIONS = 1000  # per thread; 8 x 1,000 per variant keep the five variants near 90 s of CI
MAX_POSITION = 56
WATCHDOG_SECONDS = 600

FILES = ["torch_r4", "litertlm_r4", "mediapipe_r4", "torch_r16", "litertlm_r8_layer0", "torch_r4_layer1_qv"]
BLOBS = {name: adapter_path(name).read_bytes() for name in ("torch_r4_bf16", "litertlm_r4")}
POLICIES = [KeepAll(), Lru(max_resident=2), Lru(max_resident=None, max_bytes=60_000), OnlyActive()]
# Prompt heads that sessions share (a prefix cache takes them).
HEADS = [[(11 * head + 7 * i) % 256 for i in range(10)] for head in range(3)]
# What an operation may legitimately raise under contention (documented behaviour):
# unloading an adapter a live session uses, or one another thread already unloaded.
EXPECTED = (FailedPreconditionError, NotFoundError)


def random_sources(rng: random.Random) -> list[LoraSource]:
    choice = rng.randrange(5)
    if choice == 0:
        return []
    if choice == 1:
        name = rng.choice(list(BLOBS))
        return [LoraSource(buffer=BLOBS[name], scale=rng.choice([0.5, 1.0]))]
    if choice == 2:  # a blend that fits the r16 slot
        return [LoraSource(path=adapter_path("torch_r4"), scale=0.7),
                LoraSource(path=adapter_path("litertlm_r4"), scale=0.3)]
    return [LoraSource(path=adapter_path(rng.choice(FILES)), scale=rng.choice([1.0, 2.0]))]


@dataclass
class Record:
    """What a session was created with and what it did: enough to replay it alone."""

    sources: list[LoraSource]
    fed: list[list[int]] = field(default_factory=list)  # each call's tokens (first: the prompt)
    argmax: list[int] = field(default_factory=list)  # the greedy token after each call
    digests: list[bytes] = field(default_factory=list)  # each call's logits, hashed

    def add(self, tokens: list[int], logits: np.ndarray) -> int:
        """Records a call: the tokens fed and the logits it gave; returns the greedy token."""
        self.fed.append(tokens)
        self.argmax.append(int(np.argmax(logits)))
        self.digests.append(digest(logits))
        return self.argmax[-1]


def digest(logits: np.ndarray) -> bytes:
    return hashlib.sha1(np.ascontiguousarray(logits).tobytes()).digest()


@dataclass
class Live:
    session: object
    record: Record
    next_token: int


def worker(engine: Engine, seed: int, records: list[Record], errors: list[BaseException]) -> None:
    rng = random.Random(seed)
    live: list[Live] = []
    try:
        for _ in range(OPERATIONS):
            op = rng.random()
            if op < 0.12 or not live:
                record = Record(random_sources(rng))
                session = engine.create_session(SessionConfig(loras=record.sources))
                prompt = [rng.randrange(256) for _ in range(rng.randint(1, 12))]
                if rng.random() < 0.5:
                    prompt = rng.choice(HEADS) + prompt
                live.append(Live(session, record, record.add(prompt, session.run_prefill(prompt))))
            elif op < 0.75:
                item = rng.choice(live)
                if item.session.position >= MAX_POSITION:
                    item.session.close()
                    records.append(item.record)
                    live.remove(item)
                    continue
                item.next_token = item.record.add([item.next_token], item.session.run_decode(item.next_token))
            elif op < 0.79:  # several of this thread's sessions in one step
                items = [i for i in rng.sample(live, min(len(live), rng.randint(2, 4)))
                         if i.session.position < MAX_POSITION]
                logits = engine.decode_together([(i.session, i.next_token) for i in items])
                for item, row in zip(items, logits):
                    item.next_token = item.record.add([item.next_token], row)
            elif op < 0.82:
                item = rng.choice(live)
                clone = item.session.clone()
                record = Record(item.record.sources, [list(f) for f in item.record.fed], list(item.record.argmax),
                                list(item.record.digests))
                live.append(Live(clone, record, item.next_token))
            elif op < 0.88:
                item = live.pop(rng.randrange(len(live)))
                item.session.close()
                records.append(item.record)
            elif op < 0.94:
                source = rng.choice(random_sources(rng) or [LoraSource(path=adapter_path("torch_r16"))])
                engine.register_adapter(source)
            elif op < 0.985:
                ids = engine.adapter_ids()
                if ids:
                    try:
                        engine.unload_adapter(rng.choice(ids))
                    except EXPECTED:
                        pass
            else:
                engine.set_residency(rng.choice(POLICIES))
        for item in live:
            item.session.close()
            records.append(item.record)
    except BaseException as exc:  # surfaced by the test
        errors.append(exc)


def replay(engine: Engine, record: Record) -> Record:
    """``record``'s calls run again by one session alone."""
    again = Record(record.sources)
    with engine.create_session(SessionConfig(loras=record.sources)) as session:
        again.add(record.fed[0], session.run_prefill(record.fed[0]))
        for tokens in record.fed[1:]:
            again.add(tokens, session.run_decode(tokens[0]))
    return again


@pytest.fixture(scope="module")
def op_form(tmp_path_factory: pytest.TempPathFactory, kernel_cache) -> Path:
    """The transposed fixture in the kernels' op form (decode attention, LoRA deltas)."""
    if kernels.load_for_this_cpu()[0] is None:
        pytest.skip("the kernels cannot be built or run here")
    path = tmp_path_factory.mktemp("op_form") / "gqa_op.tflite"
    path.write_bytes(rewrite_decode_attention(MODEL_FILES["transposed"].read_bytes())[0])
    return path


@pytest.mark.parametrize("executors, batch_wait_s, form", [(1, 0.002, "standard"), (2, 0.002, "standard"),
                                                           (1, 0.01, "standard"), (1, None, "standard"),
                                                           (1, 0.002, "op")],
                         ids=["one executor", "a pool of two", "batches wait 10 ms", "no batching", "op form"])
def test_random_operations_from_many_threads(executors, batch_wait_s, form, request):
    """Every session's calls, replayed by a session alone, give its greedy tokens; in the op
    form, whose kernels sum a batch's row as they sum it alone (rows padded into a larger
    rank's slot or window included), with a prefix cache taking the prompts' shared heads, its
    logits bit for bit."""
    model = request.getfixturevalue("op_form") if form == "op" else MODEL_FILES["default"]
    records: list[Record] = []
    errors: list[BaseException] = []
    settings = EngineSettings(executors=executors, batch_wait_s=batch_wait_s,
                              prefix_cache_bytes=1 << 20 if form == "op" else 0)
    with Engine(model, settings) as engine:
        threads = [threading.Thread(target=worker, args=(engine, seed, records, errors), daemon=True)
                   for seed in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WATCHDOG_SECONDS)
        if any(t.is_alive() for t in threads):
            faulthandler.dump_traceback(file=sys.stderr)
            pytest.fail(f"deadlock: threads still running after {WATCHDOG_SECONDS} s")
        assert not errors, repr(errors[:3])
        stats = engine.stats()
        assert stats.sessions == ()  # every session was closed
        assert all(a.sessions == 0 for a in stats.adapters)
        for lora_id in engine.adapter_ids():
            engine.unload_adapter(lora_id)  # nothing holds them any more
        assert engine.adapter_ids() == [] and engine.stats().resident == ()
    assert len(records) > THREADS * OPERATIONS * 0.1
    if form == "op":
        assert stats.prefix_cache.hits > 0
    if batch_wait_s is not None:  # decode_together alone guarantees batches of several rows
        assert max(rows for rows, _ in stats.decode_batches) > 1
    with Engine(model, EngineSettings(batch_wait_s=None)) as alone:
        for record in records:
            again = replay(alone, record)
            assert again.argmax == record.argmax
            if form == "op":
                assert again.digests == record.digests


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_register_use_unload_cycles_do_not_grow_memory(tmp_path):
    blob = adapter_path("torch_r16").read_bytes()

    def cycle(i: int) -> None:
        source = LoraSource(buffer=blob) if i % 2 else LoraSource(path=adapter_path("litertlm_r4"))
        lora_id = engine.register_adapter(source)
        if i % 10 == 0:  # materialize now and then, so buffers are allocated and freed too
            with engine.create_session(SessionConfig(loras=[source])) as session:
                session.run_decode(1)
        engine.unload_adapter(lora_id)

    with Engine(MODEL_FILES["default"]) as engine:
        for i in range(500):  # warm up allocator pools and caches
            cycle(i)
        start = rss_bytes()
        for i in range(10_000):
            cycle(i)
        growth = rss_bytes() - start
        assert engine.adapter_ids() == [] and engine.stats().resident == ()
    assert growth < 5 * 1024 * 1024, f"RSS grew by {growth / 1024:.0f} KiB over 10,000 cycles"
