"""Writing a ``.litertlm`` bundle with ``litert-lm-builder``: the model, the Hugging Face
tokenizer, and an LlmMetadata section (start and stop tokens, the chat template as its
``jinja_prompt_template``, the KV length as ``max_num_tokens``).

The LlmMetadata section also carries two key/value items, ``bos_token`` and
``eos_token``: the texts chat templates insert, which :class:`runtime.Engine` passes to
the template (LiteRT-LM ignores them).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from litert_lm_builder import litertlm_builder as builder
from litert_lm_builder.runtime.proto import llm_metadata_pb2

from runtime.export.checkpoint import TokenizerAssets


def write_bundle(
    model_path: str | os.PathLike[str], tokenizer: TokenizerAssets, kv_length: int,
    out_path: str | os.PathLike[str],
) -> None:
    """Writes the bundle of the ``.tflite`` at ``model_path`` to ``out_path``."""
    metadata = llm_metadata_pb2.LlmMetadata(max_num_tokens=kv_length)
    if tokenizer.bos_token_id is not None:
        metadata.start_token.token_ids.ids.append(tokenizer.bos_token_id)
    for token in tokenizer.stop_token_ids:
        metadata.stop_tokens.add().token_ids.ids.append(token)
    if tokenizer.chat_template:
        metadata.jinja_prompt_template = tokenizer.chat_template
    texts = [builder.Metadata(key=key, value=value, dtype=builder.DType.STRING)
             for key, value in (("bos_token", tokenizer.bos_token), ("eos_token", tokenizer.eos_token)) if value]
    with tempfile.TemporaryDirectory() as work:
        tokenizer_file = Path(work, "tokenizer.json")
        tokenizer_file.write_text(tokenizer.tokenizer_json, encoding="utf-8")
        metadata_file = Path(work, "llm_metadata.pb")
        metadata_file.write_bytes(metadata.SerializeToString())
        bundle = builder.LitertLmFileBuilder()
        bundle.add_system_metadata(builder.Metadata(key="generator", value="python -m runtime export",
                                                    dtype=builder.DType.STRING))
        bundle.add_tflite_model(str(model_path), builder.TfLiteModelType.PREFILL_DECODE)
        bundle.add_hf_tokenizer(str(tokenizer_file))
        bundle.add_llm_metadata(str(metadata_file), additional_metadata=texts or None)
        with open(out_path, "wb") as stream:
            bundle.build(stream)
