"""What a litert-torch LLM export offers, discovered from its signatures alone.

Signatures are named by the contract of :mod:`runtime.util.signature_names` (prefill of a
length, decode, batched decode, attention windows, LoRA rank slots). Inputs are
``tokens``, ``input_pos``, one ``kv_cache_{k,v}_{layer}`` per layer and, on LoRA
signatures, the LoRA inputs; a batched signature's ``tokens`` are ``[B, 1]``,
``input_pos`` ``[B]``, and each row's KV cache and LoRA inputs carry the row's suffix.
Outputs are the updated KV caches and ``logits`` (always on decode, on prefill only
when exported with ``output_logits_on_prefill``). A window's caches hold W positions
(``..._attend{W}``): the first W of the session's context, in the layout of the whole cache.

This module turns the details the interpreter reports into a :class:`ModelSpec`,
checking everything the executor relies on, so that a model this runtime cannot drive
is refused at open time with a message naming the signature and the tensor.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from runtime.errors import InvalidArgumentError, NotFoundError, UnimplementedError
from runtime.util.signature_names import (
    ALL_LINEAR, ATTENTION, DORA, SCORE, VERIFY, LoraSlot, SignatureName, cheapest_slot, parse_row_tensor_name,
)
from runtime.adapters.lora_util import DORA_SIDE, MLP_PROJECTIONS, is_lora_input_name, parse_lora_input_name, rank_axis
from runtime.util.kv_layout import KV_LAYOUT_DEFAULT, KV_LAYOUT_GROUPED, KV_LAYOUT_TRANSPOSED
from runtime.util.tensor_spec import TensorSpec

TOKENS = "tokens"
INPUT_POS = "input_pos"
LOGITS = "logits"
HIDDEN = "hidden"  # a verify signature's final hidden states [1, L, hidden] (the lm_head's input)
_KV_NAME = re.compile(r"kv_cache_(?P<kind>[kv])_(?P<layer>0|[1-9][0-9]*)")


# What the interpreter reports for one signature: input and output details by name.
SignatureDetails = tuple[Mapping[str, Mapping[str, Any]], Mapping[str, Mapping[str, Any]]]

PLAIN_GROUP = "plain"  # decode without LoRA inputs and its shortest prefill, each window too


def signature_group(kind: str, rows: int, lora_slot: LoraSlot | None) -> str:
    """The group a signature compiles in (signatures a session needs together): ``plain``
    (prefills and decode, their attention windows); per LoRA slot the same (``lora_r16``,
    ``lora_all_r8``); ``verify`` and ``score`` per slot (``verify``, ``verify_lora_r16``);
    a batched decode of B rows per slot (``batch8``, ``batch8_lora_r16``), windows with it."""
    slot = lora_slot.suffix[1:] if lora_slot is not None else ""
    base = f"batch{rows}" if rows > 1 else kind if kind in (VERIFY, SCORE) else ""
    if not base:
        return slot or PLAIN_GROUP
    return f"{base}_{slot}" if slot else base


def compile_groups(signatures: Mapping[str, SignatureSpec | SignatureName]) -> dict[str, tuple[str, ...]]:
    """The keys of ``signatures`` by the group they compile in, the plain group first: a
    partition. A group is :func:`signature_group`'s, but prefills longer than the shortest
    of their slot compile apart, a group per length with its windows (``plain_prefill512``,
    ``lora_r16_prefill128``): a short prompt's first token waits for the compile of what it
    runs only (SmolLM2's default export: 3 of its 7 signatures, ~90 of ~200 ms on an AMD
    EPYC), a long prompt compiles its length once."""
    shortest: dict[LoraSlot | None, int] = {}
    for spec in signatures.values():
        if spec.kind == "prefill" and spec.seq_len is not None:
            shortest[spec.lora_slot] = min(spec.seq_len, shortest.get(spec.lora_slot, spec.seq_len))
    # By signature_group's group, then by prefill length (0: the group itself).
    split: dict[str, dict[int, list[str]]] = {PLAIN_GROUP: {0: []}}
    for key, spec in signatures.items():
        longer = spec.kind == "prefill" and spec.seq_len is not None and spec.seq_len > shortest[spec.lora_slot]
        split.setdefault(signature_group(spec.kind, spec.rows, spec.lora_slot), {}).setdefault(
            spec.seq_len if longer else 0, []).append(key)
    return {f"{group}_prefill{length}" if length else group: tuple(keys)
            for group, by_length in split.items() for length, keys in sorted(by_length.items())}


@dataclass(frozen=True)
class SignatureSpec:
    """One runnable signature: prefill of a fixed length or decode, plain or with LoRA;
    a batched decode runs ``rows`` sessions at once."""

    key: str
    kind: str  # "prefill", "decode", "verify" or "score"
    seq_len: int
    lora_slot: LoraSlot | None
    inputs: Mapping[str, TensorSpec]
    outputs: Mapping[str, TensorSpec]
    rows: int = 1  # sessions per run: B for decode_batch{B}
    window: int | None = None  # attends over the cache's first `window` positions (None: all)

    def row_input(self, name: str) -> tuple[int, str] | None:
        """For a KV cache tensor of a batched signature, ``(row, the single-session name)``;
        ``None`` for ``tokens``, ``input_pos`` and the stacked LoRA inputs (or any tensor
        of an unbatched signature)."""
        if self.rows == 1 or name in (TOKENS, INPUT_POS) or is_lora_input_name(name):
            return None
        parsed = parse_row_tensor_name(name)
        return (parsed[1], parsed[0]) if parsed else None

    @property
    def has_logits(self) -> bool:
        """Whether running it returns logits."""
        return LOGITS in self.outputs

    @cached_property
    def lora_inputs(self) -> dict[str, TensorSpec]:
        """The signature's LoRA inputs as one row takes them, by name (a batched
        signature takes each stacked: ``[rows, ...]`` of this shape); worked out once, as
        every LoRA buffer an adapter allocates looks its name up here."""
        return {n: _shared_spec(n, s.shape[1:], s.dtype) if self.rows > 1 else s
                for n, s in self.inputs.items() if is_lora_input_name(n)}


@dataclass(frozen=True)
class ModelSpec:
    """Everything the executor needs to know about a model, read from the model itself."""

    signatures: Mapping[str, SignatureSpec]
    kv_inputs: tuple[TensorSpec, ...]
    kv_layout: str
    kv_length: int
    vocab_size: int
    num_layers: int

    @cached_property
    def groups(self) -> dict[str, tuple[str, ...]]:
        """The signature keys by the group they compile in (:func:`compile_groups`), the
        plain group first. The executor compiles a group when a session first needs one of
        its signatures; callers ask for signatures."""
        return compile_groups(self.signatures)

    @cached_property
    def _group_by_key(self) -> dict[str, str]:
        return {key: group for group, keys in self.groups.items() for key in keys}

    def group_of(self, signature: SignatureSpec) -> str:
        """The group ``signature`` compiles in (:attr:`groups`)."""
        return self._group_by_key[signature.key]

    def session_groups(self, lora_slot: LoraSlot | None) -> tuple[str, ...]:
        """The groups one session in ``lora_slot`` runs its prefills and decode steps in:
        its decode's (with the shortest prefill) first, then each longer prefill's."""
        first = self.group_of(self.decode(lora_slot))
        prefills = {self.group_of(spec) for spec in self.signatures.values()
                    if spec.kind == "prefill" and spec.lora_slot == lora_slot}
        return (first, *(group for group in self.groups if group in prefills and group != first))

    @property
    def prefill_lengths(self) -> tuple[int, ...]:
        """The prefill lengths the model was exported with, ascending."""
        return tuple(sorted({s.seq_len for s in self.signatures.values() if s.kind == "prefill"}))

    @property
    def slots(self) -> tuple[LoraSlot, ...]:
        """The LoRA slots, cheapest first (empty when the model takes no LoRA)."""
        found = {s.lora_slot for s in self.signatures.values() if s.lora_slot}
        return tuple(sorted(found, key=lambda slot: slot.cost_order))

    @property
    def prefill_has_logits(self) -> bool:
        """Whether prefill signatures return logits (else the last token is decoded)."""
        return all(s.has_logits for s in self.signatures.values() if s.kind == "prefill")

    def score_lengths(self, lora_slot: LoraSlot | None) -> tuple[int, ...]:
        """The lengths of the ``score_{L}`` signatures for a rank slot (``None``: without
        LoRA inputs), ascending; empty when the model was exported without them."""
        return tuple(sorted(s.seq_len for s in self.signatures.values() if s.kind == SCORE and s.lora_slot == lora_slot))

    def score(self, length: int, lora_slot: LoraSlot | None = None) -> SignatureSpec:
        """The ``score_{length}`` signature for a rank slot."""
        return self._find(SCORE, length, lora_slot)

    @property
    def can_score(self) -> bool:
        """Whether a prompt's logits at every position come from one pass per chunk: the
        model has ``score_{L}`` signatures (``runtime export --score-lengths``) or prefill
        signatures that return logits (``--prefill-logits``)."""
        return bool(self.score_lengths(None)) or self.prefill_has_logits

    @property
    def head_dim(self) -> int:
        """Size of one attention head: the last dimension of K in both layouts."""
        return self.kv_inputs[0].shape[3]

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes one session's KV cache takes."""
        return sum(spec.nbytes for spec in self.kv_inputs)

    def cache_length(self, signature: SignatureSpec) -> int:
        """The positions each KV cache input of ``signature`` holds: its window, else all."""
        return signature.window or self.kv_length

    def kv_position_axis(self, name: str) -> int:
        """The axis of KV input ``name`` that runs over cache positions (the layouts' shapes:
        :mod:`runtime.util.kv_layout`)."""
        return _position_axis(self.kv_layout, name)

    def decode(self, lora_slot: LoraSlot | None = None, window: int | None = None) -> SignatureSpec:
        """The decode signature for a LoRA slot (``None``: the plain one), attending over
        the first ``window`` positions (``None``: the whole cache)."""
        return self._find("decode", 1, lora_slot, window=window)

    def windows(self, lora_slot: LoraSlot | None, rows: int = 1, kind: str = "decode",
                seq_len: int = 1) -> tuple[int, ...]:
        """The attention windows of the signatures of ``kind`` and ``seq_len`` (by default
        the decode steps of ``rows`` rows) for a rank slot, ascending (empty: they attend
        over the whole cache only)."""
        return self._windows.get((kind, seq_len, lora_slot, rows), ())

    def window_for(self, position: int, lora_slot: LoraSlot | None, rows: int = 1, kind: str = "decode",
                   seq_len: int = 1) -> int | None:
        """The smallest attention window of :meth:`windows` that holds a step whose last
        token is at ``position`` (the step attends over positions ``0..position``), or
        ``None``: the whole cache."""
        return next((w for w in self.windows(lora_slot, rows, kind, seq_len) if w > position), None)

    @cached_property
    def _windows(self) -> dict[tuple[str, int, LoraSlot | None, int], tuple[int, ...]]:
        windows: dict[tuple[str, int, LoraSlot | None, int], list[int]] = {}
        for spec in self.signatures.values():
            if spec.window is not None:
                windows.setdefault((spec.kind, spec.seq_len, spec.lora_slot, spec.rows), []).append(spec.window)
        return {key: tuple(sorted(found)) for key, found in windows.items()}

    def batch_sizes(self, lora_slot: LoraSlot | None) -> tuple[int, ...]:
        """Rows of the batched decode signatures for a rank slot (``None``: without LoRA
        inputs), ascending; empty when there are none."""
        return self._batch_sizes.get(lora_slot, ())

    @cached_property
    def _batch_sizes(self) -> dict[LoraSlot | None, tuple[int, ...]]:
        sizes: dict[LoraSlot | None, list[int]] = {}
        for spec in self.signatures.values():
            if spec.rows > 1 and spec.window is None:
                sizes.setdefault(spec.lora_slot, []).append(spec.rows)
        return {slot: tuple(sorted(rows)) for slot, rows in sizes.items()}

    @cached_property
    def _by_shape(self) -> dict[tuple[str, int, LoraSlot | None, int, int | None], SignatureSpec]:
        return {(s.kind, s.seq_len, s.lora_slot, s.rows, s.window): s for s in self.signatures.values()}

    def decode_batch(self, rows: int, lora_slot: LoraSlot | None, window: int | None = None) -> SignatureSpec:
        """The batched decode signature of ``rows`` rows for a rank slot (and window)."""
        return self._find("decode", 1, lora_slot, rows, window)

    def prefill(self, seq_len: int, lora_slot: LoraSlot | None = None, window: int | None = None) -> SignatureSpec:
        """The prefill signature of length ``seq_len`` for a rank slot (attending over the
        first ``window`` positions; ``None``: the whole cache)."""
        return self._find("prefill", seq_len, lora_slot, window=window)

    def verify_lengths(self, lora_slot: LoraSlot | None) -> tuple[int, ...]:
        """The lengths of the ``verify{L}`` signatures for a rank slot (``None``: without
        LoRA inputs), ascending; empty when the model was exported without them."""
        return tuple(sorted(s.seq_len for s in self.signatures.values()
                            if s.kind == VERIFY and s.lora_slot == lora_slot and s.window is None))

    def verify(self, length: int, lora_slot: LoraSlot | None = None, window: int | None = None) -> SignatureSpec:
        """The ``verify{length}`` signature for a rank slot (attending over the first
        ``window`` positions; ``None``: the whole cache)."""
        return self._find(VERIFY, length, lora_slot, window=window)

    @property
    def hidden_size(self) -> int | None:
        """The width of the final hidden state the verify signatures return (what draft
        heads take); ``None`` when the model has no verify signatures."""
        return next((s.outputs[HIDDEN].shape[-1] for s in self.signatures.values() if s.kind == VERIFY), None)

    def slot_inputs(self, slot: LoraSlot) -> dict[str, TensorSpec]:
        """The LoRA inputs of ``slot`` (shared by its prefill and decode signatures)."""
        return self.decode(slot).lora_inputs

    @property
    def lora_slots(self) -> dict[LoraSlot, dict[str, TensorSpec]]:
        """Every LoRA slot with its inputs, cheapest first: what adapters are fitted against."""
        return {slot: self.slot_inputs(slot) for slot in self.slots}

    def slot_for(self, need: LoraSlot) -> LoraSlot | None:
        """The cheapest slot that holds ``need`` (a rank and the projections it touches),
        or ``None`` if none does."""
        return cheapest_slot(self.slots, need)

    def _find(self, kind: str, seq_len: int, lora_slot: LoraSlot | None, rows: int = 1,
              window: int | None = None) -> SignatureSpec:
        spec = self._by_shape.get((kind, seq_len, lora_slot, rows, window))
        if spec is not None:
            return spec
        slot = f" with LoRA slot {lora_slot}" if lora_slot else ""
        batch = f" for {rows} rows" if rows > 1 else ""
        attend = f" attending over {window} positions" if window else ""
        raise NotFoundError(f"the model has no {kind} signature of length {seq_len}{batch}{attend}{slot}")

    @classmethod
    def from_details(cls, details: Mapping[str, SignatureDetails], source: str,
                     kv_layout: str | None = None) -> ModelSpec:
        """Builds and checks a spec from ``{signature_key: (input_details, output_details)}``;
        ``kv_layout``: the layout the model names (:func:`runtime.util.kv_layout.named_kv_layout`),
        ``None`` to tell it by the caches' shapes (an export that names none)."""
        signatures = {key: _signature(key, ins, outs, source) for key, (ins, outs) in details.items()}
        decodes = [s for s in signatures.values()
                   if s.kind == "decode" and s.lora_slot is None and s.rows == 1 and s.window is None]
        if not decodes:
            raise InvalidArgumentError(
                f"{source}: no plain 'decode' signature among {sorted(signatures)}; "
                "expected a litert-torch LLM export"
            )
        decode = decodes[0]
        if LOGITS not in decode.outputs:
            raise InvalidArgumentError(f"{source}: signature 'decode' has no 'logits' output")
        kv_inputs = tuple(s for n, s in decode.inputs.items() if _KV_NAME.fullmatch(n))
        if not kv_inputs:
            raise InvalidArgumentError(f"{source}: signature 'decode' has no kv_cache_* inputs")
        kv = {s.name: s for s in kv_inputs}
        layout, kv_length = _kv_layout(kv, max((s.seq_len for s in signatures.values()), default=1),
                                       f"{source}: signature {decode.key!r}", kv_layout)
        for spec in signatures.values():
            _check_window_span(spec, kv_length, source)
            cache = _window_caches(kv, layout, spec.window)
            if spec.rows == 1:
                _check_same_kv(spec, cache, kv, source)
            else:
                _check_batch(spec, signatures, cache, source)
        for spec in signatures.values():
            _check_window(spec, signatures, source)
        vocab = decode.outputs[LOGITS].shape[-1] if decode.outputs[LOGITS].shape else 0
        for spec in signatures.values():
            logits = spec.outputs.get(LOGITS)
            if logits is not None and (logits.shape != (spec.rows, spec.seq_len, vocab) or vocab < 1
                                       or logits.dtype != np.float32):
                raise InvalidArgumentError(f"{source}: signature {spec.key!r} output {logits.describe()}: expected "
                                           f"[{spec.rows}, {spec.seq_len}, {vocab}] float32, logits of the "
                                           f"vocabulary 'decode' returns ({vocab}) for each of its tokens")
            if spec.kind == VERIFY:
                _check_verify(spec, signatures, vocab, source)
            elif spec.kind == SCORE:
                _check_score(spec, signatures, vocab, source)
        for spec in signatures.values():
            if spec.kind == "prefill" and spec.lora_slot and spec.window is None:  # windows: by _check_window
                _check_same_lora_as_decode(spec, signatures, source)
        return cls(
            signatures=signatures,
            kv_inputs=kv_inputs,
            kv_layout=layout,
            kv_length=kv_length,
            vocab_size=vocab,
            num_layers=len({_KV_NAME.fullmatch(n)["layer"] for n in kv}),
        )


