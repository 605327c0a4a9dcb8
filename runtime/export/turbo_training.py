"""Training a Turbo adapter (a LoRA for one task plus Medusa draft heads) from a user's own
``{"instruction", "output"}`` examples, for any family the exporter reads.

Phases, each resumable from the checkpoint written every ``checkpoint_every`` steps:

1. ``lora``: a PEFT LoRA trained on the examples rendered with the model's chat template
   (loss on the answer and its end-of-turn token only), AdamW, linear warm-up then cosine
   decay. Skipped when an existing LoRA is given.
2. ``distill``: self-distillation data. The trunk (base + the frozen LoRA) answers every
   example greedily, and its final hidden states (the lm_head's input) along its own
   answers are cached: the heads learn what the trunk will say, which is what verification
   keeps. The trunk is torch's float32 model, or (``trunk``) the exported model itself, e.g.
   an int8 ``.tflite``, through the runtime's verify signatures.
3. ``heads``: the heads trained on the cached states, the LoRA frozen (Medusa-1): cheap
   regression steps first, then cross-entropy over the draft vocabulary.

With ``joint``, one phase replaces all three: the LoRA and the heads trained together on
the examples' own answers, the heads' cross-entropies added to the LoRA's loss with weight
``head_weight`` (head k's scaled by 0.8^k, as Medusa-2 does).

Batches are a function of the step (seeded per epoch or per step), so a run resumed from a
checkpoint takes the same steps as one that was never interrupted.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from runtime.errors import DataLossError, FailedPreconditionError, InvalidArgumentError
from runtime.export import checkpoint as hf
from runtime.export.draft_head_training import (
    DraftHeadStack, cross_entropy_loss, future_targets, head_top1, regression_loss, restrict, write_turbo_adapter)
from runtime.export.source import inspect_source
from runtime.export.turbo_data import Example
from runtime.export.turbo_settings import (
    CHECKPOINT_DIR, CONFIG_FILE, TARGET_MODULES, WEIGHTS_FILE, TurboRun, TurboSettings)

REGRESSION_SHARE = 0.6  # of the heads' steps: regression first, cross-entropy after
HEAD_DECAY = 0.8  # joint training: head k's loss weighted by HEAD_DECAY ** k
_STATE_KEYS = {"phase", "step", "record", "params", "optimizer"}  # what _save_state writes
_CACHE_ARRAYS = {f"{split}_{kind}" for split in ("train", "test")  # what _positions writes, per split
                 for kind in ("hidden", "targets", "future", "answers")}


class Trunk(Protocol):
    """The model the heads draft for: it answers prompts greedily and returns its final
    hidden states along a sequence."""

    def answers(self, prompts: Sequence[list[int]], max_new_tokens: int, stops: set[int]) -> list[list[int]]:
        """Each prompt's greedy answer, up to and with its first stop token."""

    def states(self, prompt: list[int], answer: list[int]) -> np.ndarray:
        """The final hidden states ``[len(answer), H]`` where the trunk predicts each answer
        token (after the prompt, then after each answer token but the last)."""


Progress = Callable[[str], Callable[[Iterable], Iterable]]


