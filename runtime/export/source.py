"""What an export reads, checked before anything heavy is imported or loaded.

A source is a Hugging Face model directory (``config.json`` and ``*.safetensors``) or a
GGUF model file. This module reads only headers (JSON, safetensors headers, GGUF
metadata) with packages the runtime already depends on, so a wrong path, an unsupported
architecture or a truncated weights file is refused in a second, without torch.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import DataLossError, InvalidArgumentError, NotFoundError, UnimplementedError
from runtime.adapters.gguf_data import GGUF_MAGIC, check_gguf_header

# Hugging Face model_type -> the family's name, for messages.
FAMILIES = {
    "llama": "Llama (SmolLM2, Llama 3.x)",
    "qwen2": "Qwen2 / Qwen2.5",
    "qwen3": "Qwen3",
    "gemma3_text": "Gemma 3 (text)",
}
# GGUF general.architecture -> the model_type transformers gives it.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}


@dataclass(frozen=True)
class Source:
    """A checked export source."""

    # The directory or GGUF file as given.
    path: Path
    # The Hugging Face model_type of its architecture (a key of FAMILIES).
    model_type: str
    # The GGUF file's name inside ``directory`` when the source is a GGUF file, else None.
    gguf_file: str | None
    # The number of weights (from the files' headers): what the export's memory scales with.
    parameters: int
    # The longest context the checkpoint was made for (config.json's max_position_embeddings,
    # a GGUF file's {architecture}.context_length); None where the source does not say.
    context_length: int | None = None

    @property
    def directory(self) -> Path:
        """The directory transformers loads from."""
        return self.path.parent if self.gguf_file else self.path


def supported_architectures() -> str:
    """The supported families, for error messages."""
    return ", ".join(f"{name} [{model_type}]" for model_type, name in FAMILIES.items())


def inspect_source(path: str | os.PathLike[str]) -> Source:
    """Checks that ``path`` is a Hugging Face directory or GGUF file of a supported family
    whose weights files are complete; raises a StatusError naming the file otherwise."""
    path = Path(path)
    if path.is_dir():
        return _inspect_directory(path)
    if not path.exists():
        raise NotFoundError(f"{path}: no such file or directory (expected a Hugging Face model directory or a "
                            "GGUF file)")
    with open(path, "rb") as file:
        magic = file.read(4)
    if magic != GGUF_MAGIC:
        raise InvalidArgumentError(f"{path}: neither a directory nor a GGUF file (no GGUF magic)")
    return _inspect_gguf(path)


def _inspect_directory(path: Path) -> Source:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise NotFoundError(f"{path}: no config.json (expected a Hugging Face model directory)")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgumentError(f"{config_file}: not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise InvalidArgumentError(f"{config_file}: expected a JSON object")
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        architecture = ", ".join(config.get("architectures") or []) or "unnamed"
        raise UnimplementedError(
            f"{config_file}: architecture {architecture} (model_type {model_type!r}) is not supported; "
            f"supported: {supported_architectures()}"
        )
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise NotFoundError(f"{path}: no *.safetensors weights (other weight formats are not read)")
    parameters = sum(_safetensors_parameters(file) for file in weights)
    text_config = config.get("text_config")  # multimodal checkpoints (Gemma 3) keep the text model's apart
    context = config.get("max_position_embeddings", text_config.get("max_position_embeddings")
                         if isinstance(text_config, dict) else None)
    return Source(path=path, model_type=model_type, gguf_file=None, parameters=parameters,
                  context_length=_positive_int(context))


def _safetensors_parameters(file: Path) -> int:
    """The number of weights in ``file``, from its header; refuses a corrupt or truncated file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="numpy") as opened:
            return sum(math.prod(opened.get_slice(name).get_shape()) for name in opened.keys())
    except SafetensorError as exc:
        raise DataLossError(f"{file}: corrupt or truncated safetensors file: {exc}") from None
    except OSError as exc:
        raise InvalidArgumentError(f"{file}: cannot be read: {exc}") from None


def _inspect_gguf(path: Path) -> Source:
    from gguf import GGUFReader

    check_gguf_header(path)
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise DataLossError(f"{path}: corrupt or truncated GGUF file: {exc}") from None
    fields = {name: _contents(field) for name, field in reader.fields.items()}
    general_type = fields.get("general.type", "model")
    if general_type != "model":
        raise InvalidArgumentError(f"{path}: general.type is {general_type!r}, expected a model, not an adapter")
    architecture = fields.get("general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise UnimplementedError(
            f"{path}: GGUF architecture {architecture!r} is not supported; supported: {supported_architectures()}"
        )
    parameters = sum(int(tensor.n_elements) for tensor in reader.tensors)
    return Source(path=path, model_type=GGUF_ARCHITECTURES[architecture], gguf_file=path.name, parameters=parameters,
                  context_length=_positive_int(fields.get(f"{architecture}.context_length")))


def _positive_int(value: object) -> int | None:
    """``value`` when it is a positive integer (a context length as a source states it), else None."""
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _contents(field: object) -> object:
    try:
        return field.contents()  # type: ignore[attr-defined]
    except (ValueError, IndexError, TypeError, UnicodeDecodeError):
        return None