def _spec(name: str, detail: Mapping[str, Any]) -> TensorSpec:
    return _shared_spec(name, tuple(map(int, detail["shape"])), np.dtype(detail["dtype"]))


@functools.lru_cache(maxsize=1 << 15)  # signatures share most tensors: one object each, compared by identity first
def _shared_spec(name: str, shape: tuple[int, ...], dtype: np.dtype) -> TensorSpec:
    return TensorSpec(name, shape, dtype)


def _signature(
    key: str, inputs: Mapping[str, Mapping[str, Any]], outputs: Mapping[str, Mapping[str, Any]], source: str
) -> SignatureSpec:
    named = SignatureName.parse(key)
    if named is None:
        raise UnimplementedError(
            f"{source}: signature {key!r} is neither prefill nor decode; expected a litert-torch LLM export"
        )
    ins = {name: _spec(name, d) for name, d in inputs.items()}
    outs = {name: _spec(name, d) for name, d in outputs.items()}
    for required in (TOKENS, INPUT_POS):
        if required not in ins:
            raise InvalidArgumentError(f"{source}: signature {key!r} has no {required!r} input")
    if named.rows > 1:
        return _batch_signature(key, named, ins, outs, source)
    unknown = [n for n in ins if n not in (TOKENS, INPUT_POS) and not _KV_NAME.fullmatch(n) and not is_lora_input_name(n)]
    if unknown:
        raise UnimplementedError(
            f"{source}: signature {key!r} has inputs this runtime cannot feed: {unknown}"
        )
    tokens = ins[TOKENS]
    if len(tokens.shape) != 2 or tokens.shape[0] != 1 or tokens.dtype != np.int32:
        raise InvalidArgumentError(
            f"{source}: signature {key!r} input 'tokens' is {tokens.describe()}, expected [1, seq] int32"
        )
    seq_len = tokens.shape[1]
    if named.kind in (VERIFY, SCORE) and named.seq_len != seq_len:
        raise InvalidArgumentError(f"{source}: signature {key!r} input 'tokens' is {tokens.describe()}, expected "
                                   f"[1, {named.seq_len}] int32")
    positions = ins[INPUT_POS]
    if positions.shape != (seq_len,) or positions.dtype != np.int32:
        raise InvalidArgumentError(f"{source}: signature {key!r} input {INPUT_POS!r} is {_shape(positions)}, expected "
                                   f"[{seq_len}] int32: a position per token")
    unbound = [n for n in outs if n not in (LOGITS, HIDDEN) and not _KV_NAME.fullmatch(n)]
    if unbound:
        raise UnimplementedError(f"{source}: signature {key!r} has outputs this runtime cannot bind: {unbound} "
                                 "(expected the kv_cache_* it takes, 'logits' and, on verify, 'hidden')")
    hidden = outs.get(HIDDEN)
    if hidden is not None and (len(hidden.shape) != 3 or hidden.shape[:2] != (1, seq_len)
                               or hidden.dtype != np.float32):
        raise InvalidArgumentError(f"{source}: signature {key!r} output {HIDDEN!r} is {_shape(hidden)}, expected "
                                   f"[1, {seq_len}, width] float32: a final hidden state per token")
    lora_slot = _lora_slot(key, ins, source)
    if named.lora_slot is not None and named.lora_slot != lora_slot:
        raise InvalidArgumentError(
            f"{source}: signature {key!r} is named for LoRA slot {named.lora_slot} but its LoRA inputs are "
            f"{lora_slot or 'none'}")
    return SignatureSpec(key, named.kind, seq_len, lora_slot, ins, outs, window=named.window)


