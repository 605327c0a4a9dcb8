"""``decode_batch{B}``: one decode step for B sessions in one pass over the base weights.

Every row has its own token, position, KV cache and LoRA weights; the base linears (q/k/v,
output projection, feed-forward, lm_head) run once over the ``[B, 1, hidden]``
activations, which at real size is what a decode step costs: reading the weights.
Attention runs per row (each row attends over its own cache up to its own position) with
litert-torch's own ``sdpa_with_kv_update``, and each row adds its own ``x A_i B_i``.

Inputs, named as the runtime binds them (litert-torch names a nested dict's leaves
``{outer}_{inner}``; a row's names are the single-session names with ``_{row}`` appended):

- ``tokens`` int32 ``[B, 1]``, ``input_pos`` int32 ``[B]``;
- ``kv_cache_{k,v}_{layer}_{row}``: one session's cache, in the layout of ``decode``;
- ``lora_atten_{q,k,v,o}_{a,b}_prime_weight_{layer}_{row}`` (with a LoRA rank): that
  row's adapter, in the layout of ``decode_lora_r{R}``. Zeros make a row plain.

Outputs: ``logits`` ``[B, 1, vocab]`` and ``kv_cache_{k,v}_{layer}_{row}``.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.errors import UnimplementedError
from runtime.export.litert import attention, kv_utils, lora_utils, model_builder, rotary_position_embedding
from runtime.export.litert import sdpa_with_kv_update

_PROJECTIONS = {"q": "query", "k": "key", "v": "value", "o": "output"}


def check_batchable(model: nn.Module) -> None:
    """Raises ``UnimplementedError`` unless ``model`` is litert-torch's decoder with its
    standard blocks (the families whose batched step this module knows how to write)."""
    blocks = getattr(model, "transformer_blocks", ())
    plain = isinstance(model, model_builder.DecoderOnlyModel) and all(
        type(block) is attention.TransformerBlock and type(block.atten_func) is attention.CausalSelfAttention
        for block in blocks)
    if not plain:
        raise UnimplementedError(
            f"batched decode signatures are not available for {type(model).__name__} (Gemma 3's own "
            "decoder); Llama, Qwen2 and Qwen3 exports have them")
    if any(block.atten_func.config.use_alibi for block in blocks):
        raise UnimplementedError("batched decode signatures do not support ALiBi attention")


class BatchDecode(nn.Module):
    """The ``decode_batch{batch}`` step of ``model`` (litert-torch's ``DecoderOnlyModel``),
    with per-row LoRA inputs of rank ``lora_rank`` (``None``: no LoRA inputs)."""

    def __init__(self, model: nn.Module, batch: int, lora_rank: int | None, kv_layout: tuple) -> None:
        super().__init__()
        check_batchable(model)
        self.model = model
        self.batch = batch
        self.lora_rank = lora_rank
        self.kv_layout = kv_layout

    def sample_kwargs(self, kv_length: int) -> dict[str, object]:
        """Inputs of the right shapes; they also fix the signature's input names."""
        config = self.model.config
        kwargs: dict[str, object] = {
            "tokens": torch.zeros((self.batch, 1), dtype=torch.int32),
            "input_pos": torch.zeros((self.batch,), dtype=torch.int32),
        }
        entry = kv_utils.KVCacheEntry.from_model_config(kv_length, config.block_config(0).attn_config,
                                                        kv_layout=self.kv_layout)
        kwargs["kv_cache"] = {f"{kind}_{layer}_{row}": torch.zeros_like(cache)
                              for layer in range(config.num_layers) for row in range(self.batch)
                              for kind, cache in (("k", entry.k_cache), ("v", entry.v_cache))}
        if self.lora_rank:
            zeros = lora_utils.LoRA.zeros(self.lora_rank, config)
            kwargs["lora"] = {
                _lora_key(layer, short, side, row): torch.zeros_like(getattr(getattr(entry.attention, long), side))
                for layer, entry in enumerate(zeros.adapters) for short, long in _PROJECTIONS.items()
                for side in ("a_prime", "b_prime") for row in range(self.batch)}
        return kwargs

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, kv_cache: dict[str, torch.Tensor],
                lora: dict[str, torch.Tensor] | None = None) -> dict[str, object]:
        model, batch = self.model, self.batch
        config = model.config
        attn_config = config.block_config(0).attn_config
        x = model.tok_embedding(tokens)  # [B, 1, D]
        if config.embedding_scale is not None:
            x = x * config.embedding_scale
        n_elem = int(attn_config.rotary_percentage * attn_config.head_dim)
        cos, sin = config.build_rope(input_pos, n_elem, attn_config.rotary_base)  # [1, B, n/2]
        rope = (cos.reshape(batch, 1, 1, -1), sin.reshape(batch, 1, 1, -1))  # [B, heads, T, n/2]
        kv_length = kv_utils.KVCacheEntry(kv_cache["k_0_0"], kv_cache["v_0_0"],
                                          kv_layout=self.kv_layout).get_max_seq_len()
        mask = model.mask_cache.index_select(2, input_pos)[:, :, :, :kv_length].reshape(batch, 1, 1, kv_length)
        updated: dict[str, torch.Tensor] = {}
        for layer, block in enumerate(model.transformer_blocks):
            normed = block.pre_atten_norm(x)
            attended = self._attention(block.atten_func, layer, normed, rope, mask, input_pos, kv_cache, lora,
                                        updated)
            if block.config.parallel_residual:
                x = x + attended + block.ff(normed)
            else:
                x = x + attended
                x = x + block.ff(block.post_atten_norm(x))
        logits = model.lm_head(model.final_norm(x))  # [B, 1, vocab]
        return {"logits": logits, "kv_cache": updated}

    def _attention(self, attn: nn.Module, layer: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   mask: torch.Tensor, input_pos: torch.Tensor, kv_cache: dict[str, torch.Tensor],
                   lora: dict[str, torch.Tensor] | None, updated: dict[str, torch.Tensor]) -> torch.Tensor:
        """litert-torch's ``CausalSelfAttention.forward`` for B rows of one token each:
        shared projections, per-row LoRA, per-row attention over the row's own cache."""
        config, batch = attn.config, self.batch
        qkv = attn.qkv_projection(x)
        q_per_kv = config.num_heads // config.num_query_groups
        if config.qkv_transpose_before_split:
            qkv = qkv.view(batch, 1, -1, config.head_dim)
            q, k, v = qkv.split((q_per_kv * config.num_query_groups, config.num_query_groups,
                                 config.num_query_groups), dim=-2)
        else:
            qkv = qkv.view(batch, 1, config.num_query_groups, -1)
            q, k, v = qkv.split((q_per_kv * config.head_dim, config.head_dim, config.head_dim), dim=-1)
        if lora is not None:
            q = q + self._lora_delta(x, lora, layer, "q").reshape(q.shape)
            k = k + self._lora_delta(x, lora, layer, "k").reshape(k.shape)
            v = v + self._lora_delta(x, lora, layer, "v").reshape(v.shape)
        q = attn.query_norm(q).reshape(batch, 1, -1, config.head_dim)
        k = attn.key_norm(k).reshape(batch, 1, -1, config.head_dim)
        v = attn.value_norm(v).reshape(batch, 1, -1, config.head_dim)
        q, k = rotary_position_embedding.apply_rope_inline(q, k, *rope)
        rows = []
        for row in range(batch):
            entry = kv_utils.KVCacheEntry(kv_cache[f"k_{layer}_{row}"], kv_cache[f"v_{layer}_{row}"],
                                          kv_layout=self.kv_layout)
            one = slice(row, row + 1)
            out, entry = sdpa_with_kv_update.sdpa_with_kv_update(
                q[one], k[one], v[one], entry, input_pos[one], mask[one], config, attn.enable_hlfb)
            updated[f"k_{layer}_{row}"], updated[f"v_{layer}_{row}"] = entry.k_cache, entry.v_cache
            rows.append(out)
        attended = torch.cat(rows, dim=0) if batch > 1 else rows[0]  # [B, 1, heads * head_dim]
        y = attn.output_projection(attended)
        if lora is not None:
            y = y + self._lora_delta(attended, lora, layer, "o")
        return y

    def _lora_delta(self, x: torch.Tensor, lora: dict[str, torch.Tensor], layer: int, projection: str) -> torch.Tensor:
        """``x_i A_i B_i`` for every row i of ``x`` ``[B, 1, in]``: ``[B, 1, out]``."""
        rows = [torch.matmul(torch.matmul(x[row:row + 1], lora[_lora_key(layer, projection, "a_prime", row)]),
                             lora[_lora_key(layer, projection, "b_prime", row)])
                for row in range(self.batch)]
        return torch.cat(rows, dim=0) if self.batch > 1 else rows[0]


def _lora_key(layer: int, projection: str, side: str, row: int) -> str:
    """The ``lora`` dict key whose flattened input name is the single-session name
    (``lora_atten_q_a_prime_weight_{layer}``) with ``_{row}`` appended."""
    return f"atten_{projection}_{side}_weight_{layer}_{row}"

