"""The ``.tflite`` pass behind ``--lora-dtype float16``: every signature's LoRA factor inputs
(``lora_..._a_prime_weight_L`` ``[in, r]`` and ``..._b_prime_weight_L`` ``[r, out]``, stacked
``[N, ...]`` in batched decode signatures) taken in float16: half the bytes an adapter holds
while resident, and half what a batch of rows with distinct adapters reads at each step (eight
rank-8 adapters on SmolLM2's q/k/v/o: 29 MB a step in float32).

What it changes, in every signature with such inputs (decode, prefill, windows, batched rows,
verify and score alike)::

    factor (f32) -> [readers]

becomes::

    factor (f16) -> DEQUANTIZE(-> f32) -> [the same readers]

so the graph computes in float32 what it computed before, over the adapter's weights rounded
to float16 once, when the runtime writes them into the slot's buffers. The LoRA-delta op
(:mod:`runtime.util.attention_rewrite`, run after this pass) reads the float16 factors
itself, and its form drops the ``DEQUANTIZE``; the standard form keeps it. DoRA's output
scales (``..._m_prime_weight_L``) stay float32.

A factor that is not float32 is refused naming the signature and input: the graph is never
half converted.
"""

from __future__ import annotations

import numpy as np
from ai_edge_litert import schema_py_generated as schema

from runtime.errors import InvalidArgumentError
from runtime.util.attention_rewrite import runs_our_ops
from runtime.util.graph_edit import FLOAT16, FLOAT32, TYPE_NAMES, computed_tensor, consumers, operator, operator_code

# The LoRA factor inputs of this runtime's exports (litert-torch's names); DoRA's
# ``_m_prime_weight`` scale is not one.
FACTOR_MARKERS = (b"_a_prime_weight_", b"_b_prime_weight_")
# DEQUANTIZE of float16 is that op's version 3.
_DEQUANTIZE_VERSION = 3


def is_lora_factor(name: bytes) -> bool:
    """Whether a signature input's name is a LoRA factor's (``A`` or ``B``) of this runtime's exports."""
    return name.startswith(b"lora_") and any(marker in name for marker in FACTOR_MARKERS)


def lora_factors_to_float16(model: schema.ModelT) -> dict[str, int]:
    """Rewrites ``model`` (the object form of a ``.tflite``) in place so that its LoRA factor
    inputs are float16 (see the module); the factors converted per signature.
    ``InvalidArgumentError`` naming the signature and input when a factor is not float32, or
    when the model has no LoRA factor input or already runs the runtime's custom ops;
    ``model`` is left unchanged then."""
    if runs_our_ops(model):
        raise InvalidArgumentError("the model already runs the runtime's custom ops: store the LoRA factors in "
                                   "float16 before that pass (attention_rewrite.standard_form_only takes a file of "
                                   "both forms back to its standard form)")
    plans: dict[int, list[int]] = {}
    counts = {}
    for sig in model.signatureDefs or ():
        key = sig.signatureKey.decode()
        factors = [(entry.name, int(entry.tensorIndex)) for entry in sig.inputs or () if is_lora_factor(entry.name)]
        if not factors:
            continue
        sub = model.subgraphs[sig.subgraphIndex]
        for name, tensor in factors:
            if sub.tensors[tensor].type != FLOAT32:
                raise InvalidArgumentError(
                    f"signature {key!r}, input {name.decode(errors='replace')!r}: a "
                    f"{TYPE_NAMES.get(sub.tensors[tensor].type, '?')} LoRA factor; only float32 factors are stored "
                    "in float16")
        plans.setdefault(sig.subgraphIndex, sorted(tensor for _, tensor in factors))
        counts[key] = len(factors)
    if not plans:
        raise InvalidArgumentError("the model has no LoRA factor input (lora_..._a_prime_weight_L) to store in "
                                   "float16: export it with --lora-ranks")
    dequantize = operator_code(model, "DEQUANTIZE", _DEQUANTIZE_VERSION)
    for index, factors in plans.items():
        _apply(model.subgraphs[index], factors, dequantize)
    return counts


def _apply(sub: schema.SubGraphT, factors: list[int], dequantize: int) -> None:
    """Each factor made float16, and a ``DEQUANTIZE`` to float32 before its first reader
    standing in for it in every reader."""
    readers_of = consumers(sub)
    before: dict[int, list[schema.OperatorT]] = {}  # op index -> ops inserted before it
    for tensor in factors:
        readers = readers_of.get(tensor, [])
        sub.tensors[tensor].type = FLOAT16
        if not readers:
            continue
        as32 = computed_tensor(sub, tensor, (sub.tensors[tensor].name or b"") + b"/float32", FLOAT32)
        before.setdefault(readers[0], []).append(operator(dequantize, [tensor], [as32]))
        for j in readers:
            reader = sub.operators[j]
            reader.inputs = np.array([as32 if int(i) == tensor else int(i) for i in reader.inputs], np.int32)
    operators = []
    for j, op in enumerate(sub.operators):
        operators += before.get(j, []) + [op]
    sub.operators = operators
