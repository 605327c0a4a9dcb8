"""LoRA on every linear projection: the MLP's gate/up/down beside attention's q/k/v/o.

litert-torch 0.10.0 applies LoRA to attention only (its ``LoRA`` pytree has no MLP
part), so an all-linear slot's signatures are traced from :class:`AllLinearStep`: the
decoder's own loop over its blocks, where each block's attention is litert-torch's own
(given its q/k/v/o LoRA as a ``LoRAEntry``) and its gated feed-forward is computed here
with each projection's ``x A B`` added. A plain dict of tensors is the ``lora`` input:
``atten_{q,k,v,o}_{a,b}_prime_weight_{L}`` (the names litert-torch's pytree gives) and
``ff_{gate,up,down}_{a,b}_prime_weight_{L}``, flattened by the converter to the
runtime's ``lora_atten_*`` and ``lora_ff_*`` inputs.

Zero inputs make every delta zero: an all-linear signature with zeros equals the plain one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from runtime.errors import UnimplementedError
from runtime.export.families.common import causal_mask
from runtime.export.families.gemma3 import Gemma3Decoder  # its forward: gemma3_steps.py
from runtime.export.litert import attention, export_config as export_cfg, kv_utils, model_builder
from runtime.export.litert import rotary_position_embedding, sdpa_with_kv_update

ATTENTION_PROJECTIONS = {"q": "query", "k": "key", "v": "value", "o": "output"}  # ours -> litert-torch's
MLP_PROJECTIONS = ("gate", "up", "down")

# Computes a projection's LoRA delta for its input ``x``, or None when it has none.
Delta = Callable[[str, torch.Tensor], torch.Tensor | None]
# Computes a projection's base output: (its name, its linear layer, its input).
Project = Callable[[str, nn.Module, torch.Tensor], torch.Tensor]


def lora_key(layer: int, projection: str, side: str) -> str:
    """The ``lora`` dict key of one projection's ``a_prime`` / ``b_prime`` in one layer,
    whose flattened input name is the runtime's (``lora_atten_q_a_prime_weight_0``,
    ``lora_ff_gate_b_prime_weight_3``)."""
    block = "ff" if projection in MLP_PROJECTIONS else "atten"
    return f"{block}_{projection}_{side}_weight_{layer}"


def is_standard_decoder(model: nn.Module) -> bool:
    """Whether ``model`` is litert-torch's ``DecoderOnlyModel`` of standard blocks (whose
    forward this package's own steps write out), not a decoder of its own like Gemma 3's."""
    return isinstance(model, model_builder.DecoderOnlyModel) and all(
        type(block) is attention.TransformerBlock and type(block.atten_func) is attention.CausalSelfAttention
        for block in model.transformer_blocks)


class CausalMaskStep(nn.Module):
    """A prefill or decode step of litert-torch's ``DecoderOnlyModel`` ``model`` by its own
    forward (LoRA, if any, in litert-torch's form), given the causal mask computed from the
    positions (:func:`causal_mask`): left to itself it gathers rows of a ``[kv_length,
    kv_length]`` float32 table, 64 MiB in the file at 4,096 positions."""

    def __init__(self, model: nn.Module, export_config: export_cfg.ExportConfig) -> None:
        super().__init__()
        self.model = model
        self.export_config = export_config

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, kv_cache: kv_utils.KVCache,
                lora: object = None) -> dict[str, object]:
        mask = causal_mask(input_pos, kv_cache.get_max_seq_len())[None, None]
        return self.model(tokens, input_pos, kv_cache, mask=mask, lora=lora, export_config=self.export_config)


def check_mlp_lora(model: nn.Module) -> None:
    """Raises ``UnimplementedError`` unless ``model`` is litert-torch's decoder whose blocks
    are standard, or Gemma 3's own decoder, and whose feed-forward is gated with separate
    gate and up projections (Llama, Qwen2, Qwen3, Gemma 3): the structure
    :func:`feed_forward` computes."""
    if not is_standard_decoder(model) and not isinstance(model, Gemma3Decoder):
        raise UnimplementedError(
            f"--lora-targets all-linear is not available for {type(model).__name__}: Llama, Qwen2, Qwen3 and "
            "Gemma 3 exports have it (use --lora-targets attention)")
    if any(block.atten_func.config.use_alibi for block in model.transformer_blocks):
        raise UnimplementedError("--lora-targets all-linear does not support ALiBi attention (use --lora-targets "
                                 "attention)")
    for layer, block in enumerate(model.transformer_blocks):
        ff = block.ff
        if not (ff.config.use_separate_gating and not ff.use_glu and hasattr(ff, "w3")):
            raise UnimplementedError(
                f"layer {layer}'s feed-forward is not a gated one with separate gate and up projections: "
                "--lora-targets all-linear cannot apply LoRA to it")


def lora_shapes(model: nn.Module, rank: int, mlp: bool, dora: bool = False) -> dict[str, tuple[int, ...]]:
    """The ``lora`` dict's keys and shapes for a slot of ``rank`` (attention projections,
    and with ``mlp`` the feed-forward's): ``a_prime`` ``[in, r]``, ``b_prime`` ``[r, out]``,
    and with ``dora`` each projection's output scale ``m_prime`` ``[out]``
    (:mod:`runtime.export.dora`)."""
    config = model.config
    shapes = {}
    for layer in range(config.num_layers):
        attn = config.block_config(layer).attn_config
        q_out, kv_out, dim = attn.num_heads * attn.head_dim, attn.num_query_groups * attn.head_dim, config.embedding_dim
        fans = {"q": (dim, q_out), "k": (dim, kv_out), "v": (dim, kv_out), "o": (q_out, dim)}
        if mlp:
            hidden = config.block_config(layer).ff_config.intermediate_size
            fans.update(gate=(dim, hidden), up=(dim, hidden), down=(hidden, dim))
        for projection, (fan_in, fan_out) in fans.items():
            shapes[lora_key(layer, projection, "a_prime")] = (fan_in, rank)
            shapes[lora_key(layer, projection, "b_prime")] = (rank, fan_out)
            if dora:
                shapes[lora_key(layer, projection, "m_prime")] = (fan_out,)
    return shapes


def feed_forward(ff: nn.Module, x: torch.Tensor, delta: Delta, project: Project | None = None) -> torch.Tensor:
    """litert-torch's ``GatedFeedForward.forward`` with each projection's LoRA delta added:
    ``down(act(gate(x) + dg) * (up(x) + du)) + dd`` between its pre and post norms;
    ``project`` computes the base projections (default: the linear layers themselves)."""
    project = project or (lambda _, linear, inputs: linear(inputs))
    x_norm = ff.pre_ff_norm(x)
    gate, up = project("gate", ff.w1, x_norm), project("up", ff.w3, x_norm)
    gate_delta, up_delta = delta("gate", x_norm), delta("up", x_norm)
    if gate_delta is not None:
        gate = gate + gate_delta
    if up_delta is not None:
        up = up + up_delta
    hidden = ff.act(gate) * up
    out = project("down", ff.w2, hidden)
    down_delta = delta("down", hidden)
    if down_delta is not None:
        out = out + down_delta
    return ff.post_ff_norm(out)


def lora_attention(attn: nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
                   input_pos: torch.Tensor, kv_entry: kv_utils.KVCacheEntry, delta: Delta,
                   project: Project | None = None) -> tuple[torch.Tensor, kv_utils.KVCacheEntry]:
    """litert-torch's ``CausalSelfAttention.forward`` with each projection's LoRA delta added
    to its own output: ``q = q + dq`` after the fused q/k/v projection's split, where
    litert-torch writes ``q += dq`` into the split's view, which the converter lowers to a
    PAD and a SELECT over the whole fused output per projection (6 ops more per layer, and
    SELECT is not one of XNNPACK's). ``project`` computes the base projections by their
    names, ``"qkv"`` (the fused one) and ``"o"`` (default: the linear layers themselves)."""
    config = attn.config
    project = project or (lambda _, linear, inputs: linear(inputs))
    batch, length, _ = x.size()
    qkv = project("qkv", attn.qkv_projection, x)
    q_per_kv = config.num_heads // config.num_query_groups
    if config.qkv_transpose_before_split:
        qkv = qkv.view(batch, length, -1, config.head_dim)
        q, k, v = qkv.split((q_per_kv * config.num_query_groups, config.num_query_groups, config.num_query_groups),
                            dim=-2)
    else:
        qkv = qkv.view(batch, length, config.num_query_groups, -1)
        q, k, v = qkv.split((q_per_kv * config.head_dim, config.head_dim, config.head_dim), dim=-1)
    q = q + delta("q", x).reshape(q.shape)
    k = k + delta("k", x).reshape(k.shape)
    v = v + delta("v", x).reshape(v.shape)
    q = attn.query_norm(q).reshape(batch, length, -1, config.head_dim)
    k = attn.key_norm(k).reshape(batch, length, -1, config.head_dim)
    v = attn.value_norm(v).reshape(batch, length, -1, config.head_dim)
    q, k = rotary_position_embedding.apply_rope_inline(q, k, *rope)
    out, kv_entry = sdpa_with_kv_update.sdpa_with_kv_update(q, k, v, kv_entry, input_pos, mask, config,
                                                            attn.enable_hlfb)
    return project("o", attn.output_projection, out) + delta("o", out), kv_entry


class AllLinearStep(nn.Module):
    """A prefill or decode step of one session of ``model`` (litert-torch's
    ``DecoderOnlyModel``) with LoRA of rank ``lora_rank`` on every linear projection, or with
    ``mlp=False`` on attention's q/k/v/o only (the same graph as litert-torch's own LoRA
    step, less the ops :func:`lora_attention` saves; the same inputs)."""

    def __init__(self, model: nn.Module, lora_rank: int, export_config: export_cfg.ExportConfig,
                 mlp: bool = True) -> None:
        super().__init__()
        if mlp:
            check_mlp_lora(model)
        self.model = model
        self.lora_rank = lora_rank
        self.export_config = export_config
        self.mlp = mlp

    def sample_lora(self) -> dict[str, torch.Tensor]:
        """Zero ``lora`` inputs of the right shapes; they also fix the inputs' names."""
        return {key: torch.zeros(shape) for key, shape in lora_shapes(self.model, self.lora_rank, self.mlp).items()}

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, kv_cache: kv_utils.KVCache,
                lora: dict[str, torch.Tensor]) -> dict[str, object]:
        model = self.model
        config = model.config
        attn_config = config.block_config(0).attn_config
        x = model.tok_embedding(tokens)
        if config.embedding_scale is not None:
            x = x * config.embedding_scale
        rope = config.build_rope(input_pos, int(attn_config.rotary_percentage * attn_config.head_dim),
                                 attn_config.rotary_base)
        mask = causal_mask(input_pos, kv_cache.get_max_seq_len())[None, None]
        entries = []
        for layer, block in enumerate(model.transformer_blocks):
            x_norm = block.pre_atten_norm(x)
            attended, kv_entry = self.attention(block.atten_func, layer, x_norm, rope, mask, input_pos,
                                                kv_cache.caches[layer], lora)
            if block.config.parallel_residual:
                x = x + attended + self.feed_forward(block.ff, layer, x_norm, lora)
            else:
                x = x + attended
                x = x + self.feed_forward(block.ff, layer, block.post_atten_norm(x), lora)
            entries.append(kv_entry)
        updated = kv_utils.KVCache(tuple(entries))
        if torch.numel(input_pos) > 1 and not self.export_config.output_logits_on_prefill:
            return {"kv_cache": updated}
        return {"logits": model.lm_head(model.final_norm(x)), "kv_cache": updated}

    def attention(self, attn: nn.Module, layer: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                  mask: torch.Tensor, input_pos: torch.Tensor, kv_entry: kv_utils.KVCacheEntry,
                  lora: dict[str, torch.Tensor]) -> tuple[torch.Tensor, kv_utils.KVCacheEntry]:
        """One block's attention with its q/k/v/o LoRA (:func:`lora_attention`)."""
        return lora_attention(attn, x, rope, mask, input_pos, kv_entry, deltas(lora, layer))

    def feed_forward(self, ff: nn.Module, layer: int, x: torch.Tensor, lora: dict[str, torch.Tensor]) -> torch.Tensor:
        """One block's feed-forward, with its gate/up/down LoRA in an all-linear slot."""
        if not self.mlp:
            return ff(x)
        return feed_forward(ff, x, deltas(lora, layer), self.projector(lora, layer))

    def projector(self, lora: dict[str, torch.Tensor], layer: int) -> Project | None:
        """How one layer's feed-forward computes its base projections (None: as they are)."""
        return None


