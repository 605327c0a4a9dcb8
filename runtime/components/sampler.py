"""Choosing the next token from logits: greedy, temperature, top-k and top-p, seeded."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.errors import InternalError, InvalidArgumentError


@dataclass(frozen=True)
class SamplerConfig:
    """How to pick a token. ``temperature == 0`` means greedy (argmax).

    ``top_k == 0`` and ``top_p == 1.0`` disable those filters; ``seed`` makes sampling
    reproducible.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and np.isfinite(self.temperature)):
            raise InvalidArgumentError(f"temperature={self.temperature}, expected a finite value >= 0")
        if self.top_k < 0:
            raise InvalidArgumentError(f"top_k={self.top_k}, expected >= 0 (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError(f"top_p={self.top_p}, expected a value in (0, 1]")


class Sampler:
    """Picks token ids from logits according to a :class:`SamplerConfig`.

    Holds its own random generator, so one sampler gives a reproducible sequence; give
    each concurrent generation its own sampler.
    """

    def __init__(self, config: SamplerConfig | None = None) -> None:
        self.config = config or SamplerConfig()
        self._rng = np.random.default_rng(self.config.seed)

    def sample(self, logits: np.ndarray) -> int:
        """The next token id for a ``(vocab,)`` vector of logits."""
        logits = finite_logits(logits)
        if logits is None:
            raise InternalError("the model produced non-finite logits (NaN or Inf)")
        return self.pick(logits)

    def pick(self, logits: np.ndarray) -> int:
        """The next token id for a non-empty ``(vocab,)`` vector of finite logits, float32
        or float64 (greedy reads them as they are; sampling computes in float64)."""
        config = self.config
        if config.temperature == 0.0 or config.top_k == 1:
            return int(np.argmax(logits))  # float32 to float64 keeps every value and so the argmax
        logits = logits.astype(np.float64, copy=False)
        candidates = np.argsort(-logits, kind="stable")
        if config.top_k:
            candidates = candidates[: config.top_k]
        scaled = logits[candidates] / config.temperature
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        if config.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), config.top_p) + 1)
            candidates, probs = candidates[:keep], probs[:keep] / probs[:keep].sum()
        return int(candidates[self._rng.choice(len(candidates), p=probs)])


def finite_logits(logits: np.ndarray) -> np.ndarray | None:
    """``logits`` as a flat float array (float32 logits as they are, no copy), or None if
    any is NaN or infinite; ``InvalidArgumentError`` if there are none. One pass over the
    vocabulary: a greedy step's sampling is this and an argmax."""
    logits = np.asarray(logits).reshape(-1)
    if logits.dtype not in (np.float32, np.float64):
        logits = logits.astype(np.float64)
    if logits.size == 0:
        raise InvalidArgumentError("logits are empty")
    return logits if np.isfinite(logits).all() else None


def greedy() -> Sampler:
    """A sampler that always picks the most likely token."""
    return Sampler(SamplerConfig())
