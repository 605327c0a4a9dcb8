#!/usr/bin/env python3
"""llama.cpp's half of the runtime-vs-llama.cpp benchmark, on the same weights.

Run with the llama.cpp virtualenv made by ``setup.sh`` (never a project dependency)::

    benchmarks/llama_cpp/.venv/bin/python benchmarks/llama_cpp/bench_llama_cpp.py \
        [--repeats 9] [--steps 128] [--cycles 1000] [--out FILE]

That standalone run measures the bench model set on its own. ``benchmarks/run.py`` uses
the same code differently: a ``--serve SET`` child (:class:`Server`) that times one thing
per request, so that each of its rounds measures both sides back to back, at either
model size of ``files.py``; and fresh-process probes (``--load-probe``, ``--rss-probe``).

Uses only llama-cpp-python 0.3.36's low-level ctypes API. (The high-level
``Llama(lora_path=...)`` tests the adapter pointer with ``is None``; a failed load
returns a NULL ``LP_c_void_p``, which is falsy but not None, so a bad adapter file is
accepted and the first ``eval`` segfaults. Here every pointer is tested with ``not``.)
Functions used:
``llama_model_load_from_file``, ``llama_init_from_model``, ``llama_batch_init``,
``llama_decode``, ``llama_get_logits_ith``, ``llama_adapter_lora_init``,
``llama_adapter_lora_free``, ``llama_set_adapters_lora``, ``llama_get_memory`` /
``llama_memory_clear``.

Models: those of ``files.py`` (built by ``setup.sh``); the standalone run uses the
bench set (``bench-f32.gguf``, ``bench-q8_0.gguf``, ``lora-peft_r8_a-f32.gguf``,
``lora-peft_r8_b-f32.gguf``, ``lora-peft_r64-f32.gguf`` in ``benchmarks/models/gguf/``).

Every standalone timing is the median of ``--repeats`` runs, one thread (``n_threads``
and ``n_threads_batch`` = 1). Two context settings are measured (the served requests
use the exact one):

``exact``
    float32 KV cache, flash attention off. The logits then match transformers'
    (checked first, ``--atol``, default 1e-3; the script exits 1 otherwise). With
    llama.cpp's defaults they do not: its CPU flash-attention path rounds to f16
    (max |diff| ~7e-3 on this model even with an f32 KV cache).
``default``
    llama.cpp's default context (f16 KV cache, flash attention "auto"): decode plain
    and with the rank-8 adapter only, for reference.

Switching adapters: ``llama_set_adapters_lora`` itself takes microseconds, but it marks
the scheduler for re-reservation (``sched_need_reserve``), so the next ``llama_decode``
re-plans the worst-case graphs; that is the measured switch cost.

Prints one JSON object and writes it to ``--out`` (default
``benchmarks/llama_cpp/results.json``). Times in ms, memory in KiB (VmRSS from
/proc/self/status). The load average before and after is recorded: on a shared 2-core
box the absolute times move by up to 1.5x between runs, so compare with the runtime
measured in the same time window (ratios within one run are steadier).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

import llama_cpp as L
from files import BENCH, BENCH_MODELS, BLEND, EVERY_SET, SETTING_ADAPTERS, ModelSet

HERE = Path(__file__).resolve().parent
REFERENCE = BENCH_MODELS / "reference_logits.npz"
N_CTX = BENCH.n_ctx

# --------------------------------------------------------------------------
# Logging: keep llama.cpp quiet, but remember what it said (for crash reports).
# --------------------------------------------------------------------------

_LOG_TAIL: list[str] = []
_LOG_KEEP = [False]


@L.llama_log_callback
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # ggml.h: DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5 (continues the previous line).
    keep = level in (3, 4) or (level == 5 and _LOG_KEEP[0])
    _LOG_KEEP[0] = keep
    if keep:
        _LOG_TAIL.append(text.decode("utf-8", "replace").strip())
        del _LOG_TAIL[:-50]


def rss_kib(field: str = "VmRSS") -> int:
    """Resident set size of this process (or another field of /proc/self/status), KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 4)


