"""What a Hugging Face checkpoint of a supported family must state and hold, checked from
``config.json`` and the safetensors headers alone, or from a GGUF file's metadata and tensor
table (no torch, no weights read).

transformers fills a field config.json leaves out with its class's default, initializes a
tensor the weights files lack with random values (only logging it), and fails on a shape
that disagrees with the config only once every weight is loaded. Each of those becomes an
export that is wrong or fails minutes in; this module refuses them first, naming the field
or the tensor and what was expected.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import InvalidArgumentError, NotFoundError, UnimplementedError

# The MLP activations the families lower (runtime.export.families.common maps them).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# RoPE types transformers recomputes from the sequence length; a graph holds fixed tables.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
# RoPE types whose tables transformers computes once (the families export them as they are).
FIXED_ROPE = ("default", "linear", "llama3", "yarn", "proportional")
# Weight element types (safetensors' names) transformers loads as float32 for the export.
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
# The blockwise quantizations' block sizes: each linear layer's input width must split into
# whole blocks (ai-edge-quantizer says otherwise only once every signature is lowered).
QUANTIZATION_BLOCKS = {"int4-block32": 32, "int4-block128": 128}


@dataclass(frozen=True)
class FamilyLayout:
    """What a family's config and weights look like, where they differ between families."""

    # transformers' default where config.json has no tie_word_embeddings.
    tie_word_embeddings: bool
    # transformers' default head_dim where config.json has none; None: hidden_size // heads.
    head_dim: int | None
    # The config field naming the MLP activation, and its default.
    activation_field: str
    activation: str
    # q and k RMS-normalized per head (q_norm, k_norm).
    qk_norm: bool
    # Norms before and after the MLP as well (Gemma's four per block).
    sandwich_norms: bool
    # q/k/v carry biases whatever attention_bias says (Qwen2), and o_proj never does.
    qkv_bias_always: bool = False
    # Layers may attend over a sliding window (layer_types); the others' decoders have none.
    sliding_window_layers: bool = False
    # Exported with DoRA slots (--dora-ranks): litert-torch's standard decoder, not Gemma 3's own.
    dora: bool = True
    # Config values the family's decoder does not compute (field -> the only value it takes).
    fixed: tuple[tuple[str, object], ...] = ()