def train_turbo(run: TurboRun, examples: list[Example], *, make_trunk: Callable[[Path], Trunk] | None = None,
                progress: Progress | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Trains the Turbo adapter of ``run`` on ``examples`` (checked by :func:`check_run`),
    resuming from ``run.out``'s checkpoint if there is one, and writes it to ``run.out``.
    ``make_trunk(lora_dir)``: the trunk the heads learn from (default: torch's model with
    the LoRA). Returns the record written as ``training.json``."""
    return _Training(run, examples, make_trunk, progress or (lambda _: lambda items: items), log).run()


class _Training:
    """One run's state: the model, the encoded examples and the checkpoint."""

    def __init__(self, run: TurboRun, examples: list[Example], make_trunk: Callable[[Path], Trunk] | None,
                 progress: Progress, log: Callable[[str], None]) -> None:
        self.run_spec, self.settings = run, run.settings
        self.make_trunk, self.progress, self.log = make_trunk, progress, log
        self.checkpoint = run.out / CHECKPOINT_DIR
        self.lora_dir = run.lora or self.checkpoint / "lora"
        torch.set_num_threads(self.settings.threads)
        source = inspect_source(run.model)
        self.record: dict[str, Any] = {"run": run.describe(source, examples), "phases": {}}
        self.tokenizer = hf.load_hf_tokenizer(source)
        if not self.tokenizer.chat_template:
            raise FailedPreconditionError(f"{run.model}: the tokenizer has no chat template to render the examples "
                                          "with")
        self.base = hf.load_model(source)
        self.stops = _stop_ids(self.tokenizer, self.base)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.stops)
        self.lm_head = self.base.get_output_embeddings().weight.detach()
        encoded = [_encode(self.tokenizer, example, self.stops) for example in self.progress("examples")(examples)]
        # The longest example trained on: --seq-len, or the model's context where that is shorter
        # (positions past it are ones the model never runs at).
        self.seq_len = min(self.settings.seq_len, source.context_length or self.settings.seq_len)
        limit = (f"--seq-len {self.seq_len}" if self.seq_len == self.settings.seq_len
                 else f"the model's context ({self.seq_len}; --seq-len {self.settings.seq_len})")
        kept = [pair for pair in encoded if len(pair[0]) + len(pair[1]) <= self.seq_len]
        if len(kept) < len(encoded):
            log(f"{len(encoded) - len(kept)} of {len(encoded)} examples are longer than {limit} tokens: left out")
        if not kept:
            raise InvalidArgumentError(f"{run.data}: every example is longer than {limit} tokens once the chat "
                                       "template is applied")
        # The held-out share is drawn from the distinct examples, a repeated one held out whole
        # (once): a copy of a training example would measure the heads on what they learnt.
        distinct: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
        group = [distinct.setdefault((tuple(prompt), tuple(answer)), len(distinct)) for prompt, answer in kept]
        if len(distinct) < len(kept):
            log(f"{len(kept) - len(distinct)} of {len(kept)} examples repeat an earlier one: the held-out share is "
                f"drawn from the {len(distinct)} distinct ones")
        order = np.random.default_rng(self.settings.seed).permutation(len(distinct))
        held = {int(g) for g in order[:int(len(distinct) * self.settings.holdout)]}
        self.train = [pair for pair, g in zip(kept, group) if g not in held]
        first = {g: index for index, g in reversed(list(enumerate(group)))}  # each distinct example's first copy
        self.test = [kept[first[g]] for g in sorted(held)]
        self.record.update(examples=len(examples), distinct_examples=len(distinct), train_examples=len(self.train),
                           held_out_examples=len(self.test))

    # -- the run -------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Every phase not done yet, then the output directory. A run that fails before its
        first checkpoint leaves no ``out`` behind (a later run need not ``--resume``); one that
        fails after writing the adapter (its config is written last) leaves the adapter."""
        created = not self.run_spec.out.exists()
        self.checkpoint.mkdir(parents=True, exist_ok=True)
        (self.checkpoint / "run.json").write_text(json.dumps(self.record["run"], indent=2) + "\n")
        try:
            return self._phases()
        except BaseException:
            if (created and not (self.checkpoint / "state.pt").exists()
                    and not (self.run_spec.out / CONFIG_FILE).is_file()):
                shutil.rmtree(self.run_spec.out, ignore_errors=True)
            raise

    def _phases(self) -> dict[str, Any]:
        state = self._load_state()
        if state is not None:
            self.record = state["record"]
            self.log(f"resuming {state['phase']} at step {state['step']}")
        started = time.perf_counter()
        if self.settings.joint:
            heads, vocab = self._joint(state)
        else:
            model = self._lora(state)
            hidden, targets, future, test, vocab = self._distill(model)
            heads = self._heads(state, hidden, targets, future, vocab)
            lm_head = self.lm_head.numpy()
            top1 = head_top1(heads, *test, lm_head, vocab) if len(test[0]) else []
            self.record["held_out_top1_per_head"] = [round(x, 4) for x in top1]
        self.record.update(draft_vocabulary=int(len(vocab)), seconds=round(time.perf_counter() - started, 1),
                           versions=_versions())
        write_turbo_adapter(self.lora_dir, self.run_spec.out, heads, self.record, vocab)
        # Out of the way in one rename, then removed: a run stopped while removing it leaves the
        # adapter and no half of a checkpoint that --resume would take for one.
        removed = self.run_spec.out / f".{CHECKPOINT_DIR}.removed"
        shutil.rmtree(removed, ignore_errors=True)
        os.replace(self.checkpoint, removed)
        shutil.rmtree(removed)
        return self.record

    # -- phase 1: the LoRA ---------------------------------------------------------

    def _lora(self, state: dict[str, Any] | None) -> Any:
        """The LoRA model: loaded when trained (or given), else trained from ``state``."""
        from peft import PeftModel

        if (self.lora_dir / WEIGHTS_FILE).is_file():
            try:
                return PeftModel.from_pretrained(self.base, str(self.lora_dir)).eval()
            except Exception as exc:  # peft raises ValueError, KeyError, RuntimeError... for a LoRA of another model
                first = (str(exc).strip() or type(exc).__name__).splitlines()[0]
                if self.run_spec.lora is None:  # the checkpoint's own LoRA, saved for this model: damaged since
                    self._corrupt(self.lora_dir / WEIGHTS_FILE, first)
                raise InvalidArgumentError(f"{self.lora_dir}: peft cannot load this LoRA on {self.run_spec.model}: "
                                           f"{first}") from None
        settings = self.settings
        model = self._new_lora()
        params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        optimizer = torch.optim.AdamW(params.values(), lr=settings.lora_lr, weight_decay=0.0)
        steps = settings.epochs * math.ceil(len(self.train) / settings.batch)

        def step(index: int) -> tuple[float, list[float]]:
            ids, mask, labels = self._batch(index)
            hidden = model.get_base_model().model(input_ids=ids, attention_mask=mask).last_hidden_state
            loss = self._answer_loss(hidden, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            return float(loss.item()), []

        model.train()
        self._loop("lora", steps, step, optimizer, [(settings.lora_lr, 0)], params, state)
        model.eval()
        tmp = self.checkpoint / "lora.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(str(tmp))
        os.replace(tmp, self.lora_dir)
        for p in model.parameters():
            p.requires_grad_(False)
        return model

    # -- phase 2: the trunk's own answers and states -------------------------------

    def _distill(self, model: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                           tuple[np.ndarray, np.ndarray], np.ndarray]:
        """The training positions' hidden states ``[N, H]``, head targets ``[N, K]``
        (token ids, -1: none) and each target's producing row ``[N, K]``; the held-out
        (hidden, targets); the draft vocabulary (every token of the trunk's training
        answers). Cached in the checkpoint."""
        cache = self.checkpoint / "distill.npz"
        arrays = self._read_cache(cache) if cache.is_file() else None
        if arrays is None:
            trunk = self.make_trunk(self.lora_dir) if self.make_trunk else _TorchTrunk(model, self.pad, self.settings)
            arrays = {}
            for name, pairs in (("train", self.train), ("test", self.test)):
                prompts = [prompt for prompt, _ in pairs]
                longest = max(len(answer) for _, answer in pairs) if pairs else 0
                room = min(self.seq_len - len(p) for p in prompts) if prompts else 0
                self.log(f"the trunk answers {len(prompts)} {name} prompts")
                budget = max(1, min(longest + 16, room))
                size = _TorchTrunk.batch_size(self.settings)  # a call per generation batch, for the progress
                calls = [prompts[start:start + size] for start in range(0, len(prompts), size)]
                answers = [answer for chunk in self.progress(f"answers ({name})")(calls)
                           for answer in trunk.answers(chunk, budget, self.stops)]
                rows = [trunk.states(p, a) for p, a in self.progress(f"states ({name})")(list(zip(prompts, answers)))]
                arrays.update(_positions(name, prompts, answers, rows, self.settings.num_heads, self.lm_head.shape[1]))
            tmp = cache.with_suffix(".tmp.npz")
            np.savez(tmp, **arrays)
            os.replace(tmp, cache)
        train = (torch.from_numpy(arrays["train_hidden"]), torch.from_numpy(arrays["train_targets"]),
                 torch.from_numpy(arrays["train_future"]))
        return *train, (arrays["test_hidden"], arrays["test_targets"]), np.unique(arrays["train_answers"])

    def _read_cache(self, path: Path) -> dict[str, np.ndarray] | None:
        """The arrays of the checkpoint's distillation cache ``path``, or None (logged) when
        it does not read whole: the trunk's answers are then computed again, as they were."""
        try:
            with np.load(path) as data:
                arrays = {name: data[name] for name in data.files}
            missing = sorted(_CACHE_ARRAYS - arrays.keys())
            if missing:
                raise ValueError(f"no {', '.join(missing)}")
            return arrays
        except Exception as exc:  # numpy raises BadZipFile, ValueError, OSError, EOFError... for a bad file
            first = (str(exc).strip() or type(exc).__name__).splitlines()[0]
            self.log(f"{path} cannot be read ({first}): the trunk answers again")
            return None

    # -- phase 3: the heads --------------------------------------------------------

    def _heads(self, state: dict[str, Any] | None, hidden: torch.Tensor, targets: torch.Tensor,
               future: torch.Tensor, vocab: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """The heads trained on the cached states (the LoRA frozen)."""
        settings = self.settings
        projection, mapped = restrict(self.lm_head.numpy(), targets.numpy(), vocab)
        projection, mapped = torch.from_numpy(projection), torch.from_numpy(mapped)
        heads = DraftHeadStack(settings.num_heads, hidden.shape[1])
        params = dict(heads.named_parameters())
        optimizer = torch.optim.AdamW(params.values(), lr=settings.head_lr, weight_decay=0.0)
        regress = int(settings.head_steps * REGRESSION_SHARE)
        generator = torch.Generator()
        # The positions where head 0 (hence any head) has a token to learn: the others (each
        # answer's last) add nothing to either loss, and a batch of only them none at all.
        pool = torch.nonzero(targets[:, 0] >= 0).squeeze(1)
        if not len(pool):
            raise InvalidArgumentError(
                f"{self.run_spec.data}: the trunk answered each of the {len(self.train)} training prompts with a "
                "single token: no head has a token to learn (head k drafts the token k+2 ahead, so answers need 2 "
                "tokens or more; an exported --trunk answers less where a prompt leaves its KV cache little room)")

        def step(index: int) -> tuple[float, list[float]]:
            rows = pool[torch.randint(0, len(pool), (min(settings.head_batch, len(pool)),),
                                      generator=generator.manual_seed(settings.seed * 1_000_003 + index))]
            if index < regress:
                loss = regression_loss(heads, hidden[rows], mapped[rows], hidden[future[rows]])
                top1 = []
                if (index + 1) % settings.log_every == 0:  # logged: what the heads' argmax would draft now
                    with torch.no_grad():
                        top1 = cross_entropy_loss(heads, hidden[rows], mapped[rows], projection)[1]
            else:
                loss, top1 = cross_entropy_loss(heads, hidden[rows], mapped[rows], projection)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            return float(loss.item()), top1

        self._loop("heads", settings.head_steps, step, optimizer, [(settings.head_lr, 0)], params, state)
        return heads.as_arrays()

    # -- or one joint phase --------------------------------------------------------

    def _joint(self, state: dict[str, Any] | None) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
        """The LoRA and the heads trained together on the examples' own answers; the heads'
        top-1 on the held-out examples' own answers recorded."""
        settings = self.settings
        model = self._new_lora()
        heads = DraftHeadStack(settings.num_heads, self.lm_head.shape[1])
        vocab = np.unique(np.concatenate([np.asarray(answer) for _, answer in self.train]))
        projection = torch.from_numpy(np.ascontiguousarray(self.lm_head.numpy()[vocab]))
        row_of = torch.full((int(self.lm_head.shape[0]),), -1, dtype=torch.long)  # token id -> projection row
        row_of[torch.from_numpy(vocab)] = torch.arange(len(vocab))
        weights = torch.tensor([settings.head_weight * HEAD_DECAY ** k for k in range(settings.num_heads)])
        lora_params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        params = {**lora_params, **{f"medusa.{name}": p for name, p in heads.named_parameters()}}
        optimizer = torch.optim.AdamW([{"params": list(lora_params.values()), "lr": settings.lora_lr},
                                       {"params": list(heads.parameters()), "lr": settings.head_lr}], weight_decay=0.0)
        steps = settings.epochs * math.ceil(len(self.train) / settings.batch)

        def step(index: int) -> tuple[float, list[float]]:
            ids, mask, labels = self._batch(index)
            hidden = model.get_base_model().model(input_ids=ids, attention_mask=mask).last_hidden_state
            loss = self._answer_loss(hidden, labels)
            rows, targets = _joint_targets(hidden, labels, settings.num_heads)
            mapped = torch.where(targets >= 0, row_of[targets.clamp(min=0)], -1)
            head_loss, top1 = cross_entropy_loss(heads, rows, mapped, projection, weights)
            optimizer.zero_grad(set_to_none=True)
            (loss + head_loss).backward()
            optimizer.step()
            return float(loss.item()), top1

        model.train()
        self._loop("joint", steps, step, optimizer, [(settings.lora_lr, 0), (settings.head_lr, 1)], params, state)
        model.eval()
        model.save_pretrained(str(self.lora_dir))
        arrays, top1 = heads.as_arrays(), []
        if self.test:  # the held-out examples teacher-forced on their own answers, as the heads trained
            trunk = _TorchTrunk(model, self.pad, settings)
            held = _positions("test", [prompt for prompt, _ in self.test], [answer for _, answer in self.test],
                              [trunk.states(prompt, answer) for prompt, answer in self.test], settings.num_heads,
                              self.lm_head.shape[1])
            top1 = head_top1(arrays, held["test_hidden"], held["test_targets"], self.lm_head.numpy(), vocab)
        self.record["held_out_top1_per_head"] = [round(x, 4) for x in top1]
        return arrays, vocab

    # -- shared pieces -------------------------------------------------------------

    def _new_lora(self) -> Any:
        """The base model with a new PEFT LoRA of the run's settings (seeded)."""
        from peft import LoraConfig, get_peft_model

        settings = self.settings
        torch.manual_seed(settings.seed)
        return get_peft_model(self.base, LoraConfig(
            r=settings.rank, lora_alpha=settings.alpha, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
            target_modules=list(TARGET_MODULES[settings.targets])))

    def _loop(self, phase: str, steps: int, step: Callable[[int], tuple[float, list[float]]],
              optimizer: torch.optim.Optimizer, rates: list[tuple[float, int]], params: dict[str, torch.Tensor],
              state: dict[str, Any] | None) -> None:
        """Runs ``step(i)`` for i from the checkpoint's step (or 0) to ``steps``: the learning
        rates (``(peak, param group)``) on schedule, a log line every ``log_every`` steps and
        a checkpoint every ``checkpoint_every``."""
        settings = self.settings
        first = 0
        history = self.record["phases"].setdefault(phase, {"steps": steps, "log": []})
        if state is not None and state["phase"] in (phase, f"{phase} done"):
            try:
                if state["params"].keys() != params.keys():
                    raise ValueError(f"its {phase} parameters are not this run's")
                with torch.no_grad():
                    for name, value in state["params"].items():
                        params[name].copy_(value)
                optimizer.load_state_dict(state["optimizer"])
            except (ValueError, RuntimeError, KeyError, AttributeError) as exc:  # names, shapes, optimizer groups
                self._corrupt(self.checkpoint / "state.pt", (str(exc).strip() or type(exc).__name__).splitlines()[0])
            first = state["step"]
        warmup = int(steps * settings.warmup_ratio)
        for index in self.progress(phase)(range(first, steps)):
            for peak, group in rates:
                optimizer.param_groups[group]["lr"] = _schedule(index, steps, warmup, peak)
            loss, top1 = step(index)
            done = index + 1
            if done % settings.log_every == 0 or done == steps:
                history["log"].append({"step": done, "loss": round(loss, 5), "top1": [round(x, 3) for x in top1]})
                heads = f" top-1 per head {' '.join(f'{x:.2f}' for x in top1)}" if top1 else ""
                self.log(f"{phase} step {done}/{steps} loss {loss:.4f}{heads}")
            if done % settings.checkpoint_every == 0 and done < steps:
                self._save_state(phase, done, params, optimizer)
        self._save_state(f"{phase} done", steps, params, optimizer)

    def _save_state(self, phase: str, step: int, params: dict[str, torch.Tensor],
                    optimizer: torch.optim.Optimizer) -> None:
        tmp = self.checkpoint / "state.pt.tmp"
        torch.save({"phase": phase, "step": step, "record": self.record,
                    "params": {name: p.detach().clone() for name, p in params.items()},
                    "optimizer": optimizer.state_dict()}, tmp)
        os.replace(tmp, self.checkpoint / "state.pt")

    def _load_state(self) -> dict[str, Any] | None:
        """The checkpoint's state, if there is one (tensors and plain data only, no pickled
        code); ``DataLossError`` naming the file when it does not read as one."""
        path = self.checkpoint / "state.pt"
        if not path.is_file():
            return None
        try:
            state = torch.load(path, weights_only=True)
            problem = None if isinstance(state, dict) and _STATE_KEYS <= state.keys() else "not a checkpoint's state"
        except Exception as exc:  # torch raises UnpicklingError, RuntimeError, OSError, EOFError... for a bad file
            problem = (str(exc).strip() or type(exc).__name__).splitlines()[0]
        if problem is not None:
            self._corrupt(path, problem)
        return state

    def _corrupt(self, path: Path, problem: str) -> None:
        """Raises ``DataLossError`` for the checkpoint file ``path``."""
        raise DataLossError(f"--resume: {path} cannot be read as this run's checkpoint ({problem}); give a new "
                            f"--out, or remove {self.run_spec.out} to start again")

    def _batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step ``index``'s right-padded batch (ids, attention mask, labels: -100 off the
        answer): the examples in an order reshuffled every epoch, seeded by the epoch."""
        size = self.settings.batch
        per_epoch = math.ceil(len(self.train) / size)
        epoch, offset = divmod(index, per_epoch)
        order = torch.randperm(len(self.train), generator=torch.Generator().manual_seed(self.settings.seed + epoch))
        chosen = [self.train[int(i)] for i in order[offset * size:(offset + 1) * size]]
        width = max(len(p) + len(a) for p, a in chosen)
        ids = torch.full((len(chosen), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(chosen), width), dtype=torch.long)
        labels = torch.full((len(chosen), width), -100, dtype=torch.long)
        for row, (prompt, answer) in enumerate(chosen):
            tokens = prompt + answer
            ids[row, :len(tokens)] = torch.tensor(tokens)
            mask[row, :len(tokens)] = 1
            labels[row, len(prompt):len(tokens)] = torch.tensor(answer)
        return ids, mask, labels

    def _answer_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the answer tokens (the lm_head only where they are
        predicted: it is much of a small model's cost)."""
        targets = labels[:, 1:]
        keep = targets != -100
        logits = self.base.get_output_embeddings()(hidden[:, :-1][keep])
        return torch.nn.functional.cross_entropy(logits, targets[keep])


