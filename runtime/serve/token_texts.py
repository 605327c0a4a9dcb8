"""Token texts as an answer reads them, for its logprobs: a token's text is what it adds to
the decoded text of the tokens before it (vLLM's incremental detokenization), so that the
texts of an answer's tokens add up to its text and their offsets are right.

Decoding each token alone does not: SentencePiece drops a piece's leading space when it
stands first, and a token holding part of a multi-byte character decodes to U+FFFD. Here a
token adds nothing while its character is incomplete (its text comes with the token that
completes it), and its ``bytes`` are its own where the tokenizer spells them (byte-level
BPE, byte fallback), never the replacement character's. Each decode covers a few tokens
(from the last one that added text on), not the whole answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from runtime.components.tokenizer import REPLACEMENT_CHARACTER, Tokenizer


@dataclass(frozen=True)
class TokenText:
    """How a token reads at its place in an answer: the text it adds there, and its bytes."""

    text: str
    bytes: bytes


@dataclass(frozen=True)
class _Place:
    """One position of a segment: the tokens decoded from ``start`` on, the text of those up
    to ``read`` (what was added before), and the token there."""

    tokens: Sequence[int]
    start: int
    read: int
    index: int
    before: str


class TokenReader:
    """``reader(position, token)``: how ``token`` reads at ``position`` of an answer (its own
    token there, or an alternative to it in ``top_logprobs``)."""

    def __init__(self, tokenizer: Tokenizer, segments: Sequence[Sequence[int]]) -> None:
        """``segments``: the answer's tokens in the parts that are decoded apart (an echoed
        prompt, then the generated tokens); positions count on across them."""
        self._decode = tokenizer.decode
        self._own_bytes: Callable[[int], bytes | None] | None = getattr(tokenizer, "token_bytes", None)
        self._places: list[_Place] = []
        self._texts: list[str] = []
        for segment in segments:
            self._read(list(segment))

    def __call__(self, position: int, token: int) -> TokenText:
        place = self._places[position]
        if token == place.tokens[place.index]:
            text = self._texts[position]
        else:
            text = self._added(place, [*place.tokens[place.start:place.index], token])
        own = self._own_bytes(token) if self._own_bytes is not None else None
        return TokenText(text, own if own is not None else text.encode("utf-8"))

    def _read(self, tokens: list[int]) -> None:
        """The text each of ``tokens`` adds; a character still incomplete at the end (the
        answer ends with U+FFFD) goes with the last token, so that the texts add up."""
        start = read = 0
        for index in range(len(tokens)):
            place = _Place(tokens, start, read, index, self._decode(tokens[start:read]))
            text = self._added(place, tokens[start:index + 1])
            if text:
                start, read = read, index + 1
            self._places.append(place)
            self._texts.append(text)
        if tokens:
            self._texts[-1] += self._decode(tokens[start:])[len(self._decode(tokens[start:read])):]

    def _added(self, place: _Place, window: Sequence[int]) -> str:
        """What ``window`` (the place's tokens from its start, ending with the token read)
        adds to the text before: nothing while that ends in an incomplete character."""
        text = self._decode(window)
        if len(text) <= len(place.before) or text.endswith(REPLACEMENT_CHARACTER):
            return ""
        return text[len(place.before):]
