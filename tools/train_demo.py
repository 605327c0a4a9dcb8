#!/usr/bin/env python3
"""Train a tiny byte-level base model and three LoRA skills, export them, measure them.

Needs the ``export`` extra (torch 2.13.0, litert-torch 0.10.0) and the word list of the
PyPI package ``english-words`` (no dependencies), CPU only::

    python3 -m pip install -e '.[export]' 'english-words==2.0.2'
    nice -n 10 python3 tools/train_demo.py [--out-dir DIR] [--cache-dir DIR]

The point of the project in one picture: one frozen base model and several LoRA
adapters, each giving it a different skill, selected per session. Every session is fed
the *same* prompt bytes (``"<line>\\n"``); only the adapter differs:

=============  ===============================================
base           echoes the line: ``hello world`` -> ``hello world``
``uppercase``  ``hello world`` -> ``HELLO WORLD``
``no_vowels``  ``hello world`` -> ``hll wrld``
``json``       ``hello world`` -> ``{"text": "hello world", "words": 2}``
=============  ===============================================

The skills are character-level, so they are trained and measured on any lowercase
text, not on a fixed vocabulary: a line is 1-5 "words" separated by single spaces, each
word either a real word from Webster's Second International (``english-words``' list
``web2``, 234,450 words) or a random string of letters a-z (a quarter of those with one
letter doubled, the base's hardest case to copy). Held out from every
training line (base and adapters) and used only to measure:

* *unseen words*: the everyday words of :data:`EVERYDAY_WORDS` (what a newcomer types:
  ``hello``, ``apple``, ``garden``...) and a seeded 2% of the word list;
* *unseen random strings*: the measuring lines are drawn from their own seed and any
  line that occurs in training is skipped.

The three measuring sets are: lines of training words (new combinations), lines of
unseen words, lines of random strings of 2-8 letters; 1-4 words a line, each line with
at least one vowel (so that echo and ``no_vowels`` differ).

``no_vowels`` stands in for "reverse the line": with rank-8 LoRA on attention only and
the base frozen, reversal stayed at 0% exact match (it needs a position-mirroring
attention pattern), while deleting characters is a change of *where* the copy head
looks, which attention LoRA learns.

Steps, all from fixed seeds (``TrainConfig.seed`` and offsets of it):

1. A Llama-style decoder over bytes (vocab 256; RMSNorm, RoPE, grouped-query attention,
   gated SiLU MLP) is built with litert-torch's ``DecoderOnlyModel`` from the config
   helper of ``tools/build_test_models.py``, so the trained weights export directly.
2. The base is trained on "echo" lines (``"<line>\\n<line>\\n"``, in any case: lower,
   upper, capitalised or mixed, copied as they are) and on made-up text (sentences of
   training words with capitals, digits and punctuation, and small JSON records), so it
   copies any line and knows capitals, digits and braces, but solves none of the tasks.
3. One LoRA adapter per task on attention q/k/v/o (the only places the exported graph
   takes LoRA), base frozen, computed exactly as the graph does:
   ``proj(x) + (x @ a_prime) @ b_prime`` with ``a_prime`` ``[in, r]``, ``b_prime``
   ``[r, out]`` and no scaling.
4. Export with litert-torch (float32, prefill 16/64, KV cache 256, LoRA rank 8) and the
   adapters with ``runtime.adapters.lora_writer`` into ``runtime/demo_assets/``.
5. Greedy exact-match accuracy of every session (base and each adapter) against every
   task, on the three measuring sets, through ``runtime.Engine`` on the exported files
   (and in torch); ``demo.json`` records it with the config, seeds, sizes and versions.

``--cache-dir`` keeps the trained weights of each stage (base, then each adapter) keyed
by the configuration, so a re-run with a changed adapter setting retrains only that.
The two litert-torch 0.10.0 workarounds come from ``runtime.export.litert_torch_fixes``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import os
import random
import shutil
import string
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

# Threads that spin while they wait for each other burn the cores another process on a
# shared machine would use (measured here: 8x the CPU time per training step); set
# before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

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

# The word list: a PyPI package, so the script installs it by name.
WORD_LIST_PACKAGE = "english-words"
WORD_LIST_SOURCE = "web2"
LETTERS = string.ascii_lowercase
VOWELS = "aeiou"

# Tasks: name -> description. "echo" is what the base model does alone.
TASKS = ("echo", "uppercase", "no_vowels", "json")
ADAPTER_TASKS = TASKS[1:]
TASK_DESCRIPTIONS = {
    "echo": "the line as it is (the base model alone)",
    "uppercase": "the line in capital letters",
    "no_vowels": "the line with the vowels a, e, i, o, u removed",
    "json": 'a fixed JSON record: {"text": <line>, "words": <word count>}',
}
DEMO_PROMPTS = ("hello world", "good morning", "light apple music large", "green tea", "zorbly quix")

# Everyday words a newcomer would type, held out of all training: lines made of them are
# one of the measuring sets, and every word of the demo prompts is among them.
EVERYDAY_WORDS = """
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
with sat hello world apple garden morning music quick dog cat sun
""".split()


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Training hyper-parameters (the model shape is a ``btm.TinyGqaConfig``)."""

    seed: int = 20240611
    threads: int = 2
    # Lines (training): 1-5 words of 1-12 letters, at most 60 characters.
    max_words: int = 5
    max_word_len: int = 12
    max_line_chars: int = 60
    held_out_word_fraction: float = 0.02
    # Random training strings with one letter doubled ("mmruj"): copying a doubled letter
    # is the base's most frequent miss, and uniform random strings rarely have one.
    random_doubled_fraction: float = 0.25
    # Base model.
    base_steps: int = 5000
    base_batch: int = 32
    base_seq_len: int = 96
    base_lr: float = 3e-3
    base_echo_fraction: float = 0.85
    # Adapters.
    lora_rank: int = 8
    lora_steps: tuple[tuple[str, int], ...] = (("uppercase", 1000), ("no_vowels", 2000), ("json", 3000))
    lora_batch: int = 16
    lora_lr: float = 1e-2
    # Measuring: lines of 1-4 words, random strings of 2-8 letters.
    eval_max_words: int = 4
    eval_random_len: tuple[int, int] = (2, 8)
    num_eval: int = 200
    num_dev: int = 32  # lines per set scored during training (from their own seed)
    dev_every: int = 500
    max_new_tokens: int = 96

    def stage_key(self, stage: str) -> str:
        """A short hash of the fields ``stage`` depends on (for ``--cache-dir``)."""
        fields = {k: v for k, v in dataclasses.asdict(self).items()
                  if not k.startswith(("lora_", "eval_", "num_", "dev_", "max_new", "threads"))}
        if stage != "base":
            fields.update(task=stage, rank=self.lora_rank, steps=dict(self.lora_steps)[stage],
                          batch=self.lora_batch, lr=self.lora_lr)
        blob = json.dumps(fields, sort_keys=True).encode() + json.dumps(model_config().to_json()).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


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
        batch_sizes=(),  # no batched decode signatures: the demo stays small
    )