# --------------------------------------------------------------------------
# A thin wrapper over the low-level API.
# --------------------------------------------------------------------------


class Model:
    """One loaded GGUF model."""

    def __init__(self, path: Path) -> None:
        params = L.llama_model_default_params()
        params.n_gpu_layers = 0
        start = time.perf_counter()
        self.ptr = L.llama_model_load_from_file(str(path).encode(), params)
        self.load_ms = (time.perf_counter() - start) * 1e3
        if not self.ptr:
            raise RuntimeError(f"llama_model_load_from_file failed for {path}: {_LOG_TAIL[-3:]}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.ptr))

    def adapter(self, path: Path) -> Any:
        """``llama_adapter_lora_init``; raises (instead of aborting) on failure."""
        _LOG_TAIL.clear()
        ptr = L.llama_adapter_lora_init(self.ptr, str(path).encode())
        if not ptr:
            raise RuntimeError(f"llama_adapter_lora_init failed for {path}: {_LOG_TAIL[-3:]}")
        return ptr

    def free(self) -> None:
        L.llama_model_free(self.ptr)


class Context:
    """A one-sequence context with a reusable batch and a preallocated logits array."""

    def __init__(self, model: Model, exact: bool, n_ctx: int = N_CTX, threads: int = 1) -> None:
        params = L.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_ctx
        params.n_ubatch = n_ctx
        params.n_seq_max = 1
        params.n_threads = threads
        params.n_threads_batch = threads
        if exact:
            params.type_k = L.GGML_TYPE_F32
            params.type_v = L.GGML_TYPE_F32
            params.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ptr = L.llama_init_from_model(model.ptr, params)
        if not self.ptr:
            raise RuntimeError(f"llama_init_from_model failed: {_LOG_TAIL[-3:]}")
        self.n_vocab = model.n_vocab
        self.n_ctx = n_ctx
        self.memory = L.llama_get_memory(self.ptr)
        self.batch = L.llama_batch_init(n_ctx, 0, 1)
        self.logits = np.empty(self.n_vocab, np.float32)
        self._logits_addr = self.logits.ctypes.data
        self._logit_bytes = self.logits.nbytes
        self.pos = 0

    def reset(self) -> None:
        L.llama_memory_clear(self.memory, True)
        self.pos = 0

    def set_adapters(self, adapters: list[tuple[Any, float]]) -> None:
        """``llama_set_adapters_lora`` with (adapter, scale) pairs; [] clears."""
        n = len(adapters)
        if n == 0:
            rc = L.llama_set_adapters_lora(self.ptr, None, 0, None)
        else:
            arr = (L.llama_adapter_lora_p_ctypes * n)(*(a for a, _ in adapters))
            scales = (ctypes.c_float * n)(*(s for _, s in adapters))
            rc = L.llama_set_adapters_lora(self.ptr, arr, n, scales)
        if rc != 0:
            raise RuntimeError(f"llama_set_adapters_lora returned {rc}: {_LOG_TAIL[-3:]}")

    def eval(self, tokens: list[int] | np.ndarray) -> np.ndarray:
        """Decodes ``tokens`` at the next positions; returns the last token's logits."""
        b = self.batch
        n = len(tokens)
        for i, tok in enumerate(tokens):
            b.token[i] = int(tok)
            b.pos[i] = self.pos + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 0
        b.logits[n - 1] = 1
        b.n_tokens = n
        rc = L.llama_decode(self.ptr, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}: {_LOG_TAIL[-3:]}")
        self.pos += n
        ctypes.memmove(self._logits_addr, L.llama_get_logits_ith(self.ptr, -1), self._logit_bytes)
        return self.logits

    def step(self, token: int) -> None:
        """One decode step (the timed unit); logits copied into the preallocated array."""
        b = self.batch
        b.token[0] = token
        b.pos[0] = self.pos
        b.n_seq_id[0] = 1
        b.seq_id[0][0] = 0
        b.logits[0] = 1
        b.n_tokens = 1
        if L.llama_decode(self.ptr, b) != 0:
            raise RuntimeError(f"llama_decode failed: {_LOG_TAIL[-3:]}")
        self.pos += 1
        ctypes.memmove(self._logits_addr, L.llama_get_logits_ith(self.ptr, 0), self._logit_bytes)

    def free(self) -> None:
        L.llama_batch_free(self.batch)
        L.llama_free(self.ptr)


# --------------------------------------------------------------------------
# Measurements.
# --------------------------------------------------------------------------


def token_at(i: int, n_vocab: int) -> int:
    return (i * 7919 + 11) % (n_vocab - 3) + 3


def check_logits(ctx: Context, adapters: dict, ref: Any, atol: float) -> dict[str, Any]:
    """Per position, llama.cpp's logits vs transformers' for each adapter setting."""
    tokens = ref["tokens"]
    cases = {
        "plain": [],
        "r8_a": [(adapters["r8_a"], 1.0)],
        "r8_b": [(adapters["r8_b"], 1.0)],
        "r64": [(adapters["r64"], 1.0)],
        "blend_a07_b03": [(adapters[name], s) for name, s in BLEND],
    }
    out = {}
    for key, setting in cases.items():
        ctx.set_adapters(setting)
        ctx.reset()
        got = np.stack([ctx.eval([int(t)]).copy() for t in tokens])
        want = ref[key]
        diff = float(np.max(np.abs(got - want)))
        out[key] = {
            "max_abs_diff": diff,
            "argmax_agree": float(np.mean(got.argmax(-1) == want.argmax(-1))),
            "ok": diff <= atol,
        }
        # The whole sequence in one batch (prefill) must give the same last logits.
        ctx.reset()
        last = ctx.eval(tokens).copy()
        out[key]["batched_last_max_abs_diff"] = float(np.max(np.abs(last - want[-1])))
    ctx.set_adapters([])
    return out


def timed_steps(ctx: Context, steps: int, prompt: int = 0) -> float:
    """Seconds per decode step over ``steps`` steps, after a reset and a prompt of
    ``prompt`` tokens (1 when 0; prefilled in one batch, not timed)."""
    n_vocab = ctx.n_vocab
    ctx.reset()
    if prompt:
        ctx.eval([token_at(i, n_vocab) for i in range(prompt)])
    else:
        ctx.step(1)
    start = time.perf_counter()
    for i in range(steps):
        ctx.step(token_at(i, n_vocab))
    return (time.perf_counter() - start) / steps


def decode_ms(
    ctx: Context, settings: dict[str, list[tuple[Any, float]]], steps: int, repeats: int
) -> dict[str, dict[str, float]]:
    """ms per decode step for each adapter setting, the settings interleaved run by run.

    Interleaving (every repeat measures every setting once) keeps drift on a shared,
    noisy machine from favouring one setting. The first round only warms up.
    """
    samples: dict[str, list[float]] = {name: [] for name in settings}
    for r in range(repeats + 1):
        for name, setting in settings.items():
            ctx.set_adapters(setting)
            t = timed_steps(ctx, steps)
            if r:
                samples[name].append(t)
    ctx.set_adapters([])
    return {
        name: {"median": median_ms(v), "min": round(min(v) * 1e3, 4)}
        for name, v in samples.items()
    }


def prefill_ms(ctx: Context, n: int, repeats: int) -> float:
    tokens = [token_at(i, ctx.n_vocab) for i in range(n)]
    samples = []
    for r in range(repeats + 1):
        ctx.reset()
        start = time.perf_counter()
        ctx.eval(tokens)
        if r:
            samples.append(time.perf_counter() - start)
    return median_ms(samples)


def per_step_samples(ctx: Context, steps: int, before_step: Callable[[int], None]) -> list[float]:
    """Times of ``before_step(i)`` + one decode step, step by step (seconds)."""
    samples = []
    ctx.reset()
    ctx.step(1)
    for i in range(steps):
        if ctx.pos >= ctx.n_ctx - 1:
            ctx.reset()
            ctx.step(1)
        tok = token_at(i, ctx.n_vocab)
        start = time.perf_counter()
        before_step(i)
        ctx.step(tok)
        samples.append(time.perf_counter() - start)
    return samples[4:]  # the first steps after a change of pattern warm up


def switch_costs(ctx: Context, a: Any, b: Any, steps: int, repeats: int) -> dict[str, float]:
    """Switching between two loaded adapters, each switch followed by one decode step.

    Per repeat, interleaved: plain steps (no adapter), steps with adapter A fixed, steps
    that re-set A before each step, steps alternating A and B, steps alternating A and
    none. Medians over all steps of all repeats.
    """
    one_a, one_b = [(a, 1.0)], [(b, 1.0)]

    def fixed(setting):
        def run():
            ctx.set_adapters(setting)
            return per_step_samples(ctx, steps, lambda i: None)
        return run

    patterns = {
        "plain_decode_step_ms": fixed([]),
        "same_adapter_decode_step_ms": fixed(one_a),
        "same_adapter_set_again_plus_decode_ms": lambda: per_step_samples(
            ctx, steps, lambda i: ctx.set_adapters(one_a)),
        "switch_a_b_plus_decode_ms": lambda: per_step_samples(
            ctx, steps, lambda i: ctx.set_adapters(one_b if i % 2 else one_a)),
        "switch_adapter_none_plus_decode_ms": lambda: per_step_samples(
            ctx, steps, lambda i: ctx.set_adapters(one_a if i % 2 else [])),
    }
    samples: dict[str, list[float]] = {k: [] for k in patterns}
    for r in range(repeats + 1):
        for name, run in patterns.items():
            got = run()
            if r:
                samples[name] += got
    # The set call alone (its cost may be deferred to the next decode).
    alone = []
    for i in range(steps):
        start = time.perf_counter()
        ctx.set_adapters(one_b if i % 2 else one_a)
        alone.append(time.perf_counter() - start)
    ctx.set_adapters([])
    out = {k: median_ms(v) for k, v in samples.items()}
    out["set_adapters_call_alone_ms"] = median_ms(alone)
    out["switch_overhead_vs_same_adapter_ms"] = round(
        out["switch_a_b_plus_decode_ms"] - out["same_adapter_decode_step_ms"], 4)
    out["switch_a_b_plus_decode_over_plain_decode"] = round(
        out["switch_a_b_plus_decode_ms"] / out["plain_decode_step_ms"], 3)
    return out


def register_ms(model: Model, path: Path, repeats: int) -> float:
    """Median time of ``llama_adapter_lora_init`` (each adapter freed after)."""
    samples = []
    for r in range(repeats + 1):
        start = time.perf_counter()
        ptr = model.adapter(path)
        elapsed = time.perf_counter() - start
        L.llama_adapter_lora_free(ptr)
        if r:
            samples.append(elapsed)
    return median_ms(samples)


def rss_probe(model_path: Path, adapter_path: Path, count: int) -> dict[str, Any]:
    """In a fresh process: RSS growth per loaded adapter (``count`` copies), then freed.

    A fresh process, because memory freed by earlier measurements is reused by the
    allocator and would hide the growth.
    """
    model = Model(model_path)
    ctx = Context(model, exact=True)
    ctx.eval([1, 2, 3])
    before = rss_kib()
    ptrs = [model.adapter(adapter_path) for _ in range(count)]
    loaded = rss_kib()
    for p in ptrs:
        L.llama_adapter_lora_free(p)
    freed = rss_kib()
    return {
        "file_kib": round(adapter_path.stat().st_size / 1024, 1),
        "copies": count,
        "rss_growth_per_adapter_kib": round((loaded - before) / count, 1),
        "rss_still_held_after_free_kib": freed - before,
    }


def rss_per_adapter(model_path: Path, adapter_path: Path, count: int) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--rss-probe",
           str(model_path), str(adapter_path), str(count)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": f"probe exited {done.returncode}: {done.stderr[-500:]}"}
    return json.loads(done.stdout)


def switch_cycles_rss(ctx: Context, a: Any, b: Any, cycles: int) -> dict[str, Any]:
    """RSS before and after ``cycles`` (switch adapter + decode) cycles."""
    one_a, one_b = [(a, 1.0)], [(b, 1.0)]
    ctx.reset()
    ctx.step(1)
    for i in range(20):  # settle allocations first
        ctx.set_adapters(one_b if i % 2 else one_a)
        ctx.step(token_at(i, ctx.n_vocab))
    before = rss_kib()
    start = time.perf_counter()
    for i in range(cycles):
        if ctx.pos >= ctx.n_ctx - 1:
            ctx.reset()
            ctx.step(1)
        ctx.set_adapters(one_b if i % 2 else one_a)
        ctx.step(token_at(i, ctx.n_vocab))
    elapsed = time.perf_counter() - start
    after = rss_kib()
    ctx.set_adapters([])
    return {
        "cycles": cycles,
        "rss_before_kib": before,
        "rss_after_kib": after,
        "rss_growth_kib": after - before,
        "mean_cycle_ms": round(elapsed / cycles * 1e3, 4),
    }


# --------------------------------------------------------------------------
# Driver.
# --------------------------------------------------------------------------


def bench_model(kind: str, args: argparse.Namespace, ref: Any, out: dict) -> None:
    model_path = BENCH.theirs[kind]
    rss0 = rss_kib()
    model = Model(model_path)
    entry: dict[str, Any] = {
        "file": str(model_path.relative_to(BENCH_MODELS.parent.parent)),
        "file_kib": round(model_path.stat().st_size / 1024, 1),
        "load_ms": round(model.load_ms, 2),
        "rss_growth_after_load_kib": rss_kib() - rss0,
    }
    out["models"][kind] = entry

    adapters: dict[str, Any] = {}
    rss_before = rss_kib()
    for name, adapter in BENCH.adapters.items():
        start = time.perf_counter()
        adapters[name] = model.adapter(adapter.gguf)
        entry.setdefault("first_adapter_init_ms", {})[name] = round(
            (time.perf_counter() - start) * 1e3, 3
        )
    entry["rss_growth_three_adapters_kib"] = rss_kib() - rss_before

    ctx = Context(model, exact=True)
    check = check_logits(ctx, adapters, ref, args.atol)
    if kind == "f32":
        bad = {k: v["max_abs_diff"] for k, v in check.items() if not v["ok"]}
        out["same_weights_check"] = {
            "ok": not bad,
            "atol": args.atol,
            "max_abs_diff": {k: v["max_abs_diff"] for k, v in check.items()},
            "note": "f32 GGUF (+ f32 LoRA GGUFs) vs transformers (+ PEFT semantics), "
            "f32 KV cache, flash attention off, every position of a 16-token sequence "
            "decoded one by one; batched_last_* = the same 16 tokens in one batch",
        }
        if bad:
            out["error"] = f"llama.cpp f32 logits differ from transformers: {bad}"
            return
    else:  # quantized: informational only
        for v in check.values():
            v.pop("ok")
    entry["vs_transformers_exact_ctx"] = check

    steps, reps = args.steps, args.repeats
    settings = {
        "plain": [],
        "lora_r8": [(adapters["r8_a"], 1.0)],
        "blend_r8_a0.7_b0.3": [(adapters[name], s) for name, s in BLEND],
        "lora_r64": [(adapters["r64"], 1.0)],
    }
    dec = decode_ms(ctx, settings, steps, reps)
    for key in ("lora_r8", "blend_r8_a0.7_b0.3", "lora_r64"):
        dec[key]["over_plain"] = round(dec[key]["median"] / dec["plain"]["median"], 3)
    entry["decode_ms_per_token_exact_ctx"] = dec
    entry["prefill_ms_exact_ctx"] = {f"{n}_tokens": prefill_ms(ctx, n, reps) for n in (8, 64)}
    entry["switch_exact_ctx"] = switch_costs(
        ctx, adapters["r8_a"], adapters["r8_b"], args.switch_steps, reps
    )
    entry["switch_cycles_rss"] = switch_cycles_rss(
        ctx, adapters["r8_a"], adapters["r8_b"], args.cycles
    )
    ctx.free()

    ctx_default = Context(model, exact=False)
    entry["decode_ms_per_token_default_ctx"] = decode_ms(
        ctx_default, {k: settings[k] for k in ("plain", "lora_r8")}, steps, reps
    )
    ctx_default.set_adapters(settings["lora_r8"])
    ctx_default.reset()
    last = ctx_default.eval(ref["tokens"]).copy()
    entry["default_ctx_r8_a_last_logits_max_abs_diff"] = float(
        np.max(np.abs(last - ref["r8_a"][-1]))
    )
    ctx_default.free()

    entry["adapter_register_ms"] = {
        name: register_ms(model, BENCH.adapters[name].gguf, max(reps, 10))
        for name in ("r8_a", "r64")
    }
    if kind == "f32":
        entry["adapter_rss_fresh_process"] = {
            name: rss_per_adapter(model_path, BENCH.adapters[name].gguf, args.rss_copies)
            for name in ("r8_a", "r64")
        }
    for ptr in adapters.values():
        L.llama_adapter_lora_free(ptr)
    model.free()


class Server:
    """llama.cpp's side of ``benchmarks/run.py``'s alternating rounds, on one model set.

    Reads one JSON request per line on stdin and answers with one JSON line on stdout
    (``{"error": ...}`` for a request it cannot serve). Models, adapters and contexts
    (exact: f32 KV cache, flash attention off; the set's ``n_ctx``) are made on first use
    and kept. Blocked on stdin between requests, it takes no CPU while the other side
    measures. Requests (``kind`` is a GGUF precision of the set, ``threads`` the
    context's thread count)::

        {"op": "decode", "kind", "setting", "threads", "steps", "prompt"} -> {"ms"}  (per step)
        {"op": "prefill", "kind", "tokens", "threads"} -> {"ms"}  (the whole prompt)
        {"op": "switch", "kind", "threads", "steps"} -> {"step_ms", "switch_ms", "two_contexts_ms"}
        {"op": "register", "kind", "adapter", "repeats"} -> {"ms"}  (median of repeats)
        {"op": "concurrency", "kind", "sessions", "steps"} -> {"tokens_per_s"}
        {"op": "logits", "kind", "setting", "tokens", "out"} -> {"positions"}  (.npy file)
    """

    def __init__(self, models: ModelSet) -> None:
        self.set = models
        self.models: dict[str, Model] = {}
        self.loaded: dict[str, dict[str, Any]] = {}
        self.contexts: dict[tuple, Context] = {}
        self.pools: dict[str, list[Context]] = {}

    def model(self, kind: str) -> Model:
        if kind not in self.models:
            self.models[kind] = Model(self.set.theirs[kind])
            used = {name for adapters in SETTING_ADAPTERS.values() for name, _ in adapters}
            self.loaded[kind] = {name: self.models[kind].adapter(adapter.gguf)
                                 for name, adapter in self.set.adapters.items() if name in used}
        return self.models[kind]

    def context(self, kind: str, threads: int, slot: str = "main") -> Context:
        key = (kind, threads, slot)
        if key not in self.contexts:
            self.contexts[key] = Context(self.model(kind), exact=True, n_ctx=self.set.n_ctx, threads=threads)
        return self.contexts[key]

    def setting(self, kind: str, name: str) -> list[tuple[Any, float]]:
        self.model(kind)
        return [(self.loaded[kind][adapter], scale) for adapter, scale in SETTING_ADAPTERS[name]]

    def decode(self, kind: str, setting: str, threads: int, steps: int, prompt: int = 0) -> dict:
        ctx = self.context(kind, threads)
        ctx.set_adapters(self.setting(kind, setting))
        return {"ms": timed_steps(ctx, steps, prompt) * 1e3}

    def prefill(self, kind: str, tokens: int, threads: int) -> dict:
        ctx = self.context(kind, threads)
        ctx.set_adapters([])
        prompt = [token_at(i, ctx.n_vocab) for i in range(tokens)]
        ctx.reset()
        start = time.perf_counter()
        ctx.eval(prompt)
        return {"ms": (time.perf_counter() - start) * 1e3}

    def switch(self, kind: str, threads: int, steps: int) -> dict:
        """Per step: adapter A fixed; A and B set alternately before each step on one
        context; two contexts (one per adapter) stepped alternately, nothing switched."""
        ctx = self.context(kind, threads)
        one_a, one_b = self.setting(kind, "r8"), [(self.loaded[kind]["r8_b"], 1.0)]
        ctx.set_adapters(one_a)
        fixed = per_step_samples(ctx, steps, lambda i: None)
        switching = per_step_samples(ctx, steps, lambda i: ctx.set_adapters(one_b if i % 2 else one_a))
        other = self.context(kind, threads, "other")
        other.set_adapters(one_b)
        ctx.set_adapters(one_a)
        for c in (ctx, other):
            c.reset()
            c.step(1)
        pairs = []
        for i in range(steps // 2):
            start = time.perf_counter()
            for c in (ctx, other):
                if c.pos >= c.n_ctx - 1:
                    c.reset()
                    c.step(1)
                c.step(token_at(i, c.n_vocab))
            pairs.append((time.perf_counter() - start) / 2)
        return {"step_ms": median_ms(fixed), "switch_ms": median_ms(switching), "two_contexts_ms": median_ms(pairs[2:])}

    def register(self, kind: str, adapter: str, repeats: int) -> dict:
        return {"ms": register_ms(self.model(kind), Path(adapter), repeats)}

    def concurrency(self, kind: str, sessions: int, steps: int) -> dict:
        """Aggregate tokens/s of ``sessions`` contexts (1 thread each, rank-8 adapters A
        and B in turn) stepped by as many Python threads at once (ctypes calls release
        the GIL)."""
        pool = self.pools.setdefault(kind, [])
        while len(pool) < sessions:
            ctx = Context(self.model(kind), exact=True, n_ctx=self.set.n_ctx, threads=1)
            ctx.set_adapters([(self.loaded[kind]["r8_b" if len(pool) % 2 else "r8_a"], 1.0)])
            timed_steps(ctx, 2)
            pool.append(ctx)
        barrier = threading.Barrier(sessions + 1)

        def drive(ctx: Context) -> None:
            barrier.wait()
            timed_steps(ctx, steps)

        threads = [threading.Thread(target=drive, args=(ctx,)) for ctx in pool[:sessions]]
        for t in threads:
            t.start()
        barrier.wait()
        start = time.perf_counter()
        for t in threads:
            t.join()
        return {"tokens_per_s": sessions * (steps + 1) / (time.perf_counter() - start)}

    def logits(self, kind: str, setting: str, tokens: list[int], out: str) -> dict:
        """Logits at each position, the tokens decoded one by one (threads 1)."""
        ctx = self.context(kind, 1)
        ctx.set_adapters(self.setting(kind, setting))
        ctx.reset()
        np.save(out, np.stack([ctx.eval([int(t)]).copy() for t in tokens]))
        return {"positions": len(tokens)}

    def serve(self) -> int:
        print(json.dumps({"ready": True, "llama_cpp_python": L.__version__,
                          "system_info": L.llama_print_system_info().decode().strip()}), flush=True)
        for line in sys.stdin:
            request = json.loads(line)
            op = request.pop("op")
            try:
                reply = getattr(self, op)(**request) if op in self.OPS else {"error": f"unknown op {op!r}"}
            except (RuntimeError, KeyError, TypeError, ValueError) as exc:
                reply = {"error": f"{op}: {exc}"}
            print(json.dumps(reply), flush=True)
        return 0

    OPS = ("decode", "prefill", "switch", "register", "concurrency", "logits")


def load_probe(model_path: Path, n_ctx: int, threads: int) -> dict[str, Any]:
    """In a fresh process: load the model, make a context, run the first decode step.
    Times in ms; RSS before loading, and RSS and peak RSS (VmHWM) at the end, in KiB."""
    before = rss_kib()
    start = time.perf_counter()
    model = Model(model_path)
    loaded = time.perf_counter()
    ctx = Context(model, exact=True, n_ctx=n_ctx, threads=threads)
    made = time.perf_counter()
    ctx.step(1)
    done = time.perf_counter()
    return {"load_ms": (loaded - start) * 1e3, "context_ms": (made - loaded) * 1e3,
            "first_decode_ms": (done - made) * 1e3, "rss_before_kib": before, "rss_kib": rss_kib(),
            "peak_rss_kib": rss_kib("VmHWM")}


QUANTIZE_TYPES = {"q4_0": L.LLAMA_FTYPE_MOSTLY_Q4_0, "q4_1": L.LLAMA_FTYPE_MOSTLY_Q4_1}


def quantize(source: Path, out: Path, kind: str) -> dict[str, Any]:
    """llama.cpp's own quantizer (what ``llama-quantize`` runs): ``source`` GGUF -> ``out``
    in ``kind``, the whole file, output tensor included."""
    params = L.llama_model_quantize_default_params()
    params.ftype = QUANTIZE_TYPES[kind]
    start = time.perf_counter()
    if L.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize {source} -> {out} ({kind}) failed")
    return {"out": str(out), "kind": kind, "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=128, help="decode steps per timed run")
    parser.add_argument("--switch-steps", type=int, default=100,
                        help="steps per pattern and repeat")
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--rss-copies", type=int, default=20)
    parser.add_argument("--atol", type=float, default=1e-3)
    parser.add_argument("--models", default="f32,q8_0")
    parser.add_argument("--out", type=Path, default=HERE / "results.json",
                        help="also write the JSON here (default: %(default)s)")
    parser.add_argument("--rss-probe", nargs=3, metavar=("MODEL", "ADAPTER", "COUNT"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--serve", choices=list(EVERY_SET), metavar="SET",
                        help="serve timing requests on stdin for a model set of files.py (see Server)")
    parser.add_argument("--quantize", nargs=3, metavar=("SOURCE", "OUT", "TYPE"),
                        help=f"quantize a GGUF file with llama.cpp ({', '.join(QUANTIZE_TYPES)}) and exit")
    parser.add_argument("--load-probe", nargs=3, metavar=("MODEL", "N_CTX", "THREADS"),
                        help="print load_probe's JSON for one model and exit")
    args = parser.parse_args(argv)

    L.llama_log_set(_log_callback, ctypes.c_void_p(0))
    L.llama_backend_init()
    if args.serve:
        return Server(EVERY_SET[args.serve]).serve()
    if args.quantize:
        source, out, kind = args.quantize
        print(json.dumps(quantize(Path(source), Path(out), kind)))
        return 0
    if args.load_probe:
        model_path, n_ctx, threads = args.load_probe
        print(json.dumps(load_probe(Path(model_path), int(n_ctx), int(threads))))
        return 0
    if args.rss_probe:
        model_path, adapter_path, count = args.rss_probe
        print(json.dumps(rss_probe(Path(model_path), Path(adapter_path), int(count))))
        return 0
    ref = np.load(REFERENCE)
    out: dict[str, Any] = {
        "tool": "llama-cpp-python (low-level API)",
        "llama_cpp_python": L.__version__,
        "system_info": L.llama_print_system_info().decode().strip(),
        "python": platform.python_version(),
        "threads": 1,
        "n_ctx": N_CTX,
        "repeats": args.repeats,
        "decode_steps_per_run": args.steps,
        "units": {"time": "ms (median of repeats)", "memory": "KiB (VmRSS)"},
        "loadavg_start": Path("/proc/loadavg").read_text().split()[:3],
        "models": {},
    }
    start = time.perf_counter()
    for kind in args.models.split(","):
        bench_model(kind, args, ref, out)
        if "error" in out:
            break
    out["rss_end_kib"] = rss_kib()
    out["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    out["bench_seconds"] = round(time.perf_counter() - start, 1)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 1 if "error" in out else 0


if __name__ == "__main__":
    sys.exit(main())
