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
        logits = np.asarray(logits, dtype=np.float64).reshape(-1)
        if logits.size == 0:
            raise InvalidArgumentError("logits are empty")
        if not np.all(np.isfinite(logits)):
            raise InternalError("the model produced non-finite logits (NaN or Inf)")
        config = self.config
        if config.temperature == 0.0 or config.top_k == 1:
            return int(np.argmax(logits))
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


def greedy() -> Sampler:
    """A sampler that always picks the most likely token."""
    return Sampler(SamplerConfig())
