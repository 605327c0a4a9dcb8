"""One export, stage by stage: source -> ``.tflite`` and/or ``.litertlm``, all or nothing,
measured (seconds and peak memory per stage, seconds per signature)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from runtime.errors import InvalidArgumentError
from runtime.export import budget, bundle, checkpoint, convert, families, finish, litert, lowering, projection_map
from runtime.export.measure import Measurements, MemoryWatch, process_peak_rss_bytes, release_freed_memory
from runtime.export.outputs import PendingOutputs
from runtime.export.settings import NATIVE_BUNDLE, QUANTIZATIONS, ExportSettings
from runtime.export.source import Source, check_settings, check_tokenizer
from runtime.util import flatbuffer_model
from runtime.util.attention_rewrite import rewrite_attention
from runtime.util.kv_cache_precision import kv_caches_to_float16
from runtime.util.kv_layout import KV_LAYOUT_METADATA
from runtime.util.lora_precision import lora_factors_to_float16


@dataclass(frozen=True)
class AlsoAt:
    """The same export at another precision, from the same lowered graph (tracing,
    lowering and converting are done once for all precisions): ``quantize`` (a key of
    :data:`~runtime.export.settings.QUANTIZATIONS`) and the files it writes."""

    quantize: str
    model_out: Path | None = None
    bundle_out: Path | None = None


@dataclass
class ExportReport:
    """What an export wrote, the plan it ran, and where its time and memory went."""

    model_path: Path | None
    bundle_path: Path | None
    plan: budget.Plan
    measurements: Measurements

    @property
    def stage_seconds(self) -> dict[str, float]:
        """Seconds per stage, in order."""
        return {stage.name: stage.seconds for stage in self.measurements.stages}


def export(
    source: Source,
    settings: ExportSettings,
    *,
    model_out: Path | None = None,
    bundle_out: Path | None = None,
    jobs: int | None = None,
    max_memory: int | None = None,
    also: Sequence[AlsoAt] = (),
    progress: Callable[[Iterable[str]], Iterable[str]] = lambda steps: steps,
) -> ExportReport:
    """Exports ``source`` to ``model_out`` (a ``.tflite``) and/or ``bundle_out`` (a
    ``.litertlm`` with the tokenizer, stop tokens and chat template), lowering the
    signatures in up to ``jobs`` worker processes within ``max_memory`` bytes
    (:func:`runtime.export.budget.plan`; one job lowers in this process), and the same
    model at each precision of ``also``. Each output is written under a temporary name in
    its directory and renamed at the end; on any failure nothing is left behind. An output
    that is ``source`` or would replace a file in it is refused before anything starts.
    ``progress`` wraps the iteration over the steps (a stage or a signature each), which
    yields each step's name when it is done."""
    precisions = [AlsoAt(settings.quantize, model_out, bundle_out), *also]
    for precision in precisions:
        if precision.model_out is None and precision.bundle_out is None:
            raise InvalidArgumentError(f"the {precision.quantize} export needs a model file, a bundle or both")
        if precision.quantize not in QUANTIZATIONS:
            raise InvalidArgumentError(f"quantize={precision.quantize!r}: expected one of {', '.join(QUANTIZATIONS)}")
    if settings.attention_kernel == "native" and any(precision.bundle_out is not None for precision in precisions):
        raise InvalidArgumentError(NATIVE_BUNDLE)
    if any(precision.bundle_out is not None for precision in precisions):
        check_tokenizer(source)
    check_settings(source, [precision.quantize for precision in precisions], settings.dora_ranks)
    if len({precision.quantize for precision in precisions}) < len(precisions):
        raise InvalidArgumentError(f"quantizations {', '.join(p.quantize for p in precisions)}: each at most once")
    targets = [path for precision in precisions for path in (precision.model_out, precision.bundle_out)
               if path is not None]
    plan = budget.plan(source.parameters, jobs, max_memory)
    measurements = Measurements(jobs=plan.jobs)
    start = time.perf_counter()
    with PendingOutputs(targets, sources=[source.path]) as outputs, MemoryWatch() as watch:
        job = _Job(source, settings, outputs, precisions, plan.jobs, measurements, watch)
        for _ in progress(job.steps()):
            pass
        outputs.commit()
    measurements.seconds = time.perf_counter() - start
    measurements.exporter_peak_rss_bytes = process_peak_rss_bytes()
    # Sampling misses short spikes (serializing copies the flatbuffer for a moment); the
    # kernel's high-water mark of the exporter alone does not.
    measurements.peak_rss_bytes = max(measurements.exporter_peak_rss_bytes, measurements.finisher_peak_rss_bytes,
                                      *measurements.worker_peak_rss_bytes,
                                      *(stage.peak_rss_bytes for stage in measurements.stages))
    measurements.peak_pss_bytes = max(stage.peak_pss_bytes for stage in measurements.stages)
    return ExportReport(model_out, bundle_out, plan, measurements)


