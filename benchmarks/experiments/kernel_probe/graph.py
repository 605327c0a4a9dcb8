"""A few-op .tflite written directly with the wheel's flatbuffer schema (no converter):
enough to put a CUSTOM op between built-in ops and give each graph signatures, so the
probes in this folder run through the same C API calls ``runtime/executor/native.py`` makes."""

from __future__ import annotations

from dataclasses import dataclass, field

import flatbuffers
import numpy as np
from ai_edge_litert import schema_py_generated as s

_TYPES = {np.dtype(np.float32): s.TensorType.FLOAT32, np.dtype(np.int32): s.TensorType.INT32}


@dataclass
class Graph:
    """One subgraph per signature; tensors by name within the signature being built."""

    codes: list = field(default_factory=list)  # OperatorCodeT
    buffers: list = field(default_factory=lambda: [s.BufferT()])  # buffer 0: the empty one
    subgraphs: list = field(default_factory=list)
    signatures: list = field(default_factory=list)

    def begin(self, key: str) -> None:
        sub = s.SubGraphT()
        sub.tensors, sub.operators, sub.inputs, sub.outputs, sub.name = [], [], [], [], key
        self.subgraphs.append(sub)
        self._names: dict[str, int] = {}
        self._key = key

    def tensor(self, name: str, shape, dtype=np.float32, data: np.ndarray | None = None) -> int:
        t = s.TensorT()
        t.name, t.shape, t.type = name, list(shape), _TYPES[np.dtype(dtype)]
        if data is not None:
            b = s.BufferT()
            b.data = np.frombuffer(np.ascontiguousarray(data, dtype).tobytes(), np.uint8)
            self.buffers.append(b)
            t.buffer = len(self.buffers) - 1
        sub = self.subgraphs[-1]
        sub.tensors.append(t)
        self._names[name] = len(sub.tensors) - 1
        return self._names[name]

    def _code(self, builtin: int, custom: str | None) -> int:
        for i, c in enumerate(self.codes):
            if c.builtinCode == builtin and (c.customCode or None) == custom:
                return i
        c = s.OperatorCodeT()
        c.builtinCode, c.deprecatedBuiltinCode, c.version = builtin, min(builtin, 127), 1
        c.customCode = custom
        self.codes.append(c)
        return len(self.codes) - 1

    def op(self, builtin: int, inputs: list[str], outputs: list[str], options=None, options_type: int = 0,
           custom: str | None = None, custom_options: bytes | None = None) -> None:
        o = s.OperatorT()
        o.opcodeIndex = self._code(builtin, custom)
        o.inputs = [self._names[n] for n in inputs]
        o.outputs = [self._names[n] for n in outputs]
        if options is not None:
            o.builtinOptionsType, o.builtinOptions = options_type, options
        if custom_options is not None:
            o.customOptions = list(custom_options)
        self.subgraphs[-1].operators.append(o)

    def add(self, a: str, b: str, out: str) -> None:
        self.op(s.BuiltinOperator.ADD, [a, b], [out], s.AddOptionsT(), s.BuiltinOptions.AddOptions)

    def custom(self, name: str, inputs: list[str], outputs: list[str], options: bytes | None = None) -> None:
        self.op(s.BuiltinOperator.CUSTOM, inputs, outputs, custom=name, custom_options=options)

    def end(self, inputs: list[str], outputs: list[str]) -> None:
        sub = self.subgraphs[-1]
        sub.inputs = [self._names[n] for n in inputs]
        sub.outputs = [self._names[n] for n in outputs]
        sig = s.SignatureDefT()
        sig.signatureKey, sig.subgraphIndex = self._key, len(self.subgraphs) - 1
        sig.inputs, sig.outputs = [], []
        for names, into in ((inputs, sig.inputs), (outputs, sig.outputs)):
            for n in names:
                m = s.TensorMapT()
                m.name, m.tensorIndex = n, self._names[n]
                into.append(m)
        self.signatures.append(sig)

    def to_bytes(self) -> bytes:
        model = s.ModelT()
        model.version, model.description = 3, "kernel_probe"
        model.operatorCodes, model.subgraphs, model.buffers = self.codes, self.subgraphs, self.buffers
        model.signatureDefs = self.signatures
        builder = flatbuffers.Builder(1024)
        original = s.BufferT.Pack
        s.BufferT.Pack = _pack_aligned  # LiteRT wraps a tensor for a custom op only at 64-byte-aligned data
        try:
            builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
        finally:
            s.BufferT.Pack = original
        return bytes(builder.Output())


ALIGNMENT = 64


def _pack_aligned(self: s.BufferT, builder: flatbuffers.Builder) -> int:
    """``BufferT.Pack`` with the data vector aligned to :data:`ALIGNMENT` bytes (the
    builder pads the whole buffer to its largest alignment, so the data lies aligned in
    the file, and in a file mapped at a page boundary)."""
    data = None
    if self.data is not None:
        raw = bytes(np.asarray(self.data, np.uint8))
        builder.StartVector(1, len(raw), ALIGNMENT)
        builder.head = builder.head - len(raw)
        builder.Bytes[builder.head:builder.head + len(raw)] = raw
        data = builder.EndVector()
    s.BufferStart(builder)
    if data is not None:
        s.BufferAddData(builder, data)
    s.BufferAddOffset(builder, self.offset)
    s.BufferAddSize(builder, self.size)
    return s.BufferEnd(builder)