# --------------------------------------------------------------------------
# Data.
# --------------------------------------------------------------------------


def task_answer(task: str, line: str) -> str:
    """The expected output line (without the trailing newline) for ``task``."""
    if task == "echo":
        return line
    if task == "uppercase":
        return line.upper()
    if task == "no_vowels":
        return "".join(c for c in line if c not in VOWELS)
    if task == "json":
        return json.dumps({"text": line, "words": len(line.split())})
    raise ValueError(task)


def load_word_list() -> list[str]:
    """The lowercase a-z words of the ``english-words`` list ``web2``, sorted."""
    try:
        from english_words import get_english_words_set
    except ImportError:
        raise SystemExit(f"tools/train_demo.py needs the word list: "
                         f"python3 -m pip install '{WORD_LIST_PACKAGE}==2.0.2'") from None
    words = get_english_words_set([WORD_LIST_SOURCE], lower=True, alpha=True)
    return sorted(w for w in words if w.isascii() and w.isalpha())


@dataclasses.dataclass(frozen=True)
class WordPools:
    """Words by length: those training may use, and those only the measuring uses."""

    train: dict[int, list[str]]
    unseen_everyday: list[str]
    unseen_sampled: list[str]
    held_out: frozenset[str]

    @classmethod
    def build(cls, words: Sequence[str], tc: TrainConfig) -> "WordPools":
        everyday = sorted(set(EVERYDAY_WORDS))
        rest = [w for w in words if w not in set(everyday) and len(w) <= tc.max_word_len]
        sampled = sorted(random.Random(tc.seed + 4).sample(rest, round(tc.held_out_word_fraction * len(rest))))
        held = set(everyday) | set(sampled)
        train: dict[int, list[str]] = {}
        for w in rest:
            if w not in held:
                train.setdefault(len(w), []).append(w)
        return cls(train, everyday, sampled, frozenset(held))

    def train_size(self) -> int:
        return sum(len(v) for v in self.train.values())


