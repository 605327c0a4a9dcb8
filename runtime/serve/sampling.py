"""How one request picks its tokens: the core's :class:`~runtime.Sampler` after vLLM's
logits processing (repetition penalty, ``min_tokens``), and non-finite logits reported
as what they are: a broken adapter or blend, not a server error."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from runtime import Sampler, SamplerConfig
from runtime.components.sampler import finite_logits
from runtime.serve.logprobs import TokenLogprob, token_logprobs

_SUPPRESSED = -1e30  # a stop token's logit before min_tokens: finite, so never sampled


class NonFiniteLogits(Exception):
    """The model produced NaN or infinite logits (raised before sampling from them)."""


class RequestSampler(Sampler):
    """A :class:`Sampler` that first applies the request's ``repetition_penalty`` (vLLM's:
    the logits of tokens already in the prompt or the output divided by it when positive,
    multiplied when negative) and, until ``min_tokens`` tokens were generated, keeps the
    ``stop_tokens`` from being chosen."""

    def __init__(self, config: SamplerConfig, *, prompt: Sequence[int], stop_tokens: Collection[int],
                 min_tokens: int = 0, repetition_penalty: float = 1.0, logprobs: int | None = None) -> None:
        """``logprobs``: record each chosen token's logprob and this many top ones
        (:attr:`logprobs`), from the model's logits as given; ``None``: record nothing."""
        super().__init__(config)
        self._top = logprobs
        self.logprobs: list[TokenLogprob] = []
        self._history = list(prompt) if repetition_penalty != 1.0 else []
        self._stops = np.array(sorted(stop_tokens), dtype=np.int64)
        self._min_tokens = min_tokens
        self._penalty = repetition_penalty
        self.generated = 0

    def sample(self, logits: np.ndarray) -> int:
        """The next token id; :class:`NonFiniteLogits` if ``logits`` hold NaN or Inf."""
        logits = finite_logits(logits)
        if logits is None:
            raise NonFiniteLogits
        penalize = self._penalty != 1.0 and self._history
        suppress = self.generated < self._min_tokens and self._stops.size
        raw = logits
        if penalize or suppress:
            logits = logits.astype(np.float64)  # a copy: the caller's logits stay as they are
        if penalize:
            seen = np.unique(np.asarray(self._history, dtype=np.int64))
            values = logits[seen]
            logits[seen] = np.where(values > 0, values / self._penalty, values * self._penalty)
        logits = self.adjust(logits)  # logit bias, presence and frequency penalties (the core's)
        if suppress:
            logits[self._stops] = _SUPPRESSED
        token = self.record(self.pick(logits))
        if self._top is not None:
            self.logprobs.extend(token_logprobs(raw[None], [token], self._top))
        self.generated += 1
        if self._penalty != 1.0:
            self._history.append(token)
        return token