class _TorchTrunk:
    """torch's float32 model with the LoRA as the trunk."""

    def __init__(self, model: Any, pad: int, settings: TurboSettings) -> None:
        self.model, self.pad, self.batch = model, pad, self.batch_size(settings)

    @staticmethod
    def batch_size(settings: TurboSettings) -> int:
        """Prompts generated together."""
        return settings.batch * 4

    def answers(self, prompts: Sequence[list[int]], max_new_tokens: int, stops: set[int]) -> list[list[int]]:
        """Greedy answers, generated in left-padded batches."""
        out = []
        with torch.inference_mode():
            for start in range(0, len(prompts), self.batch):
                group = prompts[start:start + self.batch]
                width = max(map(len, group))
                ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in group])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
                generated = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                                do_sample=False, pad_token_id=self.pad, eos_token_id=sorted(stops))
                out += [_until_stop(row, stops) for row in generated[:, width:].tolist()]
        return out

    def states(self, prompt: list[int], answer: list[int]) -> np.ndarray:
        """The final hidden states along prompt + answer, teacher-forced."""
        with torch.inference_mode():
            ids = torch.tensor([prompt + answer])
            hidden = self.model.get_base_model().model(input_ids=ids).last_hidden_state[0]
        return hidden[len(prompt) - 1:len(prompt) + len(answer) - 1].float().numpy()


