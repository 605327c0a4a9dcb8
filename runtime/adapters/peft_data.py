"""Hugging Face PEFT LoRA adapters: a directory, or a state dict with its config, as AdapterData.

A PEFT directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` with
keys ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``.lora_B.weight``
``[out, r]``. PEFT applies ``scale * B @ A`` with ``scale = lora_alpha / r`` (or
``lora_alpha / sqrt(r)`` with ``use_rslora``), ``r`` and ``lora_alpha`` taken from
``rank_pattern`` / ``alpha_pattern`` where a pattern matches the module. The exported
graph adds ``(x @ a) @ b``, so each projection becomes ``a = (scale * A).T``,
``b = B.T``, named like litert-torch's inputs.

What maps: ``...layers.<N>.{self_attn,attn,attention}.{q,k,v,o}_proj`` and
``...layers.<N>.mlp.{gate,up,down}_proj`` (Llama, SmolLM, Qwen, Gemma, Mistral: what
``target_modules="all-linear"`` trains). LoRA-XS checkpoints (``peft_type`` "LORA_XS", or
an extra ``r x r`` ``lora_R`` or ``lora_latent_mapping`` between A and B) fold it into A.
``fan_in_fan_out`` only changes how PEFT merges into a transposed base weight, not the
activation path, so it needs nothing here; ``layers_to_transform`` is checked against the keys.
DoRA (``use_dora: true``): every module also has ``.lora_magnitude_vector`` ``[out]``; the
adapter is a :class:`runtime.adapters.dora.DoraLoraData`, whose magnitudes are read (and checked
finite) when it is opened, and divided by the row norms of ``W + s B A`` (``W`` from the
model file) when it is materialized.

An opened adapter is checked in full, then keeps only its config, its pairs' shapes
(:class:`runtime.adapters.adapter_data.LazyLoraData`) and how to read it again: the per-module
objects are built again at first use (a few KiB per registered adapter instead of hundreds).

Refused, with every offending module listed: embeddings, lm_head, ``modules_to_save``,
LoRA biases, unknown ``peft_type``; DoRA with LoRA-XS.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from runtime.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError, UnimplementedError
from runtime.adapters.adapter_data import DerivedLoraData, DerivedTensor, LazyLoraData, refuse_unappliable
from runtime.adapters.dora import DerivedDoraData, DoraLoraData, DoraMagnitudes, DoraProjection
from runtime.adapters.draft_heads import CONFIG_KEYS as HEADS_CONFIG_KEYS
from runtime.adapters.draft_heads import is_draft_head_key, read_draft_heads, read_heads_config
from runtime.adapters.lora_util import Convention, lora_input_name
from runtime.adapters.lora_xs import DEFAULT_N_ITER, DEFAULT_RANDOM_STATE, LoraXsFactors
from runtime.util.scoped_file import FileWatch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_PROJECTIONS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
                "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_KEY = re.compile(
    r"(?:base_model\.model\.)?(?P<module>(?:.*\.)?layers\.(?P<layer>0|[1-9][0-9]*)\."
    r"(?:(?:self_attn|attn|attention)\.(?P<proj>[qkvo]_proj)|mlp\.(?P<mlp>gate_proj|up_proj|down_proj)))"
    r"\.(?:(?P<part>lora_A|lora_B|lora_R|lora_latent_mapping|default_lora_latent_mapping)(?:\.default)?\.weight"
    r"|(?P<magnitude>lora_magnitude_vector)(?:\.default)?(?:\.weight)?)"
)
_PEFT_TYPES = ("LORA", "LORA_XS")  # LoRA-XS: lora_A, lora_R, lora_B, applied as B R A
MAX_N_ITER = 1000  # LoRA-XS's TruncatedSVD power iterations: its reference takes 10
_LORA_XS_PARTS = ("lora_R", "lora_latent_mapping", "default_lora_latent_mapping")  # the r x r matrix
_MAGNITUDE = "lora_magnitude_vector"  # DoRA's [out]


@dataclass(frozen=True)
class PeftLoraConfig:
    """The fields of PEFT's ``LoraConfig`` that decide how an adapter is applied."""

    r: int
    lora_alpha: float = 8.0
    use_rslora: bool = False
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)
    fan_in_fan_out: bool = False
    layers_to_transform: tuple[int, ...] | None = None
    # LoRA-XS's TruncatedSVD settings, for an R-only adapter's rebuilt A and B (config keys
    # "n_iter" and "random_state"; LoRA-XS's reference uses 10 and 42).
    n_iter: int = DEFAULT_N_ITER
    random_state: int = DEFAULT_RANDOM_STATE
    # DoRA: every module has a magnitude vector that rescales its output (runtime.adapters.dora).
    use_dora: bool = False

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source: str) -> PeftLoraConfig:
        """Checks a parsed ``adapter_config.json``; refuses what cannot be applied."""
        if not isinstance(config, Mapping):
            raise InvalidArgumentError(f"{source}: {CONFIG_FILE} must hold a JSON object")
        peft_type = str(config.get("peft_type", "LORA")).upper()
        if peft_type not in _PEFT_TYPES:
            raise InvalidArgumentError(
                f"{source}: peft_type {config.get('peft_type')!r} is not supported, expected one of "
                f"{', '.join(_PEFT_TYPES)}"
            )
        use_dora = config.get("use_dora", False)
        if not isinstance(use_dora, bool) and use_dora is not None:
            raise InvalidArgumentError(f"{source}: 'use_dora' is {use_dora!r}, expected true or false")
        if use_dora and peft_type == "LORA_XS":
            raise UnimplementedError(f"{source}: use_dora with peft_type LORA_XS (DoRA over LoRA-XS) cannot be applied")
        if config.get("modules_to_save"):
            raise InvalidArgumentError(
                f"{source}: modules_to_save {config['modules_to_save']!r} replaces whole "
                "modules, which a frozen base cannot take"
            )
        if config.get("bias", "none") not in ("none", None):
            raise InvalidArgumentError(f"{source}: LoRA biases (bias={config['bias']!r}) cannot be applied")
        r = config.get("r")
        if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
            raise InvalidArgumentError(f"{source}: 'r' is {r!r}, expected a positive integer")
        alpha = config.get("lora_alpha", 8)
        if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
            raise InvalidArgumentError(f"{source}: 'lora_alpha' is {alpha!r}, expected a number")
        layers = config.get("layers_to_transform")
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = [layers]
        if layers is not None and (
            not isinstance(layers, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
        ):
            raise InvalidArgumentError(
                f"{source}: layers_to_transform is {layers!r}, expected a layer index or a list of them"
            )
        return cls(
            r=r,
            lora_alpha=float(alpha),
            use_rslora=bool(config.get("use_rslora", False)),
            rank_pattern=_pattern(config.get("rank_pattern"), "rank_pattern", source),
            alpha_pattern=_pattern(config.get("alpha_pattern"), "alpha_pattern", source),
            fan_in_fan_out=bool(config.get("fan_in_fan_out", False)),
            layers_to_transform=tuple(layers) if layers else None,
            n_iter=_count(config.get("n_iter", DEFAULT_N_ITER), "n_iter", MAX_N_ITER, source),
            random_state=_count(config.get("random_state", DEFAULT_RANDOM_STATE), "random_state", 2**32 - 1, source),
            use_dora=bool(use_dora),
        )

    def rank_and_alpha(self, module: str) -> tuple[int, float]:
        """``(r, alpha)`` for a module path such as ``model.layers.1.self_attn.v_proj``."""
        return (
            int(_match_pattern(self.rank_pattern, module, self.r)),
            float(_match_pattern(self.alpha_pattern, module, self.lora_alpha)),
        )

    def scale(self, module: str) -> float:
        """PEFT's scaling of the module's delta: ``alpha / r`` or ``alpha / sqrt(r)`` (rsLoRA)."""
        r, alpha = self.rank_and_alpha(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def read_peft_directory(directory: str | os.PathLike[str], lora_xs: LoraXsFactors | None = None, *,
                        heads: bool = False) -> LazyLoraData:
    """Opens a PEFT adapter directory (which paths name one is decided by
    :func:`runtime.adapters.adapter_formats.peft_directory`). ``lora_xs``: the model's
    factors, which an R-only LoRA-XS adapter needs. ``heads``: also read the draft heads
    (Turbo LoRA) the safetensors file carries, in the same pass, into ``draft_heads``."""
    directory = Path(directory)
    if not directory.is_dir():
        raise NotFoundError(f"{directory}: no such PEFT adapter directory")
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for required in (config_path, weights_path):
        if not required.is_file():
            raise NotFoundError(f"{directory}: PEFT adapter has no {required.name}")
    config = PeftLoraConfig.from_dict(_load_json(config_path), str(config_path))
    watch = FileWatch(weights_path)
    opened = [_open_weights(weights_path)]  # the first build reads the file opened here, heads and all
    draft_heads = None
    if heads:
        shapes, handle = opened[0]
        draft_heads = read_draft_heads({key: shape for key, shape in shapes.items() if is_draft_head_key(key)},
                                       handle.get_tensor, read_heads_config(directory), str(directory))

    def build() -> DerivedLoraData:
        shapes, handle = opened.pop() if opened else _open_weights(weights_path)
        return _derive(shapes, handle.get_tensor, config, str(directory), lora_xs, watches=(FileWatch(weights_path),))

    data = _registered_kind(config).of(build, (watch,))
    data.draft_heads = draft_heads
    return data


def _open_weights(weights_path: Path) -> tuple[dict[str, tuple[int, ...]], Any]:
    """The safetensors file's tensor shapes, and its open handle to read tensors from."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(weights_path), framework="np")
        return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}, handle
    except (SafetensorError, OSError, ValueError) as exc:
        raise InvalidArgumentError(f"{weights_path}: not a readable safetensors file: {exc}") from None


def _registered_kind(config: PeftLoraConfig) -> type[LazyLoraData]:
    """What an adapter of ``config`` is once registered."""
    return DoraLoraData if config.use_dora else LazyLoraData


def read_peft_state_dict(
    state_dict: Mapping[str, Any], config: Mapping[str, Any] | PeftLoraConfig, name: str = "<PEFT state dict>",
    lora_xs: LoraXsFactors | None = None, *, heads: bool = False,
) -> LazyLoraData:
    """A PEFT state dict (key -> array) with its config (a dict as in ``adapter_config.json``);
    ``lora_xs`` and ``heads`` as for :func:`read_peft_directory` (the heads' settings come
    from the config dict)."""
    heads_config = {key: config[key] for key in HEADS_CONFIG_KEYS if isinstance(config, Mapping) and key in config}
    if not isinstance(config, PeftLoraConfig):
        config = PeftLoraConfig.from_dict(config, name)
    arrays: dict[str, np.ndarray] = {}
    for key, value in state_dict.items():
        try:
            arrays[str(key)] = np.asarray(value)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"{name}: tensor {key!r} is not an array: {exc}") from None
    shapes = {k: a.shape for k, a in arrays.items()}
    draft_heads = None
    if heads:
        draft_heads = read_draft_heads({key: shape for key, shape in shapes.items() if is_draft_head_key(key)},
                                       arrays.__getitem__, heads_config, name)
    data = _registered_kind(config).of(functools.partial(_derive, shapes, arrays.__getitem__, config, name, lora_xs))
    data.draft_heads = draft_heads
    return data


@dataclass
class _Module:
    layer: int
    projection: str
    parts: dict[str, str] = field(default_factory=dict)  # part -> key


def _derive(
    shapes: Mapping[str, tuple[int, ...]],
    load: Callable[[str], np.ndarray],
    config: PeftLoraConfig,
    source: str,
    lora_xs: LoraXsFactors | None,
    watches: tuple[FileWatch, ...] = (),
) -> DerivedLoraData:
    modules: dict[str, _Module] = {}
    refused: list[str] = []
    for key in shapes:
        if is_draft_head_key(key):
            continue  # Turbo LoRA's draft heads: read by runtime.adapters.draft_heads
        match = _KEY.fullmatch(key)
        if match is None:
            refused.append(_why_refused(key))
            continue
        module = modules.setdefault(
            match["module"], _Module(int(match["layer"]), _PROJECTIONS[match["proj"] or match["mlp"]])
        )
        module.parts[match["part"] or match["magnitude"]] = key
    refuse_unappliable(source, refused, separator="; ")
    if not modules:
        raise InvalidArgumentError(f"{source}: no LoRA tensors found")
    tensors: dict[str, DerivedTensor] = {}
    magnitudes: dict[tuple[int, str], DoraProjection] = {}
    for path, module in sorted(modules.items(), key=lambda item: (item[1].layer, item[1].projection)):
        if config.layers_to_transform is not None and module.layer not in config.layers_to_transform:
            raise InvalidArgumentError(
                f"{source}: {path} is in layer {module.layer}, outside layers_to_transform "
                f"{list(config.layers_to_transform)}"
            )
        magnitude_key = module.parts.pop(_MAGNITUDE, None)
        if (magnitude_key is not None) != config.use_dora:
            raise InvalidArgumentError(
                f"{source}: {path} has a DoRA magnitude ({magnitude_key!r}) but the config has no use_dora: true"
                if magnitude_key else f"{source}: {path} has no {_MAGNITUDE} though the config says use_dora: true")
        module_tensors = _module_tensors(path, module, shapes, load, config, source, lora_xs)
        tensors.update(module_tensors)
        if magnitude_key is not None:
            fan_out = module_tensors[lora_input_name(Convention.LITERT_TORCH, module.layer, module.projection,
                                                     "b")].shape[1]
            magnitudes[(module.layer, module.projection)] = _magnitude(
                module, magnitude_key, shapes[magnitude_key], fan_out, load, source, lora_xs)
    if config.use_dora:
        return DerivedDoraData(tensors, DoraMagnitudes.of(magnitudes, source), source_name=source,
                               format_name="peft (DoRA)", watches=watches)
    return DerivedLoraData(tensors, source_name=source, format_name="peft", watches=watches)


def _magnitude(module: _Module, key: str, shape: tuple[int, ...], fan_out: int, load: Callable[[str], np.ndarray],
               source: str, lora_xs: LoraXsFactors | None) -> DoraProjection:
    """A module's DoRA magnitude ``[out]``, read now (it is small) and checked finite."""
    if shape != (fan_out,):
        raise InvalidArgumentError(
            f"{source}: tensor {key!r} is {list(shape)}, expected [{fan_out}] (one DoRA magnitude per output "
            "channel of its lora_B)")
    magnitude = _float32(load(key), key, source).astype(np.float64)
    if not np.isfinite(magnitude).all():
        raise InvalidArgumentError(f"{source}: tensor {key!r} holds NaN or Inf values")

    def weight() -> np.ndarray:
        if lora_xs is None:
            raise FailedPreconditionError(
                f"{source}: a DoRA adapter's output scales need the base model's weights; open it with a model "
                "(--model, or through an Engine)")
        return lora_xs.model_weights().weight(module.layer, module.projection)
    return DoraProjection(key, magnitude, weight)


def _module_tensors(path: str, module: _Module, shapes: Mapping[str, tuple[int, ...]],
                    load: Callable[[str], np.ndarray], config: PeftLoraConfig, source: str,
                    lora_xs: LoraXsFactors | None) -> dict[str, DerivedTensor]:
    """One module's ``a = (scale * A).T`` and ``b = B.T``; with LoRA-XS's ``r x r`` R between
    them, ``a = (scale * R A).T``, and an R-only adapter's A and B rebuilt from the base
    weight when first read (registering reads shapes only)."""
    r_key = next((module.parts[part] for part in _LORA_XS_PARTS if part in module.parts), None)
    if "lora_A" in module.parts or "lora_B" in module.parts:
        rank, fan_in, fan_out, factors = _stored_factors(path, module, shapes, load, source)
    else:
        rank, fan_in, fan_out, factors = _rebuilt_factors(path, module, shapes, config, source, lora_xs)
    if r_key is not None and shapes[r_key] != (rank, rank):
        raise InvalidArgumentError(f"{source}: tensor {r_key!r} is {list(shapes[r_key])}, expected [{rank}, {rank}]")
    module_name = path.removeprefix("base_model.model.")
    expected_rank, _ = config.rank_and_alpha(module_name)
    if expected_rank != rank:
        raise InvalidArgumentError(
            f"{source}: {path} has rank {rank}, but the config says r={expected_rank} for {module_name}")
    scale = config.scale(module_name)

    def a_prime() -> np.ndarray:
        a = factors()[0]
        if r_key is not None:
            a = _float32(load(r_key), r_key, source) @ a
        with np.errstate(over="ignore", invalid="ignore"):  # non-finite values are refused later
            return (np.float32(scale) * a).T

    def b_prime() -> np.ndarray:
        return factors()[1].T

    f32 = np.dtype(np.float32)
    return {
        lora_input_name(Convention.LITERT_TORCH, module.layer, module.projection, "a"):
            DerivedTensor((fan_in, rank), f32, a_prime),
        lora_input_name(Convention.LITERT_TORCH, module.layer, module.projection, "b"):
            DerivedTensor((rank, fan_out), f32, b_prime),
    }


# A module's rank, fan-in, fan-out, and how to get its (A [r, in], B [out, r]).
_Factors = tuple[int, int, int, Callable[[], tuple[np.ndarray, np.ndarray]]]


def _stored_factors(path: str, module: _Module, shapes: Mapping[str, tuple[int, ...]],
                    load: Callable[[str], np.ndarray], source: str) -> _Factors:
    """A and B as the file holds them."""
    for part in ("lora_A", "lora_B"):
        if part not in module.parts:
            raise InvalidArgumentError(f"{source}: {path} has no {part}.weight (half of a LoRA pair is missing)")
    a_key, b_key = module.parts["lora_A"], module.parts["lora_B"]
    a_shape, b_shape = shapes[a_key], shapes[b_key]
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1] or a_shape[0] == 0:
        raise InvalidArgumentError(
            f"{source}: tensor {a_key!r} {list(a_shape)} and {b_key!r} {list(b_shape)} are not a "
            "LoRA pair (expected A [r, in] and B [out, r])"
        )
    return a_shape[0], a_shape[1], b_shape[0], lambda: (_float32(load(a_key), a_key, source),
                                                        _float32(load(b_key), b_key, source))


def _rebuilt_factors(path: str, module: _Module, shapes: Mapping[str, tuple[int, ...]], config: PeftLoraConfig,
                     source: str, lora_xs: LoraXsFactors | None) -> _Factors:
    """An R-only LoRA-XS module's A and B, rebuilt from the base weight as LoRA-XS does."""
    if len(module.parts) != 1:
        raise InvalidArgumentError(f"{source}: {path} has {sorted(module.parts)} but no lora_A and lora_B: expected "
                                   "one r x r LoRA-XS matrix")
    (r_key,) = module.parts.values()
    if lora_xs is None:
        raise FailedPreconditionError(
            f"{source}: {path} holds only {r_key!r}: an R-only LoRA-XS adapter, whose A and B are rebuilt from the "
            "base model's weights; open it with a model (--model, or through an Engine)")
    rank = shapes[r_key][0] if len(shapes[r_key]) == 2 else 0
    if rank == 0 or shapes[r_key] != (rank, rank):
        raise InvalidArgumentError(f"{source}: tensor {r_key!r} is {list(shapes[r_key])}, expected a square [r, r]")
    fan_out, fan_in = lora_xs.shape(module.layer, module.projection)
    return rank, fan_in, fan_out, lambda: lora_xs.factors(module.layer, module.projection, rank, config.n_iter,
                                                           config.random_state)


def _count(value: Any, field_name: str, most: int, source: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= most:
        raise InvalidArgumentError(f"{source}: {field_name} is {value!r}, expected an integer in [0, {most}]")
    return value


def _why_refused(key: str) -> str:
    if "modules_to_save" in key:
        return f"{key} (modules_to_save)"
    if key.endswith(".bias"):
        return f"{key} (LoRA bias)"
    if "lora_embedding" in key:
        return f"{key} (embedding LoRA)"
    return key


def _float32(array: np.ndarray, key: str, source: str) -> np.ndarray:
    if array.dtype.kind != "f":
        raise InvalidArgumentError(f"{source}: tensor {key!r} has dtype {array.dtype}, expected floating point")
    return np.asarray(array, dtype=np.float32)


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgumentError(f"{path}: not valid JSON: {exc}") from None


def _pattern(value: Any, field_name: str, source: str) -> dict[str, Any]:
    if value in (None, {}):
        return {}
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(f"{source}: {field_name} must be an object, got {type(value).__name__}")
    for key, number in value.items():
        if not isinstance(number, int | float) or isinstance(number, bool) or number <= 0:
            raise InvalidArgumentError(f"{source}: {field_name}[{key!r}] = {number!r}, expected a positive number")
    return dict(value)


def _match_pattern(pattern: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's rule: the first key that matches the end of the module path wins."""
    for key, value in pattern.items():
        try:
            if re.match(rf"(.*\.)?{key}$", module):
                return value
        except re.error:
            if module == key or module.endswith("." + key):
                return value
    return default

