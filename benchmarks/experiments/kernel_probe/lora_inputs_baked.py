"""What an adapter's factors cost as signature inputs on the real step: a copy of an export
whose LoRA factor inputs are constants of the graph instead, timed against the export with
the same factors bound as inputs.

    python3 -m benchmarks.experiments.kernel_probe.lora_inputs_baked MODEL.tflite \
        [--signature decode_lora_all_r8] [--plain decode] [--position 10] [--rounds 15] [--runs 100]

Why: an all-linear rank-8 adapter's decode signature takes 420 more inputs than the plain one
(A and B of 7 projections in 30 layers), and LiteRT registers every input buffer on every run
(``LiteRtCompiledModelT::Run``: a lookup by name, a lock, a custom allocation; RESULTS.md
section 10 put it at ~0.5 us an input from a CONCATENATION signature). Stacking a
projection's factors over the layers (14 inputs instead of 420) would take most of that off;
this measures the most it could, before building it: the same graph, the same ops reading the
same factors, with none of the 420 as inputs. The copy is written to a temporary folder (the
factors random, the same as the original is given); every signature of the file but
``--signature``'s keeps its inputs. Also timed: the factors as inputs in one block of memory
(a ``PageBlock``) instead of a buffer each, a copy whose signature takes 420 inputs that no op
reads (the binding alone), and the plain step of the baked copy (each compiled model reads
its own weight-cache file, every one put in 2 MB pages first: how the page cache holds a file
moves the step by 25%, ``runtime/util/page_advice.py``). Prints the logits' largest difference
(all must agree) and, per form, the median step in microseconds over alternating rounds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from ai_edge_litert import schema_py_generated as schema

from runtime.executor.native import HostBuffer, NativeModel, PageBlock
from runtime.util import flatbuffer_model
from runtime.util.attention_rewrite import attention_forms
from runtime.util.lora_precision import is_lora_factor
from runtime.util.page_advice import read_again_in_huge_pages


def factors(model: schema.ModelT, key: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Random factors for signature ``key``'s LoRA factor inputs, by input name (small, so
    that the step's numbers stay those of a real adapter)."""
    sig = next(sig for sig in model.signatureDefs if sig.signatureKey.decode() == key)
    sub = model.subgraphs[sig.subgraphIndex]
    rng = np.random.default_rng(seed)
    values = {}
    for entry in sig.inputs:
        if is_lora_factor(entry.name):
            shape = tuple(int(d) for d in sub.tensors[entry.tensorIndex].shape)
            values[entry.name.decode()] = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    return values


def bake(model: schema.ModelT, key: str, values: dict[str, np.ndarray], forms: dict[int, int]) -> int:
    """Makes signature ``key``'s LoRA factor inputs constants holding ``values``, in its
    subgraph and in the op form paired with it (``forms``); returns the inputs removed."""
    sig = next(sig for sig in model.signatureDefs if sig.signatureKey.decode() == key)
    baked = {int(entry.tensorIndex): values[entry.name.decode()] for entry in sig.inputs
             if entry.name.decode() in values}
    for index in (sig.subgraphIndex, forms.get(sig.subgraphIndex)):
        if index is None:
            continue
        sub = model.subgraphs[index]
        for tensor, value in baked.items():
            buffer = schema.BufferT()
            buffer.data = np.frombuffer(value.tobytes(), np.uint8)
            model.buffers.append(buffer)
            sub.tensors[tensor].buffer = len(model.buffers) - 1
        sub.inputs = [int(i) for i in sub.inputs if int(i) not in baked]
    sig.inputs = [entry for entry in sig.inputs if int(entry.tensorIndex) not in baked]
    return len(baked)


def unused_inputs(model: schema.ModelT, key: str, values: dict[str, np.ndarray], forms: dict[int, int]) -> None:
    """Gives signature ``key`` (baked) one new input per entry of ``values``, of its shape,
    that no op reads (in its subgraph and its op form alike): the binding alone."""
    sig = next(sig for sig in model.signatureDefs if sig.signatureKey.decode() == key)
    subgraphs = [model.subgraphs[index] for index in (sig.subgraphIndex, forms.get(sig.subgraphIndex))
                 if index is not None]
    first = max(len(sub.tensors) for sub in subgraphs)  # both forms' new inputs at the same indices
    for sub in subgraphs:
        while len(sub.tensors) < first:  # padding no op reads
            pad = schema.TensorT()
            pad.name, pad.shape, pad.type, pad.buffer = f"pad_{len(sub.tensors)}".encode(), [1], 0, 0
            sub.tensors.append(pad)
        for offset, (name, value) in enumerate(values.items()):
            tensor = schema.TensorT()
            tensor.name, tensor.shape, tensor.type, tensor.buffer = f"unused_{name}".encode(), list(value.shape), 0, 0
            sub.tensors.append(tensor)
            sub.inputs = [*sub.inputs, first + offset]
    added = [first]
    for offset, name in enumerate(values):
        entry = schema.TensorMapT()
        entry.name, entry.tensorIndex = f"unused_{name}".encode(), added[0] + offset
        sig.inputs.append(entry)


