"""Tiny export sources written without torch: a Hugging Face Llama directory (config.json,
model.safetensors, a word-level tokenizer with a chat template) and the same weights as a
GGUF file laid out the way llama.cpp's converter writes a Llama."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

VOCAB = 96
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 32, 2, 4, 2, 8, 64
ROPE_THETA, RMS_EPS = 10_000.0, 1e-5
WORDS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "paris", "france", "capital", "the", "of", "is",
         "what", "?", "."] + [f"w{i}" for i in range(VOCAB - 14)]
BOS, EOS = 1, 2
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|> ' + message['content'] + ' ' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def llama_weights(seed: int = 7) -> dict[str, np.ndarray]:
    """Hugging Face Llama weights (``[out, in]`` projections), tied embeddings."""
    rng = np.random.default_rng(seed)

    def draw(*shape: int, std: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    weights = {"model.embed_tokens.weight": draw(VOCAB, HIDDEN, std=0.5),
               "model.norm.weight": 1 + draw(HIDDEN, std=0.1)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": 1 + draw(HIDDEN, std=0.1),
            p + "self_attn.q_proj.weight": draw(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": draw(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": draw(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": draw(HIDDEN, HEADS * HEAD_DIM),
            p + "post_attention_layernorm.weight": 1 + draw(HIDDEN, std=0.1),
            p + "mlp.gate_proj.weight": draw(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": draw(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": draw(HIDDEN, INTERMEDIATE),
        })
    return weights


def write_llama_directory(directory: Path, *, tokenizer: bool = True) -> Path:
    """A Hugging Face Llama model directory; with ``tokenizer``, a word-level
    tokenizer.json and a tokenizer_config.json carrying :data:`CHAT_TEMPLATE`."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "hidden_act": "silu", "rms_norm_eps": RMS_EPS,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA}, "max_position_embeddings": 256,
        "tie_word_embeddings": True, "bos_token_id": BOS, "eos_token_id": EOS,
    }
    (directory / "config.json").write_text(json.dumps(config))
    save_file(llama_weights(), str(directory / "model.safetensors"))
    if tokenizer:
        write_tokenizer(directory)
    return directory


def write_tokenizer(directory: Path, vocab: int = VOCAB) -> None:
    """tokenizer.json (whitespace-split words: :data:`WORDS`, then ``w{i}`` up to ``vocab``)
    and tokenizer_config.json with the template."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = WORDS + [f"w{i}" for i in range(VOCAB - 14, vocab - 14)]
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(word, special=True) for word in WORDS[:5]])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE,
    }))


def write_gqa_directory(directory: Path) -> Path:
    """The tiny GQA model of ``tests/models/gqa_weights.npz`` (the one exported with verify
    signatures in ``tests/models/turbo/``) as a Hugging Face Llama directory with a
    word-level tokenizer of its 256 tokens and :data:`CHAT_TEMPLATE`."""
    from safetensors.numpy import save_file

    weights = np.load(Path(__file__).resolve().parent / "models" / "gqa_weights.npz")
    config = {key.removeprefix("config."): weights[key].item() for key in weights if key.startswith("config.")}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config["vocab"],
        "hidden_size": config["hidden"], "intermediate_size": config["intermediate"],
        "num_hidden_layers": config["num_layers"], "num_attention_heads": config["num_heads"],
        "num_key_value_heads": config["num_kv_groups"], "head_dim": config["head_dim"], "hidden_act": "silu",
        "rms_norm_eps": config["rms_eps"], "rope_parameters": {"rope_type": "default", "rope_theta": config["rope_base"]},
        "max_position_embeddings": config["kv_cache_max_len"], "tie_word_embeddings": False, "bos_token_id": BOS,
        "eos_token_id": EOS}))
    names = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
             **{p: f"self_attn.{p}_proj" for p in "qkvo"}, **{p: f"mlp.{p}_proj" for p in ("gate", "up", "down")}}
    state = {"model.embed_tokens.weight": weights["embedding"], "model.norm.weight": weights["final_norm"],
             "lm_head.weight": weights["lm_head"]}
    for i in range(config["num_layers"]):
        state.update({f"model.layers.{i}.{hf_name}.weight": weights[f"layers.{i}.{name}"]
                      for name, hf_name in names.items()})
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in state.items()}, str(directory / "model.safetensors"))
    write_tokenizer(directory, config["vocab"])
    return directory


def write_llama_gguf(path: Path) -> Path:
    """The weights of :func:`llama_weights` as a float32 GGUF model (llama architecture,
    q/k rows permuted as llama.cpp's converter does; no tokenizer)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_vocab_size(VOCAB)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    weights = llama_weights()
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    for i in range(LAYERS):
        for hf_name, gguf_name in names.items():
            tensor = weights[f"model.layers.{i}.{hf_name}.weight"]
            if gguf_name in ("attn_q", "attn_k"):
                tensor = _rope_permute(tensor, HEADS if gguf_name == "attn_q" else KV_HEADS)
            writer.add_tensor(f"blk.{i}.{gguf_name}.weight", tensor)
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _rope_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for q/k: per head, the two RoPE halves interleaved."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