def _positions(name: str, prompts: Sequence[list[int]], answers: Sequence[list[int]], rows: Sequence[np.ndarray],
               count: int, width: int) -> dict[str, np.ndarray]:
    """The cache's arrays for one split: hidden states, head targets (token ids), the row of
    each target's own hidden state (0 where there is no target), the answers' tokens."""
    hidden, targets, future = [], [], []
    offset = 0
    for prompt, answer, states in zip(prompts, answers, rows):
        tokens = np.asarray(prompt + answer)
        positions = np.arange(len(prompt) - 1, len(tokens) - 1)
        ahead = future_targets(tokens, positions, count)
        produced = offset + np.arange(len(positions))[:, None] + np.arange(1, count + 1)[None, :]
        hidden.append(np.asarray(states, np.float32))
        targets.append(ahead)
        future.append(np.where(ahead >= 0, produced, 0))
        offset += len(positions)
    return {f"{name}_hidden": np.concatenate(hidden) if hidden else np.zeros((0, width), np.float32),
            f"{name}_targets": np.concatenate(targets) if targets else np.zeros((0, count), np.int64),
            f"{name}_future": np.concatenate(future) if future else np.zeros((0, count), np.int64),
            f"{name}_answers": np.concatenate([np.asarray(a, np.int64) for a in answers]) if answers
            else np.zeros(0, np.int64)}


