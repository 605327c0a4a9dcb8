"""Loading a checked source with transformers: the model in float32 and its tokenizer.

transformers reads both kinds of source: a model directory, and a GGUF file, whose
tensors it dequantizes (that needs ``accelerate``) and whose tokenizer and chat template
it converts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from runtime.errors import InvalidArgumentError
from runtime.export.source import Source


@dataclass(frozen=True)
class TokenizerAssets:
    """What a bundle carries besides the model."""

    # The Hugging Face tokenizer as tokenizer.json text.
    tokenizer_json: str
    # The Jinja2 chat template, or None when the checkpoint has none.
    chat_template: str | None
    # The texts of the beginning- and end-of-sequence tokens ("" when there is none), as
    # chat templates insert them.
    bos_token: str
    eos_token: str
    # The beginning-of-sequence token id, or None.
    bos_token_id: int | None
    # Token ids that end a generation.
    stop_token_ids: tuple[int, ...]


def load_model(source: Source) -> Any:
    """The source's transformers causal LM, float32, in eval mode."""
    import transformers

    extra: dict[str, Any] = {}
    if source.gguf_file:
        extra["gguf_file"] = source.gguf_file
        if hasattr(transformers, "GgufConfig"):  # versions that can keep GGUF blocks packed: unpack them
            extra["quantization_config"] = transformers.GgufConfig(gguf_file=source.gguf_file, dequantize=True)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            source.directory, dtype=torch.float32, local_files_only=True, **extra
        )
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError... for unreadable input
        raise InvalidArgumentError(f"{source.path}: transformers cannot load the model: {_first_line(exc)}") from None
    return model.eval()


def load_hf_tokenizer(source: Source) -> Any:
    """The source's transformers tokenizer (a GGUF file's converted one)."""
    from transformers import AutoTokenizer

    extra = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    try:
        return AutoTokenizer.from_pretrained(source.directory, local_files_only=True, **extra)
    except Exception as exc:  # transformers raises many kinds for unreadable tokenizer files
        raise InvalidArgumentError(f"{source.path}: the tokenizer cannot be read: {_first_line(exc)}") from None


def load_tokenizer(source: Source) -> TokenizerAssets:
    """The source's tokenizer as a bundle carries it (stop tokens: its end-of-sequence
    token; :func:`with_generation_stops` adds the model's)."""
    tokenizer = load_hf_tokenizer(source)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise InvalidArgumentError(
            f"{source.path}: the tokenizer ({type(tokenizer).__name__}) has no tokenizer.json form to bundle"
        )
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates: the default one is the chat
        template = template.get("default")
    return TokenizerAssets(
        tokenizer_json=backend.to_str(),
        chat_template=template or None,
        bos_token=tokenizer.bos_token or "",
        eos_token=tokenizer.eos_token or "",
        bos_token_id=tokenizer.bos_token_id,
        stop_token_ids=() if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),),
    )


def with_generation_stops(assets: TokenizerAssets, model: Any) -> TokenizerAssets:
    """``assets`` with the model's generation-config ``eos_token_id``(s) added to its stops."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    extra = eos if isinstance(eos, list | tuple) else [] if eos is None else [eos]
    stops = list(assets.stop_token_ids) + [int(t) for t in extra if int(t) not in assets.stop_token_ids]
    return dataclasses.replace(assets, stop_token_ids=tuple(dict.fromkeys(stops)))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
