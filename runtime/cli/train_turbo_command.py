"""``train-turbo``: a Turbo adapter (a LoRA for one task plus Medusa draft heads) trained from
the user's own ``{"instruction", "output"}`` examples, for any family ``export`` reads
(needs the ``export`` extra); written as a PEFT directory the runtime loads by path."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from runtime.cli.options import import_export_module
from runtime.cli.progress import progress_bar
from runtime.errors import FailedPreconditionError, InvalidArgumentError
from runtime.export.turbo_settings import (
    CHECKPOINT_DIR, CONFIG_FILE, TARGET_MODULES, TurboRun, TurboSettings, check_run)
from runtime.util.native_logs import muted_native_logs

INTERRUPTED = 130  # the exit code of a Ctrl-C (128 + SIGINT), as a shell reports it


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Registers the ``train-turbo`` sub-command."""
    parser = commands.add_parser(
        "train-turbo",
        help="train a Turbo adapter (LoRA + draft heads) on your own instruction/output examples",
        description="Trains a LoRA for one task on {\"instruction\", \"output\"} examples (rendered with the model's "
        "chat template), then Medusa draft heads on the frozen LoRA from the trunk's own answers (--joint: both "
        "together), and writes a PEFT directory with the heads that `python -m runtime generate/serve` load by path. "
        "Checkpoints every --checkpoint-every steps; --resume continues an interrupted run. Needs the export "
        "extra: pip install -e \".[export]\".",
    )
    parser.add_argument("--model", type=Path, required=True,
                        help="a Hugging Face model directory or GGUF file (Llama, Qwen2, Qwen3, Gemma 3)")
    parser.add_argument("--data", type=Path, required=True,
                        help="a .json list or .jsonl file of {\"instruction\", \"output\"} records (\"input\" optional), "
                        "or a directory of them")
    parser.add_argument("--out", type=Path, required=True, help="the Turbo adapter's directory (must not exist)")
    parser.add_argument("--lora", type=Path, help="add heads to this existing PEFT LoRA instead of training one")
    parser.add_argument("--trunk", type=Path, metavar="MODEL.tflite",
                        help="train the heads on this exported model's own answers and hidden states (e.g. the int8 "
                        "export the adapter will run on; it needs --verify-lengths and a LoRA slot of --rank)")
    parser.add_argument("--joint", action="store_true",
                        help="train the LoRA and the heads together (the heads' losses weighted by --head-weight)")
    parser.add_argument("--resume", action="store_true", help="continue the run checkpointed in --out")
    defaults = TurboSettings()
    numbers: list[tuple[str, type, str]] = [
        ("--num-heads", int, "draft heads: tokens drafted past the trunk's next one (a model's verify{L} runs "
         "L-1 of them)"),
        ("--rank", int, "LoRA rank"), ("--alpha", int, "LoRA alpha"),
        ("--epochs", int, "passes over the examples (LoRA, or joint)"), ("--batch", int, "examples per step"),
        ("--seq-len", int, "longest prompt + answer in tokens, at most the model's context (longer examples "
         "are left out)"),
        ("--lora-lr", float, "the LoRA's peak learning rate"), ("--head-lr", float, "the heads' peak learning rate"),
        ("--warmup-ratio", float, "share of each phase's steps warming the learning rate up"),
        ("--head-steps", int, "steps training the heads on the cached hidden states"),
        ("--head-batch", int, "positions per heads step"),
        ("--head-weight", float, "--joint: the heads' losses' weight beside the LoRA's"),
        ("--holdout", float, "share of the examples held out for the per-head top-1 in training.json"),
        ("--seed", int, "seed of the LoRA's start and the batches"), ("--threads", int, "torch threads"),
        ("--checkpoint-every", int, "steps between checkpoints"), ("--log-every", int, "steps between log lines"),
    ]
    for flag, kind, text in numbers:
        default = getattr(defaults, flag[2:].replace("-", "_"))
        parser.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default})")
    parser.add_argument("--targets", choices=sorted(TARGET_MODULES), default=defaults.targets,
                        help=f"the LoRA's projections (default: {defaults.targets})")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Checks the run (data, model family, --out) without loading a model, then trains. A
    Ctrl-C ends it with one line saying whether a checkpoint was kept to ``--resume``."""
    settings = TurboSettings(**{field.name: getattr(args, field.name) for field in dataclasses.fields(TurboSettings)})
    spec = TurboRun(model=args.model, data=args.data, out=args.out, settings=settings, lora=args.lora,
                    trunk=args.trunk)
    examples = check_run(spec, args.resume)
    make_trunk = None if args.trunk is None else _tflite_trunk(args.trunk, settings.num_heads)
    # torch, transformers and peft log natively as they load and through Python (warnings, their
    # own loading bars): only our progress reaches stderr, the log lines go to stdout. (Not the
    # whole run in muted_native_logs: the --trunk engine mutes its own loading.)
    terminal = sys.stderr

    def progress(phase: str) -> Callable[[Iterable], Iterable]:
        def wrap(items: Iterable) -> Iterable:
            with contextlib.redirect_stderr(terminal):
                return progress_bar(f"train-turbo {phase}", unit="step")(items)
        return wrap

    try:
        with open(os.devnull, "w") as quiet, contextlib.redirect_stderr(quiet):
            with muted_native_logs():
                training = import_export_module("turbo_training", "train-turbo", "torch, transformers, peft")
            record = training.train_turbo(spec, examples, make_trunk=make_trunk, progress=progress, log=_log)
    except KeyboardInterrupt:
        if (args.out / CHECKPOINT_DIR / "state.pt").is_file():
            said = (f"interrupted: the checkpoint in {args.out / CHECKPOINT_DIR} is kept; the same command with "
                    "--resume continues it")
        elif (args.out / CONFIG_FILE).is_file():  # written last, the checkpoint already put aside
            said = f"interrupted as the run ended: {args.out} is written"
        else:
            said = "interrupted before the first checkpoint: nothing kept"
        print(said, file=sys.stderr, flush=True)
        return INTERRUPTED
    print(_summary(args.out, record, settings), flush=True)
    return 0


def _summary(out: Path, record: dict[str, Any], settings: TurboSettings) -> str:
    """The run's last line: what was written, what it was trained on and for how many steps,
    and the heads' held-out top-1, or why there is none."""
    steps = ", ".join(f"{phase} {history['steps']} steps" for phase, history in record["phases"].items())
    top1 = record.get("held_out_top1_per_head") or []
    if top1:
        held = f"held-out top-1 per head {' '.join(f'{x:.2f}' for x in top1)}"
    else:
        held = (f"no held-out examples to measure the heads on (--holdout {settings.holdout} of "
                f"{record['distinct_examples']} distinct examples)")
    return (f"wrote {out}: {settings.num_heads} heads, draft vocabulary {record['draft_vocabulary']}, "
            f"trained on {record['train_examples']} of {record['examples']} examples ({steps}), "
            f"{record['seconds']:.0f} s; {held}")


