"""``export``: a Hugging Face model directory or GGUF file -> a ``.tflite`` with LoRA slots
and/or a ``.litertlm`` bundle (needs the ``export`` extra)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from runtime.cli.options import import_export_module
from runtime.cli.progress import progress_bar
from runtime.errors import InvalidArgumentError
from runtime.export.budget import GB, plan
from runtime.export.outputs import PendingOutputs, check_targets
from runtime.export.settings import (ATTENTION_KERNELS, DEFAULT_PREFILL_WINDOW, KERNEL_KV_LAYOUTS, KV_CACHE_DTYPES,
                                     KV_LAYOUTS, LORA_DTYPES, LORA_TARGETS, MAX_DEFAULT_KV_LENGTH, NATIVE_BUNDLE,
                                     QUANTIZATIONS, ExportSettings, default_kv_length, precision_name)
from runtime.export.source import check_settings, check_tokenizer, inspect_source, supported_architectures
from runtime.util.native_logs import muted_native_logs

PRECISION_FIELD = "{precision}"  # where --out / --bundle name each precision's file


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Registers the ``export`` sub-command."""
    defaults = ExportSettings()
    parser = commands.add_parser(
        "export",
        help="export a Hugging Face model or GGUF file as a .tflite with LoRA slots (and a .litertlm bundle)",
        description="Exports a checkpoint with litert-torch: signatures prefill_{L} and decode, and per LoRA "
        f"rank slot R prefill_{{L}}_lora_r{{R}} and decode_lora_r{{R}}. Families: {supported_architectures()}. "
        "Needs the export extra: pip install -e '.[export]'.",
    )
    parser.add_argument("source", type=Path, help="a Hugging Face model directory or a GGUF model file")
    parser.add_argument("--out", type=Path, help="the .tflite model to write")
    parser.add_argument("--bundle", type=Path,
                        help="also (or only) write a .litertlm bundle: model, tokenizer, stop tokens, chat template")
    parser.add_argument("--lora-ranks", default="", metavar="R,R,...",
                        help="LoRA rank slots, e.g. 8,16 (default: none)")
    parser.add_argument("--lora-targets", choices=LORA_TARGETS, default=None,
                        help="attention: LoRA on q/k/v/o; all-linear: also slots with the MLP's gate/up/down (an "
                        "attention-only adapter still runs the cheaper slots). Default: all-linear (every family: "
                        "Llama, Qwen2, Qwen3, Gemma 3)")
    parser.add_argument("--dora-ranks", default="", metavar="R,R,...",
                        help="DoRA slots for PEFT use_dora adapters, e.g. 8: all-linear slots whose projections also "
                        "take an output scale, in prefill, decode and attention-window signatures (Llama, Qwen2, "
                        "Qwen3; default: none)")
    parser.add_argument("--kv-length", type=int, default=None,
                        help=f"KV-cache positions: the longest context a session holds (default: the model's "
                        f"context, up to {MAX_DEFAULT_KV_LENGTH:,})")
    parser.add_argument("--prefill-lengths", default=None, metavar="L,L,...",
                        help="prefill signature lengths (default: 32, 128 and 512, those up to half --kv-length)")
    parser.add_argument("--quantize", default=defaults.quantize, metavar="Q[,Q,...]",
                        help="weights: none (float32), int8 (dynamic-range int8), int8-weights, fp16, "
                        "int4-block32, int4-block128; several (e.g. none,int8) write one model each from one "
                        "tracing and lowering, --out and --bundle then naming them with {precision} "
                        "(f32 for none, else the value), e.g. --out model-{precision}.tflite")
    parser.add_argument("--kv-layout", choices=KV_LAYOUTS, default=defaults.kv_layout,
                        help="the KV caches' layout: transposed (the default; K [1, G, T, D], V [1, G, D, T]); "
                        "grouped keeps V as K lies (K and V [1, G, T, D]): a batch of 8 int8 SmolLM2 rows 0.89-0.98x "
                        "the time at 8-900 positions; both run in the attention kernel and in Google's "
                        "LiteRT-LM engine; default is litert-torch's own (K and V [1, T, G, D]), standard ops only. "
                        "docs/export.md")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=defaults.kv_cache_dtype,
                        help="the KV caches' element type: float32 (the default), or float16 (llama.cpp's "
                        "default): half the bytes a long session's attention reads per step, rows rounded to "
                        "float16 when written; where the attention kernel cannot run, the standard form converts "
                        "the whole cache every step (slower than float32 there); a --bundle keeps float32 caches. "
                        "docs/kernels.md")
    parser.add_argument("--lora-dtype", choices=LORA_DTYPES, default=defaults.lora_dtype,
                        help="the LoRA slots' factor inputs (A and B): float32 (the default), or float16: half the "
                        "memory a resident adapter takes and half what a batch of sessions with distinct adapters "
                        "reads per step, the adapter's weights rounded to float16 when loaded; a --bundle keeps "
                        "float32 factors. docs/kernels.md")
    parser.add_argument("--attention-kernel", choices=ATTENTION_KERNELS, default=defaults.attention_kernel,
                        help="auto (the default): each decode signature's attention in standard ops and, beside "
                        "them in the same file sharing every weight, as one custom op per layer whose kernel the "
                        "runtime compiles with the system C compiler at first open (0.34-0.50x the attention's time "
                        "at SmolLM2's shapes with AVX2; reads only the positions in use), the LoRA deltas likewise "
                        "(odml_runtime.lora_delta: a batch of 8 SmolLM2 int8 rows with adapters 0.78x the step) "
                        "and float32 linear layers (odml_runtime.linear_rows: 8 SmolLM2 f32 rows 0.64x the step, "
                        "the weights' size more page cache); the runtime runs the op "
                        "where the kernel builds on a CPU with AVX2 and FMA, else the standard ops, saying so; "
                        "bundles and --kv-layout default get standard ops only. xnnpack: standard ops only. "
                        "native: the custom op only (opens only where the kernel builds; transposed or grouped KV "
                        "layout, no --bundle). "
                        "docs/kernels.md")
    parser.add_argument("--batch-sizes", default="", metavar="B,B,...",
                        help="batched decode signatures: B sessions step in one pass over the weights (e.g. 2,4,8)")
    parser.add_argument("--batch-lora-ranks", default=None, metavar="R,R,...",
                        help="the LoRA rank slots the batched signatures take (default: every --lora-ranks slot)")
    parser.add_argument("--attention-windows", default="", metavar="W,W,...",
                        help="extra decode signatures (single and batched) attending over the cache's first W "
                        "positions only: faster while a session is short (e.g. 128,512); with --verify-lengths "
                        "also verify{L} signatures attending over W")
    parser.add_argument("--prefill-windows", default=None, metavar="W,W,...",
                        help="extra prefill signatures (every prefill length up to W) attending over the cache's "
                        "first W positions only: a prompt's chunks ending below W do not pay for the whole cache "
                        f"(each window costs export time like a prefill length per LoRA slot). Default: "
                        f"{DEFAULT_PREFILL_WINDOW} where the KV length is longer; 'none' for no windows")
    parser.add_argument("--verify-lengths", default="", metavar="L,L,...",
                        help="verify{L} signatures (per LoRA slot and plain): L tokens at once with logits and final "
                        "hidden states at all L, which speculative decoding with an adapter's draft heads (Turbo "
                        "LoRA) needs (e.g. 4; default: none)")
    parser.add_argument("--score-lengths", default="", metavar="L,L,...",
                        help="score_{L} signatures (per LoRA slot and plain): prefills that also return the logits at "
                        "all L positions, what a prompt's logprobs (the server's echo, lm-eval's loglikelihood) are "
                        "read from, while plain prefills compute none (e.g. 128,512; default: none; each length costs "
                        "export time like a prefill length per LoRA slot)")
    parser.add_argument("--prefill-logits", action="store_true", help="prefill signatures also return logits (every "
                        "prompt then pays for them; --score-lengths keeps generation's prefill without)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="worker processes lowering signatures side by side (default: one per core, as many as "
                        "--max-memory holds)")
    parser.add_argument("--max-memory", type=float, default=None, metavar="GB",
                        help="memory the export may use, all processes together (default: what is available now); "
                        "fewer jobs run when it is tight")
    parser.add_argument("--verbose", action="store_true",
                        help="print where the time and memory went: per stage and per signature")
    parser.add_argument("--report", type=Path, metavar="FILE.json",
                        help="write the plan and the measurements (per stage and per signature) as JSON")
    parser.set_defaults(run=run)


def parse_integers(option: str, text: str) -> tuple[int, ...]:
    """``"8,16"`` -> ``(8, 16)``; an option name for the error message."""
    try:
        return tuple(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError:
        raise InvalidArgumentError(f"{option} {text!r}: expected comma-separated integers") from None


def parse_quantizations(text: str) -> tuple[str, ...]:
    """``"none,int8"`` -> ``("none", "int8")``, each a key of ``QUANTIZATIONS``, each once."""
    names = tuple(part for part in text.replace(" ", "").split(",") if part)
    unknown = [name for name in names if name not in QUANTIZATIONS]
    if not names or unknown:
        raise InvalidArgumentError(f"--quantize {text!r}: expected one or more of {', '.join(QUANTIZATIONS)}, "
                                   "comma-separated")
    if len(set(names)) < len(names):
        raise InvalidArgumentError(f"--quantize {text!r}: a quantization given twice")
    return names


def output_path(option: str, template: Path | None, quantize: str, quantizations: Sequence[str]) -> Path | None:
    """``template`` with ``{precision}`` replaced by ``quantize``'s name (f32 for none); with
    several quantizations it must contain ``{precision}``, naming the option otherwise."""
    if template is None:
        return None
    if len(quantizations) > 1 and PRECISION_FIELD not in template.name:
        raise InvalidArgumentError(f"{option} {template}: with several --quantize values ({', '.join(quantizations)}) "
                                   f"the file name needs {PRECISION_FIELD}, e.g. model-{PRECISION_FIELD}{template.suffix}")
    return template.with_name(template.name.replace(PRECISION_FIELD, precision_name(quantize)))


def run(args: argparse.Namespace) -> int:
    """Checks everything that can be checked without torch, then exports stage by stage."""
    if args.out is None and args.bundle is None:
        raise InvalidArgumentError("give --out MODEL.tflite, --bundle MODEL.litertlm or both")
    quantizations = parse_quantizations(args.quantize)
    if args.attention_kernel == "native" and args.bundle is not None:
        raise InvalidArgumentError(NATIVE_BUNDLE)
    if args.attention_kernel == "native" and args.kv_layout not in KERNEL_KV_LAYOUTS:
        raise InvalidArgumentError(f"--attention-kernel native with --kv-layout {args.kv_layout}: the kernel reads the "
                                   "transposed and grouped layouts only (K [1, G, T, D], V [1, G, D, T] or [1, G, T, "
                                   "D]); drop --kv-layout or use --attention-kernel xnnpack")
    outputs = [(quantize, output_path("--out", args.out, quantize, quantizations),
                output_path("--bundle", args.bundle, quantize, quantizations)) for quantize in quantizations]
    source = inspect_source(args.source)
    if args.bundle is not None:
        check_tokenizer(source)
    settings = ExportSettings(
        lora_ranks=parse_integers("--lora-ranks", args.lora_ranks),
        lora_targets=args.lora_targets,
        dora_ranks=parse_integers("--dora-ranks", args.dora_ranks),
        kv_length=default_kv_length(source.context_length) if args.kv_length is None else args.kv_length,
        prefill_lengths=None if args.prefill_lengths is None
        else parse_integers("--prefill-lengths", args.prefill_lengths),
        quantize=quantizations[0],
        kv_layout=args.kv_layout,
        prefill_logits=args.prefill_logits,
        batch_sizes=parse_integers("--batch-sizes", args.batch_sizes),
        batch_lora_ranks=None if args.batch_lora_ranks is None
        else parse_integers("--batch-lora-ranks", args.batch_lora_ranks),
        attention_windows=parse_integers("--attention-windows", args.attention_windows),
        prefill_windows=None if args.prefill_windows is None
        else () if args.prefill_windows.strip().lower() == "none"
        else parse_integers("--prefill-windows", args.prefill_windows),
        verify_lengths=parse_integers("--verify-lengths", args.verify_lengths),
        score_lengths=parse_integers("--score-lengths", args.score_lengths),
        attention_kernel=args.attention_kernel,
        kv_cache_dtype=args.kv_cache_dtype,
        lora_dtype=args.lora_dtype,
    )
    check_settings(source, quantizations, settings.dora_ranks)
    targets = [path for _, *paths in outputs for path in paths if path is not None]
    # The report too, written after the models: a report path that is one of them, or a
    # directory, would fail or replace a finished model only once the export is over.
    check_targets([*targets, *([] if args.report is None else [args.report])], sources=[args.source])
    if args.max_memory is not None and not (math.isfinite(args.max_memory) and args.max_memory > 0):
        raise InvalidArgumentError(f"--max-memory {args.max_memory}: expected a finite number of GB > 0")
    max_memory = None if args.max_memory is None else int(args.max_memory * GB)
    plan(source.parameters, args.jobs, max_memory)  # a model that cannot fit is refused before torch is imported
    # torch and the converter log natively (fd 2) and through Python (import-time warnings,
    # their own progress bars): only our progress reaches stderr (a bar on a terminal, else a
    # line per stage and signature, so that a log of a long export shows where it is).
    with muted_native_logs(keep_python_stderr=True):
        terminal = sys.stderr

        def progress(stages: Iterable) -> Iterable:
            with contextlib.redirect_stderr(terminal):
                return progress_bar("export", unit="step", lines_off_terminal=True)(stages)

        with open(os.devnull, "w") as quiet, contextlib.redirect_stderr(quiet):
            exporter = import_export_module("exporter", "export", "torch, litert-torch, transformers")
            # A terminated export (SIGTERM) unwinds like a failed one: its partial files are removed.
            # (Installed after the import: a library imported there may install its own.)
            signal.signal(signal.SIGTERM, _exit_on_termination)
            (_, model_out, bundle_out), *others = outputs
            report = exporter.export(source, settings, model_out=model_out, bundle_out=bundle_out, jobs=args.jobs,
                                     max_memory=max_memory, also=[exporter.AlsoAt(*other) for other in others],
                                     progress=progress)
    for path in targets:
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    measured = report.measurements
    dora = f", DoRA slots {list(settings.dora_ranks)}" if settings.dora_ranks else ""
    print(f"{source.model_type} from {args.source}: LoRA slots {list(settings.lora_ranks) or 'none'}{dora}, KV length "
          f"{settings.kv_length}, prefill {list(settings.prefill_lengths)}, {', '.join(quantizations)}; "
          f"{len(measured.signatures)} signatures in {measured.seconds:.1f} s, {measured.jobs} job(s), "
          f"peak RSS {measured.peak_rss_bytes / GB:.2f} GB, PSS {measured.peak_pss_bytes / GB:.2f} GB")
    if args.verbose:
        print(report.plan.describe())
        print(measured.table())
    if args.report is not None:
        with PendingOutputs([args.report]) as pending:  # all of it or nothing
            pending.temporary(args.report).write_text(json.dumps({
                "source": str(args.source), "parameters": source.parameters, "settings": dataclasses.asdict(settings),
                "quantizations": list(quantizations),
                "plan": dataclasses.asdict(report.plan), **measured.as_dict(),
                "outputs": {str(path): path.stat().st_size for path in targets}}, indent=2) + "\n")
            pending.commit()
    return 0


def _exit_on_termination(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
