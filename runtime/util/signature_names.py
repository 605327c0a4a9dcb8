"""The names of an exported model's signatures and of a batched signature's row tensors.

The one place that writes and reads the naming contract between the exporter and the
runtime (``runtime/export`` formats names with it, ``runtime/executor/model_spec.py``
parses them with it):

* ``prefill_{L}`` (or litert-torch's bare ``prefill``) and ``decode``: one session's
  prefill of L tokens, one session's decode step;
* ``decode_batch{B}``: B sessions' decode steps in one run;
* ``verify{L}``: L tokens of one session at L consecutive positions, returning the logits
  and the final hidden states (the lm_head's input) at all L: the step of speculative
  decoding that checks a draft (Turbo LoRA);
* ``score_{L}``: a prefill of L tokens that also returns the logits at all L positions:
  what a prompt's logprobs (``echo``) are read from, beside the prefills that return none;
* ``_attend{W}`` on a decode, a prefill or a verify: the step takes and attends over a
  cache of W positions only (a session's first W);
* ``_lora_r{R}``: the signature takes LoRA inputs of rank R for the attention projections
  q/k/v/o; ``_lora_all_r{R}``: for every linear projection, the MLP's gate/up/down too;
  ``_lora_dora_r{R}``: those and a DoRA output scale per projection (a :class:`LoraSlot` each).

In that order: ``decode_batch8_attend128_lora_r16``, ``prefill_32_attend128_lora_r8``,
``verify4_attend128_lora_r8``. A batched signature's KV cache tensors are the
single-session names with ``_{row}`` appended; its LoRA inputs keep the single-session
names, every row's stacked along a leading axis.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

_SIGNATURE = re.compile(
    r"(?P<kind>prefill|decode|score)(?:_(?P<len>[1-9][0-9]*))?(?:_batch(?P<rows>[1-9][0-9]*))?"
    r"(?:_attend(?P<window>[1-9][0-9]*))?(?:_lora(?:(?P<all>_all)|(?P<dora>_dora))?_r(?P<rank>[1-9][0-9]*))?"
)
ATTENTION = "attention"  # LoRA on q/k/v/o
ALL_LINEAR = "all-linear"  # LoRA on q/k/v/o and the MLP's gate/up/down
DORA = "dora"  # all-linear, and each projection's DoRA output scale (m / ||W + s B A|| - 1)
LORA_TARGETS = (ATTENTION, ALL_LINEAR, DORA)  # the cheaper first
_SUFFIXES = {ATTENTION: "_lora_r", ALL_LINEAR: "_lora_all_r", DORA: "_lora_dora_r"}


@dataclass(frozen=True)
class LoraSlot:
    """One set of LoRA inputs a signature takes: ``rank`` columns for every projection of
    ``targets`` (``"attention"``: q/k/v/o; ``"all-linear"``: those and gate/up/down;
    ``"dora"``: all-linear plus a DoRA output scale per projection, zeros making it plain).

    An adapter runs in any slot that :meth:`holds` its rank and projections (zero-padded:
    exact); the cheapest such slot is the first in :attr:`cost_order`.
    """

    rank: int
    targets: str = ATTENTION

    def holds(self, other: LoraSlot) -> bool:
        """Whether ``other``'s inputs fit into this slot's (zero-padded)."""
        return self.rank >= other.rank and LORA_TARGETS.index(self.targets) >= LORA_TARGETS.index(other.targets)

    @property
    def cost_order(self) -> tuple[int, int]:
        """Sorts slots cheapest first: attention-only, all-linear, DoRA, then by rank."""
        return LORA_TARGETS.index(self.targets), self.rank

    @property
    def suffix(self) -> str:
        """The slot's part of a signature name."""
        return f"{_SUFFIXES[self.targets]}{self.rank}"

    def __str__(self) -> str:
        return f"r{self.rank}" if self.targets == ATTENTION else f"{self.targets} r{self.rank}"


def cheapest_slot(slots: Iterable[LoraSlot], need: LoraSlot) -> LoraSlot | None:
    """The cheapest of ``slots`` that holds ``need``, or ``None`` if none does."""
    return min((slot for slot in slots if slot.holds(need)), key=lambda slot: slot.cost_order, default=None)
_VERIFY = re.compile(
    r"verify(?P<len>[1-9][0-9]*)(?:_attend(?P<window>[1-9][0-9]*))?(?:_lora(?P<all>_all)?_r(?P<rank>[1-9][0-9]*))?"
)
VERIFY = "verify"  # the kind of a verify{L} signature
SCORE = "score"  # the kind of a score_{L} signature: a prefill that returns the logits at all L positions
_ROW_SUFFIX = re.compile(r"(?P<name>.+)_(?P<row>0|[1-9][0-9]*)")


@dataclass(frozen=True)
class SignatureName:
    """What a signature's name says about it.

    ``kind``: ``"prefill"``, ``"decode"``, ``"verify"`` or ``"score"``. ``seq_len``: a prefill's or a
    verify's length (``None`` for
    a decode, or a bare ``prefill`` whose length only its inputs tell). ``rows``: sessions
    per run (B of ``decode_batch{B}``; 1 otherwise). ``window``: attends over the cache's
    first ``window`` positions (``None``: all of them). ``lora_slot``: the LoRA inputs it
    takes (``None``: none).
    """

    kind: str
    seq_len: int | None = None
    rows: int = 1
    window: int | None = None
    lora_slot: LoraSlot | None = None

    def __str__(self) -> str:
        length = f"_{self.seq_len}" if self.seq_len is not None else ""
        batch = f"_batch{self.rows}" if self.rows > 1 else ""
        attend = f"_attend{self.window}" if self.window is not None else ""
        slot = self.lora_slot.suffix if self.lora_slot is not None else ""
        if self.kind == VERIFY:
            return f"{VERIFY}{self.seq_len}{attend}{slot}"
        return f"{self.kind}{length}{batch}{attend}{slot}"

    @classmethod
    def parse(cls, name: str) -> SignatureName | None:
        """The parts of ``name``, or ``None`` if it is not spelled by this contract.
        Whether the parts make sense together (a window on a prefill) is for the
        model's checks to say, naming the signature."""
        match = _VERIFY.fullmatch(name)
        if match is not None:
            return cls(kind=VERIFY, seq_len=int(match["len"]), window=_int(match["window"]), lora_slot=_slot(match))
        match = _SIGNATURE.fullmatch(name)
        if match is None:
            return None
        return cls(
            kind=match["kind"],
            seq_len=_int(match["len"]),
            rows=_int(match["rows"]) or 1,
            window=_int(match["window"]),
            lora_slot=LoraSlot(int(match["rank"]), ALL_LINEAR if match["all"] else DORA if match["dora"] else ATTENTION)
            if match["rank"] else None,
        )


def row_tensor_name(name: str, row: int) -> str:
    """The name of row ``row``'s copy of the single-session tensor ``name`` in a batched signature."""
    return f"{name}_{row}"


def parse_row_tensor_name(name: str) -> tuple[str, int] | None:
    """``(single-session name, row)`` of a batched signature's tensor, or ``None`` if the
    name has no row suffix."""
    match = _ROW_SUFFIX.fullmatch(name)
    return (match["name"], int(match["row"])) if match else None


def _slot(match: re.Match[str]) -> LoraSlot | None:
    return LoraSlot(int(match["rank"]), ALL_LINEAR if match["all"] else ATTENTION) if match["rank"] else None


def _int(text: str | None) -> int | None:
    return int(text) if text else None
