"""Lowered MLIR modules (:mod:`runtime.export.lowering`) -> a ``.tflite``: litert-torch's
converter passes, merging modules into one, the flatbuffer, and the quantizer.

Imports neither torch nor litert-torch, only litert-converter's MLIR bindings and
ai-edge-quantizer (~0.2 GB for the process against litert-torch's ~0.55 GB), so that the
export's last stages (:mod:`runtime.export.finish`) run in a small process of their own.
litert-converter 0.5.0 offers its converter API (merging modules, the TFLite passes, the
flatbuffer writer) only as ``litert_converter.mlir._mlir_libs.converter_api_ext``, the module
litert-torch's converter calls too; this module alone imports it (:mod:`runtime.export.lowering`
takes it from here)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

from ai_edge_quantizer import quantizer
from litert_converter.mlir import ir, passmanager
from litert_converter.mlir._mlir_libs import converter_api_ext

from runtime.errors import InvalidArgumentError


def new_context() -> ir.Context:
    """An MLIR context with the dialects the conversion needs."""
    context = ir.Context()
    converter_api_ext.prepare_mlir_context(context)
    return context


def merged(modules: Sequence[ir.Module]) -> ir.Module:
    """One module holding every function of ``modules``."""
    return modules[0] if len(modules) == 1 else converter_api_ext.merge_modules(list(modules))


def write_module(module: ir.Module, path: str | os.PathLike[str]) -> None:
    """Writes ``module`` to ``path`` as MLIR bytecode, which :func:`read_modules` parses."""
    with open(path, "wb") as stream:
        module.operation.write_bytecode(stream)


def read_modules(files: Sequence[os.PathLike[str]], context: ir.Context) -> ir.Module:
    """The bytecode files parsed into ``context`` and merged into one module, each weight's
    constants pointing at one copy of it (every worker brings its own)."""
    with context:
        module = merged([ir.Module.parseFile(str(path)) for path in files])
    share_equal_resources(module)
    return module


def _as_resource(attribute: ir.Attribute) -> ir.DenseResourceElementsAttr | None:
    """``attribute`` as a resource, or None when it is another kind."""
    try:
        return ir.DenseResourceElementsAttr(attribute)
    except ValueError:
        return None


def share_equal_resources(module: ir.Module) -> int:
    """Points every attribute of ``module`` that is a resource (a weight) at the first
    resource of the same type and bytes, so the flatbuffer stores it once; returns how many
    attributes were repointed."""
    first: dict[tuple[str, bytes], ir.Attribute] = {}
    kept: dict[ir.Attribute, ir.Attribute] = {}  # each resource hashed once, however many use it
    repointed = 0

    def visit(op: ir.Operation) -> ir.WalkResult:
        nonlocal repointed
        for name in list(op.attributes):
            value = _as_resource(op.attributes[name])
            if value is None:
                continue
            if value not in kept:
                data = converter_api_ext.dense_resource_elements_attr_to_numpy(value)
                key = (str(value.type), hashlib.blake2b(memoryview(data), digest_size=32).digest())
                kept[value] = first.setdefault(key, value)
            if kept[value] != value:
                op.attributes[name] = kept[value]
                repointed += 1
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return repointed


def to_tflite_ops(module: ir.Module, context: ir.Context) -> None:
    """Runs litert-torch's conversion passes over ``module`` in place, configured as its
    ``Converter`` configures them for a PyTorch model without PT2E quantization."""
    config = converter_api_ext.ConvertToTFLConfig()
    config.model_origin_framework = "PYTORCH"
    config.unsafe_fuse_dynamic_shaped_broadcast = True
    config.canonicalizing_inf_as_min_max_float = False  # litert-torch clamps infinities before lowering
    if hasattr(config, "enable_x64"):
        config.enable_x64 = False
    with context:
        converter_api_ext.run_convert_to_tfl_passes(module, passmanager.PassManager(), config)


def add_metadata(module: ir.Module, context: ir.Context, entries: dict[str, str]) -> None:
    """Gives the flatbuffer ``entries`` (name -> text) as metadata: the converter writes a
    module's ``tfl.metadata`` dictionary (which the lowering leaves unset) into the model."""
    with context:
        module.operation.attributes["tfl.metadata"] = ir.DictAttr.get(
            {name: ir.StringAttr.get(text) for name, text in entries.items()})


def serialize(module: ir.Module, out_path: str | os.PathLike[str] | None = None) -> bytes | None:
    """Writes ``module``'s flatbuffer to ``out_path``, or returns it when none is given."""
    if out_path is None:
        return converter_api_ext.export_flatbuffer_to_bytes(module.operation)
    converter_api_ext.export_flatbuffer_to_file(module.operation, str(out_path))
    return None


def quantize(flatbuffer: bytes, recipe: Any, quantization: str) -> bytes:
    """``flatbuffer`` quantized by ai-edge-quantizer with ``recipe`` (its recipe for the
    precision named ``quantization``: :func:`runtime.export.litert.quantizer_recipe`)."""
    try:
        return bytes(quantizer.Quantizer(flatbuffer, recipe).quantize().quantized_model)
    except ValueError as exc:  # the quantizer's word when a weight does not split into its blocks
        if "block size" not in str(exc):
            raise
        reason = " ".join(str(exc).split()).rsplit("Error: ", 1)[-1]
    raise InvalidArgumentError(f"quantize={quantization!r} does not fit this model: {reason}")