def export_decoder(model: Any, settings: ExportSettings, out_path: Path) -> None:
    """Writes a litert-torch decoder built elsewhere (the test models' tools build their
    own) to ``out_path`` as a ``.tflite`` with ``settings``' signatures, in this process."""
    context = convert.new_context()
    module = convert.merged([lowered for _, lowered in lowering.lower_each(lowering.signatures_of(model, settings),
                                                                          context)])
    convert.add_metadata(module, context, {KV_LAYOUT_METADATA: settings.kv_layout})
    convert.to_tflite_ops(module, context)
    flatbuffer = convert.serialize(module)
    recipe = litert.quantizer_recipe(settings.litert_quantize, model.config)
    if recipe is not None:
        flatbuffer = convert.quantize(flatbuffer, recipe, settings.quantize)
    if settings.graph_passes:
        model = flatbuffer_model.unpack(flatbuffer)
        if settings.kv_cache_dtype == "float16":
            kv_caches_to_float16(model)
        if settings.lora_dtype == "float16":
            lora_factors_to_float16(model)
        if settings.op_form:
            rewrite_attention(model, keep_standard=settings.attention_kernel == "auto")
        flatbuffer = flatbuffer_model.pack(model)
    Path(out_path).write_bytes(flatbuffer)


class _Job:
    """The state handed from stage to stage."""

    def __init__(self, source: Source, settings: ExportSettings, outputs: PendingOutputs, precisions: list[AlsoAt],
                 jobs: int, measurements: Measurements, watch: MemoryWatch) -> None:
        self.source, self.settings, self.outputs = source, settings, outputs
        self.precisions, self.jobs = precisions, jobs
        self.measurements, self.watch = measurements, watch
        # Each precision's .tflite: its model output, or a scratch file its bundle is made from.
        self.model_files = [outputs.temporary(p.model_out) if p.model_out else outputs.scratch(p.bundle_out, ".tflite")
                            for p in precisions]
        # Each bundle's .tflite, in standard ops with float32 caches: its model file, or the
        # scratch file the model file is moved to before its graph passes (float16 caches,
        # the custom-op form).
        self.bundle_models = [outputs.scratch(p.bundle_out, ".standard.tflite")
                              if p.bundle_out and p.model_out and settings.graph_passes else model_file
                              for p, model_file in zip(precisions, self.model_files)]
        self.tokenizer: checkpoint.TokenizerAssets | None = None
        # The litert-torch decoder from its build until lowering takes it.
        self.decoder: Any = None

    def stage(self, name: str) -> Any:
        """A context that records stage ``name``."""
        return self.measurements.stage(name, self.watch)

    def steps(self) -> Iterator[str]:
        """Runs the export; yields the name of each stage and each signature when done."""
        if any(precision.bundle_out is not None for precision in self.precisions):
            with self.stage("read the tokenizer"):
                self.tokenizer = checkpoint.load_tokenizer(self.source)
            yield "read the tokenizer"
        with self.stage("load the weights"):
            hf_model = checkpoint.load_model(self.source)
            if self.tokenizer is not None:
                self.tokenizer = checkpoint.with_generation_stops(self.tokenizer, hf_model)
        yield "load the weights"
        with self.stage("build the litert-torch model"):
            self.decoder = families.build_decoder(hf_model, self.settings.kv_length)
            self.projections = projection_map.projection_map(hf_model, self.decoder)
            del hf_model
            gc.collect()
            release_freed_memory()
        yield "build the litert-torch model"
        recipes = [litert.quantizer_recipe(replace(self.settings, quantize=precision.quantize).litert_quantize,
                                           self.decoder.config) for precision in self.precisions]
        if self.jobs == 1:
            module_files = yield from self._lower_here()
        else:  # the workers convert their modules too
            module_files = yield from self._lower_in_workers()
        yield from self._finish(module_files, recipes)
        for precision, model_file in zip(self.precisions, self.bundle_models):
            if precision.bundle_out is not None:
                name = "write the bundle" + ("" if len(self.precisions) == 1 else f" ({precision.quantize})")
                with self.stage(name):
                    assert self.tokenizer is not None
                    bundle.write_bundle(model_file, self.tokenizer, self.settings.kv_length,
                                        self.outputs.temporary(precision.bundle_out))
                yield name

    def _lower_here(self) -> Iterator[str]:
        """Lowers every signature of the decoder (dropped when done) in this process and
        converts them to TFLite ops; yields each signature's name when done and returns the
        file the module is written to, for the finishing process."""
        decoder, self.decoder = self.decoder, None
        signatures = lowering.signatures_of(decoder, self.settings)
        context = convert.new_context()
        with self.stage(f"trace and lower {len(signatures)} signatures"):
            modules = []
            for record, lowered in lowering.lower_each(signatures, context):
                modules.append(lowered)
                self.measurements.signatures.append(record)
                yield record.name
            del decoder, signatures
            gc.collect()
            release_freed_memory()
            module = convert.merged(modules)
            del modules
        with self.stage("convert to TFLite ops"):
            convert.to_tflite_ops(module, context)
            module_file = self.outputs.scratch(self.outputs.targets[0], ".mlirbc")
            convert.write_module(module, module_file)
            del module, context
            gc.collect()
            release_freed_memory()
        yield "convert to TFLite ops"
        return [module_file]

    def _lower_in_workers(self) -> Iterator[str]:
        """Saves the decoder (dropping it here) for the workers, lowers and converts the
        signatures in ``self.jobs`` worker processes; yields each signature's name when done
        and returns the files the workers wrote their modules to."""
        decoder, self.decoder = self.decoder, None
        signatures = lowering.signatures_of(decoder, self.settings)
        names = lowering.shares(signatures, self.jobs)
        self.measurements.jobs = len(names)
        anchor = self.outputs.targets[0]
        with self.stage("save the model for the workers"):
            decoder_file = self.outputs.scratch(anchor, ".pt")
            lowering.save_decoder(decoder, decoder_file)
            del decoder, signatures
            gc.collect()
            release_freed_memory()
        yield "save the model for the workers"
        files = [self.outputs.scratch(anchor, f".worker{i}.mlirbc") for i in range(len(names))]
        with self.stage(f"trace, lower, convert in {len(names)} workers"):
            peaks = [0] * len(names)
            for worker, kind, payload in lowering.lower_in_workers(decoder_file, self.settings, names, files):
                if kind == "signature":
                    self.measurements.signatures.append(payload)
                    yield payload.name
                elif kind == "converted":
                    self.measurements.worker_convert_seconds.append(payload)
                else:
                    peaks[worker] = payload
            self.measurements.worker_peak_rss_bytes = peaks
            decoder_file.unlink()
        return files

    def _finish(self, module_files: list[Path], recipes: list[Any]) -> Iterator[str]:
        """Merges, serializes and quantizes in the finishing process
        (:mod:`runtime.export.finish`), recording its stages; yields each stage's name."""
        floats = [file for precision, file in zip(self.precisions, self.model_files) if precision.quantize == "none"]
        work = finish.Finish(
            module_files=tuple(module_files),
            metadata={projection_map.METADATA_NAME: projection_map.metadata_json(self.projections),
                      KV_LAYOUT_METADATA: self.settings.kv_layout},
            float_file=floats[0] if floats else self.outputs.scratch(self.outputs.targets[0], ".f32.tflite"),
            quantized=tuple(finish.Quantized(precision.quantize, recipe, file)
                            for precision, file, recipe in zip(self.precisions, self.model_files, recipes)
                            if recipe is not None),
            graph_passes=tuple(
                finish.GraphPasses("" if len(self.precisions) == 1 else f" ({precision.quantize})", file,
                                   kv_cache_float16=self.settings.kv_cache_dtype == "float16",
                                   lora_float16=self.settings.lora_dtype == "float16",
                                   attention=None if not self.settings.op_form else finish.BOTH_FORMS
                                   if self.settings.attention_kernel == "auto" else finish.NATIVE_KERNEL,
                                   standard_copy=None if bundle_model == file else bundle_model)
                for precision, file, bundle_model in zip(self.precisions, self.model_files, self.bundle_models)
                if precision.model_out is not None)
            if self.settings.graph_passes else ())
        self.watch.restart()
        for kind, payload in finish.finish_in_process(work):
            if kind == "stage":
                name, seconds = payload
                self.measurements.record(name, seconds, self.watch)
                yield name
            else:
                self.measurements.finisher_peak_rss_bytes = payload
        for file in module_files:
            file.unlink()
