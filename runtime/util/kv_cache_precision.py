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
from runtime.util.attention_rewrite import OUR_OPS

KV_CACHE_PREFIX = "kv_cache_"
_FLOAT32, _FLOAT16 = schema.TensorType.FLOAT32, schema.TensorType.FLOAT16
_TYPE_NAMES = {v: k for k, v in vars(schema.TensorType).items() if not k.startswith("_")}
# Versions of the ops this pass adds: DEQUANTIZE of float16 is its version 3; CAST to float16 is in CAST's first.
_ADDED_OPS = {"CAST": 1, "DEQUANTIZE": 3}


def kv_caches_to_float16(model: schema.ModelT) -> dict[str, int]:
    """Rewrites ``model`` (the object form of a ``.tflite``) in place so that its KV caches
    are float16 (see the module); the caches converted per signature.
    ``InvalidArgumentError`` naming the signature and tensor when a cache is not float32 or
    is not written by a ``DYNAMIC_UPDATE_SLICE``; ``model`` is left unchanged then."""
    custom = {code.customCode.decode() if isinstance(code.customCode, bytes) else code.customCode
              for code in model.operatorCodes or () if code.customCode}
    if custom & set(OUR_OPS):
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
    codes = {name: _operator_code(model, name) for name in _ADDED_OPS}
    for index, plan in plans.items():
        _apply(model.subgraphs[index], plan, codes)
    return counts


def _consumers(sub: schema.SubGraphT) -> dict[int, list[int]]:
    consumers: dict[int, list[int]] = {}
    for j, op in enumerate(sub.operators):
        for i in op.inputs:
            if i >= 0:
                consumers.setdefault(int(i), []).append(j)
    return consumers


def _plan(model: schema.ModelT, sub: schema.SubGraphT, key: str,
          caches: list[tuple[str, int]]) -> list[tuple[int, int, list[int]]]:
    """Per cache: (its tensor, the op updating it, the ops reading the updated cache)."""
    consumers = _consumers(sub)
    names = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
    plan = []
    for name, tensor in caches:
        where = f"signature {key!r}, input {name!r}"
        if sub.tensors[tensor].type != _FLOAT32:
            raise InvalidArgumentError(f"{where}: a {_TYPE_NAMES.get(sub.tensors[tensor].type, '?')} cache; "
                                       "only float32 caches are stored in float16")
        readers = consumers.get(tensor, [])
        updates = [j for j in readers if _name(model, sub.operators[j], names) == "DYNAMIC_UPDATE_SLICE"
                   and int(sub.operators[j].inputs[0]) == tensor]
        if len(updates) != 1 or len(readers) != 1:
            found = sorted({_name(model, sub.operators[j], names) for j in readers}) or ["nothing"]
            raise InvalidArgumentError(f"{where}: read by {', '.join(found)}; expected one DYNAMIC_UPDATE_SLICE "
                                       "writing the step's rows into it")
        update = updates[0]
        updated = int(sub.operators[update].outputs[0])
        plan.append((tensor, update, consumers.get(updated, [])))
    return plan


def _name(model: schema.ModelT, op: schema.OperatorT, names: dict[int, str]) -> str:
    code = model.operatorCodes[op.opcodeIndex]
    return names.get(max(code.builtinCode, code.deprecatedBuiltinCode), "?")


def _operator_code(model: schema.ModelT, name: str) -> int:
    builtin = getattr(schema.BuiltinOperator, name)
    for index, code in enumerate(model.operatorCodes):
        if max(code.builtinCode, code.deprecatedBuiltinCode) == builtin and code.version >= _ADDED_OPS[name]:
            return index
    code = schema.OperatorCodeT()
    code.builtinCode, code.deprecatedBuiltinCode, code.version = builtin, min(builtin, 127), _ADDED_OPS[name]
    model.operatorCodes.append(code)
    return len(model.operatorCodes) - 1


def _tensor(sub: schema.SubGraphT, like: int, name: bytes, dtype: int) -> int:
    tensor = schema.TensorT()
    original = sub.tensors[like]
    tensor.name, tensor.shape, tensor.type = name, np.array(original.shape, np.int32), dtype
    if original.shapeSignature is not None:
        tensor.shapeSignature = np.array(original.shapeSignature, np.int32)
    tensor.buffer = 0  # no data: a computed tensor
    sub.tensors.append(tensor)
    return len(sub.tensors) - 1


def _op(code: int, inputs: list[int], outputs: list[int]) -> schema.OperatorT:
    op = schema.OperatorT()
    op.opcodeIndex, op.inputs, op.outputs = code, np.array(inputs, np.int32), np.array(outputs, np.int32)
    return op


def _apply(sub: schema.SubGraphT, plan: list[tuple[int, int, list[int]]], codes: dict[str, int]) -> None:
    before: dict[int, list[schema.OperatorT]] = {}  # op index -> ops inserted before it
    after: dict[int, list[schema.OperatorT]] = {}
    for tensor, update, readers in plan:
        op = sub.operators[update]
        updated, rows = int(op.outputs[0]), int(op.inputs[1])
        sub.tensors[tensor].type = sub.tensors[updated].type = _FLOAT16
        rows16 = _tensor(sub, rows, (sub.tensors[rows].name or b"") + b"/float16", _FLOAT16)
        before.setdefault(update, []).append(_op(codes["CAST"], [rows], [rows16]))
        op.inputs = np.array([int(i) if n != 1 else rows16 for n, i in enumerate(op.inputs)], np.int32)
        if readers:
            updated32 = _tensor(sub, updated, (sub.tensors[updated].name or b"") + b"/float32", _FLOAT32)
            after.setdefault(update, []).append(_op(codes["DEQUANTIZE"], [updated], [updated32]))
            for j in readers:
                reader = sub.operators[j]
                reader.inputs = np.array([updated32 if int(i) == updated else int(i) for i in reader.inputs], np.int32)
    operators = []
    for j, op in enumerate(sub.operators):
        operators += before.get(j, []) + [op] + after.get(j, [])
    sub.operators = operators
