"""Pure-numpy reference forward pass of the tiny GQA test model.

Recomputes, from ``tests/models/gqa_weights.npz`` (written by
``tools/build_test_models.py``), exactly what the exported litert-torch 0.10.0
graph computes, so tests can compare a runtime's logits against it:

* token embedding (no embedding scale), no bias anywhere;
* per layer, pre-norm residual blocks::

      h = rms_norm(x, attn_norm);  x = x + attention(h)
      h = rms_norm(x, mlp_norm);   x = x + down(silu(gate(h)) * up(h))

* ``rms_norm(x, w) = x / sqrt(mean(x**2) + eps) * w`` (not zero-centred);
* grouped-query attention: query head ``h`` reads KV group
  ``h // (num_heads // num_kv_groups)``; scores scaled by
  ``attn_scale = 1/sqrt(head_dim)``; causal mask; no attention softcap;
* RoPE in the "rotate half" form on the first ``rope_fraction*head_dim``
  channels of every head: with ``half = n/2``, ``x1 = x[:half]``,
  ``x2 = x[half:2*half]``, the result is ``[x1*cos - x2*sin, x2*cos + x1*sin,
  x[2*half:]]``, angles ``pos / rope_base**(2*i/n)`` for ``i < half``;
* final ``rms_norm`` and a separate (untied) ``lm_head``, no final softcap
  (``config.final_logit_softcap == 0``).

LoRA on the exported graph adds ``(x @ a_prime) @ b_prime`` to the q/k/v
projections (``x`` = the normed block input) and to the output projection
(``x`` = the attention output before ``o``). That equals using
``W + (a_prime @ b_prime).T``, so adapters are given here as dense deltas
``dW`` of shape ``[out, in]``; :func:`lora_delta` converts a_prime/b_prime.

Only numpy is needed. Computation is in float64 by default; the graph runs in
float32, so expect differences around 1e-5 on logits of size ~1.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import numpy as np

PROJECTIONS = ("q", "k", "v", "o")

LoraDeltas = Mapping[tuple[int, str], np.ndarray]


def load_weights(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Loads ``gqa_weights.npz`` into a plain dict of arrays."""
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def lora_delta(a_prime: np.ndarray, b_prime: np.ndarray) -> np.ndarray:
    """Dense ``[out, in]`` delta equivalent to a litert-torch LoRA pair.

    Args:
        a_prime: ``[in, r]`` (graph input ``lora_atten_*_a_prime_weight_*``).
        b_prime: ``[r, out]`` (graph input ``lora_atten_*_b_prime_weight_*``).
    """
    return (np.asarray(a_prime, np.float64) @ np.asarray(b_prime, np.float64)).T


def _cfg_int(weights: Mapping[str, np.ndarray], name: str) -> int:
    return int(weights[f"config.{name}"])


def _cfg_float(weights: Mapping[str, np.ndarray], name: str) -> float:
    return float(weights[f"config.{name}"])


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: ``x / sqrt(mean(x**2) + eps) * w``."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_tables(
    positions: np.ndarray, n_rot: int, base: float, dtype: type = np.float64
) -> tuple[np.ndarray, np.ndarray]:
    """Returns ``cos, sin`` of shape ``[len(positions), n_rot // 2]``."""
    half = n_rot // 2
    # Same expression as litert-torch's build_rope: base ** ((2/n) * i).
    timescale = float(base) ** ((2.0 / n_rot) * np.arange(half, dtype=dtype))
    radians = positions.astype(dtype)[:, None] / timescale[None, :]
    return np.cos(radians), np.sin(radians)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotates ``x`` of shape ``[T, heads, head_dim]`` ("rotate half" form)."""
    half = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1)


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x - np.max(x, axis=-1, keepdims=True)
    e = np.exp(x)
    return e / np.sum(e, axis=-1, keepdims=True)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def reference_logits(
    weights: Mapping[str, np.ndarray],
    tokens: Sequence[int] | np.ndarray,
    lora: LoraDeltas | None = None,
    dtype: type = np.float64,
) -> np.ndarray:
    """Computes the logits of every position of ``tokens``.

    Args:
        weights: The arrays of ``gqa_weights.npz`` (see :func:`load_weights`).
        tokens: Token ids, starting at position 0.
        lora: Optional map ``(layer, proj) -> dW`` with ``proj`` in
            ``"q", "k", "v", "o"`` and ``dW`` of shape ``[out, in]``; the
            layer then uses ``W + dW``. Missing entries mean no delta.
        dtype: Floating type of the computation (float64 by default).

    Returns:
        ``[len(tokens), vocab]`` logits; row ``t`` is what the graph returns
        for position ``t`` (the decode output at ``input_pos == t``).
    """
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    lora = lora or {}
    num_layers = _cfg_int(weights, "num_layers")
    num_heads = _cfg_int(weights, "num_heads")
    num_groups = _cfg_int(weights, "num_kv_groups")
    head_dim = _cfg_int(weights, "head_dim")
    eps = _cfg_float(weights, "rms_eps")
    scale = _cfg_float(weights, "attn_scale")
    final_softcap = _cfg_float(weights, "final_logit_softcap")
    attn_softcap = _cfg_float(weights, "attn_logit_softcap")
    n_rot = int(_cfg_float(weights, "rope_fraction") * head_dim)
    per_group = num_heads // num_groups

    def w(name: str) -> np.ndarray:
        return np.asarray(weights[name], dtype=dtype)

    def proj(layer: int, name: str) -> np.ndarray:
        mat = w(f"layers.{layer}.{name}")
        delta = lora.get((layer, name))
        if delta is not None:
            delta = np.asarray(delta, dtype=dtype)
            if delta.shape != mat.shape:
                raise ValueError(
                    f"LoRA delta for layer {layer} {name!r} has shape {delta.shape},"
                    f" expected {mat.shape}"
                )
            mat = mat + delta
        return mat

    seq = tokens.shape[0]
    cos, sin = rope_tables(np.arange(seq), n_rot, _cfg_float(weights, "rope_base"), dtype)
    causal = np.triu(np.ones((seq, seq), dtype=bool), k=1)  # True = masked
    kv_head = np.arange(num_heads) // per_group

    x = w("embedding")[tokens]
    for i in range(num_layers):
        p = f"layers.{i}."
        h = rms_norm(x, w(p + "attn_norm"), eps)
        q = (h @ proj(i, "q").T).reshape(seq, num_heads, head_dim)
        k = (h @ proj(i, "k").T).reshape(seq, num_groups, head_dim)
        v = (h @ proj(i, "v").T).reshape(seq, num_groups, head_dim)
        if n_rot > 0:
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
        k = k[:, kv_head]  # [T, heads, hd]
        v = v[:, kv_head]
        scores = np.einsum("thd,shd->hts", q, k) * scale
        if attn_softcap > 0:
            scores = np.tanh(scores / attn_softcap) * attn_softcap
        scores = np.where(causal[None], -np.inf, scores)
        attn = np.einsum("hts,shd->thd", _softmax(scores), v).reshape(seq, -1)
        x = x + attn @ proj(i, "o").T
        h = rms_norm(x, w(p + "mlp_norm"), eps)
        x = x + (_silu(h @ w(p + "gate").T) * (h @ w(p + "up").T)) @ w(p + "down").T
    logits = rms_norm(x, w("final_norm"), eps) @ w("lm_head").T
    if final_softcap > 0:
        logits = np.tanh(logits / final_softcap) * final_softcap
    return logits
