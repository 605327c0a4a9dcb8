"""Which tensor names are LoRA inputs, what they mean, and how each convention lays them out.

Three spellings of the same thing are in use (the README's "Adapter formats" table):

==============  ==================================================  ===============
convention      name                                                a / b layout
==============  ==================================================  ===============
litert-torch    ``lora_atten_{q,k,v,o}_{a,b}_prime_weight_{L}``     [in, r] / [r, out]
                ``lora_ff_{gate,up,down}_{a,b}_prime_weight_{L}``
litert-lm       ``{query,key,value,post}_w_prime_{left,right}_{L}``  [r, in] / [r, out]
                ``{gate,up,down}_w_prime_{left,right}_{L}``
mediapipe       ``transformer.layer_{L}.attn.{q,k,v,attn_vec_einsum}.w_prime_{left,right}``
                                                                    [r, in] / [r, out]
==============  ==================================================  ===============

The attention projections q/k/v/o are in every convention; the MLP's gate/up/down
(written by ``export --lora-targets all-linear``) in litert-torch's, named in the same
style, and LiteRT-LM's; MediaPipe's names stop at attention.

A DoRA slot (``export --dora-ranks``) also takes, per projection, its output scale
``lora_{atten_q,...,ff_down}_m_prime_weight_{L}`` ``[out]`` (side ``"m"``, litert-torch's
convention only): ``m' = m / ||W + s B A||_row - 1``, the DoRA magnitude over the row norm
of the adapted weight, less one, so that zeros leave the base projection as it is.

Internally every adapter is handled in the *graph layout* of litert-torch exports:
``a`` is ``[in, r]`` and ``b`` is ``[r, out]``, so the delta added to a projection's
output is ``(x @ a) @ b``.
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass

import numpy as np

from runtime.errors import InvalidArgumentError

ATTENTION_PROJECTIONS = ("q", "k", "v", "o")
MLP_PROJECTIONS = ("gate", "up", "down")
PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
SIDES = ("a", "b")
DORA_SIDE = "m"  # a DoRA slot's per-output-channel scale input, [out]


class Convention(enum.Enum):
    """A naming and layout convention for LoRA tensors."""

    LITERT_TORCH = "litert-torch"
    LITERT_LM = "litert-lm"
    MEDIAPIPE = "mediapipe"


_LAYER = r"(?P<layer>0|[1-9][0-9]*)"
_PATTERNS: dict[Convention, re.Pattern[str]] = {
    Convention.LITERT_TORCH: re.compile(
        rf"lora_(?:atten_(?P<proj>[qkvo])|ff_(?P<mlp>gate|up|down))_(?P<side>[abm])_prime_weight_{_LAYER}"
    ),
    Convention.LITERT_LM: re.compile(
        rf"(?P<proj>query|key|value|post|gate|up|down)_w_prime_(?P<side>left|right)_{_LAYER}"
    ),
    Convention.MEDIAPIPE: re.compile(
        rf"transformer\.layer_{_LAYER}\.attn\.(?P<proj>q|k|v|attn_vec_einsum)"
        r"\.w_prime_(?P<side>left|right)"
    ),
}

_PROJECTION_SPELLING: dict[Convention, dict[str, str]] = {
    Convention.LITERT_TORCH: {"q": "q", "k": "k", "v": "v", "o": "o", "gate": "gate", "up": "up", "down": "down"},
    Convention.LITERT_LM: {"q": "query", "k": "key", "v": "value", "o": "post", "gate": "gate", "up": "up",
                           "down": "down"},
    Convention.MEDIAPIPE: {"q": "q", "k": "k", "v": "v", "o": "attn_vec_einsum"},
}
_SIDE_SPELLING: dict[Convention, dict[str, str]] = {
    Convention.LITERT_TORCH: {"a": "a", "b": "b", "m": "m"},
    Convention.LITERT_LM: {"a": "left", "b": "right"},
    Convention.MEDIAPIPE: {"a": "left", "b": "right"},
}


@dataclass(frozen=True, order=True, slots=True)
class LoraInputName:
    """The meaning of one LoRA tensor name: which layer, projection and side."""

    layer: int
    projection: str  # one of PROJECTIONS
    side: str  # one of SIDES, or DORA_SIDE
    convention: Convention

    @property
    def key(self) -> tuple[int, str, str]:
        """The convention-independent identity ``(layer, projection, side)`` (one tuple per
        name: parsed names are shared)."""
        return _key(self.layer, self.projection, self.side)

    @property
    def pair(self) -> tuple[int, str]:
        """``(layer, projection)``: what the ``a`` and ``b`` halves share (one tuple per pair)."""
        return _key(self.layer, self.projection)


@functools.lru_cache(maxsize=1 << 14)
def _key(*parts: int | str) -> tuple[int | str, ...]:
    return parts


@functools.lru_cache(maxsize=1 << 15)  # a model's signatures ask about the same names tens of thousands of times
def is_lora_input_name(name: str) -> bool:
    """True when ``name`` is, as a whole, a LoRA input name in any known convention."""
    return any(p.fullmatch(name) for p in _PATTERNS.values())


@functools.lru_cache(maxsize=1 << 14)  # one shared object per name: registered adapters hold hundreds
def parse_lora_input_name(name: str) -> LoraInputName:
    """Parses a LoRA input name; ``InvalidArgumentError`` when it is none."""
    for convention, pattern in _PATTERNS.items():
        match = pattern.fullmatch(name)
        if match:
            spelled = match["proj"] or match.groupdict().get("mlp")
            projection = _invert(_PROJECTION_SPELLING[convention])[spelled]
            side = _invert(_SIDE_SPELLING[convention])[match["side"]]
            return LoraInputName(int(match["layer"]), projection, side, convention)
    raise InvalidArgumentError(f"{name!r} is not a LoRA input name in any known convention")


def lora_input_name(convention: Convention, layer: int, projection: str, side: str) -> str:
    """Spells the LoRA input for ``(layer, projection, side)`` in ``convention``."""
    if projection not in _PROJECTION_SPELLING[convention] or side not in _SIDE_SPELLING[convention] or layer < 0:
        raise InvalidArgumentError(
            f"no LoRA input for layer={layer}, projection={projection!r}, side={side!r} in the "
            f"{convention.value} convention"
        )
    proj = _PROJECTION_SPELLING[convention][projection]
    sd = _SIDE_SPELLING[convention][side]
    if convention is Convention.LITERT_TORCH:
        block = "ff" if projection in MLP_PROJECTIONS else "atten"
        return f"lora_{block}_{proj}_{sd}_prime_weight_{layer}"
    if convention is Convention.LITERT_LM:
        return f"{proj}_w_prime_{sd}_{layer}"
    return f"transformer.layer_{layer}.attn.{proj}.w_prime_{sd}"


def rank_axis(convention: Convention, side: str) -> int:
    """The axis of a stored tensor that holds the rank."""
    if convention is Convention.LITERT_TORCH and side == "a":
        return 1
    return 0


def to_graph_layout(convention: Convention, side: str, array: np.ndarray) -> np.ndarray:
    """Returns ``array`` (stored in ``convention``) in graph layout: a ``[in, r]``, b ``[r, out]``.

    A view, never a copy.
    """
    return array.T if side == "a" and convention is not Convention.LITERT_TORCH else array


def from_graph_layout(convention: Convention, side: str, array: np.ndarray) -> np.ndarray:
    """Inverse of :func:`to_graph_layout`: graph layout to how ``convention`` stores it."""
    return to_graph_layout(convention, side, array)


def _invert(mapping: dict[str, str]) -> dict[str, str]:
    return {v: k for k, v in mapping.items()}
