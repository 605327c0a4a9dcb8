"""Signatures -> one MLIR module, in this process or in a worker process of its own.

litert-torch's ``Converter.convert`` traces every signature, runs its decompositions twice
(once after ``torch.export``, once before lowering: each a full AOTAutograd re-trace,
~13 s per signature at SmolLM2-135M's size), then lowers them all into one MLIR module in
one process. Here each signature is traced once with ``torch.export``, goes through the
same litert-torch graph passes, and is decomposed once, by the lowering (as litert-torch's
own V2 converter does: ``run_decompositions=False``); the exports come out with the same
logits to the bit. Signature sets that do not depend on each other are lowered and
converted to TFLite ops in worker processes (``jobs``), each into its own module written as
MLIR bytecode; the export's finishing process (:mod:`runtime.export.finish`) parses them
into one context and points every constant at one copy of its weight
(:func:`runtime.export.convert.read_modules`), so each weight is stored once in the
flatbuffer.

Weights are never copied on the way: the lowering makes each large weight an MLIR resource
that refers to the torch tensor's own memory (litert-torch's "resource constants", which
its converter folds and serializes as it does inline ones: the same ops and buffers), and
workers rebuild the decoder from its blueprint (:func:`runtime.export.families.blueprint`)
without initializing it, over the weights the exporter saved with ``torch.save``,
memory-mapped: their pages are the page cache's, shared by every worker.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runtime.export import convert, families, spawned
from runtime.export.convert import converter_api_ext, ir
from runtime.export.litert import (
    backend_export, convert_core, fx_infra, inline_consts, litert_signature, litert_torch, output_names,
    run_graph_passes,
)
from runtime.export.measure import SignatureRecord, release_freed_memory
from runtime.export.settings import ExportSettings
from runtime.export.signatures import SIGNATURE_SETS, Signature


def signatures_of(model: nn.Module, settings: ExportSettings) -> list[Signature]:
    """Every signature of the export (:data:`~runtime.export.signatures.SIGNATURE_SETS`), in
    the order the sets give them."""
    return [signature for signature_set in SIGNATURE_SETS for signature in signature_set(model, settings)]


def shares(signatures: Sequence[Signature], jobs: int) -> list[list[str]]:
    """The signature names split into at most ``jobs`` shares of about equal cost (a
    signature costs about its rows: a batch of B traces B rows), largest first."""
    costs = {signature.name: signature.rows for signature in signatures}
    out: list[list[str]] = [[] for _ in range(min(jobs, len(signatures)))]
    loads = [0] * len(out)
    for name in sorted(costs, key=lambda n: -costs[n]):
        lightest = loads.index(min(loads))
        out[lightest].append(name)
        loads[lightest] += costs[name]
    return out


def lower_each(signatures: Sequence[Signature], context: ir.Context, worker: int = 0
               ) -> Iterator[tuple[SignatureRecord, ir.Module]]:
    """Traces and lowers each of ``signatures`` into a module of ``context`` (weights are
    shared between them: one attribute per weight); yields each one's timings and module
    as it is done."""
    fx_infra.silence_torch_logs()
    litert_torch.config.show_progress = False  # the export command shows its own
    torch._dynamo.config.cache_size_limit = 64  # one graph per signature; as litert-torch sets it
    # Weights become resources over the tensors' memory (no copy); small constants stay inline.
    constants = inline_consts.InlineConstsContext(enable_resource_constants=True)
    for signature in signatures:
        start = time.perf_counter()
        spec = litert_signature.Signature(signature.name, signature.module, sample_args=(),
                                          sample_kwargs=dict(signature.sample_kwargs()))
        program = convert_core.export_torch_signature(spec, run_decompositions=False)
        program = run_graph_passes(program)
        traced = time.perf_counter()
        lowered = backend_export.exported_program_to_mlir(program, ir_context=context,
                                                          lowering_context_plugins=[constants])
        converter_api_ext.set_signature(
            lowered.module.operation, signature_name=signature.name, input_names=spec.flat_arg_names,
            output_names=output_names(program, lowered))
        yield SignatureRecord(signature.name, traced - start, time.perf_counter() - traced, worker), lowered.module


def save_decoder(decoder: nn.Module, path: Path) -> None:
    """Writes what :func:`load_decoder` rebuilds ``decoder`` from."""
    torch.save({"blueprint": families.blueprint(decoder), "weights": decoder.state_dict()}, path)


def load_decoder(path: Path) -> nn.Module:
    """The decoder :func:`save_decoder` wrote, its weights memory-mapped from ``path``. It is
    built on the meta device (no weights allocated and randomly initialized, only to be
    replaced), unless a tensor of it is not among the saved ones."""
    saved = torch.load(path, mmap=True, weights_only=False)
    factory, args, kwargs = saved["blueprint"]
    with torch.device("meta"):
        model = factory(*args, **kwargs)
    model.load_state_dict(saved["weights"], assign=True)
    if _has_meta_tensors(model):  # a tensor built in __init__ and not saved: build it for real
        model = factory(*args, **kwargs)
        model.load_state_dict(saved["weights"], assign=True)
    return model.eval()


def _has_meta_tensors(model: nn.Module) -> bool:
    return any(tensor.is_meta for module in model.modules()
               for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False), *vars(module).values()]
               if isinstance(tensor, torch.Tensor))


@dataclass(frozen=True)
class _Task:
    """What one worker lowers: the names of its signatures from the saved decoder."""

    worker: int
    decoder_file: Path
    settings: ExportSettings
    names: tuple[str, ...]
    out_file: Path


def _lower(task: _Task, tell: Callable[[str, Any], None]) -> None:
    """A worker's body: loads the decoder (memory-mapped), lowers its signatures, converts
    them to TFLite ops, writes the module as bytecode; tells each signature as
    ``("signature", SignatureRecord)`` and the conversion's seconds as ``("converted",
    seconds)``."""
    model = load_decoder(task.decoder_file)
    wanted = set(task.names)
    signatures = [s for s in signatures_of(model, task.settings) if s.name in wanted]
    modules, context = [], convert.new_context()
    for record, module in lower_each(signatures, context, task.worker):
        modules.append(module)
        tell("signature", record)
    module = convert.merged(modules)
    del modules, signatures, model
    gc.collect()
    release_freed_memory()
    start = time.perf_counter()
    convert.to_tflite_ops(module, context)
    tell("converted", time.perf_counter() - start)
    convert.write_module(module, task.out_file)


def lower_in_workers(decoder_file: Path, settings: ExportSettings, names: Sequence[Sequence[str]],
                     out_files: Sequence[Path]) -> Iterator[tuple[int, str, Any]]:
    """Lowers each share of ``names`` in a worker process of its own (all at once), from
    the decoder saved at ``decoder_file``, and converts it to TFLite ops, worker i writing
    its module to ``out_files[i]`` as MLIR bytecode; yields ``(worker, kind, payload)``:
    ``"signature"`` with a :class:`SignatureRecord` as signatures are done, then
    ``"converted"`` with the conversion's seconds and ``"done"`` with the worker's peak RSS
    (errors and deaths as :func:`runtime.export.spawned.run_all` raises them)."""
    works = [spawned.Work(f"export worker {i} (lowering {', '.join(share)})", _lower,
                          (_Task(i, decoder_file, settings, tuple(share), out_file),))
             for i, (share, out_file) in enumerate(zip(names, out_files))]
    yield from spawned.run_all(works)