# Word lengths as drawn for training lines: short words often (as people type them), long
# ones still present. A length is drawn first, then a word (or random string) of it.
LENGTH_WEIGHTS = {1: 2, 2: 6, 3: 10, 4: 12, 5: 12, 6: 11, 7: 10, 8: 9, 9: 7, 10: 6, 11: 5, 12: 4}


def random_string(rng: random.Random, length: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(length))


def with_doubled_letter(rng: random.Random, word: str) -> str:
    """``word`` with one letter written twice in place of the next (same length)."""
    i = rng.randrange(len(word) - 1)
    return word[: i + 1] + word[i] + word[i + 2 :]


def training_word(rng: random.Random, pools: WordPools, p_random: float, p_doubled: float = 0.0) -> str:
    """A word of the training pool or a random string (never a held-out word), its
    length drawn first; a random string of 2 or more letters has a doubled letter with
    probability ``p_doubled``."""
    length = rng.choices(list(LENGTH_WEIGHTS), weights=list(LENGTH_WEIGHTS.values()))[0]
    if rng.random() < p_random or length not in pools.train:
        while True:
            word = random_string(rng, length)
            if p_doubled and length > 1 and rng.random() < p_doubled:
                word = with_doubled_letter(rng, word)
            if word not in pools.held_out:
                return word
    return rng.choice(pools.train[length])


class TrainingLines:
    """Lowercase training lines (never one of ``excluded``): 1-5 words, each line all real
    words, all random strings, or mixed, in equal shares."""

    def __init__(self, pools: WordPools, excluded: set[str], tc: TrainConfig, seed: int) -> None:
        self.pools, self.excluded, self.tc = pools, excluded, tc
        self.rng = random.Random(seed)

    def line(self) -> str:
        while True:
            p_random = self.rng.choice((0.0, 0.5, 1.0))
            n = self.rng.randint(1, self.tc.max_words)
            text = " ".join(training_word(self.rng, self.pools, p_random, self.tc.random_doubled_fraction)
                            for _ in range(n))
            if len(text) <= self.tc.max_line_chars and text not in self.excluded:
                return text


def measuring_lines(kind: str, pools: WordPools, tc: TrainConfig, count: int, seed: int) -> list[str]:
    """``count`` distinct lines of 1-``eval_max_words`` words, each with a vowel:
    ``seen_words`` (training words), ``unseen_words`` (held-out words, everyday and
    sampled in equal shares) or ``random_strings`` (``eval_random_len`` letters)."""
    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < count:
        words = []
        for _ in range(rng.randint(1, tc.eval_max_words)):
            if kind == "seen_words":
                words.append(training_word(rng, pools, 0.0))
            elif kind == "unseen_words":
                words.append(rng.choice(pools.unseen_everyday if rng.random() < 0.5 else pools.unseen_sampled))
            elif kind == "random_strings":
                words.append(random_string(rng, rng.randint(*tc.eval_random_len)))
            else:
                raise ValueError(kind)
        text = " ".join(words)
        if len(text) <= tc.max_line_chars and any(c in VOWELS for c in text) and text not in seen:
            seen.add(text)
            out.append(text)
    return out


MEASURING_SETS = {
    "seen_words": "new combinations of training words",
    "unseen_words": "words never seen in training (half everyday words, half sampled from the list)",
    "random_strings": "random strings of 2-8 letters",
}


def case_variant(rng: random.Random, line: str) -> str:
    """The line as is (70%), in capitals, capitalised word by word, or in random case."""
    r = rng.random()
    if r < 0.7:
        return line
    if r < 0.8:
        return line.upper()
    if r < 0.9:
        return " ".join(w.capitalize() for w in line.split(" "))
    return "".join(c.upper() if rng.random() < 0.5 else c for c in line)


