#!/usr/bin/env python3
"""Check the test models in ``tests/models`` against the numpy reference.

Needs only numpy and ai-edge-litert (no torch)::

    python3 tools/check_test_models.py [--models-dir DIR]

For every ``.tflite`` listed in ``MANIFEST.json`` this drives the classic
``ai_edge_litert.interpreter.Interpreter`` like a runtime would: zeroed KV
cache, one prefill call (prompt padded to the signature length), then decode
steps, feeding every ``kv_cache_*`` output back as the next input. The decode
logits (and the prefill logits where the signature returns them) are compared
with ``tests/reference_model.py``:

1. plain signatures (``prefill_8``, ``prefill_32``, ``decode``);
2. LoRA signatures with a random adapter, against the reference with
   ``W + (a_prime @ b_prime).T`` merged into q/k/v/o;
3. LoRA signatures with all-zero adapter inputs, which must be bit-identical
   to the plain signatures.

Exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from ai_edge_litert.interpreter import Interpreter

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests"))

import reference_model  # noqa: E402  (needs the sys.path entry above)

TOLERANCE = 1e-4
LORA_INPUT_RE = re.compile(r"^lora_atten_([qkvo])_(a|b)_prime_weight_(\d+)$")


@dataclass
class RunResult:
    """Logits of one prefill + decode run."""

    prefill: np.ndarray | None  # [n_prompt, vocab] if the signature returns logits
    decode: np.ndarray  # [n_decode, vocab], row j is position n_prompt + j


def run_sequence(
    interp: Interpreter,
    tokens: np.ndarray,
    n_prompt: int,
    prefill_len: int,
    suffix: str = "",
    lora_inputs: Mapping[str, np.ndarray] | None = None,
) -> RunResult:
    """Prefills ``tokens[:n_prompt]`` then decodes the rest one token a step.

    Args:
        interp: The interpreter of the model.
        tokens: The whole token sequence (prompt then decode inputs).
        n_prompt: How many tokens go through the prefill signature.
        prefill_len: Which ``prefill_{len}`` signature to use (>= n_prompt).
        suffix: Signature suffix, e.g. ``"_lora_r4"``.
        lora_inputs: Values for the signature's LoRA inputs.
    """
    lora_inputs = dict(lora_inputs or {})
    prefill = interp.get_signature_runner(f"prefill_{prefill_len}{suffix}")
    decode = interp.get_signature_runner(f"decode{suffix}")
    kv = {
        name: np.zeros(detail["shape"], dtype=detail["dtype"])
        for name, detail in decode.get_input_details().items()
        if name.startswith("kv_cache_")
    }

    padded = np.zeros((1, prefill_len), dtype=np.int32)
    padded[0, :n_prompt] = tokens[:n_prompt]
    out = prefill(
        tokens=padded, input_pos=np.arange(prefill_len, dtype=np.int32), **kv, **lora_inputs
    )
    kv = {name: out[name] for name in kv}
    prefill_logits = out["logits"][0, :n_prompt].copy() if "logits" in out else None

    decode_logits = []
    for pos in range(n_prompt, len(tokens)):
        out = decode(
            tokens=np.array([[tokens[pos]]], dtype=np.int32),
            input_pos=np.array([pos], dtype=np.int32),
            **kv,
            **lora_inputs,
        )
        kv = {name: out[name] for name in kv}
        decode_logits.append(out["logits"][0, 0].copy())
    return RunResult(prefill_logits, np.stack(decode_logits))


def lora_input_shapes(interp: Interpreter, signature: str) -> dict[str, tuple[int, ...]]:
    """The LoRA inputs of ``signature`` and their shapes."""
    details = interp.get_signature_runner(signature).get_input_details()
    return {
        name: tuple(int(d) for d in detail["shape"])
        for name, detail in details.items()
        if LORA_INPUT_RE.match(name)
    }


def random_lora(
    shapes: Mapping[str, tuple[int, ...]], rng: np.random.Generator, std: float = 0.15
) -> tuple[dict[str, np.ndarray], dict[tuple[int, str], np.ndarray]]:
    """Draws LoRA inputs and returns them with the reference's dense deltas."""
    inputs = {
        name: (rng.standard_normal(shape) * std).astype(np.float32)
        for name, shape in sorted(shapes.items())
    }
    deltas: dict[tuple[int, str], np.ndarray] = {}
    for name in inputs:
        match = LORA_INPUT_RE.match(name)
        assert match is not None
        proj, half, layer = match.groups()
        if half == "a":
            b_name = f"lora_atten_{proj}_b_prime_weight_{layer}"
            deltas[(int(layer), proj)] = reference_model.lora_delta(inputs[name], inputs[b_name])
    return inputs, deltas


