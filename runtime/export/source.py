"""What an export reads, checked before anything heavy is imported or loaded.

A source is a Hugging Face model directory (``config.json`` and ``*.safetensors``) or a
GGUF model file. This module reads only headers (JSON, safetensors headers, GGUF
metadata) with packages the runtime already depends on, so a wrong path, an unsupported
architecture, a config value the export cannot take, a weight missing, misshapen or not a
float (:mod:`runtime.export.layout`) or a truncated weights file is refused in a second,
without torch.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import DataLossError, InvalidArgumentError, NotFoundError, UnimplementedError
from runtime.adapters.gguf_data import check_gguf_header
from runtime.export import layout
from runtime.util.gguf_file import GGUF_MAGIC

# Hugging Face model_type -> the family's name, for messages.
FAMILIES = {
    "llama": "Llama (SmolLM2, Llama 3.x)",
    "qwen2": "Qwen2 / Qwen2.5",
    "qwen3": "Qwen3",
    "gemma3_text": "Gemma 3 (text)",
}
# The weights files transformers reads from a directory: the one file, else the index of shards.
SAFE_WEIGHTS, SAFE_WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"
# The files transformers builds a directory's tokenizer from, one sufficing.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
# GGUF general.architecture -> the model_type transformers gives it.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
# The {architecture}.* metadata transformers builds the model's config from (it would fill a
# missing one with its class default, then fail or mis-shape the weights).
GGUF_REQUIRED_FIELDS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
# GGUF tensor types transformers dequantizes (with gguf's dequantize, which reads no others:
# Q8_1 and Q8_K are llama.cpp's internal ones, I8-I64 and F64 no model weights).
GGUF_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                     "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
                     "TQ1_0", "TQ2_0", "MXFP4")


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
    # What the tokenizer is read from: a file of :data:`TOKENIZER_FILES` in the directory, or
    # the GGUF file's tokenizer.ggml.model; None when the source has no tokenizer.
    tokenizer: str | None = None
    # The model's dimensions as the config or GGUF metadata state them (hidden, intermediate,
    # layers, heads, kv_heads, head_dim; from config.json also vocab): what
    # :func:`runtime.export.layout.check_export` checks settings against.
    dimensions: Mapping[str, int] | None = None

    @property
    def directory(self) -> Path:
        """The directory transformers loads from."""
        return self.path.parent if self.gguf_file else self.path


def check_settings(source: Source, quantizations: Sequence[str], dora_ranks: Sequence[int]) -> None:
    """Refuses export settings ``source``'s model cannot take (a quantization block that does
    not divide its layers, DoRA slots for Gemma 3: :func:`runtime.export.layout.check_export`),
    before it is loaded."""
    if source.dimensions is not None:
        layout.check_export(source.path, source.model_type, source.dimensions, quantizations, dora_ranks)


def check_tokenizer(source: Source, needed_by: str = "a bundle carries") -> None:
    """Checks that ``source`` has a tokenizer, which ``needed_by`` says what needs (a
    directory's tokenizer.json must be JSON, its token ids within the model's vocabulary);
    raises a StatusError naming the source or the file otherwise. Checked before torch is
    imported, where transformers' own error came after it."""
    if source.tokenizer is None:
        where = "tokenizer.ggml.model metadata" if source.gguf_file else " or ".join(TOKENIZER_FILES)
        raise NotFoundError(f"{source.path}: no tokenizer ({where}), which {needed_by}")
    if source.gguf_file or source.tokenizer != "tokenizer.json":
        return
    file = source.directory / source.tokenizer
    try:
        tokenizer = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgumentError(f"{file}: not a readable JSON file: {exc}") from None
    if not isinstance(tokenizer, dict) or not isinstance(tokenizer.get("model"), dict):
        raise InvalidArgumentError(f"{file}: expected a Hugging Face tokenizer (a JSON object with a model)")
    vocab = (source.dimensions or {}).get("vocab")
    ids = _token_id_count(tokenizer)
    if vocab is not None and ids > vocab:
        raise InvalidArgumentError(f"{file}: token ids up to {ids - 1}, but the model's vocab_size is {vocab}: the "
                                   "embedding has no row for the rest (a tokenizer of another model?)")


def _token_id_count(tokenizer: Mapping[str, object]) -> int:
    """One more than the highest token id a tokenizer.json object gives: its model's
    vocabulary (a token -> id map, or a list of entries) and its added tokens."""
    vocab = tokenizer["model"].get("vocab") if isinstance(tokenizer["model"], dict) else None
    ids = [value for value in vocab.values() if isinstance(value, int)] if isinstance(vocab, dict) else []
    count = len(vocab) if isinstance(vocab, list) else max(ids, default=-1) + 1
    added = tokenizer.get("added_tokens")
    added_ids = [token.get("id") for token in added if isinstance(token, dict)] if isinstance(added, list) else []
    return max([count, *(i + 1 for i in added_ids if isinstance(i, int))])