def _log(line: str) -> None:
    print(line, flush=True)


class _TfliteTrunk:
    """An exported model with the trained LoRA, run by the runtime: its greedy answers and
    the final hidden states its verify signatures return."""

    def __init__(self, model: Path, lora: Path, verify_length: int) -> None:
        """``verify_length``: the model's longest verify run (room an answer leaves for it)."""
        from runtime import Engine, LoraSource

        self._engine = Engine(model)
        self._source = LoraSource(path=lora, heads=False)
        self._verify_length = verify_length

    def answers(self, prompts: Sequence[list[int]], max_new_tokens: int, stops: set[int]) -> list[list[int]]:
        """Each prompt's greedy answer through the runtime."""
        from runtime import SessionConfig

        out = []
        for prompt in prompts:
            with self._engine.create_session(SessionConfig(loras=[self._source])) as session:
                budget = max(1, min(max_new_tokens, session.kv_length - len(prompt) - self._verify_length))
                out.append(list(session.generate(prompt, max_new_tokens=budget, stop_tokens=sorted(stops)).tokens))
        return out

    def states(self, prompt: list[int], answer: list[int]) -> np.ndarray:
        """The verify signatures' hidden states along prompt + answer."""
        from runtime import SessionConfig

        with self._engine.create_session(SessionConfig(loras=[self._source])) as session:
            if len(prompt) > 1:
                session.run_prefill(prompt[:-1])
            return session.hidden_states(prompt[-1:] + answer[:-1])


def _tflite_trunk(model: Path, heads: int) -> Callable[[Path], _TfliteTrunk]:
    """``--trunk``: checked now (verify signatures that check ``heads`` drafts), opened with
    the LoRA when the heads' phase comes."""
    from runtime import Engine

    with Engine(model) as engine:
        lengths = engine.spec.verify_lengths(None)
    if not lengths:
        raise FailedPreconditionError(f"--trunk {model}: the model has no verify signatures to return hidden states; "
                                      f"export it with --verify-lengths {heads + 1}")
    if lengths[-1] - 1 < heads:
        raise InvalidArgumentError(f"--num-heads {heads}: --trunk {model}'s longest verify run (verify{lengths[-1]}) "
                                   f"checks {lengths[-1] - 1} drafts; give --num-heads {lengths[-1] - 1} or export "
                                   f"with --verify-lengths {heads + 1}")
    return lambda lora: _TfliteTrunk(model, lora, lengths[-1])
