"""Tokenizers: text to token ids and back. Bytes, Hugging Face ``tokenizer.json``, SentencePiece."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from typing import Protocol

from runtime.errors import InvalidArgumentError
from runtime.util.gguf_file import GGUF_MAGIC
from runtime.util.scoped_file import ScopedFile

# Special tokens that end a generation in common vocabularies (Llama 3's three as its
# generation config lists them: end of text, of a turn, of a tool call; Phi-3's end of turn).
_STOP_TOKEN_TEXTS = ("</s>", "<|endoftext|>", "<eos>", "<|im_end|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>",
                     "<|end|>", "<end_of_turn>")
# Special tokens that begin a sequence in common vocabularies.
_BOS_TOKEN_TEXTS = ("<|begin_of_text|>", "<s>", "<bos>")
# A byte-fallback token's spelling (SentencePiece's and tokenizer.json's): one byte of a
# character the vocabulary has no token for.
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# What some editors put before a UTF-8 text file's first character.
_UTF8_BOM = b"\xef\xbb\xbf"
# What a tokenizer decodes an incomplete UTF-8 sequence to.
REPLACEMENT_CHARACTER = "\ufffd"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet (what byte-level BPE vocabularies spell tokens in): the
    character standing for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = (byte for byte in range(256) if byte not in printable)
    return {**{chr(byte): byte for byte in printable}, **{chr(256 + n): byte for n, byte in enumerate(others)}}


_BYTE_LEVEL = _byte_level_alphabet()


def _read(path: str | os.PathLike[str], size: int = -1) -> bytes:
    """The bytes of the tokenizer file ``path`` (its first ``size`` ones, if given):
    ``NotFoundError``, ``InvalidArgumentError`` (a directory, a FIFO) or
    ``PermissionDeniedError`` naming it when it cannot be read as a file."""
    with ScopedFile(path) as file, open(file.fileno(), "rb", closefd=False) as stream:
        return stream.read(size)


def _utf8(text: str) -> bytes:
    """``text``'s UTF-8 bytes; ``InvalidArgumentError`` if it is not a ``str`` or holds a lone
    surrogate (what Python makes of bytes that are not UTF-8 in a command line or a file
    name), which no tokenizer can take."""
    if not isinstance(text, str):
        raise InvalidArgumentError(f"text is {type(text).__name__}, expected a str")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(f"text holds a lone surrogate {text[exc.start]!r} at character {exc.start}, "
                                   "expected Unicode text (was it read from bytes that are not UTF-8?)") from None


class Tokenizer(Protocol):
    """What the engine needs to take text in and give text out."""

    @property
    def vocab_size(self) -> int:
        """How many token ids there are."""

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Tokens that end a generation."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids; ids the tokenizer lacks (a model may have more embeddings than
        its tokenizer has tokens, as Gemma 3 has) add nothing, so decoding never fails."""