def supported_architectures() -> str:
    """The supported families, for error messages."""
    return ", ".join(f"{name} [{model_type}]" for model_type, name in FAMILIES.items())


def inspect_source(path: str | os.PathLike[str]) -> Source:
    """Checks that ``path`` is a Hugging Face directory or GGUF file of a supported family
    whose weights files are complete; raises a StatusError naming the file otherwise."""
    path = Path(path)
    if path.is_dir():
        return _inspect_directory(path)
    _refuse_broken_link(path)
    if not path.exists():
        raise NotFoundError(f"{path}: no such file or directory (expected a Hugging Face model directory or a "
                            "GGUF file)")
    with open(path, "rb") as file:
        magic = file.read(4)
    if magic != GGUF_MAGIC:
        if (path.parent / "config.json").is_file():
            raise InvalidArgumentError(f"{path}: a file of the model directory {path.parent}; give the directory")
        raise InvalidArgumentError(f"{path}: neither a directory nor a GGUF file (no GGUF magic)")
    return _inspect_gguf(path)


def _inspect_directory(path: Path) -> Source:
    config_file = path / "config.json"
    _refuse_broken_link(config_file)
    if not config_file.is_file():
        if (path / "adapter_config.json").is_file():
            raise InvalidArgumentError(
                f"{path}: a PEFT adapter (adapter_config.json), not a model: export its base model "
                f"({_adapter_base(path / 'adapter_config.json')}) and give the adapter to generate/serve as a LoRA"
            )
        ggufs = sorted(file.name for file in path.glob("*.gguf"))
        found = f"; it holds {', '.join(ggufs[:3])}: give a GGUF file itself" if ggufs else ""
        raise NotFoundError(f"{path}: no config.json (expected a Hugging Face model directory){found}")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgumentError(f"{config_file}: not valid JSON: {exc}") from None
    except OSError as exc:
        raise InvalidArgumentError(f"{config_file}: cannot be read: {exc.strerror or exc}") from None
    if not isinstance(config, dict):
        raise InvalidArgumentError(f"{config_file}: expected a JSON object")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        names = config.get("architectures")
        architecture = ", ".join(map(str, names)) if isinstance(names, list) and names else "unnamed"
        raise UnimplementedError(
            f"{config_file}: architecture {architecture} (model_type {model_type!r}) is not supported; "
            f"supported: {supported_architectures()}"
        )
    dims = layout.check_config(config_file, config, model_type)
    tensors = _safetensors_tensors(_weights_files(path))
    layout.check_tensors(config_file, config, model_type, dims, tensors)
    text_config = config.get("text_config")  # multimodal checkpoints (Gemma 3) keep the text model's apart
    context = config.get("max_position_embeddings", text_config.get("max_position_embeddings")
                         if isinstance(text_config, dict) else None)
    return Source(path=path, model_type=model_type, gguf_file=None,
                  parameters=sum(math.prod(info.shape) for info in tensors.values()),
                  context_length=_positive_int(context),
                  tokenizer=next((name for name in TOKENIZER_FILES if (path / name).is_file()), None),
                  dimensions=dims)


def _refuse_broken_link(path: Path) -> None:
    """Raises ``NotFoundError`` when ``path`` is a symbolic link that leads to no file (its
    target is missing, or links form a loop), which would otherwise read as "no such file"."""
    if path.is_symlink() and not path.exists():
        raise NotFoundError(f"{path}: a symbolic link that leads to no file (its target {os.readlink(path)} is "
                            "missing, or the links form a loop)")


