"""``inspect FILE``: what a model or an adapter file holds, and whether an adapter fits."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from runtime.components.lora import dora_output_scales, plan_adapter
from runtime.errors import InvalidArgumentError, NotFoundError, StatusError
from runtime.executor import kernels
from runtime.executor.model_spec import ModelSpec
from runtime.executor.weight_cache import default_max_bytes, survey, user_directory
from runtime.adapters.adapter_data import AdapterData
from runtime.adapters.adapter_formats import open_adapter
from runtime.adapters.lora_util import PROJECTIONS, is_lora_input_name, parse_lora_input_name
from runtime.util.attention_rewrite import DECODE_ATTENTION, attention_forms, custom_codes
from runtime.util.signature_names import LoraSlot
from runtime.adapters.lora_xs import LoraXsFactors
from runtime.util.kv_layout import named_kv_layout
from runtime.util.litertlm_bundle import LitertLmBundle, is_litertlm, model_file
from runtime.util.model_view import ModelFile, signature_details
from runtime.util.model_weights import ModelWeights
from runtime.util.tensor_spec import TensorSpec


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Registers the ``inspect`` sub-command."""
    parser = commands.add_parser(
        "inspect",
        help="describe a model or a LoRA adapter file",
        description="Prints a model's signatures, inputs and LoRA rank slots, or an adapter's "
        "convention, rank and tensors. With --model, also says whether the adapter fits.",
    )
    parser.add_argument("file", type=Path, nargs="?", help="a .tflite model, a .litertlm bundle or an adapter")
    parser.add_argument("--check", type=Path, metavar="ADAPTER", help="the adapter to check against --model")
    parser.add_argument("--model", type=Path, help="check that the adapter fits this model")
    parser.add_argument("--weight-cache", type=Path, metavar="DIR", nargs="?", const=True,
                        help="list the XNNPACK weight cache: its files, their models, sizes and last use, and the "
                        "cap (DIR: a directory given as --weight-cache-dir; default: the user's cache directory)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Prints the description; a file that is neither kind raises InvalidArgumentError."""
    if args.weight_cache is not None:
        if args.file is not None or args.check is not None or args.model is not None:
            raise InvalidArgumentError("--weight-cache lists the cache directory: give no FILE, --check or --model")
        directory = user_directory() if args.weight_cache is True else args.weight_cache
        if args.weight_cache is not True and not directory.is_dir():  # (the user's is made by the first model)
            if directory.exists():
                raise InvalidArgumentError(f"--weight-cache {directory}: is a file, not a directory: expected a "
                                           "weight cache directory")
            raise NotFoundError(f"--weight-cache {directory}: no such directory")
        print(survey(directory, default_max_bytes()).describe())
        return 0
    adapter = args.check or args.file
    if adapter is None:
        raise InvalidArgumentError("inspect needs a FILE, or --check ADAPTER --model M")
    if args.check is not None and args.file is not None:
        raise InvalidArgumentError("give FILE or --check ADAPTER, not both")
    if args.model is not None:
        return _check_fit(adapter, args.model)
    if args.check is not None:
        raise InvalidArgumentError("--check needs --model")
    try:
        adapter = open_adapter(args.file)
    except StatusError as adapter_error:
        try:
            model = _read_model(args.file)
        except StatusError as model_error:
            raise InvalidArgumentError(
                f"{args.file} is neither a LoRA adapter ({adapter_error}) nor a model this "
                f"runtime can run ({model_error})"
            ) from None
        print(describe_model(args.file, *model))
        return 0
    with adapter:
        print(describe_adapter(adapter))
    return 0


def _check_fit(adapter_path: Path, model_path: Path) -> int:
    spec = _read_model(model_path)[0]
    lora_xs = LoraXsFactors(lambda: ModelWeights.open(model_file(model_path).header(), str(model_path)))
    with open_adapter(adapter_path, head_dim=spec.head_dim, lora_xs=lora_xs) as adapter:
        print(describe_adapter(adapter))
        plan = plan_adapter(adapter, spec.lora_slots)
        touched = sorted({projection for _, projection in plan.pairs}, key=PROJECTIONS.index)
        print(f"fits {model_path}: touches {'/'.join(touched)}; rank {plan.rank} goes in slot "
              f"{spec.slot_for(LoraSlot(plan.rank, plan.targets))}")
        if plan.dora is not None:
            scales = np.concatenate(list(dora_output_scales(plan).values()))
            print(f"DoRA: magnitudes on {len(plan.pairs)} projections; output scales m / ||W + s B A|| from the "
                  f"model's weights in [{scales.min():.4f}, {scales.max():.4f}] at scale 1")
    return 0


def _read_model(path: Path) -> tuple[ModelSpec, str]:
    """A model's spec and how its decode attention runs here (:func:`_attention_form`), read
    from the file's header as :class:`~runtime.executor.litert_executor.LlmExecutor` reads it
    (a ``.litertlm`` bundle's model section, as the engine opens it): nothing is compiled, so
    inspecting a model costs milliseconds, not an open."""
    header = model_file(path).header()  # (a file that is no .tflite is refused there, naming it)
    spec = ModelSpec.from_details(signature_details(header, source=str(path)), str(path),
                                  named_kv_layout(header, str(path)))
    return spec, _attention_form(path, header)


def _attention_form(path: Path, header: memoryview) -> str:
    """How the model's decode signatures compute attention (docs/kernels.md), and which form
    this machine runs: a file of both forms runs the op where :func:`kernels.attention_form_here`
    says so; a file of the op alone runs it where the kernel builds (else it cannot open); a
    file naming a custom op this runtime has no kernel for cannot open."""
    kernels.refuse_unknown_ops(header, str(path))  # as the open refuses it
    both, native = bool(attention_forms(header)), DECODE_ATTENTION in custom_codes(header)
    kernel = f"native kernel ({DECODE_ATTENTION}: built with this machine's C compiler; this runtime only)"
    if both:
        op_form, notice = kernels.attention_form_here(str(path))
        if notice:  # why not the op, and what that costs, as opening the model would say
            print(notice, file=sys.stderr)
        return (f"in both forms, xnnpack (standard ops) and {kernel}; this machine runs "
                f"{'the native kernel' if op_form else 'xnnpack'}")
    if native:
        kernels.build_library()  # the open's refusal, naming why, where it cannot be built
        return kernel
    return "xnnpack (standard ops)"


def _slots(spec: ModelSpec) -> str:
    """The LoRA slots line: the slots, their inputs' types and what an adapter holds in each."""
    if not spec.slots:
        return "  LoRA slots none"
    inputs = {slot: spec.slot_inputs(slot).values() for slot in spec.slots}
    types = "/".join(sorted({str(tensor.dtype) for tensors in inputs.values() for tensor in tensors}))
    held = " / ".join(f"{sum(tensor.nbytes for tensor in tensors):,}" for tensors in inputs.values())
    return f"  LoRA slots {', '.join(map(str, spec.slots))} ({types}; {held} bytes a resident adapter)"


def describe_model(path: Path, spec: ModelSpec, attention: str) -> str:
    """A model's signatures and inputs, marking the LoRA inputs; ``attention``: how its
    decode attention runs on this machine (:func:`_read_model`)."""
    lines = [
        f"model {path} ({path.stat().st_size:,} bytes)",
        *_bundle(path),
        f"  layers {spec.num_layers}, vocab {spec.vocab_size}, KV cache {spec.kv_length} positions "
        f"({spec.kv_layout} layout, {'/'.join(sorted({str(c.dtype) for c in spec.kv_inputs}))}, "
        f"{spec.kv_cache_bytes:,} bytes per session)",
        f"  prefill lengths {list(spec.prefill_lengths)}"
        f"{'' if spec.prefill_has_logits else ' (no logits on prefill: the last token is decoded)'}",
        _slots(spec),
        f"  base weights map {_weights_map(model_file(path))}",
        f"  decode attention {attention}",
    ]
    slots = [None, *spec.slots]
    batched = {slot: spec.batch_sizes(slot) for slot in slots if spec.batch_sizes(slot)}
    if batched:
        lines.append("  batched decode rows " + ", ".join(
            f"{list(rows)} ({f'LoRA slot {slot}' if slot else 'no LoRA'})" for slot, rows in batched.items()))
    windows = sorted({w for slot in slots for w in spec.windows(slot)})
    if windows:
        lines.append(f"  attention windows {windows} (a decode step attends over the first W positions while it "
                     "fits in one)")
    prefill_windows = sorted({w for slot in slots for length in spec.prefill_lengths
                              for w in spec.windows(slot, kind="prefill", seq_len=length)})
    if prefill_windows:
        lines.append(f"  prefill windows {prefill_windows} (a prefill chunk attends over the first W positions "
                     "while it ends in one)")
    for key, signature in spec.signatures.items():
        lora = signature.lora_inputs
        outputs = ", ".join(pattern for pattern, _ in _numbered_groups(sorted(signature.outputs)))
        lines.append(f"  signature {key}: {len(signature.inputs)} inputs ({len(lora)} LoRA), outputs {outputs}")
        for pattern, names in _numbered_groups(list(signature.inputs), signature.inputs):
            tensor = signature.inputs[names[0]]
            count = f" ({len(names)})" if len(names) > 1 else ""
            marker = "  [LoRA]" if names[0] in lora else ""
            lines.append(f"    {pattern + count:<44} {str(list(tensor.shape)):<18} {tensor.dtype.name}{marker}")
    return "\n".join(lines)


_NUMBERED = re.compile(r"(?P<stem>.*?)(?P<numbers>(?:_[0-9]+)+)")


def _numbered_groups(names: list[str], tensors: Mapping[str, TensorSpec] | None = None
                     ) -> list[tuple[str, list[str]]]:
    """``names`` gathered by what they are numbered by (layer, and a batch's row):
    ``kv_cache_k_{0-29}_{0-7}`` for the 240 caches of 30 layers and 8 rows, a name alone as
    it is; in the order each first appears. With ``tensors``, only tensors of one shape and
    type share a line. One line per tensor would make a batched signature's description
    thousands of lines long."""
    groups: dict[tuple[object, ...], list[tuple[str, tuple[int, ...]]]] = {}
    for name in names:
        match = _NUMBERED.fullmatch(name)
        stem, numbers = (match["stem"], tuple(map(int, match["numbers"][1:].split("_")))) if match else (name, ())
        kind = (tensors[name].shape, tensors[name].dtype) if tensors is not None else None
        groups.setdefault((stem, len(numbers), kind), []).append((name, numbers))
    described = []
    for (stem, places, _), members in groups.items():
        if len(members) == 1:
            described.append((members[0][0], [members[0][0]]))
            continue
        spans = "".join("_{" + _ranges(sorted({numbers[i] for _, numbers in members})) + "}" for i in range(places))
        described.append((stem + spans, [name for name, _ in members]))
    return described


def _ranges(values: list[int]) -> str:
    """Sorted integers as runs: ``0-4,6,8-9``."""
    runs: list[list[int]] = []
    for value in values:
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def _bundle(path: Path) -> list[str]:
    """Where a ``.litertlm`` bundle holds its model, and what sections it has (no lines for a ``.tflite``)."""
    if not is_litertlm(path):
        return []
    with LitertLmBundle(path) as bundle:
        section = bundle.model_section()
        kinds = ", ".join(s.data_type for s in bundle.sections)
    return [f"  bundle: the model at bytes [{section.begin:,}, {section.end:,}); sections {kinds}"]


def _weights_map(model: ModelFile) -> str:
    """Whether the export says where its base weights lie (what R-only LoRA-XS adapters need)."""
    try:
        ModelWeights.open(model.header(), str(model.path))
    except StatusError:
        return "none (exported before runtime.projections metadata): R-only LoRA-XS adapters cannot run"
    return "present: R-only LoRA-XS and DoRA adapters can run"


def describe_adapter(data: AdapterData) -> str:
    """An adapter's convention, rank, tensors and where their bytes are."""
    names = data.get_all_tensor_names()
    conventions = sorted({parse_lora_input_name(n).convention.value for n in names if is_lora_input_name(n)})
    try:
        rank: object = data.get_lora_rank()
    except StatusError:
        rank = "unknown"
    placements = sorted({data.tensor_info(n).placement for n in names})
    lines = [
        f"adapter {data.source_name} ({data.format_name})",
        f"  convention {', '.join(conventions) or 'none (no LoRA tensor names)'}, rank {rank}, "
        f"{len(names)} tensors, {data.nbytes:,} bytes of weights, data {', '.join(placements) or '-'}",
    ]
    for name in names:
        info = data.tensor_info(name)
        lines.append(f"    {name:<44} {str(list(info.shape)):<12} {info.dtype.name:<9} {info.nbytes:>9,} B  {info.placement}")
    return "\n".join(lines)
