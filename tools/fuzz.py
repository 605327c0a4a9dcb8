"""Fuzzes the adapter readers and model loading: mutated .tflite LoRA files, PEFT
directories, GGUF files and model files.

    python tools/fuzz.py --cases 100000 [--seed 0] [--workers 2] [--timeout 10]

Each case is a valid fixture mutated deterministically from ``(seed, case)``: bytes
flipped or overwritten with boundary values, truncated, extended, chunks duplicated,
or (PEFT) the JSON config mangled. Worker processes load each case the way the engine
does (an adapter: detect the format, open, check against the test model's slots,
materialize every tensor; a model: open an engine on it, prefill and decode a step) and
report the outcome. The parent counts:

* crashes: a worker killed by a signal (SIGSEGV, SIGBUS...) while on a case;
* hangs: a case that took longer than ``--timeout`` seconds;
* escapes: an exception that is not a ``StatusError``.

Reproducers of every failing case are written to ``--out`` (default
``fuzz-findings/``). Exit status 1 if any count is not zero.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # fuzz this checkout's runtime, installed or not (workers too)
MODELS = ROOT / "tests" / "models"
SEEDS = {
    "tflite": [MODELS / "adapters" / f"{n}.tflite" for n in ("torch_r4_layer1_qv", "litertlm_r8_layer0", "mediapipe_r4")],
    "gguf": [MODELS / "peft" / "qkvo_r4_f16.gguf"],
    "peft": [MODELS / "peft" / "layers_1_only", MODELS / "peft" / "rank_pattern",
             MODELS / "families" / "llama" / "adapter_all_linear", MODELS / "families" / "llama" / "adapter_lora_xs",
             MODELS / "families" / "llama" / "adapter_dora"],
    "model": [MODELS / "families" / "llama" / "model.tflite", MODELS / "gqa_transposed.tflite",
              MODELS / "gemma3" / "model.tflite", MODELS / "turbo" / "default.tflite"],
}
# Adapters a model case's engine runs, each of which reads the model's own weights: an
# R-only LoRA-XS adapter (rebuilt from them), DoRA (their norms), Turbo heads (the output
# projection). Each fits one of the model seeds; an adapter another model refuses is an outcome.
MODEL_ADAPTERS = [MODELS / "families" / "llama" / "adapter_lora_xs", MODELS / "families" / "llama" / "adapter_dora",
                  MODELS / "turbo" / "trained_heads"]
# One case in MODEL_SHARE opens a model (~50 ms a case on the test models, ~10x an adapter case).
MODEL_SHARE = 20
# The model cases are checked against: the tiny Llama family export (the test model's
# hidden size, all-linear and DoRA slots, and the weights map R-only LoRA-XS adapters are
# rebuilt from and DoRA adapters' norms are taken from).
MODEL = MODELS / "families" / "llama" / "model.tflite"
INTERESTING = [b"\x00", b"\xff", b"\x7f", b"\x80", b"\x00\x00\x00\x80", b"\xff\xff\xff\x7f", b"\xff\xff\xff\xff",
               b"\x00\x00\x00\x00", b"\x01\x00\x00\x00", b"\x00\x00\x80\x7f", b"\x00\x00\xc0\x7f"]


@dataclass(frozen=True)
class Case:
    """One fuzz input: which format, and the bytes (PEFT: the weights and the config)."""

    kind: str
    data: bytes
    config: bytes = b""


def mutate(blob: bytes, rng: random.Random) -> bytes:
    """A few random structural or byte-level mutations of ``blob``."""
    data = bytearray(blob)
    for _ in range(rng.randint(1, 4)):
        if not data:
            data += rng.randbytes(rng.randint(1, 64))
            continue
        op = rng.randrange(7)
        at = rng.randrange(len(data))
        if op == 0:
            data[at] ^= 1 << rng.randrange(8)
        elif op == 1:
            value = rng.choice(INTERESTING)
            data[at : at + len(value)] = value
        elif op == 2:  # aligned 32-bit field set to a boundary value (offsets, lengths, dims)
            at -= at % 4
            data[at : at + 4] = rng.choice([0, 1, 2**31 - 1, 2**31, 2**32 - 1, len(data), len(data) * 2]).to_bytes(4, "little")
        elif op == 3:
            del data[rng.randrange(len(data) + 1):]
        elif op == 4:
            data += rng.randbytes(rng.randint(1, 256))
        elif op == 5:
            end = min(len(data), at + rng.randint(1, 64))
            data[at:at] = data[at:end]
        else:
            data[at : at + 8] = rng.randbytes(8)
    return bytes(data)


def mutate_json(text: bytes, rng: random.Random) -> bytes:
    """A JSON config with keys removed, retyped or given boundary values (or broken text)."""
    try:
        config = json.loads(text)
    except ValueError:
        return mutate(text, rng)
    if rng.random() < 0.2 or not isinstance(config, dict):
        return mutate(text, rng)
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(list(config) + ["r", "lora_alpha", "peft_type", "use_dora", "rank_pattern", "n_iter",
                                         "random_state", "alpha_pattern", "layers_to_transform", "bias",
                                         "modules_to_save"])
        config[key] = rng.choice([None, 0, -1, 2**40, 1e308, float("nan"), "x", [], {}, {"v_proj": 0},
                                  {".*": 3}, {"(": 2}, True, [1], "LORA", "lora_only"])
    return json.dumps(config, allow_nan=True).encode()


def mutate_dora(weights: bytes, rng: random.Random) -> bytes:
    """A DoRA adapter's safetensors with one magnitude vector (or a lora_B) changed: a
    length off by one or empty, NaN, Inf, zeros, huge values, or the vector dropped."""
    import numpy as np
    from safetensors.numpy import load, save

    tensors = load(weights)
    key = rng.choice([k for k in tensors if k.endswith("lora_magnitude_vector")])
    vector = tensors[key]
    change = rng.randrange(7)
    if change == 0:
        tensors[key] = vector[: rng.choice([0, len(vector) - 1])]
    elif change == 1:
        tensors[key] = np.concatenate([vector, vector[:1]])
    elif change == 2:
        vector = vector.copy()
        vector[rng.randrange(len(vector))] = rng.choice([np.nan, np.inf, -np.inf])
        tensors[key] = vector
    elif change == 3:
        tensors[key] = np.zeros_like(vector)
    elif change == 4:
        tensors[key] = np.full_like(vector, 3e38)
    elif change == 5:
        del tensors[key]
    else:  # a lora_B of zeros: the norm is the base weight's alone
        b_key = key.replace("lora_magnitude_vector", "lora_B.weight")
        tensors[b_key] = np.zeros_like(tensors[b_key])
    return save(tensors)


def make_case(seed: int, index: int) -> Case:
    """The deterministic case ``index`` of run ``seed``."""
    rng = random.Random(seed * 1_000_003 + index)
    kind = "model" if rng.randrange(MODEL_SHARE) == 0 else rng.choice(["tflite", "tflite", "gguf", "peft"])
    source = rng.choice(SEEDS[kind])
    if kind == "peft":
        weights = (source / "adapter_model.safetensors").read_bytes()
        config = (source / "adapter_config.json").read_bytes()
        if source.name == "adapter_dora" and rng.random() < 0.3:
            return Case(kind, mutate_dora(weights, rng), config)
        if rng.random() < 0.5:
            return Case(kind, mutate(weights, rng), config)
        return Case(kind, weights, mutate_json(config, rng))
    return Case(kind, mutate(source.read_bytes(), rng))


def load_case(case: Case, workdir: Path, slots, lora_xs) -> str:
    """Loads a case as the engine would; returns the outcome class name."""
    from runtime import Engine, EngineSettings, SessionConfig
    from runtime.components.lora import LoRA, plan_adapter
    from runtime.errors import StatusError
    from runtime.adapters.adapter_formats import AdapterOrigin, open_adapter
    from runtime.util.signature_names import LoraSlot, cheapest_slot

    target = workdir / "case"
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
    if case.kind == "peft":
        target.mkdir()
        (target / "adapter_model.safetensors").write_bytes(case.data)
        (target / "adapter_config.json").write_bytes(case.config)
    else:
        target.write_bytes(case.data)
    try:
        if case.kind == "model":
            with Engine(target, EngineSettings(weight_cache_dir=None)) as engine:
                with engine.create_session() as session:
                    session.run_prefill([1, 2, 3])
                    session.run_decode(4)
                for adapter in MODEL_ADAPTERS:
                    try:
                        with engine.create_session(SessionConfig(lora_path=adapter)) as session:
                            session.generate([1, 2, 3], max_new_tokens=4)
                    except StatusError:
                        pass
            return "ok"
        sources = [open_adapter(target, head_dim=16, lora_xs=lora_xs)]
        if case.kind == "tflite":
            sources.append(AdapterOrigin.of_buffer(case.data, name="<fuzz buffer>").open())
        for data in sources:
            plan = plan_adapter(data, slots)
            slot = cheapest_slot(slots, LoraSlot(plan.rank, plan.targets))
            LoRA([(plan, 1.0)], slot, slots[slot], lambda name, s=slot: _ArrayBuffer(slots[s][name]))
            data.close()
        return "ok"
    except StatusError as exc:
        return type(exc).__name__


class _ArrayBuffer:
    def __init__(self, spec) -> None:
        self.spec = spec

    def write(self, data_array) -> None:
        assert data_array.shape == self.spec.shape


def _worker(seed: int, tasks: mp.Queue, results: mp.Queue) -> None:
    from runtime.executor.litert_executor import LlmExecutor
    from runtime.adapters.lora_xs import LoraXsFactors
    from runtime.util.model_weights import ModelWeights

    executor = LlmExecutor(MODEL)
    slots = executor.spec.lora_slots
    executor.close()
    lora_xs = LoraXsFactors(lambda: ModelWeights.open(MODEL, MODEL.name))
    with tempfile.TemporaryDirectory() as tmp:
        while True:
            index = tasks.get()
            if index is None:
                return
            results.put(("start", index, ""))
            try:
                outcome = load_case(make_case(seed, index), Path(tmp), slots, lora_xs)
                results.put(("done", index, outcome))
            except BaseException as exc:  # an escape: anything that is not a StatusError
                results.put(("escape", index, "".join(traceback.format_exception_only(exc)).strip()))


def run(cases: int, seed: int, workers: int, timeout: float, out: Path) -> Counter:
    """Runs the campaign; returns the counts by outcome."""
    counts: Counter = Counter()
    findings: list[tuple[str, int, str]] = []
    context = mp.get_context("spawn")
    results: mp.Queue = context.Queue()
    pending = list(range(cases))[::-1]
    pool: dict[int, dict] = {}

    def start_worker(slot: int) -> None:
        tasks = context.Queue()
        process = context.Process(target=_worker, args=(seed, tasks, results), daemon=True)
        process.start()
        pool[slot] = {"process": process, "tasks": tasks, "case": None, "since": None}
        feed(slot)

    def feed(slot: int) -> None:
        worker = pool[slot]
        if pending:
            worker["case"] = pending.pop()
            worker["since"] = None
            worker["tasks"].put(worker["case"])
        else:
            worker["case"] = None
            worker["tasks"].put(None)

    by_case = {}
    for slot in range(workers):
        start_worker(slot)
    done = 0
    last_report = time.monotonic()
    while done < cases:
        try:
            event, index, detail = results.get(timeout=0.5)
        except Exception:
            event = None
        if event is not None:
            slot = next((s for s, w in pool.items() if w["case"] == index), None)
            if event == "start":
                if slot is not None:
                    pool[slot]["since"] = time.monotonic()
                by_case[index] = slot
            elif slot is not None:
                done += 1
                if event == "escape":
                    counts["escape"] += 1
                    findings.append(("escape", index, detail))
                else:
                    counts[detail] += 1
                feed(slot)
        for slot, worker in list(pool.items()):
            process, case = worker["process"], worker["case"]
            if case is None:
                continue
            if not process.is_alive():
                counts["crash"] += 1
                findings.append(("crash", case, f"exit code {process.exitcode}"))
                done += 1
                start_worker(slot)
            elif worker["since"] is not None and time.monotonic() - worker["since"] > timeout:
                process.kill()
                process.join()
                counts["hang"] += 1
                findings.append(("hang", case, f"over {timeout} s"))
                done += 1
                start_worker(slot)
        if time.monotonic() - last_report > 30:
            print(f"  {done}/{cases} cases, {dict(counts)}", file=sys.stderr, flush=True)
            last_report = time.monotonic()
    for worker in pool.values():
        if worker["case"] is not None:
            worker["tasks"].put(None)
        worker["process"].join(timeout=5)
        if worker["process"].is_alive():
            worker["process"].kill()
    if findings:
        out.mkdir(parents=True, exist_ok=True)
        for kind, index, detail in findings:
            case = make_case(seed, index)
            (out / f"{kind}-{seed}-{index}.{case.kind}").write_bytes(case.data)
            if case.config:
                (out / f"{kind}-{seed}-{index}.json").write_bytes(case.config)
            print(f"{kind}: case {index} ({case.kind}): {detail}", file=sys.stderr)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=Path("fuzz-findings"))
    args = parser.parse_args(argv)
    started = time.monotonic()
    counts = run(args.cases, args.seed, args.workers, args.timeout, args.out)
    failures = {k: counts.get(k, 0) for k in ("crash", "hang", "escape")}
    outcomes = {k: v for k, v in sorted(counts.items()) if k not in failures}
    print(f"{args.cases} cases in {time.monotonic() - started:.0f} s, seed {args.seed}: "
          f"crashes {failures['crash']}, hangs {failures['hang']}, non-StatusError exceptions "
          f"{failures['escape']}; outcomes {outcomes}")
    return 1 if any(failures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