def _adapter_base(adapter_config: Path) -> str:
    """The base model a PEFT adapter config names, for a message."""
    try:
        config = json.loads(adapter_config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return "unnamed"
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    return str(base) if base else "unnamed"


def _weights_files(path: Path) -> list[Path]:
    """The safetensors files transformers loads from directory ``path``: model.safetensors,
    else the shards model.safetensors.index.json names (each of which must exist)."""
    single, index = path / SAFE_WEIGHTS, path / SAFE_WEIGHTS_INDEX
    _refuse_broken_link(single)
    _refuse_broken_link(index)
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
            raise InvalidArgumentError(f"{index}: not a readable JSON object: {exc}") from None
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(shard, str) for shard in weight_map.values()):
            raise InvalidArgumentError(f"{index}: expected a weight_map of tensor names to shard file names")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            _refuse_broken_link(path / shard)
            if Path(shard).name != shard or not (path / shard).is_file():
                tensor = next(name for name, file in weight_map.items() if file == shard)
                raise NotFoundError(f"{index}: names shard {shard} (e.g. for {tensor}), which is not a file in {path}")
        return [path / shard for shard in shards]
    others = sorted(file.name for file in path.glob("*.safetensors"))
    if others:
        raise NotFoundError(f"{path}: no {SAFE_WEIGHTS} or {SAFE_WEIGHTS_INDEX} (transformers reads only those; "
                            f"found {', '.join(others[:3])}{', ...' if len(others) > 3 else ''})")
    raise NotFoundError(f"{path}: no *.safetensors weights (other weight formats are not read)")


def _safetensors_tensors(files: list[Path]) -> dict[str, layout.TensorInfo]:
    """Every tensor of ``files`` by name, from their headers; refuses a corrupt or truncated
    file, or a tensor found in two files."""
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, layout.TensorInfo] = {}
    for file in files:
        try:
            with safe_open(file, framework="numpy") as opened:
                for name in opened.keys():
                    if name in tensors:
                        raise InvalidArgumentError(f"{file}: tensor {name} is also in {tensors[name].file.name}")
                    piece = opened.get_slice(name)
                    tensors[name] = layout.TensorInfo(file, tuple(piece.get_shape()), piece.get_dtype())
        except SafetensorError as exc:
            raise DataLossError(f"{file}: corrupt or truncated safetensors file: {exc}") from None
        except OSError as exc:
            raise InvalidArgumentError(f"{file}: cannot be read: {exc}") from None
    return tensors


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
    if not isinstance(architecture, str) or architecture not in GGUF_ARCHITECTURES:
        raise UnimplementedError(
            f"{path}: GGUF architecture {architecture!r} is not supported; supported: {supported_architectures()}"
        )
    for key in GGUF_REQUIRED_FIELDS:
        value = fields.get(f"{architecture}.{key}")
        if _positive_int(value) is None:
            raise InvalidArgumentError(f"{path}: metadata {architecture}.{key} is {value!r}, expected a positive "
                                       "integer")
    unreadable = [tensor for tensor in reader.tensors if tensor.tensor_type.name not in GGUF_TENSOR_TYPES]
    if unreadable:
        kinds = sorted({tensor.tensor_type.name for tensor in unreadable})
        raise UnimplementedError(
            f"{path}: tensor {unreadable[0].name} is {unreadable[0].tensor_type.name} ({len(unreadable)} tensors of "
            f"type {', '.join(kinds)}), which transformers cannot dequantize; readable: {', '.join(GGUF_TENSOR_TYPES)}"
        )
    dims = _gguf_dimensions(fields, architecture)
    layout.check_gguf_tensors(path, GGUF_ARCHITECTURES[architecture], dims,
                              {tensor.name: tuple(int(n) for n in reversed(tensor.shape)) for tensor in reader.tensors})
    parameters = sum(int(tensor.n_elements) for tensor in reader.tensors)
    return Source(path=path, model_type=GGUF_ARCHITECTURES[architecture], gguf_file=path.name, parameters=parameters,
                  context_length=_positive_int(fields.get(f"{architecture}.context_length")),
                  tokenizer=tokenizer if isinstance(tokenizer := fields.get("tokenizer.ggml.model"), str) else None,
                  dimensions=dims)


def _gguf_dimensions(fields: Mapping[str, object], architecture: str) -> dict[str, int]:
    """The model's dimensions from a GGUF file's {architecture}.* metadata (its required
    fields checked present): those of :func:`runtime.export.layout.check_config` but the
    vocabulary, which GGUF files state in the tokenizer's metadata."""
    def field(key: str) -> int | None:
        return _positive_int(fields.get(f"{architecture}.{key}"))

    hidden, heads = field("embedding_length"), field("attention.head_count")
    return {"hidden": hidden, "intermediate": field("feed_forward_length"), "layers": field("block_count"),
            "heads": heads, "kv_heads": field("attention.head_count_kv") or heads,
            "head_dim": field("attention.key_length") or hidden // heads}


def _positive_int(value: object) -> int | None:
    """``value`` when it is a positive integer (a context length as a source states it), else None."""
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _contents(field: object) -> object:
    try:
        return field.contents()  # type: ignore[attr-defined]
    except (ValueError, IndexError, TypeError, UnicodeDecodeError):
        return None
