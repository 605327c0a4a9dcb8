"""``decode_batch{B}``: one decode step for B sessions in one pass over the base weights;
``..._attend{W}``: a step that takes and attends over a cache of W positions only (the
first W of a session's context): a decode step (``decode_attend{W}``), or T tokens of one
session (``prefill_{T}_attend{W}``, ``verify{T}_attend{W}``), so a short context does not
pay for attending over, nor for copying a window out of, the whole cache.

Every row has its own tokens, positions, KV cache and LoRA weights; the base linears (q/k/v,
output projection, feed-forward, lm_head) run once over the ``[B, T, hidden]``
activations, which at real size is what a decode step costs: reading the weights. Each
row writes its new K and V into its own cache and attends over that cache (W positions
with an attention window: at W=128 a row's attention costs ~1/8 of attending over 1024;
T tokens of a row attend causally, each over the positions up to its own); the rows' own
``x A_i B_i`` run as batched matmuls over their stacked LoRA weights. (Stacking the caches
instead, to attend in one matmul, measured twice as slow: the copies and transposes of
every row's window cost more than the operations saved.)

Inputs, named as the runtime binds them (litert-torch names a nested dict's leaves
``{outer}_{inner}``; a row's KV cache names are the single-session names with ``_{row}``
appended, and with one row every name is the single-session name):

- ``tokens`` int32 ``[B, 1]``, ``input_pos`` int32 ``[B]`` (one row of T tokens:
  ``[1, T]`` and ``[T]``, the positions consecutive, as a prefill's);
- ``kv_cache_{k,v}_{layer}_{row}``: row ``row``'s session's cache, in the layout of ``decode``: all
  its positions, or with a window W a cache of W positions (a slice of the whole cache, cut
  out in the graph, was a copy of every row's window on every step: ~47 MB a step for 8
  SmolLM2-135M rows at W=128; the runtime keeps a session's context in buffers of the
  window's length instead, :class:`runtime.executor.litert_executor.KvCache`);
- ``lora_atten_{q,k,v,o}_{a,b}_prime_weight_{layer}`` (with a LoRA rank), and in an
  all-linear slot ``lora_ff_{gate,up,down}_{a,b}_prime_weight_{layer}``: every row's adapter
  stacked, ``[B, ...]`` of the single-session input's shape, row i in ``[i]`` (in the layout
  of ``decode_lora_r{R}`` / ``decode_lora_all_r{R}``); in a DoRA slot also
  ``..._m_prime_weight_{layer}``, each projection's output scale less one
  (:mod:`runtime.export.dora`). Zeros make a row plain. The runtime fills a row when the
  batch's rows change, so the graph reads the stacked weights where they lie (stacking
  per-row inputs inside the graph copied every row's adapter on every step: a batch of 8
  rank-8 rows of SmolLM2-135M took 1.35x as long in int8, 1.2x in f32).

Outputs: ``logits`` ``[B, T, vocab]`` (left out with ``logits=False``: a prefill exported
without logits) and ``kv_cache_{k,v}_{layer}_{row}``. With a window W, every position
a step writes, a padded prefill's padding too, must be below W (the runtime picks the
signature): a position past the cache would be clamped into it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from runtime.errors import UnimplementedError
from runtime.export import grouped_kv
from runtime.export.families.common import causal_mask
from runtime.export.families.gemma3 import Gemma3Decoder  # its forward: gemma3_steps.py
from runtime.export.dora import check_dora, fused_qkv_scale, scaled_linear
from runtime.export.litert import bmm_4d, kv_utils, rotary_position_embedding
from runtime.export.mlp_lora import (check_mlp_lora, feed_forward, is_standard_decoder, lora_key, lora_product,
                                     lora_shapes)
from runtime.util.signature_names import row_tensor_name

def check_batchable(model: nn.Module) -> None:
    """Raises ``UnimplementedError`` unless ``model`` is litert-torch's decoder with its
    standard blocks or Gemma 3's own decoder (the families whose batched step this module
    and :mod:`runtime.export.gemma3_steps` write)."""
    if not is_standard_decoder(model) and not isinstance(model, Gemma3Decoder):
        raise UnimplementedError(
            f"batched and attention-window decode signatures are not available for {type(model).__name__}: "
            "Llama, Qwen2, Qwen3 and Gemma 3 exports have them")
    if any(block.atten_func.config.use_alibi for block in model.transformer_blocks):
        raise UnimplementedError("batched and attention-window decode signatures do not support ALiBi attention")


class BatchDecode(nn.Module):
    """The ``decode_batch{batch}`` step of ``model`` (litert-torch's ``DecoderOnlyModel``),
    with per-row LoRA inputs of rank ``lora_rank`` (``None``: no LoRA inputs), attending
    over the first ``window`` positions of each cache (``None``: all of them). With one
    row it is a single session's ``decode_attend{window}``, under the single-session names,
    and with ``length`` T > 1 tokens that session's T-token step (a windowed prefill or
    verify), returning logits at all T unless ``logits`` is False."""

    def __init__(self, model: nn.Module, batch: int, lora_rank: int | None, kv_layout: tuple,
                 window: int | None = None, mlp: bool = False, dora: bool = False, length: int = 1,
                 logits: bool = True) -> None:
        super().__init__()
        check_batchable(model)
        if batch > 1 and length > 1:
            raise UnimplementedError(f"a step of {batch} rows takes one token per row, not {length}")
        self.model = model
        self.batch = batch
        self.length = length
        self.logits = logits
        self.lora_rank = lora_rank
        self.kv_layout = kv_layout
        self.window = window
        self.mlp = mlp  # LoRA on the feed-forward's gate/up/down too (an all-linear slot)
        self.dora = dora  # and each projection's DoRA output scale (a DoRA slot: all-linear too)
        if mlp:
            check_mlp_lora(model)
        if dora:
            check_dora(model)
            self.mlp = True

    def _row(self, name: str, row: int) -> str:
        """The input name of ``row``'s ``name`` (one row: the single-session name)."""
        return row_tensor_name(name, row) if self.batch > 1 else name

    def _span(self, kv_cache: dict[str, torch.Tensor]) -> int:
        """The positions a row attends over: its whole cache as given (a window's W)."""
        return kv_utils.KVCacheEntry(kv_cache[self._row("k_0", 0)], kv_cache[self._row("v_0", 0)],
                                     kv_layout=self.kv_layout).get_max_seq_len()

    def sample_kwargs(self, kv_length: int) -> dict[str, object]:
        """Inputs of the right shapes; they also fix the signature's input names."""
        config = self.model.config
        kwargs: dict[str, object] = {
            "tokens": torch.zeros((self.batch, self.length), dtype=torch.int32),
            "input_pos": torch.arange(self.batch * self.length, dtype=torch.int32) % self.length,
        }
        entry = kv_utils.KVCacheEntry.from_model_config(self.window or kv_length, config.block_config(0).attn_config,
                                                        kv_layout=self.kv_layout)
        kwargs["kv_cache"] = {self._row(f"{kind}_{layer}", row): torch.zeros_like(cache)
                              for layer in range(config.num_layers) for row in range(self.batch)
                              for kind, cache in (("k", entry.k_cache), ("v", entry.v_cache))}
        if self.lora_rank:
            stacked = (self.batch,) if self.batch > 1 else ()
            kwargs["lora"] = {key: torch.zeros((*stacked, *shape))
                              for key, shape in lora_shapes(self.model, self.lora_rank, self.mlp, self.dora).items()}
        return kwargs

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, kv_cache: dict[str, torch.Tensor],
                lora: dict[str, torch.Tensor] | None = None) -> dict[str, object]:
        model, batch, length = self.model, self.batch, self.length
        config = model.config
        attn_config = config.block_config(0).attn_config
        x = model.tok_embedding(tokens)  # [B, T, D]
        if config.embedding_scale is not None:
            x = x * config.embedding_scale
        n_elem = int(attn_config.rotary_percentage * attn_config.head_dim)
        cos, sin = config.build_rope(input_pos, n_elem, attn_config.rotary_base)  # [1, B * T, n/2]
        rope = (cos.reshape(batch, 1, length, -1), sin.reshape(batch, 1, length, -1))  # [B, heads, T, n/2]
        span = self._span(kv_cache)
        mask = causal_mask(input_pos, span).reshape(batch, 1, length, span)
        masks = [mask[row:row + 1] for row in range(batch)]  # each row's, sliced once for all layers
        updated: dict[str, torch.Tensor] = {}
        for layer, block in enumerate(model.transformer_blocks):
            normed = block.pre_atten_norm(x)
            attended = self._attention(block.atten_func, layer, normed, rope, masks, input_pos, kv_cache, lora,
                                        updated)
            if block.config.parallel_residual:
                x = x + attended + self._feed_forward(block.ff, normed, lora, layer)
            else:
                x = x + attended
                x = x + self._feed_forward(block.ff, block.post_atten_norm(x), lora, layer)
        if not self.logits:
            return {"kv_cache": updated}
        return {"logits": model.lm_head(model.final_norm(x)), "kv_cache": updated}  # logits [B, T, vocab]

    def _attention(self, attn: nn.Module, layer: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   masks: list[torch.Tensor], input_pos: torch.Tensor, kv_cache: dict[str, torch.Tensor],
                   lora: dict[str, torch.Tensor] | None, updated: dict[str, torch.Tensor]) -> torch.Tensor:
        """litert-torch's ``CausalSelfAttention.forward`` for B rows of one token each (or
        one row of T tokens): shared projections, per-row LoRA, and per row: its K/V written
        into its own cache and attention over that cache's first ``window`` positions."""
        config, batch, length = attn.config, self.batch, self.length
        groups, head_dim = config.num_query_groups, config.head_dim
        if self.dora and lora is not None:
            scales = [self._scale(lora, layer, projection) for projection in ("q", "k", "v")]
            qkv = scaled_linear(attn.qkv_projection, x, fused_qkv_scale(attn, *scales))
        else:
            qkv = attn.qkv_projection(x)
        q_per_kv = config.num_heads // groups
        if config.qkv_transpose_before_split:
            qkv = qkv.view(batch, length, -1, head_dim)
            q, k, v = qkv.split((q_per_kv * groups, groups, groups), dim=-2)
        else:
            qkv = qkv.view(batch, length, groups, -1)
            q, k, v = qkv.split((q_per_kv * head_dim, head_dim, head_dim), dim=-1)
        if lora is not None:
            q = q + self._lora_delta(x, lora, layer, "q").reshape(q.shape)
            k = k + self._lora_delta(x, lora, layer, "k").reshape(k.shape)
            v = v + self._lora_delta(x, lora, layer, "v").reshape(v.shape)
        q = attn.query_norm(q).reshape(batch, length, -1, head_dim)
        k = attn.key_norm(k).reshape(batch, length, -1, head_dim)
        v = attn.value_norm(v).reshape(batch, length, -1, head_dim)
        q, k = rotary_position_embedding.apply_rope_inline(q, k, *rope)
        transposed = self.kv_layout == kv_utils.KV_LAYOUT_TRANSPOSED
        grouped = self.kv_layout == grouped_kv.KV_LAYOUT_GROUPED
        # Head h reads KV group h // q_per_kv, as litert-torch's repeat_interleave does.
        if length == 1:
            queries = q.reshape(batch, groups, q_per_kv, head_dim)
        else:  # one row [1, T, heads, hd] -> [1, G, q_per_kv * T, hd]: a group's heads' queries, T each
            queries = q.permute(0, 2, 1, 3).reshape(1, groups, q_per_kv * length, head_dim)
        queries = queries * (1.0 / math.sqrt(head_dim))
        rows = []
        for row in range(batch):
            k_name, v_name = self._row(f"k_{layer}", row), self._row(f"v_{layer}", row)
            entry = kv_utils.KVCacheEntry(kv_cache[k_name], kv_cache[v_name], kv_layout=self.kv_layout)
            one = slice(row, row + 1)
            if transposed:  # K [1, G, T, hd], V [1, G, hd, T]
                entry = kv_utils.update_transposed(entry, input_pos[one], k[one].permute(0, 2, 1, 3),
                                                   v[one].permute(0, 2, 3, 1))
                # Both products contract the caches' last axis as they lie (BATCH_MATMUL with
                # adj_y): no copy of the cache is transposed per step, and the attention of
                # a step costs ~0.6x the transposing matmuls' at 1024 positions, ~0.75x at 128.
                keys, values = entry.k_cache, entry.v_cache
                scores = bmm_4d(queries[one], keys)  # [1, G, q_per_kv * T, W]
            elif grouped:  # K and V [1, G, T, hd]: V read as it lies too (BATCH_MATMUL without adj_y)
                entry = grouped_kv.update(entry, input_pos[one], k[one].permute(0, 2, 1, 3),
                                          v[one].permute(0, 2, 1, 3))
                keys, values = entry.k_cache, entry.v_cache
                scores = bmm_4d(queries[one], keys)  # [1, G, q_per_kv * T, W]
            else:  # K and V [1, T, G, hd]
                entry = kv_utils.update(entry, input_pos[one], k[one], v[one])
                keys = entry.k_cache.permute(0, 2, 3, 1)  # [1, G, hd, W]
                values = entry.v_cache.permute(0, 2, 1, 3)  # [1, G, W, hd]
                scores = torch.matmul(queries[one], keys)  # [1, G, q_per_kv * T, W]
            updated[k_name], updated[v_name] = entry.k_cache, entry.v_cache
            if config.logit_softcap is not None:
                scores = torch.tanh(scores / config.logit_softcap) * config.logit_softcap
            span = scores.shape[-1]
            if length > 1:  # [1, heads, T, W], which the row's mask [1, 1, T, W] broadcasts over
                scores = scores.reshape(1, -1, length, span)
            probs = torch.softmax(scores + masks[row], dim=-1)
            if length > 1:
                probs = probs.reshape(1, groups, q_per_kv * length, span)
            attended_row = bmm_4d(probs, values) if transposed else \
                grouped_kv.matmul_4d(probs, values) if grouped else torch.matmul(probs, values)
            if length > 1:  # [1, G, q_per_kv * T, hd] -> [1, T, heads, hd]
                attended_row = attended_row.reshape(1, -1, length, head_dim).permute(0, 2, 1, 3)
            rows.append(attended_row.reshape(1, length, -1))  # [1, T, heads * hd]
        attended = torch.cat(rows, dim=0) if batch > 1 else rows[0]
        if self.dora and lora is not None:
            y = scaled_linear(attn.output_projection, attended, self._scale(lora, layer, "o"))
        else:
            y = attn.output_projection(attended)
        if lora is not None:
            y = y + self._lora_delta(attended, lora, layer, "o")
        return y

    def _feed_forward(self, ff: nn.Module, x: torch.Tensor, lora: dict[str, torch.Tensor] | None,
                      layer: int) -> torch.Tensor:
        """The block's feed-forward, with each row's LoRA on gate/up/down in an all-linear slot."""
        if not self.mlp or lora is None:
            return ff(x)
        project = None
        if self.dora:
            project = (lambda projection, linear, inputs:
                       scaled_linear(linear, inputs, self._scale(lora, layer, projection)))
        return feed_forward(ff, x, lambda projection, inputs: self._lora_delta(inputs, lora, layer, projection),
                            project)

    def _scale(self, lora: dict[str, torch.Tensor], layer: int, projection: str) -> torch.Tensor:
        """Each row's DoRA output scale less one of a projection: ``[B, 1, out]`` (over T tokens)."""
        return lora[lora_key(layer, projection, "m_prime")].reshape(self.batch, 1, -1)

    def _lora_delta(self, x: torch.Tensor, lora: dict[str, torch.Tensor], layer: int, projection: str) -> torch.Tensor:
        """``x_i A_i B_i`` for every row i of ``x`` ``[B, T, in]``: ``[B, T, out]``, as batched
        matmuls over the rows' stacked ``A`` ``[B, in, r]`` and ``B`` ``[B, r, out]``, or one
        row's unstacked ``[in, r]`` and ``[r, out]`` as they are (made ``[1, in, r]`` in the
        graph, they were a RESHAPE that XNNPACK ran as a copy of the adapter every step); one
        row's single token at a high rank as products and sums (:func:`lora_product`)."""
        return lora_product(x, lora[lora_key(layer, projection, "a_prime")],
                            lora[lora_key(layer, projection, "b_prime")])
