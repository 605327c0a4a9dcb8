"""The defects of litert-torch 0.10.0 an export has to work around, in one place.

1. ``litert_torch/generative/layers/lora.py`` imports
   ``tensorflow.lite.python.schema_py_generated`` although conversion needs no TensorFlow.
   The same flatbuffer schema ships as ``ai_edge_litert.schema_py_generated``; stand-in
   ``tensorflow`` packages pointing at it let the module import.
2. ``LoRA.zeros()`` (which ``convert`` uses to trace the LoRA signatures) sizes the q
   output as ``(heads // kv_heads) * head_dim`` and k/v as ``head_dim``, as if there were
   one KV group; with grouped-query or multi-head attention the traced reshape fails.
   The replacement sizes q out = heads*head_dim, k/v out = kv_heads*head_dim, o in =
   heads*head_dim, per layer.
3. Lowering a weight clamps it to the finite range in place (``clamp_``), which writes every
   page even when nothing changes: a memory-mapped weight's pages become private copies in
   every process that lowers it. The replacement clamps only a tensor that holds an
   infinity, and looks at each tensor once per process.

:func:`apply` installs all three, once per process.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
import weakref
from typing import Any, Callable

_applied = False


def apply() -> None:
    """Installs both workarounds (idempotent)."""
    global _applied
    if _applied:
        return
    _install_tensorflow_schema_stand_in()
    _size_lora_slots_per_kv_group()
    _clamp_only_infinite_weights()
    _applied = True


def _install_tensorflow_schema_stand_in() -> None:
    # torch._dynamo looks up the libraries it skips (tensorflow among them) with
    # importlib.util.find_spec when it is imported, which raises for a sys.modules entry
    # without __spec__: so it is imported before the stand-ins exist, and each stand-in
    # also gets a spec for later lookups.
    import torch._dynamo  # noqa: F401

    if "tensorflow" in sys.modules or importlib.util.find_spec("tensorflow"):
        return  # a real TensorFlow provides the module
    from ai_edge_litert import schema_py_generated

    parent: types.ModuleType | None = None
    for name in ("tensorflow", "tensorflow.lite", "tensorflow.lite.python"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
        module.__path__ = []  # type: ignore[attr-defined]
        sys.modules[name] = module
        if parent is not None:
            setattr(parent, name.rsplit(".", 1)[1], module)
        parent = module
    sys.modules["tensorflow.lite.python.schema_py_generated"] = schema_py_generated
    parent.schema_py_generated = schema_py_generated  # type: ignore[union-attr]


def _size_lora_slots_per_kv_group() -> None:
    import torch
    from litert_torch.generative.layers import lora as lora_utils
    from litert_torch.generative.layers import model_config as cfg

    def from_tensor_generator(
        cls: type,
        tensor_generator: Callable[[tuple[int, ...], torch.dtype], torch.Tensor],
        rank: int,
        config: cfg.ModelConfig,
        dtype: torch.dtype = torch.float32,
    ) -> Any:
        def weight(in_dim: int, out_dim: int) -> lora_utils.LoRAWeight:
            return lora_utils.LoRAWeight(
                a_prime=tensor_generator((in_dim, rank), dtype), b_prime=tensor_generator((rank, out_dim), dtype)
            )

        entries = []
        for layer in range(config.num_layers):
            attention = config.block_config(layer).attn_config
            q_out = attention.num_heads * attention.head_dim
            kv_out = attention.num_query_groups * attention.head_dim
            dim = config.embedding_dim
            entries.append(lora_utils.LoRAEntry(attention=lora_utils.AttentionLoRA(
                query=weight(dim, q_out), key=weight(dim, kv_out), value=weight(dim, kv_out),
                output=weight(q_out, dim),
            )))
        return cls(adapters=tuple(entries))

    lora_utils.LoRA._from_tensor_generator = classmethod(from_tensor_generator)


def _clamp_only_infinite_weights() -> None:
    import torch
    from litert_torch.backend import inline_consts

    clamp = inline_consts._clamp_inf_values
    # Tensors found finite, by id (with a weak reference: the same object, still alive).
    # Every signature lowers the same weight tensors; scanning SmolLM2's 214 for an
    # infinity took 3.5 s per signature.
    finite: dict[int, weakref.ref[torch.Tensor]] = {}

    def clamp_if_infinite(tensor: torch.Tensor) -> torch.Tensor:
        if not torch.is_floating_point(tensor):
            return tensor
        known = finite.get(id(tensor))
        if known is not None and known() is tensor:
            return tensor
        if bool(torch.isinf(tensor).any()):
            return clamp(tensor)
        finite[id(tensor)] = weakref.ref(tensor)
        return tensor

    inline_consts._clamp_inf_values = clamp_if_infinite
