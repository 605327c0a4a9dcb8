"""Small edits of a ``.tflite`` in object form (:mod:`runtime.util.flatbuffer_model`) shared
by the passes that store signature inputs in float16 (:mod:`runtime.util.kv_cache_precision`,
:mod:`runtime.util.lora_precision`): who reads a tensor, an op's builtin name, an operator
code found or added, a computed tensor and an operator made."""

from __future__ import annotations

import numpy as np
from ai_edge_litert import schema_py_generated as schema

BUILTIN_NAMES = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
TYPE_NAMES = {v: k for k, v in vars(schema.TensorType).items() if not k.startswith("_")}
FLOAT32, FLOAT16 = schema.TensorType.FLOAT32, schema.TensorType.FLOAT16


def consumers(sub: schema.SubGraphT) -> dict[int, list[int]]:
    """Per tensor of ``sub``, the indices of the operators reading it, in order."""
    readers: dict[int, list[int]] = {}
    for j, op in enumerate(sub.operators):
        for i in op.inputs:
            if i >= 0:
                readers.setdefault(int(i), []).append(j)
    return readers


def op_name(model: schema.ModelT, op: schema.OperatorT) -> str:
    """The builtin operator's name (``"?"`` for a custom op or an unknown code)."""
    code = model.operatorCodes[op.opcodeIndex]
    return BUILTIN_NAMES.get(max(code.builtinCode, code.deprecatedBuiltinCode), "?")


def operator_code(model: schema.ModelT, name: str, version: int) -> int:
    """The index of builtin ``name``'s operator code of at least ``version``, appended where missing."""
    builtin = getattr(schema.BuiltinOperator, name)
    for index, code in enumerate(model.operatorCodes):
        if max(code.builtinCode, code.deprecatedBuiltinCode) == builtin and code.version >= version:
            return index
    code = schema.OperatorCodeT()
    code.builtinCode, code.deprecatedBuiltinCode, code.version = builtin, min(builtin, 127), version
    model.operatorCodes.append(code)
    return len(model.operatorCodes) - 1


def computed_tensor(sub: schema.SubGraphT, like: int, name: bytes, dtype: int) -> int:
    """A tensor appended to ``sub`` with the shape of tensor ``like``, of type ``dtype``, no data."""
    tensor = schema.TensorT()
    original = sub.tensors[like]
    tensor.name, tensor.shape, tensor.type = name, np.array(original.shape, np.int32), dtype
    if original.shapeSignature is not None:
        tensor.shapeSignature = np.array(original.shapeSignature, np.int32)
    tensor.buffer = 0  # no data: a computed tensor
    sub.tensors.append(tensor)
    return len(sub.tensors) - 1


def operator(code: int, inputs: list[int], outputs: list[int]) -> schema.OperatorT:
    """An operator of ``code`` from ``inputs`` to ``outputs`` (tensor indices), no options."""
    op = schema.OperatorT()
    op.opcodeIndex, op.inputs, op.outputs = code, np.array(inputs, np.int32), np.array(outputs, np.int32)
    return op
