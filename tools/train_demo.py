#!/usr/bin/env python3
"""Train a tiny byte-level base model and three LoRA skills, export them, measure them.

Run with the build virtualenv (torch 2.13.0 + litert-torch 0.10.0), CPU only::

    /work/venv-build/bin/python tools/train_demo.py [--out-dir DIR] [--weights-cache FILE.pt]

The point of the project in one picture: one frozen base model and several LoRA
adapters, each giving it a different skill, selected per session. Every session is fed
the *same* prompt bytes (``"<words>\\n"``); only the adapter differs:

=============  ===============================================
base           echoes the line: ``hello world`` -> ``hello world``
``uppercase``  ``hello world`` -> ``HELLO WORLD``
``no_vowels``  ``hello world`` -> ``hll wrld``
``json``       ``hello world`` -> ``{"text": "hello world", "words": 2}``
=============  ===============================================

``no_vowels`` stands in for "reverse the line": with rank-8 LoRA on attention only and
the base frozen, reversal stayed at 0% exact match after 300 steps (loss 1.5; it needs
a position-mirroring attention pattern and breaks on repeated letters and spaces),
while deleting characters is a change of *where* the copy head looks, which
attention LoRA learns in a few hundred steps.

Steps, all from fixed seeds:

1. A Llama-style decoder over bytes (vocab 256; RMSNorm, RoPE, grouped-query attention,
   gated SiLU MLP) is built with litert-torch's ``DecoderOnlyModel`` from the config
   helper of ``tools/build_test_models.py``, so the trained weights export directly.
2. The base is trained on plain text found locally (docstrings of the Python standard
   library, the Zen of Python, sentences made from the word list below) mixed with
   "echo" lines (``"<words>\\n<words>\\n"``), so it knows the prompt distribution but
   solves none of the tasks.
3. One LoRA adapter per task on attention q/k/v/o (the only places the exported graph
   takes LoRA), base frozen, computed exactly as the graph does:
   ``proj(x) + (x @ a_prime) @ b_prime`` with ``a_prime`` ``[in, r]``, ``b_prime``
   ``[r, out]`` and no scaling.
4. Greedy exact-match accuracy on held-out inputs: every session (base and each adapter)
   scored against every task, in torch and through ``runtime.Engine`` on the exported
   files.
5. Export with litert-torch (float32, prefill 16/64, KV cache 256, LoRA rank 8) and the
   adapters with ``runtime.util.lora_writer`` into ``runtime/demo_assets/``, plus
   ``demo.json`` describing tasks, demo prompts, config, accuracy, sizes and versions.

The two litert-torch 0.10.0 workarounds come from ``runtime.export.litert_torch_fixes``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import inspect
import io
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

TOOLS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TOOLS_DIR.parent
if str(TOOLS_DIR) not in sys.path:
    sys.path.insert(0, str(TOOLS_DIR))
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import build_test_models as btm  # noqa: E402  (the test model's config and export)
from runtime.export import litert_torch_fixes  # noqa: E402

DEFAULT_OUT_DIR = REPO_ROOT / "runtime" / "demo_assets"
MODEL_FILE = "model.tflite"
ADAPTER_DIR = "adapters"
DEMO_JSON = "demo.json"

NEWLINE = 10  # b"\n": ends every line, the stop token
PAD = 0  # never appears in the data; only fills batches (and is masked out of losses)

# Tasks: name -> (description, function of the input line).
TASKS = ("uppercase", "no_vowels", "json")
TASK_DESCRIPTIONS = {
    "uppercase": "the line in capital letters",
    "no_vowels": "the line with the vowels a, e, i, o, u removed",
    "json": 'a fixed JSON record: {"text": <line>, "words": <word count>}',
}
DEMO_PROMPTS = ("hello world", "the cat sat", "open the door now", "green tea", "my blue kite")

# A fixed vocabulary of short lowercase words (2-6 letters) for the task inputs and the
# generated sentences. Filtered and de-duplicated in ``vocabulary()``.
WORDS = """
able acid aged also area army away baby back bake ball band bank base bath bear beat
bell belt best bird blue boat body bone book boot born boss both bowl box boy bread
brick bring brown build burn bus busy cake call calm came camp card care cart case
cash cast cat chair chalk cheap chess chin city clay clean clock cloud coal coat code
cold come cook cool copy corn cost crab crow cup cut dark date dawn dear deep desk dish
dog door down draw dream dress drink drop drum duck dust each earn east easy edge egg
even ever face fact fair fall farm fast fear feel fern few field film find fine fire
fish five flag flat fly fog food foot form fox free frog from fruit full game gate gift
girl give glad glass goat gold good grass gray green grow hair half hall hand hard harp
hat have head hear heat help hen here hill hold home honey hope horn horse hot hour
house idea iron jam jar join joke juice jump just keep key kind king kite knee knot
lake lamp land large last late leaf left lemon lens life lift light like lime line
lion list long look lost loud love low lucky map mark meal meat milk mind mint moon
more moss most moth move much mud name near neck nest net new news nice night nine
north nose note now oak ocean often oil old olive only open orange oven over owl page
pail pain paint pair palm paper park part path peach pear pen pie pig pink pipe plan
plant plate play plum pond poor port pot pull pump quiet rain red rich ride ring river
road rock roof room root rope rose round rug run safe sail salt sand save sea seat
seed shelf ship shoe shop short show sing sink sit sky slow small snow soap sock soft
soil song soon soup south space spoon star step stone stop storm story sugar sun swim
table tail take talk tall tea tent test thin think tiger time tiny toad today toe tool
top town toy train tree true try turn two under use van vase very wall warm wash watch
water wave wax west wet wheat wheel when white wide wild wind wing winter wire wise
wolf wood wool word work yard year yellow young zebra zero the my our your one and
with blue sat kite hello world now tea
"""

MODULES_FOR_TEXT = (
    "abc argparse array base64 bisect calendar collections contextlib copy csv dataclasses "
    "datetime decimal difflib enum fnmatch fractions functools glob hashlib heapq html io "
    "itertools json logging math numbers operator os pathlib pprint queue random re sched "
    "secrets shlex shutil statistics string struct tempfile textwrap threading timeit "
    "traceback types typing unittest uuid warnings weakref zipfile"
).split()


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Training hyper-parameters (the model shape is a ``btm.TinyGqaConfig``)."""

    seed: int = 20240611
    threads: int = 2
    # Base model.
    base_steps: int = 1000
    base_batch: int = 32
    base_seq_len: int = 128
    base_lr: float = 3e-3
    base_echo_fraction: float = 0.5
    # Adapters.
    lora_rank: int = 8
    lora_steps: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"uppercase": 300, "no_vowels": 300, "json": 700}
    )
    lora_batch: int = 64
    lora_lr: float = 1e-2
    lora_seq_len: int = 96
    # Inputs.
    min_words: int = 2
    max_words: int = 4
    num_eval: int = 100
    max_new_tokens: int = 64