def _batch_signature(key: str, named: SignatureName, ins: Mapping[str, TensorSpec], outs: Mapping[str, TensorSpec],
                     source: str) -> SignatureSpec:
    """A ``decode_batch{rows}[_attend{W}][_lora_r{R}]`` signature: tokens ``[rows, 1]``, positions
    ``[rows]``, logits ``[rows, 1, vocab]``, each row's inputs checked by :func:`_check_batch`."""
    rows = named.rows
    expected = {TOKENS: (rows, 1), INPUT_POS: (rows,)}
    for name, shape in expected.items():
        if ins[name].shape != shape or ins[name].dtype != np.int32:
            raise InvalidArgumentError(
                f"{source}: signature {key!r} input {name!r} is {_shape(ins[name])}, expected {list(shape)} int32")
    logits = outs.get(LOGITS)
    if logits is None or len(logits.shape) != 3 or logits.shape[:2] != (rows, 1):
        got = logits.describe() if logits else "nothing"
        raise InvalidArgumentError(f"{source}: signature {key!r} output 'logits' is {got}, expected [{rows}, 1, vocab]")
    _rows(key, ins, rows, source)  # every other input is a row's KV cache
    stacked = {name: spec for name, spec in ins.items() if is_lora_input_name(name)}
    for name, spec in stacked.items():
        if spec.shape[:1] != (rows,) or spec.dtype not in (np.float32, np.float16):
            raise InvalidArgumentError(f"{source}: signature {key!r} input {name!r} is {_shape(spec)}, expected "
                                       f"[{rows}, ...] float32 or float16: the rows' LoRA weights stacked")
    lora_slot = _lora_slot(key, {name: TensorSpec(name, spec.shape[1:], spec.dtype)
                                 for name, spec in stacked.items()}, source)
    if named.lora_slot != lora_slot:
        raise InvalidArgumentError(
            f"{source}: signature {key!r} is named for LoRA slot {named.lora_slot or 'none'} but its LoRA inputs "
            f"are {lora_slot or 'none'}")
    return SignatureSpec(key, "decode", 1, lora_slot, ins, outs, rows, named.window)


