"""The ``.tflite`` pass behind ``--kv-cache-dtype float16``: every signature's KV caches
stored in float16, half the bytes a long session's attention reads at each step (llama.cpp
keeps its cache in f16 by default).

What it changes, in every signature with ``kv_cache_*`` inputs (decode, prefill, attention
windows, batched rows, verify and score alike)::

    cache (f32) -> DYNAMIC_UPDATE_SLICE(cache, new rows, start) -> [readers of the cache]

becomes::

    cache (f16) -> DYNAMIC_UPDATE_SLICE(cache, CAST(new rows -> f16), start)
                -> DEQUANTIZE(-> f32) -> [the same readers]

so the graph computes in float32 what it computed before, over the rows rounded to float16
once, when they are written. The signature's inputs and outputs (the executor's cache
buffers, the prefix cache, the windows' moves) are float16. The custom attention op
(:mod:`runtime.util.attention_rewrite`, run after this pass) reads the float16 cache itself,
and its form drops the ``DEQUANTIZE``; the standard form keeps it (XNNPACK's matmuls take
float32), converting the whole cache at each step: where the kernel cannot run, a float16
cache costs more than a float32 one.

A cache that is not float32, or is read by anything but the one ``DYNAMIC_UPDATE_SLICE``
writing into it (every export of this runtime writes before it reads), is refused naming
the signature and input: the graph is never half converted.
"""

from __future__ import annotations

import numpy as np
from ai_edge_litert import schema_py_generated as schema

from runtime.errors import InvalidArgumentError
from runtime.util.attention_rewrite import runs_our_ops
from runtime.util.graph_edit import (FLOAT16, FLOAT32, TYPE_NAMES, computed_tensor, consumers, op_name,
                                      operator, operator_code)

KV_CACHE_PREFIX = "kv_cache_"
# Versions of the ops this pass adds: DEQUANTIZE of float16 is its version 3; CAST to float16 is in CAST's first.
_ADDED_OPS = {"CAST": 1, "DEQUANTIZE": 3}


def kv_caches_to_float16(model: schema.ModelT) -> dict[str, int]:
    """Rewrites ``model`` (the object form of a ``.tflite``) in place so that its KV caches
    are float16 (see the module); the caches converted per signature.
    ``InvalidArgumentError`` naming the signature and tensor when a cache is not float32 or
    is not written by a ``DYNAMIC_UPDATE_SLICE``; ``model`` is left unchanged then."""
    if runs_our_ops(model):
        raise InvalidArgumentError("the model already runs the runtime's custom ops: store the caches in float16 "
                                   "before that pass (attention_rewrite.standard_form_only takes a file of both "
                                   "forms back to its standard form)")
    plans: dict[int, list[tuple[int, int, list[int]]]] = {}
    counts = {}
    for sig in model.signatureDefs or ():
        key = sig.signatureKey.decode()
        caches = [(entry.name.decode(), int(entry.tensorIndex)) for entry in sig.inputs or ()
                  if entry.name.decode().startswith(KV_CACHE_PREFIX)]
        if caches and sig.subgraphIndex not in plans:
            plans[sig.subgraphIndex] = _plan(model, model.subgraphs[sig.subgraphIndex], key, caches)
        if caches:
            counts[key] = len(plans[sig.subgraphIndex])
    if not plans:
        raise InvalidArgumentError(f"the model has no {KV_CACHE_PREFIX}* signature input to store in float16")
    codes = {name: operator_code(model, name, version) for name, version in _ADDED_OPS.items()}
    for index, plan in plans.items():
        _apply(model.subgraphs[index], plan, codes)
    return counts


def _plan(model: schema.ModelT, sub: schema.SubGraphT, key: str,
          caches: list[tuple[str, int]]) -> list[tuple[int, int, list[int]]]:
    """Per cache: (its tensor, the op updating it, the ops reading the updated cache)."""
    readers_of = consumers(sub)
    plan = []
    for name, tensor in caches:
        where = f"signature {key!r}, input {name!r}"
        if sub.tensors[tensor].type != FLOAT32:
            raise InvalidArgumentError(f"{where}: a {TYPE_NAMES.get(sub.tensors[tensor].type, '?')} cache; "
                                       "only float32 caches are stored in float16")
        readers = readers_of.get(tensor, [])
        updates = [j for j in readers if op_name(model, sub.operators[j]) == "DYNAMIC_UPDATE_SLICE"
                   and int(sub.operators[j].inputs[0]) == tensor]
        if len(updates) != 1 or len(readers) != 1:
            found = sorted({op_name(model, sub.operators[j]) for j in readers}) or ["nothing"]
            raise InvalidArgumentError(f"{where}: read by {', '.join(found)}; expected one DYNAMIC_UPDATE_SLICE "
                                       "writing the step's rows into it")
        update = updates[0]
        updated = int(sub.operators[update].outputs[0])
        plan.append((tensor, update, readers_of.get(updated, [])))
    return plan


def _apply(sub: schema.SubGraphT, plan: list[tuple[int, int, list[int]]], codes: dict[str, int]) -> None:
    before: dict[int, list[schema.OperatorT]] = {}  # op index -> ops inserted before it
    after: dict[int, list[schema.OperatorT]] = {}
    for tensor, update, readers in plan:
        op = sub.operators[update]
        updated, rows = int(op.outputs[0]), int(op.inputs[1])
        sub.tensors[tensor].type = sub.tensors[updated].type = FLOAT16
        rows16 = computed_tensor(sub, rows, (sub.tensors[rows].name or b"") + b"/float16", FLOAT16)
        before.setdefault(update, []).append(operator(codes["CAST"], [rows], [rows16]))
        op.inputs = np.array([int(i) if n != 1 else rows16 for n, i in enumerate(op.inputs)], np.int32)
        if readers:
            updated32 = computed_tensor(sub, updated, (sub.tensors[updated].name or b"") + b"/float32", FLOAT32)
            after.setdefault(update, []).append(operator(codes["DEQUANTIZE"], [updated], [updated32]))
            for j in readers:
                reader = sub.operators[j]
                reader.inputs = np.array([updated32 if int(i) == updated else int(i) for i in reader.inputs], np.int32)
    operators = []
    for j, op in enumerate(sub.operators):
        operators += before.get(j, []) + [op] + after.get(j, [])
    sub.operators = operators