LAYOUTS: dict[str, FamilyLayout] = {
    "llama": FamilyLayout(tie_word_embeddings=False, head_dim=None, activation_field="hidden_act",
                          activation="silu", qk_norm=False, sandwich_norms=False),
    "qwen2": FamilyLayout(tie_word_embeddings=False, head_dim=None, activation_field="hidden_act",
                          activation="silu", qk_norm=False, sandwich_norms=False, qkv_bias_always=True),
    "qwen3": FamilyLayout(tie_word_embeddings=False, head_dim=128, activation_field="hidden_act",
                          activation="silu", qk_norm=True, sandwich_norms=False),
    "gemma3_text": FamilyLayout(tie_word_embeddings=True, head_dim=256, activation_field="hidden_activation",
                                activation="gelu_pytorch_tanh", qk_norm=True, sandwich_norms=True,
                                sliding_window_layers=True, dora=False,
                                fixed=(("final_logit_softcapping", None), ("attn_logit_softcapping", None),
                                       ("use_bidirectional_attention", False))),
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header describes it."""

    file: Path
    shape: tuple[int, ...]
    dtype: str


def check_config(config_file: Path, config: Mapping[str, object], model_type: str) -> dict[str, int]:
    """Checks the fields of ``config`` (``config_file``'s object, of family ``model_type``)
    the export reads; returns the model's dimensions (vocab, hidden, intermediate, layers,
    heads, kv_heads, head_dim). Raises a StatusError naming the field otherwise."""
    layout = LAYOUTS[model_type]
    if config.get("quantization_config") is not None:
        method = config["quantization_config"]
        method = method.get("quant_method", "unnamed") if isinstance(method, dict) else method
        raise UnimplementedError(f"{config_file}: quantization_config ({method}): quantized checkpoints are not "
                                 "exported; give the float checkpoint (and --quantize)")
    dims = {name: _positive_int(config_file, config, field) for name, field in (
        ("vocab", "vocab_size"), ("hidden", "hidden_size"), ("intermediate", "intermediate_size"),
        ("layers", "num_hidden_layers"), ("heads", "num_attention_heads"))}
    dims["kv_heads"] = _positive_int(config_file, config, "num_key_value_heads", default=dims["heads"])
    if dims["heads"] % dims["kv_heads"]:
        raise InvalidArgumentError(f"{config_file}: num_attention_heads {dims['heads']} is not a multiple of "
                                   f"num_key_value_heads {dims['kv_heads']}")
    if config.get("head_dim") is None and layout.head_dim is None:
        if dims["hidden"] % dims["heads"]:
            raise InvalidArgumentError(f"{config_file}: hidden_size {dims['hidden']} is not a multiple of "
                                       f"num_attention_heads {dims['heads']} (and no head_dim is given)")
        dims["head_dim"] = dims["hidden"] // dims["heads"]
    else:
        dims["head_dim"] = _positive_int(config_file, config, "head_dim", default=layout.head_dim)
    if dims["head_dim"] % 2:
        raise InvalidArgumentError(f"{config_file}: a head size of {dims['head_dim']} (head_dim, or hidden_size / "
                                   "num_attention_heads): expected an even number, RoPE rotates pairs")
    activation = config.get(layout.activation_field, layout.activation)
    if activation not in ACTIVATIONS:
        raise UnimplementedError(f"{config_file}: {layout.activation_field} {activation!r} is not supported; "
                                 f"supported: {', '.join(ACTIVATIONS)}")
    for field in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
        if field in config and not isinstance(config[field], bool):
            raise InvalidArgumentError(f"{config_file}: {field} {config[field]!r}: expected true or false")
    for field, only in layout.fixed:
        if config.get(field, only) != only:
            raise UnimplementedError(f"{config_file}: {field} {config[field]!r} is not supported for {model_type} "
                                     f"(only {json.dumps(only)})")
    layer_types = config.get("layer_types") or ["full_attention"]
    if not isinstance(layer_types, list) or not all(isinstance(kind, str) for kind in layer_types):
        raise InvalidArgumentError(f"{config_file}: layer_types {layer_types!r}: expected a list of attention types")
    sliding = config.get("use_sliding_window") or set(layer_types) != {"full_attention"}
    if sliding and not layout.sliding_window_layers:
        raise UnimplementedError(f"{config_file}: sliding-window attention (use_sliding_window / layer_types) is not "
                                 f"supported for {model_type}")
    for field in ("rope_parameters", "rope_scaling"):
        for rope_type in _rope_types(config.get(field)):
            if rope_type in LENGTH_DEPENDENT_ROPE:
                raise UnimplementedError(f"{config_file}: {field} type {rope_type!r} recomputes RoPE from the "
                                         "sequence length, which an exported graph cannot; supported: fixed tables "
                                         f"({', '.join(FIXED_ROPE)})")
            if rope_type is not None and rope_type not in FIXED_ROPE:
                raise UnimplementedError(f"{config_file}: {field} type {rope_type!r} is not a RoPE type transformers "
                                         f"computes; supported: {', '.join(FIXED_ROPE)}")
    return dims


def check_export(source: Path, model_type: str, dims: Mapping[str, int], quantizations: Sequence[str],
                 dora_ranks: Sequence[int]) -> None:
    """Refuses what a ``model_type`` model of ``dims`` (from ``source``) cannot be exported
    with, before it is loaded: a blockwise quantization whose block does not divide a linear
    layer's input width, DoRA slots for a family without them."""
    if dora_ranks and not LAYOUTS[model_type].dora:
        raise UnimplementedError(f"{source}: --dora-ranks is not available for {model_type}: DoRA slots are "
                                 "exported for Llama, Qwen2 and Qwen3")
    widths = {"hidden_size": dims["hidden"], "intermediate_size": dims["intermediate"],
              "num_attention_heads x head_dim": dims["heads"] * dims["head_dim"]}
    for quantize in quantizations:
        block = QUANTIZATION_BLOCKS.get(quantize)
        for name, width in widths.items() if block else ():
            if width % block:
                raise InvalidArgumentError(f"{source}: quantize={quantize!r} does not fit this model: its "
                                           f"{name} {width} is not divisible by block size {block}")


def check_tensors(config_file: Path, config: Mapping[str, object], model_type: str, dims: Mapping[str, int],
                  tensors: Mapping[str, TensorInfo]) -> None:
    """Checks that ``tensors`` (every tensor of the weights files, by name) hold each weight
    of the model ``config`` describes, in its shape and a float type; raises a StatusError
    naming the tensor (and its file) otherwise. Other tensors are left to transformers."""
    for name, shape in expected_shapes(config, model_type, dims).items():
        info = tensors.get(name)
        if info is None:
            extra = ""
            if name == "lm_head.weight":
                stated = "" if "tie_word_embeddings" in config else ", transformers' default for this family"
                extra = f" (tie_word_embeddings is false{stated}: the output projection is its own tensor)"
            raise NotFoundError(f"{config_file.parent}: the weights have no tensor {name} {list(shape)}{extra}")
        if info.shape != shape:
            raise InvalidArgumentError(f"{info.file}: tensor {name} has shape {list(info.shape)}, expected "
                                       f"{list(shape)} from {config_file.name}")
        if info.dtype not in FLOAT_DTYPES:
            raise UnimplementedError(f"{info.file}: tensor {name} is {info.dtype}, expected a float type "
                                     f"({', '.join(FLOAT_DTYPES)})")


def check_gguf_tensors(path: Path, model_type: str, dims: Mapping[str, int],
                       shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Checks that a GGUF file (``path``) of ``model_type`` with the dimensions its metadata
    states (``dims``, :func:`runtime.export.source` reads them) holds every tensor its model
    loads, in its shape (``shapes``: the file's tensors by llama.cpp's names, numpy's order,
    rows first). transformers would initialize a missing tensor at random, and fail on a
    shape that disagrees with the metadata only once every weight is dequantized; raises
    ``NotFoundError`` / ``InvalidArgumentError`` naming the tensor."""
    expected = expected_gguf_shapes(model_type, dims)
    for name, shape in expected.items():
        if name not in shapes:
            raise NotFoundError(f"{path}: no tensor {name} (a {model_type} model of {dims['layers']} blocks needs it)")
        if shape is not None and tuple(shapes[name]) != shape:
            raise InvalidArgumentError(f"{path}: tensor {name} has shape {list(shapes[name])}, expected {list(shape)} "
                                       "from the file's metadata")
    embedding = shapes["token_embd.weight"]
    if len(embedding) != 2 or embedding[1] != dims["hidden"]:
        raise InvalidArgumentError(f"{path}: tensor token_embd.weight has shape {list(embedding)}, expected [vocab, "
                                   f"{dims['hidden']}] from the file's metadata")
    if "output.weight" in shapes and tuple(shapes["output.weight"]) != tuple(embedding):
        raise InvalidArgumentError(f"{path}: tensor output.weight has shape {list(shapes['output.weight'])}, expected "
                                   f"{list(embedding)} (token_embd.weight's)")


def expected_gguf_shapes(model_type: str, dims: Mapping[str, int]) -> dict[str, tuple[int, ...] | None]:
    """Every tensor a ``model_type`` GGUF model of ``dims`` must hold, by llama.cpp's name,
    with its shape (numpy's order, rows first); None where the metadata does not fix it
    (the embedding's rows: GGUF states the vocabulary in the tokenizer's metadata)."""
    layout = LAYOUTS[model_type]
    hidden, inter, head_dim = dims["hidden"], dims["intermediate"], dims["head_dim"]
    q_out, kv_out = dims["heads"] * head_dim, dims["kv_heads"] * head_dim
    per_layer: dict[str, tuple[int, ...]] = {
        "attn_norm.weight": (hidden,), "attn_q.weight": (q_out, hidden), "attn_k.weight": (kv_out, hidden),
        "attn_v.weight": (kv_out, hidden), "attn_output.weight": (hidden, q_out), "ffn_norm.weight": (hidden,),
        "ffn_gate.weight": (inter, hidden), "ffn_up.weight": (inter, hidden), "ffn_down.weight": (hidden, inter)}
    if layout.qk_norm:
        per_layer.update({"attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,)})
    if layout.sandwich_norms:
        per_layer.update({"post_attention_norm.weight": (hidden,), "post_ffw_norm.weight": (hidden,)})
    if layout.qkv_bias_always:
        per_layer.update({"attn_q.bias": (q_out,), "attn_k.bias": (kv_out,), "attn_v.bias": (kv_out,)})
    expected: dict[str, tuple[int, ...] | None] = {"token_embd.weight": None, "output_norm.weight": (hidden,)}
    for i in range(dims["layers"]):
        expected.update({f"blk.{i}.{name}": shape for name, shape in per_layer.items()})
    return expected


def expected_shapes(config: Mapping[str, object], model_type: str,
                    dims: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
    """Every weight a ``model_type`` model of ``dims`` (from :func:`check_config`) loads,
    by its Hugging Face name, with its shape."""
    layout = LAYOUTS[model_type]
    hidden, inter, head_dim = dims["hidden"], dims["intermediate"], dims["head_dim"]
    q_out, kv_out = dims["heads"] * head_dim, dims["kv_heads"] * head_dim
    attention_bias = bool(config.get("attention_bias", False))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (dims["vocab"], hidden),
                                          "model.norm.weight": (hidden,)}
    if not config.get("tie_word_embeddings", layout.tie_word_embeddings):
        shapes["lm_head.weight"] = (dims["vocab"], hidden)
    norms = ["input_layernorm", "post_attention_layernorm"]
    if layout.sandwich_norms:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for i in range(dims["layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + f"{norm}.weight": (hidden,) for norm in norms})
        projections = {"self_attn.q_proj": (q_out, hidden), "self_attn.k_proj": (kv_out, hidden),
                       "self_attn.v_proj": (kv_out, hidden), "self_attn.o_proj": (hidden, q_out),
                       "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
                       "mlp.down_proj": (hidden, inter)}
        shapes.update({p + f"{name}.weight": shape for name, shape in projections.items()})
        biased = (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"] if layout.qkv_bias_always
                  else ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
                  if attention_bias else [])
        if config.get("mlp_bias", False):
            biased += ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
        shapes.update({p + f"{name}.bias": projections[name][:1] for name in biased})
        if layout.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)})
    return shapes


def _positive_int(config_file: Path, config: Mapping[str, object], field: str, default: int | None = None) -> int:
    value = config.get(field)
    if value is None and default is not None:
        return default
    if value is None:
        raise InvalidArgumentError(f"{config_file}: no {field} (expected a positive integer)")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidArgumentError(f"{config_file}: {field} {value!r}: expected a positive integer")
    return value


def _rope_types(parameters: object) -> list[object]:
    """The RoPE types a ``rope_parameters`` / ``rope_scaling`` value names: one dict, or one
    per attention type (Gemma 3)."""
    if not isinstance(parameters, dict):
        return []
    if any(isinstance(value, dict) for value in parameters.values()):
        return [t for value in parameters.values() for t in _rope_types(value)]
    return [parameters.get("rope_type", parameters.get("type"))]