def _rows(key: str, tensors: Mapping[str, TensorSpec], rows: int, source: str) -> list[dict[str, TensorSpec]]:
    """A batched signature's KV cache tensors, per row, under their single-session names."""
    per_row: list[dict[str, TensorSpec]] = [{} for _ in range(rows)]
    for name, spec in tensors.items():
        if name in (TOKENS, INPUT_POS, LOGITS) or is_lora_input_name(name):
            continue
        base, row = parse_row_tensor_name(name) or ("", rows)
        if row >= rows or not _KV_NAME.fullmatch(base):
            hint = (" (LoRA inputs per row: an export older than stacked batch LoRA inputs; export the model again)"
                    if is_lora_input_name(base) else "")
            raise UnimplementedError(
                f"{source}: signature {key!r} has a tensor this runtime cannot feed: {name!r} (expected KV cache names "
                f"ending in _0 ... _{rows - 1} and LoRA inputs stacked over the rows){hint}")
        per_row[row][base] = TensorSpec(base, spec.shape, spec.dtype)
    return per_row


def _check_batch(spec: SignatureSpec, signatures: Mapping[str, SignatureSpec], kv: Mapping[str, TensorSpec],
                 source: str) -> None:
    """Every row of a batched signature takes and returns exactly what ``decode`` (or
    ``decode_lora_r{R}``) does: the same KV caches, and the same LoRA inputs as its row of
    the stacked ones, the same shapes."""
    single = next((s for s in signatures.values() if (s.kind, s.seq_len, s.lora_slot, s.rows, s.window)
                   == ("decode", 1, spec.lora_slot, 1, None)), None)
    if single is None:
        raise InvalidArgumentError(
            f"{source}: signature {spec.key!r} has no single-session counterpart "
            f"{SignatureName('decode', lora_slot=spec.lora_slot)}")
    differ = _differing(spec.lora_inputs, single.lora_inputs)
    if differ:
        raise InvalidArgumentError(
            f"{source}: signature {spec.key!r} LoRA inputs differ from {single.key!r}'s stacked over "
            f"{spec.rows} rows, e.g. {differ[:3]}")
    inputs, outputs = _rows(spec.key, spec.inputs, spec.rows, source), _rows(spec.key, spec.outputs, spec.rows, source)
    for row in range(spec.rows):
        for side, tensors, wanted in (("input", inputs[row], kv), ("output", outputs[row], kv)):
            for name, want in wanted.items():
                got = tensors.get(name)
                if got is None or got.shape != want.shape or got.dtype != want.dtype:
                    raise InvalidArgumentError(
                        f"{source}: signature {spec.key!r} {side} {name}_{row} is "
                        f"{_shape(got) if got else 'missing'}, expected {_shape(want)} as in {single.key!r}")
            extra = sorted(set(tensors) - set(wanted))
            if extra:
                raise InvalidArgumentError(f"{source}: signature {spec.key!r} {side}s of row {row} include "
                                           f"{extra[:3]}, which {single.key!r} does not have")


