"""The ``grouped`` KV layout (:mod:`runtime.util.kv_layout`): K and V both ``[1, G, T, D]``.

litert-torch 0.10.0 builds caches of any order of dimensions (``KVCache.from_model_config``)
but its ``sdpa_with_kv_update`` knows two layouts, the transposed one and, for anything else,
its default ``[1, T, G, D]``. Importing this module (as :mod:`runtime.export.signatures` does,
which every lowering reads) puts :func:`sdpa_with_kv_update` in front of litert-torch's, for
every caller (litert-torch's attention blocks, which every family's plain steps and Gemma 3's
blocks run, and :func:`runtime.export.mlp_lora.lora_attention`): caches in
:data:`KV_LAYOUT_GROUPED` are written and read here, any other layout is handed to
litert-torch's as before. The batched and windowed steps (:mod:`runtime.export.batch_decode`)
write and read their rows' caches with :func:`update` and :func:`matmul_4d`.

The attention is the transposed layout's (litert-torch's ``_sdpa_with_kv_update_transposed``
and ``scaled_dot_product_attention_transposed``: query scaled by ``1 / sqrt(head_dim)``, the
logits soft-capped, then masked), except that the probabilities multiply V as it lies
(one 4-D ``BATCH_MATMUL`` without ``adj_y``, :func:`matmul_4d`): the same numbers, another
layout of V.
"""

from __future__ import annotations

import math

import torch
from litert_converter.mlir import ir
from litert_converter.mlir.dialects import stablehlo

from runtime.errors import UnimplementedError
from runtime.export.litert import bmm_4d, dynamic_update_slice, kv_utils, litert_types, lowerings
from runtime.export.litert import sdpa_with_kv_update as litert_sdpa

KV_LAYOUT_GROUPED = (litert_types.BNTH, litert_types.BNTH)  # K and V [1, groups, positions, head_dim]

_litert_sdpa_with_kv_update = litert_sdpa.sdpa_with_kv_update


@torch.library.custom_op("runtime_export::matmul_4d", mutates_args=())
def matmul_4d(lhs: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """``lhs`` ``[A, B, M, K]`` times ``rhs`` ``[A, B, K, N]``: one 4-D ``BATCH_MATMUL`` without
    ``adj_y`` in the graph (``torch.matmul`` of 4-D operands lowers to RESHAPEs of both to 3-D
    around it, the cache's among them), as litert-torch's ``bmm_4d`` is for ``lhs @ rhs^T``."""
    return torch.matmul(lhs, rhs)


@matmul_4d.register_fake
def _(lhs: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    return torch.matmul(lhs, rhs)


@lowerings.lower(torch.ops.runtime_export.matmul_4d)
def _lower_matmul_4d(lctx: object, lhs: ir.Value, rhs: ir.Value) -> ir.Value:
    numbers = stablehlo.DotDimensionNumbers.get(lhs_batching_dimensions=[0, 1], rhs_batching_dimensions=[0, 1],
                                                lhs_contracting_dimensions=(3,), rhs_contracting_dimensions=(2,))
    a, b, m, _ = lhs.type.shape
    result = ir.RankedTensorType.get((a, b, m, rhs.type.shape[3]), lhs.type.element_type)
    return stablehlo.dot_general(result, lhs, rhs, numbers)


def update(entry: kv_utils.KVCacheEntry, input_pos: torch.Tensor, k_slice: torch.Tensor,
           v_slice: torch.Tensor) -> kv_utils.KVCacheEntry:
    """``entry`` with ``k_slice`` and ``v_slice`` (``[1, G, L, D]``) written at positions
    ``input_pos[0]`` onwards of its caches (both grouped)."""
    zero = torch.zeros((1,), dtype=torch.float32)
    start = input_pos.float()[0].reshape(1)
    indices = [index for index in torch.cat([zero, zero, start, zero]).int()]
    return kv_utils.KVCacheEntry(dynamic_update_slice(entry.k_cache, k_slice, indices),
                                 dynamic_update_slice(entry.v_cache, v_slice, indices), entry.kv_layout)


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
           softcap: float | None) -> torch.Tensor:
    """Attention of ``query`` (``[1, G, heads per group * T, D]``, already scaled) over
    grouped caches ``keys`` and ``values`` (``[1, G, W, D]``): ``[1, G, heads per group * T, D]``.
    ``mask`` (``[1, 1, T, W]``) is added to each head's logits after soft-capping."""
    logits = bmm_4d(query, keys)  # [1, G, heads per group * T, W]
    _, groups, rows, span = logits.shape
    length = mask.shape[2]
    logits = logits.reshape(groups, rows // length, length, span)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    probs = torch.softmax((logits + mask).reshape(1, groups, rows, span), dim=-1).type_as(keys)
    return matmul_4d(probs, values)


def sdpa_with_kv_update(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv: kv_utils.KVCacheEntry,
                        input_pos: torch.Tensor, mask: torch.Tensor, config: object, enable_hlfb: bool,
                        alibi_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, kv_utils.KVCacheEntry]:
    """litert-torch's ``sdpa_with_kv_update`` (``query`` ``[B, T, heads, D]``, ``key`` and
    ``value`` ``[B, T, G, D]``) for caches in :data:`KV_LAYOUT_GROUPED`; any other layout
    goes to litert-torch's own."""
    if kv is None or kv.kv_layout != KV_LAYOUT_GROUPED:
        return _litert_sdpa_with_kv_update(query, key, value, kv, input_pos, mask, config, enable_hlfb, alibi_bias)
    if alibi_bias is not None:
        raise UnimplementedError("ALiBi attention in the grouped KV layout (no family this exporter reads has it)")
    batch, length, heads, head_dim = query.shape
    groups = config.num_query_groups
    # [B, T, heads, D] -> [1, B * G, heads per group * T, D]: a group's heads' queries, T each
    query = query.permute(0, 2, 1, 3).reshape(1, batch * groups, heads // groups * length, head_dim)
    key = key.permute(0, 2, 1, 3).reshape(1, -1, length, head_dim)
    value = value.permute(0, 2, 1, 3).reshape(1, -1, length, head_dim)
    kv = update(kv, input_pos, key, value)
    out = _attend(query * (1.0 / math.sqrt(config.head_dim)), kv.k_cache, kv.v_cache, mask, config.logit_softcap)
    return out.reshape(batch, -1, length, head_dim).permute(0, 2, 1, 3).reshape(batch, length, -1), kv


litert_sdpa.sdpa_with_kv_update = sdpa_with_kv_update