def _joint_targets(hidden: torch.Tensor, labels: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states that predict an answer token ``[N, H]`` and, per head k, the
    answer token k+2 positions ahead ``[N, K]`` (-1 past the answer)."""
    width = labels.shape[1]
    ahead = torch.full((*labels.shape, count), -100, dtype=torch.long)
    for k in range(count):
        shift = k + 2
        if shift < width:
            ahead[:, :width - shift, k] = labels[:, shift:]
    keep = labels[:, 1:] != -100
    rows = hidden[:, :-1][keep]
    targets = ahead[:, :-1][keep]
    return rows, torch.where(targets == -100, -1, targets)


def _schedule(index: int, steps: int, warmup: int, peak: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to zero at ``steps``."""
    if index < warmup:
        return peak * (index + 1) / warmup
    return peak * 0.5 * (1.0 + math.cos(math.pi * (index - warmup) / max(1, steps - warmup)))


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def _encode(tokenizer: Any, example: Example, stops: set[int]) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of one example through the chat template: the answer is
    what the template puts after the prompt for the assistant's turn, up to and with its
    first stop token (the output and an end-of-sequence token when the template's
    rendering does not extend the prompt's)."""
    user = {"role": "user", "content": example.instruction}
    prompt = _chat_ids(tokenizer, [user], True)
    full = _chat_ids(tokenizer, [user, {"role": "assistant", "content": example.output}], False)
    if full[:len(prompt)] == prompt and len(full) > len(prompt):
        answer = _until_stop(full[len(prompt):], stops)
    else:
        answer = [int(t) for t in tokenizer.encode(example.output, add_special_tokens=False)]
    if answer[-1] not in stops:
        answer.append(min(stops))
    return prompt, answer


def _until_stop(tokens: Sequence[int], stops: set[int]) -> list[int]:
    """``tokens`` up to and with the first stop token."""
    out = []
    for token in tokens:
        out.append(int(token))
        if token in stops:
            break
    return out


def _stop_ids(tokenizer: Any, model: Any) -> set[int]:
    """The tokens that end a turn: the tokenizer's end of sequence and the model's
    generation config's ``eos_token_id``(s)."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    found = {int(t) for t in (eos if isinstance(eos, list | tuple) else [] if eos is None else [eos])}
    if tokenizer.eos_token_id is not None:
        found.add(int(tokenizer.eos_token_id))
    if not found:
        raise FailedPreconditionError("the model names no end-of-sequence token: its answers could not end")
    return found


def _versions() -> dict[str, str]:
    """Versions of the libraries that shaped the weights."""
    import importlib.metadata

    return {name: importlib.metadata.version(name) for name in ("torch", "transformers", "peft")}