def _check_verify(spec: SignatureSpec, signatures: Mapping[str, SignatureSpec], vocab: int, source: str) -> None:
    """A ``verify{L}`` signature returns ``logits`` ``[1, L, vocab]`` and ``hidden``
    ``[1, L, width]`` float32, and takes the LoRA inputs of its slot's decode signature."""
    length = spec.seq_len
    logits = spec.outputs.get(LOGITS)
    if logits is None or logits.shape != (1, length, vocab) or logits.dtype != np.float32:
        raise InvalidArgumentError(f"{source}: signature {spec.key!r} output 'logits' is "
                                   f"{_shape(logits) if logits else 'missing'}, expected [1, {length}, {vocab}] float32")
    if HIDDEN not in spec.outputs:  # its shape: checked with every signature's (_signature)
        raise InvalidArgumentError(f"{source}: signature {spec.key!r} output {HIDDEN!r} is missing, expected "
                                   f"[1, {length}, width] float32")
    _check_same_lora_as_decode(spec, signatures, source)


def _check_score(spec: SignatureSpec, signatures: Mapping[str, SignatureSpec], vocab: int, source: str) -> None:
    """A ``score_{L}`` signature returns ``logits`` ``[1, L, vocab]`` float32, attends over
    the whole cache, and takes the LoRA inputs of its slot's decode signature."""
    length = spec.seq_len
    logits = spec.outputs.get(LOGITS)
    if logits is None or logits.shape != (1, length, vocab) or logits.dtype != np.float32:
        raise InvalidArgumentError(f"{source}: signature {spec.key!r} output 'logits' is "
                                   f"{_shape(logits) if logits else 'missing'}, expected [1, {length}, {vocab}] float32")
    if spec.window is not None:
        raise InvalidArgumentError(f"{source}: signature {spec.key!r}: a score signature attends over the whole cache")
    _check_same_lora_as_decode(spec, signatures, source)