def max_diff(result: RunResult, ref: np.ndarray, n_prompt: int) -> float:
    """Largest |graph - reference| over the logits the run produced."""
    diff = float(np.max(np.abs(result.decode - ref[n_prompt:])))
    if result.prefill is not None:
        diff = max(diff, float(np.max(np.abs(result.prefill - ref[:n_prompt]))))
    return diff


def check_model(path: Path, weights: Mapping[str, np.ndarray], seed: int = 0) -> list[str]:
    """Runs all checks on one model; returns the failures (empty if none)."""
    failures: list[str] = []
    interp = Interpreter(model_path=str(path), num_threads=1)
    signatures = interp.get_signature_list()
    vocab = int(weights["config.vocab"])
    rng = np.random.default_rng(seed)
    # (prefill signature length, prompt length, total length)
    cases = [(8, 5, 12), (8, 8, 10), (32, 20, 24)]
    sequences = {case: rng.integers(1, vocab, size=case[2]) for case in cases}

    def report(label: str, diff: float) -> None:
        ok = diff <= TOLERANCE
        print(f"  {label:<44} max|diff| = {diff:.2e} {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(f"{path.name}: {label}: {diff:.2e}")

    plain: dict[tuple[int, int, int], RunResult] = {}
    for case, toks in sequences.items():
        prefill_len, n_prompt, _ = case
        ref = reference_model.reference_logits(weights, toks)
        plain[case] = run_sequence(interp, toks, n_prompt, prefill_len)
        returns = "with" if plain[case].prefill is not None else "without"
        label = f"plain prefill_{prefill_len}({n_prompt}) {returns} logits + decode"
        report(label, max_diff(plain[case], ref, n_prompt))
        argmax = np.argmax(ref, axis=-1)
        print(
            f"    reference logits std {ref.std():.2f},"
            f" {len(set(argmax))} distinct argmax in {len(argmax)} positions"
        )

    ranks = sorted(int(s.rsplit("_r", 1)[1]) for s in signatures if s.startswith("decode_lora_r"))
    for rank in ranks:
        suffix = f"_lora_r{rank}"
        shapes = lora_input_shapes(interp, f"decode{suffix}")
        zero_inputs = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
        lora_inputs, deltas = random_lora(shapes, rng)
        for case, toks in sequences.items():
            prefill_len, n_prompt, _ = case
            label = f"prefill_{prefill_len}({n_prompt}){suffix}"
            ref = reference_model.reference_logits(weights, toks, lora=deltas)
            result = run_sequence(interp, toks, n_prompt, prefill_len, suffix, lora_inputs)
            report(f"{label} random LoRA", max_diff(result, ref, n_prompt))
            effect = float(np.max(np.abs(result.decode - plain[case].decode)))
            print(f"    LoRA changes decode logits by up to {effect:.2f}")
            if effect < 1e-2:
                failures.append(f"{path.name}: {label}: LoRA has no visible effect")

            zero = run_sequence(interp, toks, n_prompt, prefill_len, suffix, zero_inputs)
            same = np.array_equal(zero.decode, plain[case].decode) and (
                zero.prefill is None or np.array_equal(zero.prefill, plain[case].prefill)
            )
            print(f"  {label + ' zero LoRA == plain':<44} bit-identical: {same}")
            if not same:
                failures.append(f"{path.name}: {label}: zero LoRA differs from plain")
    return failures


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--models-dir", type=Path, default=REPO_ROOT / "tests" / "models")
    args = parser.parse_args(argv)
    manifest: dict[str, Any] = json.loads((args.models_dir / "MANIFEST.json").read_text())
    failures: list[str] = []
    for name, entry in manifest["files"].items():
        if not name.endswith(".tflite"):
            continue
        weights = reference_model.load_weights(args.models_dir / entry["config"]["weights"])
        print(f"{name} ({entry['size_bytes']} bytes)")
        failures += check_model(args.models_dir / name, weights)
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