def made_up_text_line(rng: random.Random, pools: WordPools) -> str:
    """A sentence of training words (capitalised, sometimes shouted, with digits, commas
    and a full stop), or a small JSON record of training words and numbers."""
    if rng.random() < 0.15:
        record = {training_word(rng, pools, 0.0): (rng.randint(0, 99) if rng.random() < 0.5
                                                   else " ".join(training_word(rng, pools, 0.2)
                                                                 for _ in range(rng.randint(1, 4))))
                  for _ in range(rng.randint(1, 3))}
        return json.dumps(record)
    n = rng.randint(3, 10)
    shout = rng.random() < 0.15
    parts = []
    for _ in range(n):
        w = str(rng.randint(0, 999)) if rng.random() < 0.06 else training_word(rng, pools, 0.1)
        parts.append(w.upper() if shout or rng.random() < 0.08 else w)
    text = " ".join(parts)
    if n > 5 and rng.random() < 0.4:
        cut = text.index(" ", len(text) // 2)
        text = text[:cut] + "," + text[cut:]
    return text[0].upper() + text[1:] + rng.choice("!!!" if shout else ".....?!")


class BaseData:
    """Rows of ``seq_len + 1`` bytes: packed echo pairs, or packed made-up text lines."""

    def __init__(self, pools: WordPools, excluded: set[str], tc: TrainConfig) -> None:
        self.tc, self.pools = tc, pools
        self.lines = TrainingLines(pools, excluded, tc, tc.seed + 2)
        self.rng = random.Random(tc.seed + 3)

    def row(self) -> bytes:
        n = self.tc.base_seq_len + 1
        out = b""
        echo = self.rng.random() < self.tc.base_echo_fraction
        while len(out) < n:
            if echo:
                line = case_variant(self.rng, self.lines.line())
                out += f"{line}\n{line}\n".encode()
            else:
                out += (made_up_text_line(self.rng, self.pools) + "\n").encode()
        return out[:n]

    def batch(self) -> tuple[Any, Any]:
        import torch

        rows = np.frombuffer(
            b"".join(self.row() for _ in range(self.tc.base_batch)), dtype=np.uint8
        ).reshape(self.tc.base_batch, -1)
        t = torch.from_numpy(rows.astype(np.int64))
        return t[:, :-1], t[:, 1:]


def encode_examples(pairs: Sequence[tuple[str, str]]) -> tuple[Any, Any]:
    """Input ids and targets (-100 outside the answers) for ``prompt\\nanswer\\n`` rows,
    padded to the longest."""
    import torch

    rows = [((p + "\n").encode(), (p + "\n" + a + "\n").encode()) for p, a in pairs]
    width = max(len(full) for _, full in rows) - 1
    ids = np.full((len(rows), width + 1), PAD, dtype=np.int64)
    targets = np.full((len(rows), width), -100, dtype=np.int64)
    for i, (prompt, full) in enumerate(rows):
        ids[i, : len(full)] = np.frombuffer(full, dtype=np.uint8)
        targets[i, len(prompt) - 1 : len(full) - 1] = ids[i, len(prompt) : len(full)]
    return torch.from_numpy(ids[:, :-1]), torch.from_numpy(targets)


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


@functools.lru_cache(maxsize=None)
def rope_table(dim: int, base: int, positions: int = 512) -> tuple[Any, Any]:
    """litert-torch's RoPE cos and sin for positions ``0..positions-1`` (built once: it
    costs more than a small forward pass)."""
    import torch
    from litert_torch.generative.layers import rotary_position_embedding as rope_lib

    return rope_lib.build_rope(torch.arange(positions), dim, base)


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
    cos, sin = rope_table(int(cfg.rope_fraction * hd), int(cfg.rope_base))
    cos, sin = cos[:, pos0 : pos0 + T], sin[:, pos0 : pos0 + T]
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


def dev_report(model: Any, cfg: Any, dev: dict[str, list[str]], lora: Any, task: str, max_new_tokens: int) -> str:
    """Exact match of ``task`` on the dev lines of each measuring set, as one string."""
    parts = []
    for kind, lines in dev.items():
        outs = torch_generate(model, cfg, lines, lora, max_new_tokens)
        parts.append(f"{kind} {100 * score(outs, lines, task):.0f}%")
    return ", ".join(parts)


def train_base(model: Any, cfg: Any, tc: TrainConfig, data: BaseData, dev: dict[str, list[str]]) -> dict[str, Any]:
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
    start = time.perf_counter()
    losses = []
    for step in range(tc.base_steps):
        model.train()
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
        dev_step = (step + 1) % tc.dev_every == 0 or step == tc.base_steps - 1
        if step % 50 == 0 or dev_step:
            line = f"  base step {step:4d} loss {np.mean(losses[-50:]):.3f} ({time.perf_counter() - start:.0f} s)"
            if dev_step:
                model.eval()
                line += "  echo on dev lines: " + dev_report(model, cfg, dev, None, "echo", tc.max_new_tokens)
            print(line, flush=True)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return {"steps": tc.base_steps, "final_loss": round(float(np.mean(losses[-50:])), 4),
            "seconds": round(time.perf_counter() - start, 1)}


def train_lora(
    model: Any, cfg: Any, tc: TrainConfig, task: str, lines: TrainingLines, dev: dict[str, list[str]],
    seed: int,
) -> tuple[list[dict[str, list[Any]]], dict[str, Any]]:
    """Trains a new rank-``tc.lora_rank`` adapter for ``task`` on the frozen base; the loss
    covers the answer bytes only (the prompt is context)."""
    import torch
    import torch.nn.functional as F

    lora = new_lora(cfg, tc.lora_rank, seed)
    params = lora_parameters(lora)
    opt = torch.optim.AdamW(params, lr=tc.lora_lr, weight_decay=0.0, betas=(0.9, 0.98))
    steps = dict(tc.lora_steps)[task]
    start = time.perf_counter()
    losses = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, tc.lora_lr, warmup=20)
        batch = [lines.line() for _ in range(tc.lora_batch)]
        x, y = encode_examples([(line, task_answer(task, line)) for line in batch])
        logits = forward(model, cfg, x, lora)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), y.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        dev_step = (step + 1) % tc.dev_every == 0 or step == steps - 1
        if step % 50 == 0 or dev_step:
            line = f"  {task} step {step:4d} loss {np.mean(losses[-50:]):.4f} ({time.perf_counter() - start:.0f} s)"
            if dev_step:
                line += f"  {task} on dev lines: " + dev_report(model, cfg, dev, lora, task, tc.max_new_tokens)
            print(line, flush=True)
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
    """Greedy continuations (up to and including the first newline), all prompts at once.

    Every row starts at position 0 and takes one token a step, with a KV cache: its own
    prompt bytes while it has some left, then what it generated (the runtime prefills the
    prompt in one call instead; the logits agree to float rounding).
    """
    import torch

    ids = [list((p + "\n").encode()) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    cache: list[tuple[Any, Any]] = []
    feed = torch.tensor([[row[0]] for row in ids])
    with torch.no_grad():
        for t in range(max(map(len, ids)) + max_new_tokens):
            predicted = forward(model, cfg, feed, lora, cache)[:, -1].argmax(-1).tolist()
            nxt = []
            for i, row in enumerate(ids):
                if t + 1 < len(row):
                    nxt.append(row[t + 1])
                    continue
                if not done[i]:
                    out[i].append(predicted[i])
                    done[i] = predicted[i] == NEWLINE or len(out[i]) >= max_new_tokens
                nxt.append(predicted[i])
            if all(done):
                break
            feed = torch.tensor(nxt)[:, None]
    return [bytes(row).decode("utf-8", errors="replace") for row in out]


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
        lines.append(f"  {s:<22}" + "".join(f"{100 * row[t]:>10.1f}%" for t in TASKS))
    return "\n".join(lines)


def misses(outputs: Sequence[str], prompts: Sequence[str], task: str, limit: int = 5) -> list[dict[str, str]]:
    """The first ``limit`` inputs answered wrongly for ``task``, with output and expectation."""
    wrong = [{"input": p + "\n", "output": o, "expected": task_answer(task, p) + "\n"}
             for p, o in zip(prompts, outputs) if o != task_answer(task, p) + "\n"]
    return wrong[:limit]


# --------------------------------------------------------------------------
# Export.
# --------------------------------------------------------------------------


def write_adapters(cfg: Any, loras: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Writes each adapter with the runtime's writer (litert-torch convention, float32)
    and ``uppercase`` once more in the LiteRT-LM convention (float16)."""
    from runtime.adapters.lora_util import Convention
    from runtime.adapters.lora_writer import LoraWeights, write_lora_file

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
        for s, adapter in {"base": None, **{f"+{t}": adapter_paths[t] for t in ADAPTER_TASKS}}.items():
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


def cached_stage(cache_dir: Path | None, stage: str, tc: TrainConfig, train: Any) -> Any:
    """``train()``'s result for ``stage``, from ``cache_dir`` when an identical
    configuration already trained it (written through a temporary name)."""
    import torch

    if cache_dir is None:
        return train()
    path = cache_dir / f"{stage}-{tc.stage_key(stage)}.pt"
    if path.exists():
        print(f"{stage}: loaded from {path}", flush=True)
        return torch.load(path)
    result = train()
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(result, tmp)
    tmp.replace(path)
    return result


def run(
    out_dir: Path, tc: TrainConfig, runtime_eval: bool, cache_dir: Path | None, try_int8: bool
) -> dict[str, Any]:
    import torch

    t0 = time.perf_counter()
    litert_torch_fixes.apply()
    torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)
    cfg = model_config()

    words = load_word_list()
    pools = WordPools.build(words, tc)
    kinds = list(MEASURING_SETS)
    sets = {k: measuring_lines(k, pools, tc, tc.num_eval, tc.seed + 10 + i) for i, k in enumerate(kinds)}
    dev = {k: measuring_lines(k, pools, tc, tc.num_dev, tc.seed + 20 + i) for i, k in enumerate(kinds)}
    excluded_lines = set(DEMO_PROMPTS).union(*sets.values(), *dev.values())
    print(f"{len(words)} words in the list: {pools.train_size()} for training, "
          f"{len(pools.unseen_everyday)} everyday + {len(pools.unseen_sampled)} sampled held out", flush=True)

    from litert_torch.generative.utilities import model_builder

    model = model_builder.DecoderOnlyModel(btm.litert_model_config(cfg), mask_cache_size=cfg.kv_cache_max_len)
    init_weights(model, cfg, tc.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params} parameters", flush=True)

    def train_base_stage() -> dict[str, Any]:
        print(f"training the base model ({tc.base_steps} steps)", flush=True)
        data = BaseData(pools, excluded_lines, tc)
        info = train_base(model, cfg, tc, data, dev)
        return {"state": model.state_dict(), "info": info}

    base = cached_stage(cache_dir, "base", tc, train_base_stage)
    model.load_state_dict(base["state"])
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    base_info = base["info"]

    loras: dict[str, Any] = {}
    lora_info: dict[str, Any] = {}
    for k, task in enumerate(ADAPTER_TASKS):
        def train_adapter_stage(task: str = task, k: int = k) -> dict[str, Any]:
            print(f"training the {task} adapter ({dict(tc.lora_steps)[task]} steps)", flush=True)
            lines = TrainingLines(pools, excluded_lines, tc, tc.seed + 200 + k)
            lora, info = train_lora(model, cfg, tc, task, lines, dev, tc.seed + 100 + k)
            return {"lora": lora, "info": info}

        trained = cached_stage(cache_dir, task, tc, train_adapter_stage)
        loras[task], lora_info[task] = trained["lora"], trained["info"]

    parity = {"base": check_forward_parity(model, cfg, None)}
    parity.update({t: check_forward_parity(model, cfg, loras[t]) for t in ADAPTER_TASKS})
    print(f"torch forward vs litert-torch forward, max |diff|: {parity}", flush=True)

    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = out_dir / MODEL_FILE
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        export_s = btm.export_model(model, cfg, model_path, transposed_kv=False, output_logits_on_prefill=False)
    print(f"exported {model_path} in {export_s:.1f} s", flush=True)
    adapter_paths = write_adapters(cfg, loras, out_dir)

    sessions = {"base": None, **{f"+{t}": adapter_paths[t] for t in ADAPTER_TASKS},
                "+uppercase_litertlm": adapter_paths["uppercase_litertlm"]}
    all_lines = [line for k in kinds for line in sets[k]]
    runtime_outputs: dict[str, dict[str, list[str]]] = {k: {} for k in kinds}
    demo_outputs: dict[str, dict[str, str]] = {}
    runtime_matrix: dict[str, dict[str, dict[str, float]]] = {}
    agreement: dict[str, dict[str, float]] = {}
    eval_s = 0.0
    if runtime_eval:
        t_rt = time.perf_counter()
        for s, adapter in sessions.items():
            outs, secs = runtime_generate(model_path, adapter, all_lines + list(DEMO_PROMPTS), tc.max_new_tokens)
            for i, k in enumerate(kinds):
                runtime_outputs[k][s] = outs[i * tc.num_eval : (i + 1) * tc.num_eval]
            demo_outputs[s] = dict(zip(DEMO_PROMPTS, outs[len(all_lines):]))
            print(f"  runtime {s}: {len(outs)} prompts in {secs:.1f} s", flush=True)
        eval_s = time.perf_counter() - t_rt
        for k in kinds:
            runtime_matrix[k] = accuracy_matrix(runtime_outputs[k], sets[k])
            print(format_matrix(f"runtime, {MEASURING_SETS[k]} ({tc.num_eval} lines)", runtime_matrix[k]), flush=True)
        # The torch model on the first lines of each set: the export changes no answer.
        torch_sessions = {"base": None, **{f"+{t}": loras[t] for t in ADAPTER_TASKS}}
        for k in kinds:
            lines = sets[k][: tc.num_dev]
            agreement[k] = {}
            for s in sessions:
                mine = torch_generate(model, cfg, lines, torch_sessions[s.replace("_litertlm", "")], tc.max_new_tokens)
                agreement[k][s] = sum(a == b for a, b in zip(runtime_outputs[k][s], mine)) / len(lines)
        print(f"runtime output == torch output (first {tc.num_dev} lines of each set): {agreement}", flush=True)
        print("demo prompts through the runtime:", flush=True)
        for p in DEMO_PROMPTS:
            print(f"  {p!r}: " + ", ".join(f"{s} -> {demo_outputs[s][p]!r}" for s in demo_outputs), flush=True)

    if try_int8 and runtime_eval:
        flat = {s: [o for k in kinds for o in runtime_outputs[k][s]] for s in sessions if s != "+uppercase_litertlm"}
        try_dynamic_int8(model, cfg, adapter_paths, all_lines, flat, tc.max_new_tokens)

    files = sorted([model_path, *adapter_paths.values()])
    examples = task_examples(sets, runtime_outputs) if runtime_eval else []
    demo = {
        "generator": "tools/train_demo.py",
        "about": "A byte-level toy: one frozen base model that echoes a line of lowercase text, and one "
                 "LoRA adapter per character-level skill. Feed every session the same prompt bytes; the "
                 "adapter alone selects the behaviour.",
        "model": {"file": MODEL_FILE, "parameters": n_params, "config": model_config_json(cfg)},
        "tokenizer": "bytes: prompt_ids = list(text.encode('utf-8')); output = bytes(tokens).decode()",
        "prompt_format": "the input line followed by a newline (byte 10); the same for every "
                         "session, no task tag; generation stops at the next newline",
        "inputs": f"lowercase letters a-z in 1-{tc.max_words} words separated by single spaces, at most "
                  f"{tc.max_line_chars} characters (what the model was trained on)",
        "stop_tokens": [NEWLINE],
        "max_new_tokens": tc.max_new_tokens,
        "demo_prompts": [p + "\n" for p in DEMO_PROMPTS],
        "base_behaviour": "echoes the line",
        "examples_are": "held-out lines (unseen words, random strings), the first of each length that "
                        "every adapter answered correctly through the runtime",
        "tasks": [
            {
                "name": t,
                "description": TASK_DESCRIPTIONS[t],
                "adapter": f"{ADAPTER_DIR}/{t}.tflite",
                "examples": [{"input": p + "\n", "output": task_answer(t, p) + "\n"} for p in examples],
            }
            for t in ADAPTER_TASKS
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
            "metric": "greedy exact match of the generated line (through the first newline), through "
                      "runtime.Engine on the exported files; rows: sessions, columns: tasks",
            "sets": {k: {"description": MEASURING_SETS[k], "lines": tc.num_eval, "first_lines": sets[k][:5]}
                     for k in kinds},
            "runtime": runtime_matrix,
            "runtime_equals_torch_output": {"lines_per_set": tc.num_dev, **agreement},
            "runtime_misses": {
                k: {s: misses(runtime_outputs[k][s], sets[k], "echo" if s == "base" else s[1:].replace("_litertlm", ""))
                    for s in runtime_outputs[k]}
                for k in kinds
            },
        },
        "demo_outputs_runtime": demo_outputs,
        "training": {
            "seed": tc.seed,
            "seeds": {"weights_init": tc.seed, "base_lines": tc.seed + 2, "base_rows": tc.seed + 3,
                      "held_out_words": tc.seed + 4,
                      "measuring_sets": {k: tc.seed + 10 + i for i, k in enumerate(kinds)},
                      "dev_sets": {k: tc.seed + 20 + i for i, k in enumerate(kinds)},
                      "adapters": {t: tc.seed + 100 + k for k, t in enumerate(ADAPTER_TASKS)},
                      "adapter_lines": {t: tc.seed + 200 + k for k, t in enumerate(ADAPTER_TASKS)}},
            "config": {k: v for k, v in dataclasses.asdict(tc).items() if k != "threads"},
            "word_list": {"package": f"{WORD_LIST_PACKAGE}=={btm.package_version(WORD_LIST_PACKAGE)}",
                          "list": WORD_LIST_SOURCE, "words": len(words), "training_words": pools.train_size(),
                          "held_out_everyday": len(pools.unseen_everyday),
                          "held_out_sampled": len(pools.unseen_sampled),
                          "held_out_everyday_words": pools.unseen_everyday},
            "base": base_info,
            "adapters": lora_info,
            "runtime_eval_seconds": round(eval_s, 1),
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
    tmp = out_dir / (DEMO_JSON + ".tmp")
    tmp.write_text(json.dumps(demo, indent=2) + "\n")
    tmp.replace(out_dir / DEMO_JSON)
    timings = {"base_s": base_info["seconds"], **{f"{t}_s": lora_info[t]["seconds"] for t in ADAPTER_TASKS},
               "export_s": round(export_s, 1), "total_s": round(time.perf_counter() - t0, 1)}
    print(f"timings: {timings}", flush=True)
    for q in files + [out_dir / DEMO_JSON]:
        print(f"  {q.relative_to(out_dir)}: {q.stat().st_size} bytes sha256={sha256(q)[:16]}")
    return demo


def task_examples(sets: dict[str, list[str]], outputs: dict[str, dict[str, list[str]]]) -> list[str]:
    """Lines of 2 and 3 unseen words and of 2 random strings that every adapter answered
    correctly through the runtime (the first such line of each)."""
    def right(kind: str, i: int) -> bool:
        line = sets[kind][i]
        return all(outputs[kind][f"+{t}"][i] == task_answer(t, line) + "\n" for t in ADAPTER_TASKS)

    picked = []
    for kind, n in (("unseen_words", 2), ("unseen_words", 3), ("random_strings", 2)):
        picked += [sets[kind][i] for i in range(len(sets[kind]))
                   if len(sets[kind][i].split()) == n and right(kind, i)][:1]
    return picked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--skip-runtime-eval", action="store_true",
                        help="do not measure through runtime.Engine (demo.json then has no accuracy tables)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="keep each stage's trained weights here (keyed by its configuration) and "
                             "reuse them: a re-run retrains only the stages whose settings changed")
    parser.add_argument("--try-dynamic-int8", action="store_true",
                        help="also export a dynamic_int8 copy to a temporary directory and print "
                             "its size and runtime accuracy (writes nothing)")
    parser.add_argument("--threads", type=int, default=TrainConfig.threads,
                        help="torch threads for training (on a shared machine, 1 leaves a core to others)")
    args = parser.parse_args(argv)
    run(args.out_dir, TrainConfig(threads=args.threads), not args.skip_runtime_eval, args.cache_dir, args.try_dynamic_int8)
    return 0


if __name__ == "__main__":
    sys.exit(main())