def _check_same_lora_as_decode(spec: SignatureSpec, signatures: Mapping[str, SignatureSpec], source: str) -> None:
    """``spec`` (a prefill, verify or score signature) has its LoRA slot's decode signature
    beside it, taking the same LoRA inputs: an adapter's buffers, made for the decode
    signature, serve both."""
    decode = next((s for s in signatures.values() if (s.kind, s.seq_len, s.lora_slot, s.rows, s.window)
                   == ("decode", 1, spec.lora_slot, 1, None)), None)
    if decode is None:
        raise InvalidArgumentError(f"{source}: signature {spec.key!r} has no decode signature of its LoRA slot "
                                   f"beside it (expected {str(SignatureName('decode', lora_slot=spec.lora_slot))!r})")
    differ = _differing(spec.lora_inputs, decode.lora_inputs)
    if differ:
        raise InvalidArgumentError(f"{source}: signature {spec.key!r} LoRA inputs differ from {decode.key!r}'s, "
                                   f"e.g. {differ[:3]}")


def _differing(first: Mapping[str, TensorSpec], second: Mapping[str, TensorSpec]) -> list[str]:
    """The names of the tensors ``first`` and ``second`` do not hold alike (one of them lacks
    it, or its shape or dtype differs), sorted."""
    return sorted(name for name in first.keys() | second.keys() if first.get(name) != second.get(name))