# From this rank up, one token's ``x A B`` is elementwise products and sums, not matmuls:
# XNNPACK packs a matmul's right-hand operand into its kernel's layout on every run when it
# is a graph input (as ``A`` and ``B`` are), and at rank 64 the packing costs more than the
# products. SmolLM2-135M, one session, attention window 128, 1 thread, AMD EPYC with AVX2,
# side by side in alternating rounds (2026-12-04): a rank-64 decode step took 0.93x (f32)
# and 0.82x (int8) the matmul form's time; the products alone (``benchmarks/lora_forms.py
# --rows 1``) 2.42 against 3.91 ms at rank 64, 0.87 against 1.33 at 32, 0.69 against 0.70
# at 16 and 0.65 against 0.57 at 8.
ELEMENTWISE_LORA_MIN_RANK = 32


def lora_product(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``x A B`` of one projection: ``x`` ``[..., in]`` with one row's ``a`` ``[in, r]`` and
    ``b`` ``[r, out]``, or rows' stacked ``[B, in, r]`` and ``[B, r, out]`` (batched
    matmuls). A single token against one row's ``A`` of rank ``ELEMENTWISE_LORA_MIN_RANK``
    or more is multiplied and summed where ``A`` and ``B`` lie, with no matmul to pack them."""
    if a.dim() == 2 and x.numel() == a.shape[0] and a.shape[1] >= ELEMENTWISE_LORA_MIN_RANK:
        hidden = (x.reshape(-1, 1) * a).sum(0, keepdim=True)  # [1, r]
        return (hidden.reshape(-1, 1) * b).sum(0).reshape(*x.shape[:-1], b.shape[-1])
    return torch.matmul(torch.matmul(x, a), b)


def deltas(lora: dict[str, torch.Tensor], layer: int) -> Delta:
    """The LoRA deltas of one layer's projections: ``x A B`` (:func:`lora_product`)."""

    def delta(projection: str, x: torch.Tensor) -> torch.Tensor:
        return lora_product(x, lora[lora_key(layer, projection, "a_prime")],
                            lora[lora_key(layer, projection, "b_prime")])
    return delta
