"""Choosing the next token from logits: greedy, temperature, top-k and top-p, seeded; OpenAI's
``logit_bias``, ``presence_penalty`` and ``frequency_penalty`` applied first (the one place
both of the server's endpoints and the engine's callers get them)."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from runtime.errors import InternalError, InvalidArgumentError


@dataclass(frozen=True)
class SamplerConfig:
    """How to pick a token. ``temperature == 0`` means greedy (argmax).

    ``top_k == 0`` and ``top_p == 1.0`` disable those filters; ``seed`` makes sampling
    reproducible. OpenAI's semantics for the rest, applied to the logits before any of
    that (greedy too): ``logit_bias`` adds ``(token, bias)`` pairs' bias (-100 ... 100) to
    the token's logit; a token the sampler already chose ``c`` times has
    ``c * frequency_penalty + (c > 0) * presence_penalty`` (each -2 ... 2) subtracted.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name))
        if not (self.temperature >= 0.0 and np.isfinite(self.temperature)):
            raise InvalidArgumentError(f"temperature={self.temperature}, expected a finite value >= 0")
        if not (_is_integer(self.top_k) and self.top_k >= 0):
            raise InvalidArgumentError(f"top_k={self.top_k!r:.40}, expected an integer >= 0 (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError(f"top_p={self.top_p}, expected a value in (0, 1]")
        if self.seed is not None and not (_is_integer(self.seed) and self.seed >= 0):
            raise InvalidArgumentError(f"seed={self.seed!r}, expected an integer >= 0 (or none: unseeded)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidArgumentError(f"{name}={value}, expected a value in [-2, 2]")
        mapping = isinstance(self.logit_bias, Mapping)  # {token: bias} is taken too, kept as sorted pairs
        if not (mapping or isinstance(self.logit_bias, Sequence)) or isinstance(self.logit_bias, str | bytes):
            raise InvalidArgumentError(f"logit_bias={self.logit_bias!r:.40}, expected (token, bias) pairs or a "
                                       "{token: bias} mapping")
        pairs = tuple(self.logit_bias.items() if mapping else self.logit_bias)
        seen: set[int] = set()
        for pair in pairs:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise InvalidArgumentError(f"logit_bias: {pair!r:.40} is not a (token, bias) pair")
            token, bias = pair
            if type(token) is not int or token < 0:
                raise InvalidArgumentError(f"logit_bias: token {token!r} is not a token id (an integer >= 0)")
            if token in seen:
                raise InvalidArgumentError(f"logit_bias: token {token} is given twice, expected one bias per token")
            seen.add(token)
            _check_number(f"logit_bias[{token}]", bias)
            if not -100.0 <= bias <= 100.0:
                raise InvalidArgumentError(f"logit_bias[{token}]={bias}, expected a value in [-100, 100]")
        object.__setattr__(self, "logit_bias", tuple(sorted(pairs)) if mapping else pairs)

    @property
    def adjusts(self) -> bool:
        """Whether logit bias or penalties change the logits before a pick."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class Sampler:
    """Picks token ids from logits according to a :class:`SamplerConfig`.

    Holds its own random generator, so one sampler gives a reproducible sequence; give
    each concurrent generation its own sampler.
    """

    def __init__(self, config: SamplerConfig | None = None) -> None:
        self.config = SamplerConfig() if config is None else check_sampler_config(config)
        self._rng = np.random.default_rng(self.config.seed)
        self._counts: dict[int, int] = {}  # how often each token was chosen (for the penalties)
        bias = self.config.logit_bias
        self._bias_ids = np.array([token for token, _ in bias], dtype=np.int64)
        self._bias_values = np.array([value for _, value in bias], dtype=np.float64)

    def sample(self, logits: np.ndarray) -> int:
        """The next token id for a ``(vocab,)`` vector of logits."""
        logits = finite_logits(logits)
        if logits is None:
            raise InternalError("the model produced non-finite logits (NaN or Inf)")
        return self.record(self.pick(self.adjust(logits)))

    def adjust(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` with the logit bias and the presence and frequency penalties of the
        tokens chosen so far applied: a float64 copy, or ``logits`` themselves when
        nothing applies."""
        config = self.config
        if not config.adjusts:
            return logits
        if self._bias_ids.size and self._bias_ids.max() >= logits.size:
            raise InvalidArgumentError(f"logit_bias: token {int(self._bias_ids.max())} is outside the vocabulary "
                                       f"[0, {logits.size})")
        adjusted = logits.astype(np.float64)
        if self._bias_ids.size:
            adjusted[self._bias_ids] += self._bias_values
        if self._counts and (config.presence_penalty or config.frequency_penalty):
            seen = np.fromiter(self._counts, dtype=np.int64, count=len(self._counts))
            counts = np.fromiter(self._counts.values(), dtype=np.float64, count=len(self._counts))
            adjusted[seen] -= counts * config.frequency_penalty + config.presence_penalty
        return adjusted

    def record(self, token: int) -> int:
        """Counts ``token`` as chosen (what the penalties read); returns it."""
        if self.config.presence_penalty or self.config.frequency_penalty:
            self._counts[token] = self._counts.get(token, 0) + 1
        return token

    def pick(self, logits: np.ndarray) -> int:
        """The next token id for a non-empty ``(vocab,)`` vector of finite logits, float32
        or float64 (greedy reads them as they are; sampling computes in float64).

        Sorts only what a filter needs: top-k orders its k tokens, top-p the best-first
        prefix that holds its mass, and plain temperature sampling orders nothing (a sort of
        a 49,152-token vocabulary costs about what an int8 SmolLM2 decode step does)."""
        config = self.config
        if config.temperature == 0.0 or config.top_k == 1:
            return int(np.argmax(logits))  # float32 to float64 keeps every value and so the argmax
        logits = logits.astype(np.float64, copy=False)
        pool = top_ids(logits, config.top_k) if 0 < config.top_k < logits.size else None  # best first
        candidates = logits if pool is None else logits[pool]
        # the best at 0 before dividing: a tiny temperature sends the rest to -inf (weight 0), never inf - inf
        with np.errstate(over="ignore"):
            weights = np.exp((candidates - candidates.max()) / config.temperature)
        if config.top_p < 1.0:
            pool, weights = self._nucleus(logits, pool, weights)
        index = self._rng.choice(weights.size, p=weights / weights.sum())
        return int(index if pool is None else pool[index])

    def _nucleus(self, logits: np.ndarray, pool: np.ndarray | None, weights: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
        """The smallest best-first prefix of the candidates (``pool``, best first, or every
        token when ``None``; ``weights`` their unnormalised probabilities) whose
        probability reaches top-p: the ids and their weights. Without a pool, the best 64
        tokens are ordered first, then 8 times as many until they hold top-p's mass."""
        total = weights.sum()
        size = 64
        while True:
            ids = pool if pool is not None else top_ids(logits, min(size, logits.size))
            kept = weights if pool is not None else weights[ids]
            cumulative = np.cumsum(kept) / total
            if pool is not None or cumulative[-1] >= self.config.top_p or ids.size == logits.size:
                break
            size *= 8
        keep = int(np.searchsorted(cumulative, self.config.top_p) + 1)
        return ids[:keep], kept[:keep]


def top_ids(values: np.ndarray, k: int) -> np.ndarray:
    """The ids of the ``k`` largest of ``values``, largest first, equal values in id order:
    ``np.argsort(-values, kind="stable")[:k]`` without sorting the rest."""
    if k >= values.size:
        return np.argsort(-values, kind="stable")
    kth = np.partition(values, values.size - k)[values.size - k]  # the k-th largest value
    above = np.flatnonzero(values > kth)
    ids = np.concatenate([above, np.flatnonzero(values == kth)[: k - above.size]])
    return ids[np.argsort(-values[ids], kind="stable")]


def check_sampler_config(config: object) -> SamplerConfig:
    """``config`` if it is a :class:`SamplerConfig`, else ``InvalidArgumentError`` naming it."""
    if not isinstance(config, SamplerConfig):
        raise InvalidArgumentError(f"sampler={config!r:.60}, expected a SamplerConfig")
    return config


def _is_integer(value: object) -> bool:
    """Whether ``value`` is an integer (a NumPy one too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _check_number(name: str, value: object) -> None:
    """``InvalidArgumentError`` naming ``name`` unless ``value`` is a real number (not a bool)."""
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentError(f"{name}={value!r:.40}, expected a number")


def finite_logits(logits: np.ndarray) -> np.ndarray | None:
    """``logits`` as a flat float array (float32 logits as they are, no copy), or None if
    any is NaN or infinite; ``InvalidArgumentError`` if there are none or more than one row
    of them (a ``score`` result's ``(tokens, vocab)``: flattened, its ids would run past the
    vocabulary). One pass over the vocabulary: a greedy step's sampling is this and an argmax."""
    logits = np.asarray(logits)
    if logits.ndim > 1 and logits.size != logits.shape[-1]:
        raise InvalidArgumentError(f"logits have shape {logits.shape}, expected one row: (vocab,)")
    logits = logits.reshape(-1)
    if logits.dtype not in (np.float32, np.float64):
        logits = logits.astype(np.float64)
    if logits.size == 0:
        raise InvalidArgumentError("logits are empty")
    return logits if np.isfinite(logits).all() else None


def greedy() -> Sampler:
    """A sampler that always picks the most likely token."""
    return Sampler(SamplerConfig())