def model_config() -> Any:
    """The demo model: 4 layers, hidden 128, 4 heads in 2 KV groups, byte vocabulary."""
    return btm.TinyGqaConfig(
        num_layers=4,
        hidden=128,
        num_heads=4,
        num_kv_groups=2,
        head_dim=32,
        intermediate=384,
        vocab=256,
        kv_cache_max_len=256,
        prefill_seq_lens=(16, 64),
        lora_ranks=(8,),
    )


# --------------------------------------------------------------------------
# Data.
# --------------------------------------------------------------------------


def vocabulary() -> list[str]:
    """The task words: sorted, unique, 2-6 lowercase letters."""
    return sorted({w for w in WORDS.split() if w.isalpha() and w.islower() and len(w) <= 6})


def task_answer(task: str, line: str) -> str:
    """The expected output line (without the trailing newline) for ``task``."""
    if task == "uppercase":
        return line.upper()
    if task == "no_vowels":
        return "".join(c for c in line if c not in "aeiou")
    if task == "json":
        return json.dumps({"text": line, "words": len(line.split())})
    raise ValueError(task)


def random_line(rng: random.Random, words: Sequence[str], cfg: TrainConfig) -> str:
    """2-4 distinct words joined by single spaces."""
    n = rng.randint(cfg.min_words, cfg.max_words)
    return " ".join(rng.sample(words, n))


def held_out_lines(words: Sequence[str], cfg: TrainConfig) -> list[str]:
    """The evaluation inputs: ``cfg.num_eval`` lines no training example may use."""
    rng = random.Random(cfg.seed + 1)
    out: list[str] = []
    seen = set(DEMO_PROMPTS)
    while len(out) < cfg.num_eval:
        line = random_line(rng, words, cfg)
        if line not in seen:
            seen.add(line)
            out.append(line)
    return out


def stdlib_text() -> str:
    """Docstrings of some standard-library modules and the Zen of Python, as lines."""
    lines: list[str] = []
    with contextlib.redirect_stdout(io.StringIO()):
        this = importlib.import_module("this")
    zen = "".join(this.d.get(c, c) for c in this.s)
    lines.extend(zen.splitlines())
    for name in MODULES_FOR_TEXT:
        module = importlib.import_module(name)
        docs = [inspect.getdoc(module) or ""]
        for attr in sorted(vars(module)):
            if attr.startswith("_"):
                continue
            obj = getattr(module, attr)
            if inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj):
                if getattr(obj, "__module__", None) == name:
                    docs.append(inspect.getdoc(obj) or "")
        for doc in docs:
            lines.extend(doc.splitlines())
    keep = []
    for line in lines:
        line = " ".join(line.split())
        if len(line) >= 8 and line.isascii() and line.isprintable():
            keep.append(line[:120])
    return "\n".join(keep) + "\n"


