#!/usr/bin/env python3
"""Do separately compiled signature groups share a session's buffers? One session's KV
cache written by a prefill in one compiled model (the plain group) and read by a decode in
another (a LoRA slot's group, compiled later, "on first need"), against the same two runs
in the whole model.

    python3 -m benchmarks.experiments.open_probe.handoff --model M.tflite --weight-cache C.xnnpack \\
        --prefill prefill_32 --decode decode_lora_r16

The same ``HostBuffer`` objects (KV caches bound in place, LoRA inputs zero) are bound to
each compiled model through ``handle_for`` (one tensor-buffer handle per model). Prints the
time to compile the second group at its first need, its first decode, and the largest
difference between the logits of the grouped and the whole runs (0 expected).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.experiments.open_probe import views


def run(model: object, key: str, buffers: dict[str, object]) -> float:
    """Runs ``key`` of ``model`` on ``buffers`` (by name; KV caches in place); ms."""
    sig = model.signatures[key]
    inputs = [buffers[name] for name in sig.inputs]
    outputs = [buffers[name] for name in sig.outputs]
    prepared = model.prepare(sig.index, inputs, outputs)
    start = time.perf_counter()
    model.run(prepared)
    return (time.perf_counter() - start) * 1e3


def session_buffers(model: object, keys: list[str], prompt: np.ndarray) -> dict[str, dict[str, object]]:
    """Buffers for one session: KV caches shared by every signature (same names), and per
    signature its own tokens / positions / logits (their shapes differ)."""
    from runtime.executor.native import HostBuffer

    shared: dict[str, object] = {}
    per: dict[str, dict[str, object]] = {}
    for key in keys:
        sig = model.signatures[key]
        own: dict[str, object] = {}
        for name, info in list(sig.inputs.items()) + list(sig.outputs.items()):
            if name.startswith("kv_cache_"):
                own[name] = shared.setdefault(name, HostBuffer(info))
            elif name not in own:
                own[name] = HostBuffer(info)
        per[key] = own
    first = per[keys[0]]
    first["tokens"].write(prompt)
    first["input_pos"].write(np.arange(prompt.size, dtype=np.int32))
    second = per[keys[1]]
    second["tokens"].write(np.array([[int(prompt.flat[-1])]], np.int32))
    second["input_pos"].write(np.array([prompt.size], np.int32))
    return per


def main() -> None:
    """Grouped against whole."""
    from runtime.executor.native import NativeModel

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--weight-cache", required=True)
    parser.add_argument("--prefill", default="prefill_32")
    parser.add_argument("--decode", default="decode_lora_r16")
    args = parser.parse_args()
    keys = [args.prefill, args.decode]
    whole = NativeModel(args.model, num_threads=1, weight_cache=args.weight_cache, name="whole")
    length = whole.signatures[args.prefill].inputs["tokens"].shape[1]
    prompt = (np.arange(length, dtype=np.int32) * 37 % 4000 + 100).reshape(1, length)
    reference = session_buffers(whole, keys, prompt)
    run(whole, args.prefill, reference[args.prefill])
    run(whole, args.decode, reference[args.decode])
    expected = reference[args.decode]["logits"].array.copy()

    plain_keys = [k for k, _ in views.signature_keys(args.model) if "lora" not in k and "verify" not in k]
    slot = args.decode.split("lora_")[1]
    slot_keys = [k for k, _ in views.signature_keys(args.model) if k.endswith(f"lora_{slot}") and "verify" not in k]
    start = time.perf_counter()
    plain_view = views.subset_view(args.model, plain_keys)
    plain = NativeModel(memoryview(plain_view.mapping), num_threads=1, weight_cache=args.weight_cache, name="plain")
    plain_ms = (time.perf_counter() - start) * 1e3
    grouped = session_buffers(whole, keys, prompt)  # the whole model's tensor types serve both groups
    prefill_ms = run(plain, args.prefill, grouped[args.prefill])
    start = time.perf_counter()
    slot_view = views.subset_view(args.model, slot_keys)
    lora = NativeModel(memoryview(slot_view.mapping), num_threads=1, weight_cache=args.weight_cache, name="slot")
    slot_ms = (time.perf_counter() - start) * 1e3
    first_decode_ms = run(lora, args.decode, grouped[args.decode])
    got = grouped[args.decode]["logits"].array
    print(f"plain group ({len(plain_keys)} signatures) opened in {plain_ms:.0f} ms; {args.prefill} first run "
          f"{prefill_ms:.0f} ms")
    print(f"slot group ({len(slot_keys)} signatures) compiled at first need in {slot_ms:.0f} ms; {args.decode} "
          f"first run {first_decode_ms:.0f} ms")
    print(f"logits after {args.prefill} (plain group) + {args.decode} (slot group) vs the whole model: "
          f"max |diff| {float(np.abs(got - expected).max()):.3g}; argmax {int(got.argmax())} vs {int(expected.argmax())}")


if __name__ == "__main__":
    main()
