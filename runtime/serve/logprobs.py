"""Logprobs: log-softmax of the model's float32 logits in float64, and OpenAI's two shapes
of them (the legacy completions object, the chat object).

The logits are the model's own, as the sampler receives them (before logit bias and
penalties, like vLLM's default): a token's logprob is what the model gave it, whatever
the request's sampling settings.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from runtime.serve.token_texts import TokenText

MAX_LOGPROBS = 20  # top logprobs per position, as OpenAI allows
_ROWS_AT_ONCE = 64  # log-softmax over this many positions at a time (a 512-token prompt's float64 stays small)


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token there, its logprob, and the ``top`` most likely tokens
    there with theirs (most likely first; the token itself included when it is not among
    them, as vLLM does, so that a client can tell whether it was the greedy choice)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """``log(softmax(logits))`` along the last axis, in float64."""
    values = np.asarray(logits, dtype=np.float64)
    shifted = values - values.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def token_logprobs(logits: np.ndarray, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """For each row ``i`` of ``logits`` ``(n, vocab)``, the logprob of ``tokens[i]`` under
    it and its ``top`` most likely tokens: ``logit - logsumexp(logits)`` in float64, the
    full log-softmax never written out (a 512-token prompt at a 49,152-token vocabulary
    is 25M values; only the few read are computed)."""
    entries: list[TokenLogprob] = []
    for start in range(0, len(tokens), _ROWS_AT_ONCE):
        block = np.asarray(logits[start:start + _ROWS_AT_ONCE])
        ids = np.asarray(tokens[start:start + _ROWS_AT_ONCE], dtype=np.int64)
        rows = np.arange(len(ids))
        peak = block.max(axis=1).astype(np.float64)
        shifted = block.astype(np.float64)
        shifted -= peak[:, None]
        np.exp(shifted, out=shifted)
        lse = peak + np.log(shifted.sum(axis=1))
        # the float32 logits order as their float64 values do: the top ones are found on them
        if top == 1:
            best = block.argmax(axis=1)[:, None]
        elif top > 1:
            best = np.argpartition(-block, top - 1, axis=1)[:, :top] if top < block.shape[1] else np.broadcast_to(
                np.arange(block.shape[1]), (len(ids), block.shape[1]))
        else:
            best = np.empty((len(ids), 0), dtype=np.int64)
        chosen = block[rows, ids].astype(np.float64) - lse
        best_values = block[rows[:, None], best].astype(np.float64) - lse[:, None]
        for row, token in enumerate(ids.tolist()):
            pairs = sorted(zip(best[row].tolist(), best_values[row].tolist()), key=lambda pair: (-pair[1], pair[0]))
            if top and token not in best[row]:
                pairs.append((token, float(chosen[row])))
            entries.append(TokenLogprob(token, float(chosen[row]), tuple(pairs)))
    return entries


def completion_logprobs(entries: Sequence[TokenLogprob | None], read: Callable[[int, int], TokenText],
                        tokens: Sequence[int], offset: int = 0) -> dict:
    """OpenAI's legacy ``logprobs`` object of ``/v1/completions``: per token its text, its
    logprob (``None`` for an echoed prompt's first token, which nothing predicts), the
    top logprobs as ``{text: logprob}`` and the offset of its text from ``offset`` on.
    ``read(position, token)``: how a token reads there (see :class:`TokenReader`)."""
    texts, offsets, position = [], [], offset
    for index, token in enumerate(tokens):
        text = read(index, token).text
        texts.append(text)
        offsets.append(position)
        position += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [None if entry is None else entry.logprob for entry in entries],
        "top_logprobs": [None if entry is None else _top_dict(entry, index, read)
                         for index, entry in enumerate(entries)],
        "text_offset": offsets,
    }


def _top_dict(entry: TokenLogprob, index: int, read: Callable[[int, int], TokenText]) -> dict[str, float]:
    top: dict[str, float] = {}
    for token, logprob in entry.top:
        text = read(index, token).text
        top[text] = max(logprob, top.get(text, -np.inf))  # two tokens of one text: the likelier
    return top


def chat_logprobs(entries: Sequence[TokenLogprob], read: Callable[[int, int], TokenText], top: int) -> dict:
    """OpenAI's chat ``logprobs`` object: ``{"content": [{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}]}]}`` with ``top`` alternatives per token;
    ``read(position, token)``: how a token reads there (see :class:`TokenReader`)."""
    def item(index: int, token: int, logprob: float) -> dict:
        text = read(index, token)
        return {"token": text.text, "logprob": logprob, "bytes": list(text.bytes)}

    return {"content": [{**item(index, entry.token, entry.logprob),
                         "top_logprobs": [item(index, t, lp) for t, lp in entry.top[:top]]}
                        for index, entry in enumerate(entries)],
            "refusal": None}
