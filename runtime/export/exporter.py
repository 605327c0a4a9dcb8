"""One export, stage by stage: source -> ``.tflite`` and/or ``.litertlm``, all or nothing."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.errors import InvalidArgumentError
from runtime.export import bundle, checkpoint, convert, families
from runtime.export.outputs import PendingOutputs
from runtime.export.settings import ExportSettings
from runtime.export.source import Source


@dataclass(frozen=True)
class Stage:
    """One step of an export."""

    name: str
    run: Callable[[], None]


@dataclass
class ExportReport:
    """What an export wrote and how long each stage took."""

    model_path: Path | None
    bundle_path: Path | None
    stage_seconds: dict[str, float] = field(default_factory=dict)


def export(
    source: Source,
    settings: ExportSettings,
    *,
    model_out: Path | None = None,
    bundle_out: Path | None = None,
    progress: Callable[[Iterable[Stage]], Iterable[Stage]] = lambda stages: stages,
) -> ExportReport:
    """Exports ``source`` to ``model_out`` (a ``.tflite``) and/or ``bundle_out`` (a
    ``.litertlm`` with the tokenizer, stop tokens and chat template). Each output is
    written under a temporary name in its directory and renamed at the end; on any
    failure nothing is left behind. ``progress`` wraps the iteration over the stages."""
    targets = [path for path in (model_out, bundle_out) if path is not None]
    if not targets:
        raise InvalidArgumentError("export needs model_out, bundle_out or both")
    with PendingOutputs(targets) as outputs:
        job = _Job(source, settings, outputs, model_out, bundle_out)
        report = ExportReport(model_out, bundle_out)
        for stage in progress(job.stages()):
            start = time.perf_counter()
            stage.run()
            report.stage_seconds[stage.name] = time.perf_counter() - start
        outputs.commit()
    return report


class _Job:
    """The state handed from stage to stage."""

    def __init__(self, source: Source, settings: ExportSettings, outputs: PendingOutputs,
                 model_out: Path | None, bundle_out: Path | None) -> None:
        self.source, self.settings, self.outputs = source, settings, outputs
        self.bundle_out = bundle_out
        self.model_file = outputs.temporary(model_out) if model_out else outputs.scratch(bundle_out, ".tflite")
        self.tokenizer: checkpoint.TokenizerAssets | None = None
        self.hf_model: Any = None
        self.decoder: Any = None

    def stages(self) -> list[Stage]:
        stages = []
        if self.bundle_out is not None:
            stages.append(Stage("reading the tokenizer", self.read_tokenizer))
        stages += [
            Stage("loading the weights", self.load_weights),
            Stage("building the litert-torch model", self.build),
            Stage(f"converting ({self.settings.quantize})", self.convert),
        ]
        if self.bundle_out is not None:
            stages.append(Stage("writing the bundle", self.write_bundle))
        return stages

    def read_tokenizer(self) -> None:
        self.tokenizer = checkpoint.load_tokenizer(self.source)

    def load_weights(self) -> None:
        self.hf_model = checkpoint.load_model(self.source)
        if self.tokenizer is not None:
            self.tokenizer = checkpoint.with_generation_stops(self.tokenizer, self.hf_model)

    def build(self) -> None:
        self.decoder = families.build_decoder(self.hf_model, self.settings.kv_length)
        self.hf_model = None
        gc.collect()

    def convert(self) -> None:
        convert.convert(self.decoder, self.settings, self.model_file)
        self.decoder = None
        gc.collect()

    def write_bundle(self) -> None:
        assert self.tokenizer is not None and self.bundle_out is not None
        bundle.write_bundle(self.model_file, self.tokenizer, self.settings.kv_length,
                            self.outputs.temporary(self.bundle_out))