def prepared_step(model: NativeModel, key: str, position: int, values: dict[str, np.ndarray],
                  given: dict[str, HostBuffer] | None = None):
    """Signature ``key`` prepared at ``position`` (token 7, zero caches written in place,
    ``values`` bound to the inputs they name, in ``given``'s buffers where it has them); the
    prepared run and its logits buffer."""
    sig = model.signatures[key]
    given = given or {}
    inputs = [given.get(name) or HostBuffer(info) for name, info in sig.inputs.items()]
    for buffer in inputs:
        name = buffer.info.name
        if name == "input_pos":
            buffer.write(np.full(buffer.info.shape, position, buffer.info.dtype))
        elif name == "tokens":
            buffer.write(np.full(buffer.info.shape, 7, buffer.info.dtype))
        elif name in values:
            buffer.write(values[name])
        elif name.startswith("unused_"):
            buffer.write(values[name[len('unused_'):]])
    by_name = {buffer.info.name: buffer for buffer in inputs}  # the caches written in place, as the runtime binds them
    outputs = [by_name.get(name) or HostBuffer(info) for name, info in sig.outputs.items()]
    logits = next(buffer for buffer in outputs if buffer.info.name == "logits")
    return model.prepare(sig.index, inputs, outputs), logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--signature", default="decode_lora_all_r8", help="the adapter's decode signature")
    parser.add_argument("--plain", default="decode", help="the plain decode signature: the ratios' base")
    parser.add_argument("--position", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--runs", type=int, default=100, help="steps a round, each form")
    args = parser.parse_args()
    data = args.model.read_bytes()
    pairs = attention_forms(data)
    temporary = tempfile.TemporaryDirectory(prefix="lora_baked_")
    folder = Path(temporary.name)
    paths = {}
    for variant in ("baked", "baked, unused inputs"):
        model = flatbuffer_model.unpack(data, str(args.model))
        values = factors(model, args.signature)
        removed = bake(model, args.signature, values, pairs)
        if variant != "baked":
            unused_inputs(model, args.signature, values, pairs)
        paths[variant] = folder / f"{len(paths)}.tflite"
        flatbuffer_model.write(model, paths[variant])
        del model
    # Weight caches in files, as the runtime keeps them, each in 2 MB pages: XNNPACK's in-memory
    # cache (small pages) made the same graph's step 7.0-8.4 ms from one compiled model to the next.
    original = NativeModel(args.model, num_threads=1, weight_cache=str(folder / "original.cache"), name="original")
    opened = {variant: NativeModel(path, num_threads=1, weight_cache=str(folder / f"{index}.cache"), name=variant)
              for index, (variant, path) in enumerate(paths.items())}
    for cache in folder.glob("*.cache"):
        read_again_in_huge_pages(cache)
    print(f"{args.signature}: {removed} factor inputs baked; inputs {len(original.signatures[args.signature].inputs)}"
          f" -> {', '.join(str(len(m.signatures[args.signature].inputs)) for m in opened.values())}; op form: "
          f"{original.attention_kernel} / {', '.join(str(m.attention_kernel) for m in opened.values())}")
    block = PageBlock([info for name, info in original.signatures[args.signature].inputs.items() if name in values],
                      whole_pages=list(values))
    forms = {"plain": prepared_step(original, args.plain, args.position, {}),
             "factors as inputs": prepared_step(original, args.signature, args.position, values),
             "factors as inputs, one block": prepared_step(original, args.signature, args.position, values,
                                                           block.buffers),
             "factors baked": prepared_step(opened["baked"], args.signature, args.position, values),
             "baked, 420 unused inputs": prepared_step(opened["baked, unused inputs"], args.signature,
                                                       args.position, values),
             "plain, baked file": prepared_step(opened["baked"], args.plain, args.position, {})}
    models = {"plain": original, "factors as inputs": original, "factors as inputs, one block": original,
              "factors baked": opened["baked"], "baked, 420 unused inputs": opened["baked, unused inputs"],
              "plain, baked file": opened["baked"]}
    for name, (run, _) in forms.items():
        models[name].run(run)
    for name, (_, logits) in forms.items():
        if name != "plain":
            difference = np.abs(logits.array - forms["factors as inputs"][1].array).max()
            print(f"logits of {name}: max |diff| {difference:.2e} to factors as inputs")
    moved = np.abs(forms["factors as inputs"][1].array - forms["plain"][1].array).max()
    print(f"(the adapter moves them by {moved:.2e})")
    times: dict[str, list[float]] = {name: [] for name in forms}
    order = list(forms)
    for round_ in range(args.rounds):
        for name in order if round_ % 2 == 0 else order[::-1]:
            model, (run, _) = models[name], forms[name]
            start = time.perf_counter()
            for _ in range(args.runs):
                model.run(run)
            times[name].append((time.perf_counter() - start) / args.runs * 1e6)
    base = statistics.median(times["plain"])
    print("| form | median us a step [min-max] | over plain | median of the rounds' differences to inputs |")
    print("|---|---:|---:|---:|")
    for name, values_ in times.items():
        paired = statistics.median(a - b for a, b in zip(values_, times["factors as inputs"]))
        print(f"| {name} | {statistics.median(values_):.0f} [{min(values_):.0f}-{max(values_):.0f}] | "
              f"{statistics.median(values_) / base:.3f} | {paired:+.0f} |")
    original.close()
    for model in opened.values():
        model.close()
    temporary.cleanup()


if __name__ == "__main__":
    main()
