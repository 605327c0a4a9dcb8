"""``convert``: any adapter the runtime reads -> a ``.tflite`` LoRA file for a model."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from runtime.cli.progress import progress_bar
from runtime.components.lora_converter import convert_adapter
from runtime.executor.litert_executor import LlmExecutor
from runtime.export.outputs import PendingOutputs
from runtime.adapters.adapter_formats import detect_format, open_adapter
from runtime.adapters.lora_util import Convention
from runtime.adapters.lora_xs import LoraXsFactors
from runtime.util.litertlm_bundle import model_file
from runtime.util.model_weights import ModelWeights

_DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16)}
_CONVENTIONS = {"litert-lm": Convention.LITERT_LM, "litert-torch": Convention.LITERT_TORCH}


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Registers the ``convert`` sub-command."""
    parser = commands.add_parser(
        "convert",
        help="write a PEFT, GGUF or .tflite adapter as a .tflite LoRA file",
        description="Reads an adapter in any supported format, checks it against the model and "
        "writes it as a .tflite LoRA file (litert-lm: w_prime names, data after the "
        "flatbuffer, lora_rank metadata; litert-torch: lora_atten names, inline data).",
    )
    parser.add_argument("source", type=Path, help="a PEFT directory, a GGUF LoRA or a .tflite LoRA file")
    parser.add_argument("--model", type=Path, required=True,
                        help="the .tflite model it is for, or a .litertlm bundle holding it")
    parser.add_argument("--out", type=Path, required=True, help="the .tflite file to write")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="f16")
    parser.add_argument("--convention", choices=sorted(_CONVENTIONS), default="litert-lm")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Checks ``--out`` before the model is opened, converts, writes the file atomically
    (nothing is left behind on failure), and says what it wrote."""
    with PendingOutputs([args.out], sources=[args.model, args.source]) as pending:
        model = model_file(args.model)  # a bundle's model section, or the whole file
        executor = LlmExecutor(model.header(), name=str(args.model), source=model)
        try:
            spec = executor.spec
            lora_xs = LoraXsFactors(lambda: ModelWeights.open(model.header(), str(args.model)))
            with open_adapter(args.source, head_dim=spec.head_dim, lora_xs=lora_xs) as data:
                blob = convert_adapter(data, spec.lora_slots, _CONVENTIONS[args.convention], _DTYPES[args.dtype],
                                       progress=progress_bar("converting", unit="projection"))
        finally:
            executor.close()
        pending.temporary(args.out).write_bytes(blob)
        pending.commit()
    print(f"wrote {args.out} ({len(blob):,} bytes) from {detect_format(args.source)} adapter "
          f"{args.source}, convention {args.convention}, {args.dtype}")
    return 0
