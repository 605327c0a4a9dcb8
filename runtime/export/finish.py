"""The export's last stages, in a process of their own that imports neither torch nor
litert-torch: the lowered modules merged (each weight stored once), the metadata added,
the float flatbuffer serialized straight to its file, each quantized precision made
from that file, and each ``.tflite``'s KV caches stored in float16 (``--kv-cache-dtype
float16``) and its decode attention given the runtime's custom-op form beside its standard
one (``--attention-kernel auto``) or in its place (``native``), after quantizing: the
quantizer sees float32 caches and standard ops only.

The exporter has imported torch, transformers and litert-torch (~1.2 GB resident before
it holds any weight) and keeps them until it exits; the merged module and the quantizer's
copies of the model come on top of that. Here they come on top of ~0.2 GB, and go with
the process. At SmolLM2-135M's size this moved the export's largest process from the
exporter quantizing (3.78 GB) to a worker (1.9 GB)."""

from __future__ import annotations

import gc
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.export import convert, spawned
from runtime.export.measure import release_freed_memory
from runtime.errors import InvalidArgumentError
from runtime.util import flatbuffer_model
from runtime.util.attention_rewrite import rewrite_attention
from runtime.util.flatbuffer_model import FLATBUFFER_LIMIT
from runtime.util.kv_cache_precision import kv_caches_to_float16
from runtime.util.lora_precision import lora_factors_to_float16

BOTH_FORMS, NATIVE_KERNEL = "both forms", "native kernel"  # GraphPasses.attention


@dataclass(frozen=True)
class Quantized:
    """A quantized precision: ``quantization`` (its key, for stage names and errors),
    ai-edge-quantizer's ``recipe`` for it, and the file it is written to."""

    quantization: str
    recipe: Any
    out_file: Path


@dataclass(frozen=True)
class GraphPasses:
    """The passes over a model file's graph after quantizing, in one read and one write:
    its KV caches stored in float16 (``kv_cache_float16``, runtime.util.kv_cache_precision),
    its LoRA factors in float16 (``lora_float16``, runtime.util.lora_precision), then its
    decode attention given the custom-op form (runtime.util.attention_rewrite)
    beside the standard form (``attention`` "both forms"), in its place ("native kernel"), or
    not (None). ``standard_copy``: where the file as quantized goes first (a bundle's model,
    made from it: standard ops, float32 caches), or None. ``suffix`` ends the stage's name."""

    suffix: str
    file: Path
    kv_cache_float16: bool
    attention: str | None
    lora_float16: bool = False
    standard_copy: Path | None = None

    @property
    def name(self) -> str:
        """The stage's name."""
        done = ["KV caches to float16"] * self.kv_cache_float16 + ["LoRA factors to float16"] * self.lora_float16
        done += [f"rewrite decode attention ({self.attention})"] * (self.attention is not None)
        return ", ".join(done) + self.suffix


@dataclass(frozen=True)
class Finish:
    """What the finishing process makes: the modules in ``module_files`` (MLIR bytecode,
    converted to TFLite ops) merged, with ``metadata`` (name -> text) in the flatbuffer,
    serialized as the float model to ``float_file``, then each of ``quantized`` made from it."""

    module_files: tuple[Path, ...]
    metadata: dict[str, str]
    float_file: Path
    quantized: tuple[Quantized, ...] = ()
    # The models given float16 caches or their decode attention's custom-op form, last;
    # empty with float32 caches and --attention-kernel xnnpack or the default KV layout.
    graph_passes: tuple[GraphPasses, ...] = ()


def _run(finish: Finish, tell: Callable[[str, Any], None]) -> None:
    """The finishing process's body; tells ``("stage", (name, seconds))`` after each stage."""
    start = time.perf_counter()

    def done(name: str) -> None:
        nonlocal start
        now = time.perf_counter()
        tell("stage", (name, now - start))
        start = now

    context = convert.new_context()
    module = convert.read_modules(finish.module_files, context)
    convert.add_metadata(module, context, finish.metadata)
    done("merge the workers' modules" if len(finish.module_files) > 1 else "read the module")
    convert.serialize(module, finish.float_file)  # straight to the file, never whole in memory
    del module, context  # the context holds every weight's bytes
    gc.collect()
    release_freed_memory()
    done("serialize")
    flatbuffer = finish.float_file.read_bytes() if finish.quantized else b""  # read once for every precision
    for quantized in finish.quantized:
        quantized.out_file.write_bytes(convert.quantize(flatbuffer, quantized.recipe, quantized.quantization))
        gc.collect()
        release_freed_memory()
        done(f"quantize ({quantized.quantization})")
    del flatbuffer
    for passes in finish.graph_passes:
        if passes.file.stat().st_size >= FLATBUFFER_LIMIT:
            if passes.kv_cache_float16 or passes.lora_float16:
                raise InvalidArgumentError(f"{passes.file.name}: {passes.file.stat().st_size:,} bytes; float16 KV "
                                           "caches and LoRA factors are written by a pass that makes one flatbuffer, "
                                           "at most 2 GB")
            # The attention pass likewise: a larger model keeps its standard form alone.
            if passes.standard_copy is not None:
                shutil.copyfile(passes.file, passes.standard_copy)
            done(f"{passes.name}: not done, the model is over 2 GB")
            continue
        model = flatbuffer_model.unpack(passes.file.read_bytes(), str(passes.file))
        if passes.kv_cache_float16:
            kv_caches_to_float16(model)
        if passes.lora_float16:
            lora_factors_to_float16(model)
        if passes.attention is not None:
            rewrite_attention(model, keep_standard=passes.attention == BOTH_FORMS)
        if passes.standard_copy is not None:
            os.replace(passes.file, passes.standard_copy)
        flatbuffer_model.write(model, passes.file)
        del model
        gc.collect()
        release_freed_memory()
        done(passes.name)


def finish_in_process(finish: Finish) -> Iterator[tuple[str, Any]]:
    """Runs ``finish`` in a process of its own; yields ``("stage", (name, seconds))`` after
    each stage and ``("done", its peak RSS in bytes)`` at the end (errors and a death as
    :func:`runtime.export.spawned.run_all` raises them)."""
    work = spawned.Work("the export's finishing process (merging, serializing, quantizing)", _run, (finish,))
    for _, kind, payload in spawned.run_all([work]):
        yield kind, payload