class ByteTokenizer:
    """UTF-8 bytes are the tokens (vocabulary 256); for byte-level models."""

    def __init__(self, stop_token_ids: Sequence[int] = ()) -> None:
        self._stop = tuple(int(t) for t in stop_token_ids)

    @property
    def vocab_size(self) -> int:
        """256."""
        return 256

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The byte values that end a generation (e.g. ``10`` for a newline)."""
        return self._stop

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The UTF-8 bytes of ``text`` (bytes have no special tokens to add)."""
        return list(_utf8(text))

    def token_text(self, token: int) -> str:
        """The byte as text (a byte that is not whole UTF-8 alone: U+FFFD)."""
        return self.decode([token])

    def token_bytes(self, token: int) -> bytes:
        """The byte itself (a part of a character too); nothing for an id past the bytes."""
        return bytes([token]) if 0 <= token < 256 else b""

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes back to text; invalid UTF-8 sequences become U+FFFD, ids past the bytes
        (a model's extra tokens) add nothing."""
        return bytes(token for token in ids if 0 <= token < 256).decode("utf-8", errors="replace")


class HfTokenizer:
    """A Hugging Face ``tokenizer.json`` (read with the ``tokenizers`` library)."""

    def __init__(self, source: str | os.PathLike[str] | bytes, stop_token_ids: Sequence[int] | None = None) -> None:
        from tokenizers import Tokenizer as _Tokenizer, decoders

        name = "<tokenizer.json bytes>" if isinstance(source, bytes) else str(source)
        data = source if isinstance(source, bytes) else _read(source)
        try:
            self._tokenizer = _Tokenizer.from_str(data.removeprefix(_UTF8_BOM).decode("utf-8"))
        except Exception as exc:  # the library raises its own Exception subclasses
            raise InvalidArgumentError(f"{name}: not a valid tokenizer.json: {exc}") from None
        if stop_token_ids is None:
            found = (self._tokenizer.token_to_id(text) for text in _STOP_TOKEN_TEXTS)
            stop_token_ids = [token for token in found if token is not None]
        self._stop = tuple(int(t) for t in stop_token_ids)
        self._byte_level = isinstance(self._tokenizer.decoder, decoders.ByteLevel)
        self._added = frozenset(self._tokenizer.get_added_tokens_decoder())
        self._size = self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """Size of the vocabulary including added tokens."""
        return self._size

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence tokens found in the vocabulary (or the ones given)."""
        return self._stop

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` (with ``add_special_tokens``, those the tokenizer's
        post-processor adds, such as a beginning-of-sequence token)."""
        _utf8(text)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def token_text(self, token: int) -> str:
        """The token as the vocabulary spells it (special tokens too, e.g. ``<|im_end|>``);
        nothing for an id outside the vocabulary."""
        return (self._tokenizer.id_to_token(int(token)) or "") if 0 <= token < self._size else ""

    def token_bytes(self, token: int) -> bytes | None:
        """The token's own bytes where the vocabulary spells them: a byte-level BPE token's
        (a part of a character too), a byte-fallback token's (``<0xC3>``); ``None`` for
        other tokens (added ones, special ones...), whose bytes are their text's."""
        spelling = self.token_text(token)
        if not spelling or token in self._added:
            return None
        if self._byte_level:
            values = [_BYTE_LEVEL.get(character) for character in spelling]
            return None if None in values else bytes(values)  # type: ignore[arg-type]
        match = _BYTE_PIECE.fullmatch(spelling)
        return bytes([int(match[1], 16)]) if match else None

    @property
    def bos_token(self) -> str | None:
        """The text of the vocabulary's beginning-of-sequence token, if it has a common one."""
        return next((text for text in _BOS_TOKEN_TEXTS if self._tokenizer.token_to_id(text) is not None), None)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens and ids outside the vocabulary (a model's extra tokens) skipped."""
        return self._tokenizer.decode([token for token in ids if 0 <= token < self._size], skip_special_tokens=True)


class SentencePieceTokenizer:
    """A SentencePiece model (read with the ``sentencepiece`` library)."""

    def __init__(self, source: str | os.PathLike[str] | bytes, stop_token_ids: Sequence[int] | None = None) -> None:
        import sentencepiece

        self._processor = sentencepiece.SentencePieceProcessor()
        name = "<sentencepiece bytes>" if isinstance(source, bytes) else str(source)
        proto = source if isinstance(source, bytes) else _read(source)
        try:
            self._processor.LoadFromSerializedProto(proto)
        except Exception as exc:  # RuntimeError or OSError from the library
            raise InvalidArgumentError(f"{name}: not a valid SentencePiece model: {exc}") from None
        processor = self._processor
        if stop_token_ids is None:  # the end-of-sentence id, then the common stop pieces the model has
            eos = processor.eos_id()
            found = [processor.piece_to_id(text) for text in _STOP_TOKEN_TEXTS]  # the unknown piece's id if none
            named = [token for token, text in zip(found, _STOP_TOKEN_TEXTS) if processor.id_to_piece(token) == text]
            stop_token_ids = list(dict.fromkeys(([eos] if eos >= 0 else []) + named))
        self._stop = tuple(int(t) for t in stop_token_ids)
        # The control pieces a chat template writes as text (its bos_token, eos_token), which
        # SentencePiece itself would encode as their characters: spelling -> id.
        self._controls = {processor.id_to_piece(token): token
                          for token in (processor.bos_id(), processor.eos_id(), processor.pad_id())
                          if token >= 0 and processor.is_control(token)}
        self._control_spellings = (re.compile("|".join(map(re.escape, sorted(self._controls, key=len, reverse=True))))
                                   if self._controls else None)

    @property
    def vocab_size(self) -> int:
        """Number of pieces."""
        return self._processor.get_piece_size()

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The model's end-of-sequence id and the common stop pieces it has, such as Gemma's
        ``<end_of_turn>`` (or the ones given)."""
        return self._stop

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Piece ids of ``text`` (with ``add_special_tokens``, the beginning-of-sentence id
        first, when the model has one). The spellings of the beginning- and end-of-sentence
        and padding pieces (``<s>``, ``</s>``: what a chat template inserts) are those
        pieces, as a ``tokenizer.json``'s special tokens are; the text between them is
        encoded piece by piece."""
        _utf8(text)
        ids: list[int] = []
        start = 0
        for match in self._control_spellings.finditer(text) if self._control_spellings else ():
            ids += self._processor.encode(text[start:match.start()])
            ids.append(self._controls[match[0]])
            start = match.end()
        ids += self._processor.encode(text[start:])
        bos = self._processor.bos_id()
        return [bos, *ids] if add_special_tokens and bos >= 0 else ids

    def token_text(self, token: int) -> str:
        """The piece (special pieces too, e.g. ``</s>``); nothing for an id outside the pieces."""
        return self._processor.id_to_piece(int(token)) if 0 <= token < self._processor.get_piece_size() else ""

    def token_bytes(self, token: int) -> bytes | None:
        """A byte-fallback piece's byte (``<0xC3>``: a part of a character the pieces do not
        hold); ``None`` for other pieces, whose bytes are their text's."""
        if 0 <= token < self._processor.get_piece_size() and self._processor.is_byte(token):
            return bytes([int(_BYTE_PIECE.fullmatch(self._processor.id_to_piece(token))[1], 16)])
        return None

    @property
    def bos_token(self) -> str | None:
        """The beginning-of-sentence piece, if the model has one."""
        bos = self._processor.bos_id()
        return self._processor.id_to_piece(bos) if bos >= 0 else None

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; ids past the pieces (a model's extra tokens) add nothing."""
        pieces = self._processor.get_piece_size()
        return self._processor.decode([token for token in ids if 0 <= token < pieces])


class TextStream:
    """A generation's tokens -> the text each one adds, for showing them as they come: the
    pieces join to exactly ``tokenizer.decode`` of all the tokens.

    Decoding each token alone does not: a token holding part of a multi-byte character
    decodes to U+FFFD, and SentencePiece drops a piece's leading space when it stands
    first. Here a token adds nothing while the text ends with an incomplete character (its
    text comes with the token that completes it), and each decode covers the tokens from
    the previous piece's on (vLLM's incremental detokenization), not the whole answer.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        """``decode``: the tokenizer's ids -> text (``Tokenizer.decode``)."""
        self._decode = decode
        self._tokens: list[int] = []
        self._start = self._read = 0  # decodes begin at _start; the text up to _read was given out

    def add(self, token: int) -> str:
        """Takes the next token; the text that may be shown now (maybe '')."""
        self._tokens.append(token)
        before = self._decode(self._tokens[self._start:self._read])
        text = self._decode(self._tokens[self._start:])
        if len(text) <= len(before) or text.endswith(REPLACEMENT_CHARACTER):
            return ""
        self._start, self._read = self._read, len(self._tokens)
        return text[len(before):]

    def finish(self) -> str:
        """The rest of the text when no more tokens come (a character left incomplete at
        the end reads as ``decode`` reads it)."""
        before = self._decode(self._tokens[self._start:self._read])
        rest = self._decode(self._tokens[self._start:])[len(before):]
        self._start = self._read = len(self._tokens)
        return rest


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """A tokenizer from a file: ``tokenizer.json`` (Hugging Face) or a SentencePiece model.
    A GGUF file is refused naming the way to its tokenizer: ``runtime export`` reads it (with
    transformers, the ``export`` extra) into the ``.litertlm`` bundle it writes."""
    head = _read(path, 64)
    if head.startswith(GGUF_MAGIC):
        raise InvalidArgumentError(
            f"{path}: a GGUF file, not a tokenizer.json or SentencePiece model; `runtime export GGUF --out "
            "MODEL.tflite --bundle MODEL.litertlm` writes its tokenizer into the bundle (give --model "
            "MODEL.litertlm), or give the original checkpoint's tokenizer.json")
    if head.removeprefix(_UTF8_BOM).lstrip().startswith(b"{"):
        return HfTokenizer(path)
    return SentencePieceTokenizer(path)