def _check_window_span(spec: SignatureSpec, kv_length: int, source: str) -> None:
    """An attention window is shorter than the cache and holds the step's tokens."""
    if spec.window is not None and not spec.seq_len <= spec.window < kv_length:
        raise InvalidArgumentError(f"{source}: signature {spec.key!r} attends over {spec.window} positions, "
                                   f"expected {spec.seq_len} ... {kv_length - 1} (its {spec.seq_len} token(s) "
                                   f"and a KV cache of {kv_length})")


def _check_window(spec: SignatureSpec, signatures: Mapping[str, SignatureSpec], source: str) -> None:
    """The whole-cache signature of a window's kind, length, rows and slot is beside it
    (positions past the window), taking the same LoRA inputs."""
    if spec.window is None:
        return
    whole = next((s for s in signatures.values() if (s.kind, s.seq_len, s.lora_slot, s.rows, s.window)
                  == (spec.kind, spec.seq_len, spec.lora_slot, spec.rows, None)), None)
    if whole is None:
        raise InvalidArgumentError(f"{source}: signature {spec.key!r} has no whole-cache counterpart "
                                   f"of {spec.rows} row(s) for the same LoRA slot")
    differ = _differing(spec.lora_inputs, whole.lora_inputs) + sorted(set(spec.outputs) ^ set(whole.outputs))
    if differ:
        raise InvalidArgumentError(f"{source}: signature {spec.key!r} takes or returns other tensors than its "
                                   f"whole-cache counterpart {whole.key!r}, e.g. {differ[:3]}")


def _shape(spec: TensorSpec) -> str:
    return f"{list(spec.shape)} {spec.dtype}"


def _lora_slot(key: str, inputs: Mapping[str, TensorSpec], source: str) -> LoraSlot | None:
    """The slot a signature's LoRA inputs make: their rank, all-linear when the MLP's
    projections have inputs too, DoRA when they have output scales as well."""
    ranks, mlp, scales, fan_outs = set(), False, {}, {}
    for name, spec in inputs.items():
        if is_lora_input_name(name):
            parsed = parse_lora_input_name(name)
            if parsed.side == DORA_SIDE:
                scales[parsed.pair] = spec
                continue
            if len(spec.shape) != 2:
                raise InvalidArgumentError(f"{source}: signature {key!r} LoRA input {spec.describe()} is not 2-D")
            ranks.add(spec.shape[rank_axis(parsed.convention, parsed.side)])
            mlp = mlp or parsed.projection in MLP_PROJECTIONS
            if parsed.side == "b":
                fan_outs[parsed.pair] = spec.shape[1 - rank_axis(parsed.convention, "b")]
    if len(ranks) > 1:
        raise InvalidArgumentError(f"{source}: signature {key!r} mixes LoRA ranks {sorted(ranks)}")
    if scales:
        _check_dora_scales(key, scales, fan_outs, mlp, source)
    return LoraSlot(ranks.pop(), DORA if scales else ALL_LINEAR if mlp else ATTENTION) if ranks else None