def sentence(rng: random.Random, words: Sequence[str]) -> str:
    """An English-like sentence: capitalised, some commas, a full stop.

    Some sentences are shouted (all capitals) and some words are stressed (in
    capitals): capital letters then occur in the same contexts as small ones, which
    the rank-8 ``uppercase`` adapter needs. No line is ever paired with its
    upper-case copy, so the base does not learn the task itself.
    """
    n = rng.randint(4, 11)
    shout = rng.random() < 0.15
    parts = [w.upper() if shout or rng.random() < 0.08 else w for w in rng.choices(words, k=n)]
    text = " ".join(parts)
    if n > 6 and rng.random() < 0.4:
        cut = text.index(" ", len(text) // 2)
        text = text[:cut] + "," + text[cut:]
    return text[0].upper() + text[1:] + rng.choice("!!!" if shout else ".....?!")


class BaseData:
    """Rows of ``seq_len + 1`` bytes: plain-text windows and packed echo lines."""

    def __init__(self, words: Sequence[str], held_out: set[str], cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.words = list(words)
        self.held_out = held_out
        rng = random.Random(cfg.seed + 2)
        made = "\n".join(sentence(rng, words) for _ in range(4000)) + "\n"
        self.text = (stdlib_text() + made).encode()
        self.rng = random.Random(cfg.seed + 3)

    def echo_line(self) -> str:
        while True:
            line = random_line(self.rng, self.words, self.cfg)
            if line not in self.held_out:
                return line

    def row(self) -> bytes:
        n = self.cfg.base_seq_len + 1
        if self.rng.random() >= self.cfg.base_echo_fraction:
            start = self.rng.randrange(len(self.text) - n)
            return self.text[start : start + n]
        out = b""
        while len(out) < n:
            line = self.echo_line()
            out += f"{line}\n{line}\n".encode()
        return out[:n]

    def batch(self) -> tuple[Any, Any]:
        import torch

        rows = np.frombuffer(
            b"".join(self.row() for _ in range(self.cfg.base_batch)), dtype=np.uint8
        ).reshape(self.cfg.base_batch, -1)
        t = torch.from_numpy(rows.astype(np.int64))
        return t[:, :-1], t[:, 1:]


def encode_example(prompt: str, answer: str, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Input ids and targets (-100 outside the answer) for ``prompt\\nanswer\\n``."""
    p = (prompt + "\n").encode()
    full = p + (answer + "\n").encode()
    if len(full) > seq_len + 1:
        raise ValueError(f"example too long: {full!r}")
    ids = np.full(seq_len + 1, PAD, dtype=np.int64)
    ids[: len(full)] = np.frombuffer(full, dtype=np.uint8)
    targets = np.full(seq_len, -100, dtype=np.int64)
    targets[len(p) - 1 : len(full) - 1] = ids[len(p) : len(full)]
    return ids[:-1], targets


# --------------------------------------------------------------------------
# Model: litert-torch's DecoderOnlyModel, and an autograd forward over its weights.
# --------------------------------------------------------------------------


def init_weights(model: Any, cfg: Any, seed: int) -> None:
    """Fills every weight from ``seed`` (GPT-2 style init) and makes all trainable."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            p.requires_grad_(True)
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = 0.02
            if name.endswith(("output_projection.weight", "ff.w2.weight")):
                std = 0.02 / np.sqrt(2 * cfg.num_layers)
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def new_lora(cfg: Any, rank: int, seed: int) -> list[dict[str, list[Any]]]:
    """Trainable LoRA tensors per layer: ``{proj: [a_prime [in, r], b_prime [r, out]]}``.

    ``a`` starts small and random, ``b`` at zero, so a new adapter changes nothing.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    q_out = cfg.num_heads * cfg.head_dim
    kv_out = cfg.num_kv_groups * cfg.head_dim
    dims = {"q": (cfg.hidden, q_out), "k": (cfg.hidden, kv_out), "v": (cfg.hidden, kv_out),
            "o": (q_out, cfg.hidden)}
    layers = []
    for _ in range(cfg.num_layers):
        entry = {}
        for proj, (d_in, d_out) in dims.items():
            a = (torch.randn(d_in, rank, generator=gen) / np.sqrt(d_in)).requires_grad_(True)
            b = torch.zeros(rank, d_out).requires_grad_(True)
            entry[proj] = [a, b]
        layers.append(entry)
    return layers


def lora_parameters(lora: list[dict[str, list[Any]]]) -> list[Any]:
    """Every trainable tensor of ``lora`` in a fixed order."""
    return [t for entry in lora for proj in "qkvo" for t in entry[proj]]


def rms_norm(x: Any, weight: Any, eps: float) -> Any:
    """litert-torch's RMSNorm (``x * rsqrt(mean(x^2) + eps) * w``) without its HLFB
    marker ops, which have no autograd kernel."""
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def forward(
    model: Any,
    cfg: Any,
    tokens: Any,
    lora: list[dict[str, list[Any]]] | None = None,
    cache: list[tuple[Any, Any]] | None = None,
) -> Any:
    """Logits ``[B, T, vocab]`` for ``tokens``, with autograd.

    The same computation as ``DecoderOnlyModel.forward`` + ``CausalSelfAttention`` of
    litert-torch 0.10.0 with its weights (checked by :func:`check_forward_parity`),
    minus the in-place adds on ``split`` views that autograd refuses and the HLFB
    markers, with a causal mask instead of a fixed-size KV cache.

    ``cache``: ``None`` for a whole sequence from position 0; else a list of per-layer
    ``(k, v)`` (``[B, groups, S, head_dim]``) that is filled on the first call (prefill
    from position 0) and extended by later one-token calls (decode at position S).
    """
    import torch
    import torch.nn.functional as F
    from litert_torch.generative.layers import rotary_position_embedding as rope_lib

    B, T = tokens.shape
    G, H, hd = cfg.num_kv_groups, cfg.num_heads, cfg.head_dim
    q_per_kv = H // G
    eps = cfg.rms_eps
    pos0 = cache[0][0].shape[2] if cache else 0
    if pos0 and T != 1:
        raise ValueError("after the prefill, decode one token at a time")
    x = model.tok_embedding(tokens)
    cos, sin = rope_lib.build_rope(
        torch.arange(pos0, pos0 + T), int(cfg.rope_fraction * hd), int(cfg.rope_base)
    )
    for i, block in enumerate(model.transformer_blocks):
        attn = block.atten_func
        h = rms_norm(x, block.pre_atten_norm.weight, eps)
        qkv = attn.qkv_projection(h).view(B, T, G, -1)
        q, k, v = qkv.split((q_per_kv * hd, hd, hd), dim=-1)
        if lora is not None:
            e = lora[i]
            q = q + ((h @ e["q"][0]) @ e["q"][1]).reshape(q.shape)
            k = k + ((h @ e["k"][0]) @ e["k"][1]).reshape(k.shape)
            v = v + ((h @ e["v"][0]) @ e["v"][1]).reshape(v.shape)
        q = q.reshape(B, T, H, hd)
        k = k.reshape(B, T, G, hd)
        v = v.reshape(B, T, G, hd)
        q, k = rope_lib.apply_rope_inline(q, k, cos, sin)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            if pos0:
                kt = torch.cat([cache[i][0], kt], dim=2)
                vt = torch.cat([cache[i][1], vt], dim=2)
                cache[i] = (kt, vt)
            else:
                cache.append((kt, vt))
        kt = kt.repeat_interleave(q_per_kv, dim=1)
        vt = vt.repeat_interleave(q_per_kv, dim=1)
        y = F.scaled_dot_product_attention(qt, kt, vt, is_causal=pos0 == 0, scale=cfg.attn_scale)
        y = y.transpose(1, 2).reshape(B, T, H * hd)
        out = attn.output_projection(y)
        if lora is not None:
            out = out + (y @ lora[i]["o"][0]) @ lora[i]["o"][1]
        x = x + out
        g = rms_norm(x, block.post_atten_norm.weight, eps)
        ff = block.ff
        x = x + ff.w2(F.silu(ff.w1(g)) * ff.w3(g))
    return model.lm_head(rms_norm(x, model.final_norm.weight, eps))


def litert_lora(cfg: Any, lora: list[dict[str, list[Any]]]) -> Any:
    """The trained tensors as a litert-torch ``LoRA`` (graph layout, no scaling)."""
    from litert_torch.generative.layers import lora as lora_utils

    def w(pair: list[Any]) -> Any:
        return lora_utils.LoRAWeight(a_prime=pair[0].detach().clone(), b_prime=pair[1].detach().clone())

    return lora_utils.LoRA(
        adapters=tuple(
            lora_utils.LoRAEntry(
                attention=lora_utils.AttentionLoRA(
                    query=w(e["q"]), key=w(e["k"]), value=w(e["v"]), output=w(e["o"])
                )
            )
            for e in lora
        )
    )


def check_forward_parity(model: Any, cfg: Any, lora: list[dict[str, list[Any]]] | None) -> float:
    """Max |logit difference| between :func:`forward` and litert-torch's own forward."""
    import torch
    from litert_torch.generative.layers import kv_cache as kv_utils

    tokens = torch.tensor([list(b"hello world\n{\"text\": \"HELLO dlrow\"}\n")])
    T = tokens.shape[1]
    with torch.no_grad():
        mine = forward(model, cfg, tokens, lora)
    kv = kv_utils.KVCache.from_model_config(cfg.kv_cache_max_len, model.config)
    theirs = model.forward(
        tokens, torch.arange(T), kv, lora=None if lora is None else litert_lora(cfg, lora)
    )["logits"]
    return float((mine - theirs).abs().max())


# --------------------------------------------------------------------------
# Training.
# --------------------------------------------------------------------------


def lr_at(step: int, total: int, peak: float, warmup: int = 30) -> float:
    """Linear warm-up, then cosine decay to a tenth of ``peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * frac)))


def train_base(model: Any, cfg: Any, tc: TrainConfig, data: BaseData) -> dict[str, Any]:
    """Trains every weight on next-byte prediction over ``data``; freezes them after."""
    import torch
    import torch.nn.functional as F

    params = [p for _, p in sorted(model.named_parameters())]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tc.base_lr, betas=(0.9, 0.98),
    )
    model.train()
    start = time.perf_counter()
    losses = []
    for step in range(tc.base_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc.base_steps, tc.base_lr)
        x, y = data.batch()
        logits = forward(model, cfg, x)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == tc.base_steps - 1:
            print(f"  base step {step:4d} loss {np.mean(losses[-50:]):.3f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return {"steps": tc.base_steps, "final_loss": round(float(np.mean(losses[-50:])), 4),
            "seconds": round(time.perf_counter() - start, 1)}


def train_lora(
    model: Any, cfg: Any, tc: TrainConfig, task: str, words: Sequence[str], held_out: set[str],
    seed: int,
) -> tuple[list[dict[str, list[Any]]], dict[str, Any]]:
    """Trains a new rank-``tc.lora_rank`` adapter for ``task`` on the frozen base; the loss
    covers the answer bytes only (the prompt is context)."""
    import torch
    import torch.nn.functional as F

    lora = new_lora(cfg, tc.lora_rank, seed)
    params = lora_parameters(lora)
    opt = torch.optim.AdamW(params, lr=tc.lora_lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng = random.Random(seed)
    steps = tc.lora_steps[task]
    start = time.perf_counter()
    losses = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, tc.lora_lr, warmup=20)
        xs, ys = [], []
        while len(xs) < tc.lora_batch:
            line = random_line(rng, words, tc)
            if line in held_out:
                continue
            x, y = encode_example(line, task_answer(task, line), tc.lora_seq_len)
            xs.append(x)
            ys.append(y)
        width = int(max(np.nonzero(t != -100)[0][-1] for t in ys)) + 1  # drop all-pad columns
        x = torch.from_numpy(np.stack(xs)[:, :width])
        y = torch.from_numpy(np.stack(ys)[:, :width])
        logits = forward(model, cfg, x, lora)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), y.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            print(f"  {task} step {step:4d} loss {np.mean(losses[-50:]):.4f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    for t in params:
        t.requires_grad_(False)
    return lora, {"steps": steps, "final_loss": round(float(np.mean(losses[-20:])), 5),
                  "seconds": round(time.perf_counter() - start, 1)}


# --------------------------------------------------------------------------
# Evaluation.
# --------------------------------------------------------------------------


def torch_generate(
    model: Any, cfg: Any, prompts: Sequence[str], lora: Any, max_new_tokens: int
) -> list[str]:
    """Greedy continuations (up to and including the first newline).

    Prompts of equal length are batched: one prefill, then one-token decode steps with
    a KV cache, like the runtime does.
    """
    import torch

    outs: dict[int, str] = {}
    by_len: dict[int, list[int]] = {}
    for idx, p in enumerate(prompts):
        by_len.setdefault(len((p + "\n").encode()), []).append(idx)
    with torch.no_grad():
        for _, idxs in sorted(by_len.items()):
            tokens = torch.tensor([list((prompts[i] + "\n").encode()) for i in idxs])
            cache: list[tuple[Any, Any]] = []
            nxt = forward(model, cfg, tokens, lora, cache)[:, -1].argmax(-1)
            gen = [nxt]
            done = nxt == NEWLINE
            while len(gen) < max_new_tokens and not bool(done.all()):
                nxt = forward(model, cfg, nxt[:, None], lora, cache)[:, -1].argmax(-1)
                gen.append(nxt)
                done |= nxt == NEWLINE
            rows = torch.stack(gen, dim=1).tolist()
            for i, row in zip(idxs, rows):
                if NEWLINE in row:
                    row = row[: row.index(NEWLINE) + 1]
                outs[i] = bytes(row).decode("utf-8", errors="replace")
    return [outs[i] for i in range(len(prompts))]


def score(outputs: Sequence[str], prompts: Sequence[str], task: str) -> float:
    """Fraction of ``outputs`` equal to the expected line (newline included)."""
    hits = sum(o == task_answer(task, p) + "\n" for o, p in zip(outputs, prompts))
    return hits / len(prompts)


def runtime_generate(
    model_path: Path, adapter: Path | None, prompts: Sequence[str], max_new_tokens: int
) -> tuple[list[str], float]:
    """Greedy continuations through ``runtime.Engine`` (one session, reset per prompt)."""
    from runtime import Engine, EngineSettings, SessionConfig

    start = time.perf_counter()
    outs = []
    with Engine(model_path, settings=EngineSettings(num_threads=1)) as engine:
        session = engine.create_session(SessionConfig(lora_path=adapter))
        for p in prompts:
            session.reset()
            result = session.generate(
                list((p + "\n").encode()), max_new_tokens=max_new_tokens, stop_tokens=[NEWLINE]
            )
            outs.append(bytes(result.tokens).decode("utf-8", errors="replace"))
        session.close()
    return outs, time.perf_counter() - start


def accuracy_matrix(outputs: dict[str, list[str]], prompts: Sequence[str]) -> dict[str, dict[str, float]]:
    """``{session: {task: exact-match accuracy}}`` for every session's outputs."""
    return {s: {t: score(o, prompts, t) for t in TASKS} for s, o in outputs.items()}


def format_matrix(title: str, matrix: dict[str, dict[str, float]]) -> str:
    lines = [title, f"  {'session':<22}" + "".join(f"{t:>11}" for t in TASKS)]
    for s, row in matrix.items():
        lines.append(f"  {s:<22}" + "".join(f"{100 * row[t]:>10.0f}%" for t in TASKS))
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Export.
# --------------------------------------------------------------------------


def write_adapters(cfg: Any, loras: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Writes each adapter with the runtime's writer (litert-torch convention, float32)
    and ``uppercase`` once more in the LiteRT-LM convention (float16)."""
    from runtime.util.lora_util import Convention
    from runtime.util.lora_writer import LoraWeights, write_lora_file

    adapter_dir = out_dir / ADAPTER_DIR
    adapter_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for task, lora in loras.items():
        weights = {
            (i, proj): LoraWeights(
                a=e[proj][0].detach().numpy().astype(np.float32),
                b=e[proj][1].detach().numpy().astype(np.float32),
            )
            for i, e in enumerate(lora)
            for proj in "qkvo"
        }
        written[task] = write_lora_file(adapter_dir / f"{task}.tflite", weights, Convention.LITERT_TORCH)
        if task == "uppercase":
            written["uppercase_litertlm"] = write_lora_file(
                adapter_dir / "uppercase_litertlm.tflite", weights, Convention.LITERT_LM,
                dtype=np.float16,
            )
    return written


def export_dynamic_int8(model: Any, cfg: Any, out_file: Path) -> None:
    """Like ``btm.export_model`` (default KV layout) but with ``quantize="dynamic_int8"``."""
    from litert_torch.generative.layers import kv_cache as kv_utils
    from litert_torch.generative.utilities import converter

    with tempfile.TemporaryDirectory() as tmp:
        written = converter.convert_to_tflite(
            model,
            output_path=tmp,
            output_name_prefix="demo",
            prefill_seq_len=list(cfg.prefill_seq_lens),
            kv_cache_max_len=cfg.kv_cache_max_len,
            quantize="dynamic_int8",
            config=model.config,
            lora_ranks=list(cfg.lora_ranks),
            export_config=converter.ExportConfig(kvcache_layout=kv_utils.KV_LAYOUT_DEFAULT),
        )
        shutil.move(written, out_file)


def try_dynamic_int8(
    model: Any, cfg: Any, adapter_paths: dict[str, Path], eval_lines: Sequence[str],
    f32_outputs: dict[str, list[str]], max_new_tokens: int,
) -> None:
    """Exports a dynamic_int8 copy to a temporary directory and prints its size and
    accuracy through the runtime (nothing is written to the output directory)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model_int8.tflite"
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            export_dynamic_int8(model, cfg, path)
        print(f"dynamic_int8 export: {path.stat().st_size} bytes in {time.perf_counter() - start:.0f} s",
              flush=True)
        outputs = {}
        for s, adapter in {"base": None, **{f"+{t}": adapter_paths[t] for t in TASKS}}.items():
            outputs[s], _ = runtime_generate(path, adapter, eval_lines, max_new_tokens)
        print(format_matrix("runtime, dynamic_int8 model", accuracy_matrix(outputs, eval_lines)), flush=True)
        same = {s: sum(a == b for a, b in zip(outputs[s], f32_outputs[s])) / len(eval_lines) for s in outputs}
        print(f"dynamic_int8 output == float32 output: {same}", flush=True)


def model_config_json(cfg: Any) -> dict[str, Any]:
    """The exported model's config for demo.json (without the test model's init knobs)."""
    out = {k: v for k, v in cfg.to_json().items() if k not in ("weight_std", "norm_std", "seed")}
    out.update(kv_layout="default", output_logits_on_prefill=False,
               init="normal(0, 0.02), residual outputs 0.02/sqrt(2*layers), norms 1")
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------
# Main.
# --------------------------------------------------------------------------


def run(
    out_dir: Path, tc: TrainConfig, runtime_eval: bool, weights_cache: Path | None, try_int8: bool
) -> dict[str, Any]:
    import torch

    t0 = time.perf_counter()
    litert_torch_fixes.apply()
    torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)
    cfg = model_config()

    words = vocabulary()
    eval_lines = held_out_lines(words, tc)
    held_out = set(eval_lines) | set(DEMO_PROMPTS)
    print(f"{len(words)} words, {len(eval_lines)} held-out lines", flush=True)

    from litert_torch.generative.utilities import model_builder

    model = model_builder.DecoderOnlyModel(btm.litert_model_config(cfg), mask_cache_size=cfg.kv_cache_max_len)
    init_weights(model, cfg, tc.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params} parameters", flush=True)

    data = BaseData(words, held_out, tc)
    print(f"plain text: {len(data.text)} bytes", flush=True)
    loras: dict[str, Any] = {}
    lora_info: dict[str, Any] = {}
    if weights_cache is not None and weights_cache.exists():
        cached = torch.load(weights_cache)
        model.load_state_dict(cached["base"])
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        base_info, loras, lora_info = cached["base_info"], cached["loras"], cached["lora_info"]
        print(f"loaded the trained weights from {weights_cache}", flush=True)
    else:
        print(f"training the base model ({tc.base_steps} steps)", flush=True)
        base_info = train_base(model, cfg, tc, data)
        for k, task in enumerate(TASKS):
            print(f"training the {task} adapter ({tc.lora_steps[task]} steps)", flush=True)
            loras[task], lora_info[task] = train_lora(model, cfg, tc, task, words, held_out, tc.seed + 100 + k)
        if weights_cache is not None:
            torch.save({"base": model.state_dict(), "base_info": base_info, "loras": loras,
                        "lora_info": lora_info}, weights_cache)

    parity = {"base": check_forward_parity(model, cfg, None)}
    parity.update({t: check_forward_parity(model, cfg, loras[t]) for t in TASKS})
    print(f"torch forward vs litert-torch forward, max |diff|: {parity}", flush=True)

    sessions = {"base": None, **{f"+{t}": loras[t] for t in TASKS}}
    t_eval = time.perf_counter()
    torch_outputs = {
        s: torch_generate(model, cfg, eval_lines, lora, tc.max_new_tokens) for s, lora in sessions.items()
    }
    torch_matrix = accuracy_matrix(torch_outputs, eval_lines)
    for t in TASKS:
        misses = [(p, o) for p, o in zip(eval_lines, torch_outputs[f"+{t}"]) if o != task_answer(t, p) + "\n"]
        for p, o in misses[:3]:
            print(f"  +{t} miss: {p!r} -> {o!r}", flush=True)
    print(format_matrix(f"torch, {len(eval_lines)} held-out inputs ({time.perf_counter() - t_eval:.0f} s)",
                        torch_matrix), flush=True)

    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = out_dir / MODEL_FILE
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        export_s = btm.export_model(model, cfg, model_path, transposed_kv=False, output_logits_on_prefill=False)
    print(f"exported {model_path} in {export_s:.1f} s", flush=True)
    adapter_paths = write_adapters(cfg, loras, out_dir)

    runtime_outputs: dict[str, list[str]] = {}
    demo_outputs: dict[str, dict[str, str]] = {}
    runtime_matrix: dict[str, dict[str, float]] = {}
    agreement: dict[str, float] = {}
    if runtime_eval:
        t_rt = time.perf_counter()
        rt_sessions = {"base": None, **{f"+{t}": adapter_paths[t] for t in TASKS},
                       "+uppercase_litertlm": adapter_paths["uppercase_litertlm"]}
        for s, adapter in rt_sessions.items():
            outs, secs = runtime_generate(
                model_path, adapter, list(eval_lines) + list(DEMO_PROMPTS), tc.max_new_tokens
            )
            runtime_outputs[s] = outs[: len(eval_lines)]
            demo_outputs[s] = {p: o for p, o in zip(DEMO_PROMPTS, outs[len(eval_lines):])}
            print(f"  runtime {s}: {len(outs)} prompts in {secs:.1f} s", flush=True)
        runtime_matrix = accuracy_matrix(runtime_outputs, eval_lines)
        agreement = {
            s: sum(a == b for a, b in zip(runtime_outputs[s], torch_outputs[s.replace("_litertlm", "")]))
            / len(eval_lines)
            for s in runtime_outputs
        }
        print(format_matrix(f"runtime (Engine on the exported files), {len(eval_lines)} held-out inputs "
                            f"({time.perf_counter() - t_rt:.0f} s)", runtime_matrix), flush=True)
        print(f"runtime output == torch output: {agreement}", flush=True)
        print("demo prompts through the runtime:", flush=True)
        for p in DEMO_PROMPTS:
            print(f"  {p!r}: " + ", ".join(f"{s} -> {demo_outputs[s][p]!r}" for s in demo_outputs), flush=True)

    if try_int8 and runtime_eval:
        try_dynamic_int8(model, cfg, adapter_paths, eval_lines, runtime_outputs, tc.max_new_tokens)

    files = sorted([model_path, *adapter_paths.values()])
    # Examples: the first held-out input of 2, 3 and 4 words that every adapter answers
    # correctly through the runtime (the misses are listed under accuracy.runtime_misses).
    answered = {
        p for i, p in enumerate(eval_lines)
        if all(runtime_outputs.get(f"+{t}", [task_answer(t, q) + "\n" for q in eval_lines])[i]
               == task_answer(t, p) + "\n" for t in TASKS)
    }
    examples = [next(p for p in eval_lines if len(p.split()) == n and p in answered) for n in (2, 3, 4)]
    misses = {
        s: [{"input": p + "\n", "output": o, "expected": task_answer(s[1:], p) + "\n"}
            for p, o in zip(eval_lines, outs) if o != task_answer(s[1:], p) + "\n"]
        for s, outs in runtime_outputs.items() if s[1:] in TASKS
    }
    demo = {
        "generator": "tools/train_demo.py",
        "about": "One frozen byte-level base model, one LoRA adapter per skill. Feed every "
                 "session the same prompt bytes; the adapter alone selects the behaviour.",
        "model": {
            "file": MODEL_FILE,
            "parameters": n_params,
            "config": model_config_json(cfg),
        },
        "tokenizer": "bytes: prompt_ids = list(text.encode('utf-8')); output = bytes(tokens).decode()",
        "prompt_format": "the input line followed by a newline (byte 10); the same for every "
                         "session, no task tag",
        "stop_tokens": [NEWLINE],
        "max_new_tokens": tc.max_new_tokens,
        "demo_prompts": [p + "\n" for p in DEMO_PROMPTS],
        "base_behaviour": "echoes the line",
        "examples_are": "held-out inputs of 2, 3 and 4 words, the first that every adapter "
                        "answered correctly through the runtime",
        "tasks": [
            {
                "name": t,
                "description": TASK_DESCRIPTIONS[t],
                "adapter": f"{ADAPTER_DIR}/{t}.tflite",
                "examples": [
                    {"input": p + "\n", "output": task_answer(t, p) + "\n"} for p in examples
                ],
            }
            for t in TASKS
        ],
        "adapters": {
            name: {
                "file": str(path.relative_to(out_dir)),
                "task": name.replace("_litertlm", ""),
                "convention": "litert-lm" if name.endswith("_litertlm") else "litert-torch",
                "dtype": "float16" if name.endswith("_litertlm") else "float32",
                "rank": tc.lora_rank,
                "targets": ["q", "k", "v", "o"],
            }
            for name, path in adapter_paths.items()
        },
        "accuracy": {
            "metric": "greedy exact match of the generated line (through the first newline)",
            "held_out_inputs": len(eval_lines),
            "runtime": runtime_matrix,
            "torch": torch_matrix,
            "runtime_equals_torch_output": agreement,
            "runtime_misses": misses,
        },
        "demo_expected": {t: {p + "\n": task_answer(t, p) + "\n" for p in DEMO_PROMPTS} for t in TASKS},
        "demo_outputs_runtime": demo_outputs,
        "training": {
            "seed": tc.seed,
            "seeds": {"weights_init": tc.seed, "held_out_inputs": tc.seed + 1, "sentences": tc.seed + 2,
                      "base_batches": tc.seed + 3,
                      "adapters": {t: tc.seed + 100 + k for k, t in enumerate(TASKS)}},
            "config": {k: v for k, v in dataclasses.asdict(tc).items() if k != "threads"},
            "words": len(words),
            "plain_text_bytes": len(data.text),
            "base_final_loss": base_info["final_loss"],
            "adapter_final_loss": {t: lora_info[t]["final_loss"] for t in TASKS},
            "max_abs_logit_diff_vs_litert_torch_forward": {k: float(f"{v:.3g}") for k, v in parity.items()},
        },
        "files": {str(q.relative_to(out_dir)): {"size_bytes": q.stat().st_size, "sha256": sha256(q)}
                  for q in files},
        "total_size_bytes": sum(q.stat().st_size for q in files),
        "versions": {
            "python": sys.version.split()[0],
            **{n: btm.package_version(n) for n in ("torch", "litert-torch", "ai-edge-litert", "numpy")},
        },
    }
    (out_dir / DEMO_JSON).write_text(json.dumps(demo, indent=2) + "\n")
    timings = {"base_s": base_info["seconds"], **{f"{t}_s": lora_info[t]["seconds"] for t in TASKS},
               "export_s": round(export_s, 1), "total_s": round(time.perf_counter() - t0, 1)}
    print(f"timings: {timings}", flush=True)
    for q in files + [out_dir / DEMO_JSON]:
        print(f"  {q.relative_to(out_dir)}: {q.stat().st_size} bytes sha256={sha256(q)[:16]}")
    return demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--skip-runtime-eval", action="store_true",
                        help="do not measure through runtime.Engine (demo.json then has no runtime table)")
    parser.add_argument("--weights-cache", type=Path, default=None,
                        help="a .pt file: loaded instead of training if it exists, else written "
                             "after training (to re-run the export part alone)")
    parser.add_argument("--try-dynamic-int8", action="store_true",
                        help="also export a dynamic_int8 copy to a temporary directory and print "
                             "its size and runtime accuracy (writes nothing)")
    args = parser.parse_args(argv)
    run(args.out_dir, TrainConfig(), not args.skip_runtime_eval, args.weights_cache, args.try_dynamic_int8)
    return 0


if __name__ == "__main__":
    sys.exit(main())
