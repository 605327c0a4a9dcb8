"""The base model's output projection (lm_head) ``[vocab, hidden]``, read from the ``.tflite``.

Draft heads end in the base model's lm_head. Running it outside the graph needs its
weight: it is the constant operand of the operation that produces the ``logits`` output
of a verify signature (through any reshapes), a ``FULLY_CONNECTED`` with the weight
``[vocab, hidden]``. Float32 weights are a view of the model's bytes (no copy; a mapped
file pages in as read); float16 and per-channel int8 (``--quantize int8``) weights are
converted to float32 once.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np
from ai_edge_litert import schema_py_generated as schema

from runtime.errors import InvalidArgumentError, NotFoundError, UnimplementedError

_DTYPES = {schema.TensorType.FLOAT32: np.dtype(np.float32), schema.TensorType.FLOAT16: np.dtype(np.float16),
           schema.TensorType.INT8: np.dtype(np.int8)}
_PASS_THROUGH = {schema.BuiltinOperator.RESHAPE, schema.BuiltinOperator.SQUEEZE}
_PROJECTIONS = {schema.BuiltinOperator.FULLY_CONNECTED, schema.BuiltinOperator.BATCH_MATMUL}


def read_output_projection(model: str | os.PathLike[str] | bytes | memoryview, signature_key: str,
                           source: str) -> np.ndarray:
    """The float32 ``[vocab, hidden]`` weight that turns ``signature_key``'s final hidden
    states into its ``logits``."""
    if isinstance(model, (bytes, memoryview)):
        buffer: Any = model
    else:
        try:
            with open(model, "rb") as file:
                buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise NotFoundError(f"{source}: cannot read the model: {exc.strerror}") from None
    root = schema.Model.GetRootAs(buffer, 0)
    subgraph, logits = _signature_output(root, signature_key, "logits", source)
    producers = {}
    for index in range(subgraph.OperatorsLength()):
        op = subgraph.Operators(index)
        for out in op.OutputsAsNumpy():
            producers[int(out)] = op
    tensor_index = logits
    for _ in range(8):
        op = producers.get(tensor_index)
        if op is None:
            break
        code = _opcode(root, op)
        if code in _PASS_THROUGH:
            tensor_index = int(op.InputsAsNumpy()[0])
            continue
        if code in _PROJECTIONS:
            return _weight(root, subgraph, op, buffer, source)
        break
    raise UnimplementedError(f"{source}: the logits of {signature_key!r} do not come from a FULLY_CONNECTED with "
                             "a constant weight; draft heads cannot use its lm_head")


def _signature_output(root: Any, key: str, name: str, source: str) -> tuple[Any, int]:
    for index in range(root.SignatureDefsLength()):
        signature = root.SignatureDefs(index)
        if signature.SignatureKey() == key.encode():
            for o in range(signature.OutputsLength()):
                output = signature.Outputs(o)
                if output.Name() == name.encode():
                    return root.Subgraphs(signature.SubgraphIndex()), output.TensorIndex()
            raise NotFoundError(f"{source}: signature {key!r} has no output {name!r}")
    raise NotFoundError(f"{source}: the model has no signature {key!r}")


def _opcode(root: Any, op: Any) -> int:
    code = root.OperatorCodes(op.OpcodeIndex())
    return max(code.BuiltinCode(), code.DeprecatedBuiltinCode())


def _weight(root: Any, subgraph: Any, op: Any, buffer: Any, source: str) -> np.ndarray:
    for index in op.InputsAsNumpy():
        if index < 0:
            continue
        tensor = subgraph.Tensors(int(index))
        data = _bytes(root.Buffers(tensor.Buffer()), buffer)
        if not data.nbytes:
            continue
        if tensor.Type() not in _DTYPES:
            raise UnimplementedError(f"{source}: the lm_head weight is of tensor type {tensor.Type()}; float32, "
                                     "float16 and int8 are read")
        shape = tuple(int(d) for d in tensor.ShapeAsNumpy())
        array = np.frombuffer(data, dtype=_DTYPES[tensor.Type()]).reshape(shape)
        if len(shape) != 2:
            raise InvalidArgumentError(f"{source}: the lm_head weight is {list(shape)}, expected [vocab, hidden]")
        if tensor.Type() == schema.TensorType.FLOAT32:
            return array
        if tensor.Type() == schema.TensorType.FLOAT16:
            return array.astype(np.float32)
        quantization = tensor.Quantization()
        scale = quantization.ScaleAsNumpy().astype(np.float32)
        zero = quantization.ZeroPointAsNumpy()
        zero = np.zeros(1, np.float32) if not np.size(zero) else zero.astype(np.float32)
        column = (lambda v: v.reshape(-1, 1) if v.size > 1 else v[:1])
        return ((array.astype(np.float32) - column(zero)) * column(scale)).astype(np.float32)
    raise UnimplementedError(f"{source}: the lm_head has no constant weight")


def _bytes(entry: Any, buffer: Any) -> memoryview:
    if entry.DataLength():
        return memoryview(entry.DataAsNumpy())
    if entry.Offset() > 1:
        return memoryview(buffer)[entry.Offset():entry.Offset() + entry.Size()]
    return memoryview(b"")