def _check_dora_scales(key: str, scales: Mapping[tuple[int, str], TensorSpec], fan_outs: Mapping[tuple[int, str], int],
                       mlp: bool, source: str) -> None:
    """A DoRA slot's output scales: one ``[out]`` float32 per projection of an all-linear slot."""
    for pair, spec in scales.items():
        if pair not in fan_outs or spec.shape != (fan_outs[pair],) or spec.dtype != np.float32:
            expected = f"[{fan_outs[pair]}] float32" if pair in fan_outs else "no such input (no LoRA pair for it)"
            raise InvalidArgumentError(
                f"{source}: signature {key!r} DoRA scale input {spec.describe()}: expected {expected}")
    if not mlp or set(scales) != set(fan_outs):
        missing = sorted(set(fan_outs) - set(scales))[:3]
        raise InvalidArgumentError(
            f"{source}: signature {key!r} has DoRA scale inputs but not on every linear projection "
            f"(missing for {missing or 'the MLP'}): a DoRA slot is an all-linear slot with a scale per projection")


def _check_same_kv(spec: SignatureSpec, kv: Mapping[str, TensorSpec], whole: Mapping[str, TensorSpec],
                   source: str) -> None:
    """``spec`` takes and returns the KV caches ``kv`` (``whole``: the whole cache's, which
    a window's signature of an older export took)."""
    for name, expected in kv.items():
        for side, tensors in (("input", spec.inputs), ("output", spec.outputs)):
            actual = tensors.get(name)
            if actual is None or actual.shape != expected.shape or actual.dtype != expected.dtype:
                got = actual.describe() if actual else "nothing"
                hint = (" (an attention window's caches hold its positions only since 2026-12-03: this export "
                        "takes the whole cache; export the model again)"
                        if spec.window is not None and actual is not None and actual.shape == whole[name].shape
                        else "")
                raise InvalidArgumentError(
                    f"{source}: signature {spec.key!r} {side} {name!r} is {got}, expected {expected.describe()}{hint}"
                )


def _position_axis(layout: str, name: str) -> int:
    if layout == KV_LAYOUT_DEFAULT:
        return 1
    return 3 if layout == KV_LAYOUT_TRANSPOSED and _KV_NAME.fullmatch(name)["kind"] == "v" else 2


def _window_caches(kv: Mapping[str, TensorSpec], layout: str, window: int | None) -> Mapping[str, TensorSpec]:
    """The KV cache inputs of a signature attending over ``window`` positions: ``kv`` (the
    whole cache's) with ``window`` positions (``None``: ``kv`` itself)."""
    if window is None:
        return kv
    caches = {}
    for name, spec in kv.items():
        shape = list(spec.shape)
        shape[_position_axis(layout, name)] = window
        caches[name] = _shared_spec(name, tuple(shape), spec.dtype)
    return caches


def _kv_layout(kv: Mapping[str, TensorSpec], longest_input: int, where: str,
               named: str | None) -> tuple[str, int]:
    """The layout and length of the KV caches ``kv`` (by name) that ``where`` (the source
    and signature, for errors) takes: every one 4-D, layer 0's K and V among them; the
    layout ``named`` by the model (its K and V shaped so), else told by their shapes."""
    for name in ("kv_cache_k_0", "kv_cache_v_0"):
        if name not in kv:
            raise InvalidArgumentError(f"{where} has no {name!r} input (expected a K and a V cache per layer from 0)")
    for name, spec in kv.items():
        if len(spec.shape) != 4:
            raise InvalidArgumentError(f"{where} input {name!r} is {_shape(spec)}, expected 4-D: [1, positions, "
                                       "groups, head_dim], or [1, groups, positions, head_dim] (V: [1, groups, "
                                       "head_dim, positions])")
    k, v = kv["kv_cache_k_0"], kv["kv_cache_v_0"]
    if named is None:  # an export naming no layout: default or transposed, told by the shapes
        named = KV_LAYOUT_DEFAULT if k.shape == v.shape and k.shape[1] >= longest_input else KV_LAYOUT_TRANSPOSED
    positions = _position_axis(named, "kv_cache_k_0")
    v_shape = (*k.shape[:2], k.shape[3], k.shape[2]) if named == KV_LAYOUT_TRANSPOSED else k.shape
    if v.shape != v_shape or k.shape[positions] < longest_input:
        raise InvalidArgumentError(
            f"{where}: K {_shape(k)} and V {_shape(v)} are not the {named} KV layout's ({_LAYOUT_SHAPES[named]}) "
            f"of at least {longest_input} positions (the longest input)")
    return named, k.shape[positions]


_LAYOUT_SHAPES = {KV_LAYOUT_DEFAULT: "K and V [1, positions, groups, head_dim]",
                  KV_LAYOUT_TRANSPOSED: "K [1, groups, positions, head_dim], V [1, groups, head_dim, positions]",
                  KV_LAYOUT_GROUPED: "K and V [1, groups, positions, head_dim]"}
