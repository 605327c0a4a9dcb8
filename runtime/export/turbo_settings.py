"""What a ``train-turbo`` run is: its settings, its inputs and outputs, and the checks made
before torch is imported (a bad flag, data file, model family or ``--out`` is refused in a
second, and a resumed run must be the run its checkpoint was made by)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.errors import DataLossError, InvalidArgumentError, NotFoundError
from runtime.export.source import Source, check_tokenizer, inspect_source
from runtime.export.turbo_data import Example, digest, read_examples

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
CHECKPOINT_DIR = "checkpoint"
TARGET_MODULES = {
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "all-linear": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}


@dataclass(frozen=True)
class TurboSettings:
    """Hyper-parameters of one training run (defaults: a narrow task on a laptop CPU)."""

    num_heads: int = 5
    rank: int = 16
    alpha: int = 32
    targets: str = "attention"  # a key of TARGET_MODULES
    epochs: int = 3
    batch: int = 4
    seq_len: int = 256
    lora_lr: float = 1e-3
    head_lr: float = 3e-3
    warmup_ratio: float = 0.1
    head_steps: int = 1000
    head_batch: int = 256
    joint: bool = False
    head_weight: float = 0.2
    holdout: float = 0.1  # the share of examples kept out of training, for held-out top-1
    seed: int = 0
    threads: int = 2
    checkpoint_every: int = 50
    log_every: int = 10

    def check(self) -> None:
        """Refuses values no run can use, naming the flag."""
        positive = {"--num-heads": self.num_heads, "--rank": self.rank, "--epochs": self.epochs,
                    "--batch": self.batch, "--seq-len": self.seq_len, "--head-steps": self.head_steps,
                    "--head-batch": self.head_batch, "--threads": self.threads,
                    "--checkpoint-every": self.checkpoint_every, "--log-every": self.log_every}
        for flag, value in positive.items():
            if value < 1:
                raise InvalidArgumentError(f"{flag} {value}: expected a positive integer")
        for flag, rate in {"--lora-lr": self.lora_lr, "--head-lr": self.head_lr, "--alpha": self.alpha}.items():
            if not (rate > 0 and math.isfinite(rate)):
                raise InvalidArgumentError(f"{flag} {rate}: expected a finite positive number")
        for flag, share in {"--warmup-ratio": self.warmup_ratio, "--holdout": self.holdout}.items():
            if not 0 <= share < 1:
                raise InvalidArgumentError(f"{flag} {share}: expected a number in [0, 1)")
        if not (self.head_weight >= 0 and math.isfinite(self.head_weight)):
            raise InvalidArgumentError(f"--head-weight {self.head_weight}: expected a finite number >= 0")
        if self.targets not in TARGET_MODULES:
            raise InvalidArgumentError(f"--targets {self.targets!r}: expected one of {', '.join(TARGET_MODULES)}")


@dataclass(frozen=True)
class TurboRun:
    """What one run reads and writes."""

    model: Path  # a Hugging Face model directory or GGUF file
    data: Path  # a .json / .jsonl file or a directory of them
    out: Path  # the Turbo adapter's PEFT directory
    settings: TurboSettings
    lora: Path | None = None  # an existing PEFT LoRA: heads only
    trunk: Path | None = None  # an exported model the heads are trained on (its own hidden states)

    def describe(self, source: Source, examples: Sequence[Example]) -> dict[str, Any]:
        """The run as JSON: what a resumed run must match. Paths are resolved (``model`` and
        ``./model`` name one run); the model's family and size (``source``), the examples'
        digest and the digests of the ``lora``'s files and of the ``trunk`` are kept too, so
        that another model, other data, another LoRA or another export put at the same path
        is not taken for this run's (the trunk's digest reads the file: ~1.5 s at 540 MB)."""
        return {"model": str(self.model.resolve()), "model_type": source.model_type,
                "model_parameters": source.parameters, "data": str(self.data.resolve()),
                "data_sha256": digest(examples), "lora": str(self.lora.resolve()) if self.lora else None,
                "lora_sha256": _files_digest(self.lora / CONFIG_FILE, self.lora / WEIGHTS_FILE) if self.lora else None,
                "trunk": str(self.trunk.resolve()) if self.trunk else None,
                "trunk_sha256": _files_digest(self.trunk) if self.trunk else None, **dataclasses.asdict(self.settings)}


def _files_digest(*files: Path) -> str:
    """The SHA-256 of the files' bytes one after another; ``InvalidArgumentError`` naming a
    file that cannot be read."""
    total = hashlib.sha256()
    for file in files:
        try:
            with open(file, "rb") as opened:
                total.update(hashlib.file_digest(opened, "sha256").digest())
        except OSError as exc:
            raise InvalidArgumentError(f"{file}: cannot be read: {exc.strerror}") from None
    return total.hexdigest()


def check_run(run: TurboRun, resume: bool) -> list[Example]:
    """Everything that can be refused before torch loads a model: settings, the model's
    family, the data, the LoRA directory, ``out`` (must not exist, unless ``resume``: then
    it must hold this run's checkpoint). Returns the examples."""
    run.settings.check()
    if run.settings.joint and run.lora is not None:
        raise InvalidArgumentError("--joint trains a new LoRA with the heads; --lora adds heads to an existing one: "
                                   "give one of them")
    if run.settings.joint and run.trunk is not None:
        raise InvalidArgumentError("--trunk trains the heads on an exported model's hidden states, which --joint "
                                   "(torch's states, the LoRA moving) cannot use: drop one of them")
    source = inspect_source(run.model)
    check_tokenizer(source, "train-turbo encodes the examples with")
    examples = read_examples(run.data)
    if run.lora is not None:
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            if not (run.lora / name).is_file():
                raise NotFoundError(f"--lora {run.lora}: no {name} (expected a PEFT LoRA directory)")
    if run.trunk is not None and not run.trunk.is_file():
        raise NotFoundError(f"--trunk {run.trunk}: no such file (expected an exported .tflite model)")
    saved = run.out / CHECKPOINT_DIR / "run.json"
    if resume:
        if not saved.is_file():
            raise NotFoundError(f"--out {run.out}: no checkpoint to resume ({saved} is missing)")
        before, now = _recorded_run(saved, run.out), run.describe(source, examples)
        changed = sorted(key for key in set(before) | set(now) if before.get(key) != now.get(key))
        if changed:
            differences = ", ".join(f"{key}: {before.get(key)!r}, now {now.get(key)!r}" for key in changed)
            raise InvalidArgumentError(f"--resume: the checkpoint in {run.out} was made with other settings "
                                       f"({differences}); give the same flags and data, or a new --out")
    elif run.out.exists():
        raise InvalidArgumentError(f"--out {run.out} exists: give a new directory, or --resume to continue the run "
                                   "checkpointed there")
    else:
        _check_parent(run.out)
    return examples


def _check_parent(out: Path) -> None:
    """Refuses an ``--out`` that could not be created: the directory that would hold it
    must exist (as ``export --out`` wants) and be writable."""
    parent = out.absolute().parent
    if not parent.is_dir():
        raise NotFoundError(f"--out {out}: {parent} is not an existing directory; create it first, or give an --out "
                            "in one")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InvalidArgumentError(f"--out {out}: the directory {parent} is not writable")


def _recorded_run(saved: Path, out: Path) -> dict[str, Any]:
    """What a checkpoint's ``run.json`` (``saved``) says its run was; ``DataLossError``
    naming the file where it cannot be read as one."""
    try:
        recorded = json.loads(saved.read_text(encoding="utf-8"))
        problem = None if isinstance(recorded, dict) else "not a JSON object"
    except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not JSON
        problem = str(exc)
    if problem is not None:
        raise DataLossError(f"--resume: {saved} cannot be read as the checkpointed run ({problem}); give a new "
                            f"--out, or remove {out} to start again")
    return recorded
