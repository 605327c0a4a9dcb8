#!/usr/bin/env python3
"""What one pass over a decoder's weights costs by the rows it carries: which batch sizes
are cheap on this CPU.

    python3 -m benchmarks.experiments.batch_rows [--shape smollm2] [--rows 1,2,4,6,7,8,12,14,15,16] \
        [--quantize none,int8,none-left] [--rounds 5] [--out benchmarks/results]

A batched decode step runs every session's token through the base linears at once: M rows
against each weight matrix. For each M, this builds a graph of the shape's linear layers
only (fused q/k/v, output projection, fused gate/up, down, per layer, then the lm_head; no
attention, no LoRA), converts it with litert-torch (the ``export`` extra) in each precision
(``int8``: ai-edge-quantizer's ``dynamic_wi8_afp32``, int8 weights), and times it on 1
thread, every graph taking its turn in each round, the order flipping every round. Prints
the median milliseconds per pass and per row and writes ``batch_rows.{json,md,png}``.

What it showed (SmolLM2-135M's shape, 1 thread, AMD EPYC with AVX-512): XNNPACK's float32
matrix kernel takes 7 rows at a time and each further group of 7 reads every weight again:
1 row 23.6 ms, 7 rows 27.2 ms, 8 rows 46.4 ms, 15 rows 64.6 ms. int8 has no such step
(1.02x one row at 2 rows, 1.6-1.8x at 6 to 8, 2.1x at 12 to 15). In the whole batched
step the difference shrinks: a batch of 7 SmolLM2 sessions took 62.4 ms
against 76.6 ms for 8 (8.9 against 9.6 ms a token, ``benchmarks/experiments/batch_cost.py``), and
capping batches at 7 so that 8 sessions take turns in runs of 7 measured slower, not
faster: every run then holds another set of sessions, and the batch's stacked LoRA inputs
are written again (8 sessions against one: 2.86x f32 and 2.03x int8 capped, against 3.50x
and 2.57x uncapped in the run before, ``run.py --sections concurrency``). A run's rows cost more than its pass over the weights: each row's attention and
LoRA products are small matmuls whose dynamic operands XNNPACK packs on every step.

On an AMD EPYC with AVX2 and FMA but no AVX-512 (Zen 3; 2026-12-04, ``--rows
1,2,3,4,5,6,7,8,9,10,12,16 --out benchmarks/results/avx2``) the kernels group rows
differently: float32 takes 6 rows at a time (1 row 25.8 ms, 2 to 6 rows 32.8-36.4 ms, 7 to
12 rows 51.7-53.1 ms, 16 rows 68.3 ms) and int8 takes 4 (1 row 7.7 ms, 2 to 4 rows 11.5-11.8
ms, 5 to 8 rows 21.8 ms, 9 to 12 rows 31.6-31.9 ms): 8 rows pass over the weights twice in
both precisions, 2.01x one row in float32 and 2.82x in int8.

Weights as the left operand (``--quantize none,none-left``, same box, 2026-12-04, 3 rounds:
each linear a BATCH_MATMUL ``W h`` with the rows carried as columns, so XNNPACK packs the
rows and reads every weight once whatever their number): 61.1, 60.5 and 61.3 ms for 1, 6 and 8
rows, against 25.3, 32.0 and 51.4 ms as fully connected. Flat, but the kernel then computes
a weight row against its 16-column tile of which 8 rows fill at most half, and runs at that
arithmetic's speed: slower than two passes over the weights up to 8 rows. (litert-torch turns
``(W x^T)^T`` back into a FULLY_CONNECTED; only carrying the rows as columns through the
whole graph keeps the weights on the left.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common import RESULTS


@dataclass(frozen=True)
class Shape:
    """A decoder's linear layers: ``hidden`` in and out of each block, ``ffn`` the
    feed-forward's width, ``kv`` the width of K (and of V), ``layers`` blocks, ``vocab``
    the lm_head's outputs."""

    hidden: int
    ffn: int
    kv: int
    layers: int
    vocab: int


SHAPES = {
    "smollm2": Shape(hidden=576, ffn=1536, kv=192, layers=30, vocab=49152),  # SmolLM2-135M
    "tiny": Shape(hidden=64, ffn=128, kv=32, layers=2, vocab=256),  # a quick check of the script itself
}
# --quantize values and their labels; ``none-left``: float32 with every weight the left operand
# of a batch matmul (``W h`` over the rows carried as columns, ``h`` ``[features, rows]``), so
# XNNPACK packs the rows, not the weights, and reads each weight once whatever the rows.
PRECISIONS = {"none": "f32", "int8": "int8", "none-left": "f32 weights left"}
REPEATS = 10  # passes per timed run


def build(shape: Shape, rows: int, quantize: str, out: Path) -> None:
    """Writes the graph of ``shape``'s linears over ``rows`` rows to ``out``."""
    import torch
    from torch import nn

    from runtime.export.litert import litert_torch

    class Linears(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(nn.ModuleDict({
                "qkv": nn.Linear(shape.hidden, shape.hidden + 2 * shape.kv, bias=False),
                "o": nn.Linear(shape.hidden, shape.hidden, bias=False),
                "gate_up": nn.Linear(shape.hidden, 2 * shape.ffn, bias=False),
                "down": nn.Linear(shape.ffn, shape.hidden, bias=False)}) for _ in range(shape.layers))
            self.lm_head = nn.Linear(shape.hidden, shape.vocab, bias=False)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            if quantize == "none-left":
                h = x.reshape(rows, -1).transpose(0, 1)  # [hidden, rows]: W h is a BATCH_MATMUL, not a FC
                for block in self.blocks:
                    h = h + torch.matmul(block["o"].weight, torch.matmul(block["qkv"].weight, h)[:shape.hidden])
                    h = h + torch.matmul(block["down"].weight, torch.matmul(block["gate_up"].weight, h)[:shape.ffn])
                return {"logits": torch.matmul(self.lm_head.weight, h).transpose(0, 1).reshape(rows, 1, -1)}
            for block in self.blocks:  # slices stand in for attention and the gated activation
                x = x + block["o"](block["qkv"](x)[..., :shape.hidden])
                x = x + block["down"](block["gate_up"](x)[..., :shape.ffn])
            return {"logits": self.lm_head(x)}

    sample = torch.zeros((rows, 1, shape.hidden))
    edge = litert_torch.signature("linears", Linears().eval(), sample_kwargs={"x": sample}).convert()
    if quantize in ("none", "none-left"):
        edge.export(str(out))
        return
    from ai_edge_quantizer import recipe

    from runtime.export.convert import quantize as quantized
    with tempfile.NamedTemporaryFile(suffix=".tflite") as plain:
        edge.export(plain.name)
        out.write_bytes(quantized(Path(plain.name).read_bytes(), recipe.dynamic_wi8_afp32(), quantize))


class Timed:
    """One graph, loaded on ``threads`` XNNPACK threads (``builtin``: on TFLite's own
    kernels, no XNNPACK) with its input and output buffers made once."""

    def __init__(self, path: Path, threads: int = 1, builtin: bool = False) -> None:
        from ai_edge_litert.compiled_model import CompiledModel
        from ai_edge_litert.cpu_kernel_mode import CpuKernelMode
        from ai_edge_litert.cpu_options import CpuOptions
        from ai_edge_litert.hardware_accelerator import HardwareAccelerator
        from ai_edge_litert.options import Options

        cpu = CpuOptions(num_threads=threads, kernel_mode=CpuKernelMode.BUILTIN if builtin else None)
        options = Options(HardwareAccelerator.CPU, cpu_options=cpu)
        self.model = CompiledModel.from_file(str(path), options=options)
        self.key = next(iter(self.model.get_signature_list()))
        names = self.model.get_signature_list()[self.key]
        self.inputs = {n: self.model.create_input_buffer_by_name(self.key, n) for n in names["inputs"]}
        self.outputs = {n: self.model.create_output_buffer_by_name(self.key, n) for n in names["outputs"]}

    def ms_per_pass(self) -> float:
        """Milliseconds of one pass, the mean of :data:`REPEATS` after a warm-up pass."""
        self.model.run_by_name(self.key, self.inputs, self.outputs)
        start = time.perf_counter()
        for _ in range(REPEATS):
            self.model.run_by_name(self.key, self.inputs, self.outputs)
        return (time.perf_counter() - start) / REPEATS * 1e3


def measure(shape: Shape, rows: list[int], quantizations: list[str], rounds: int) -> dict[str, dict[int, float]]:
    """Median ms per pass by precision name and rows."""
    quantization_of = {PRECISIONS[q]: q for q in quantizations}
    return measure_forms(list(quantization_of), rows, "rows",
                         lambda precision, count, path: build(shape, count, quantization_of[precision], path), rounds)


def in_alternating_rounds(graphs: dict[tuple[str, int], Timed], rounds: int) -> dict[tuple[str, int], float]:
    """The median ms per pass of each graph over ``rounds`` rounds, every graph taking its
    turn in each round, the order flipping every round."""
    times: dict[tuple[str, int], list[float]] = {key: [] for key in graphs}
    for r in range(rounds):
        print(f"round {r + 1} of {rounds}", file=sys.stderr, flush=True)
        for key in sorted(graphs, reverse=r % 2 == 1):
            times[key].append(graphs[key].ms_per_pass())
    return {key: statistics.median(values) for key, values in times.items()}


def render(shape_name: str, measured: dict[str, dict[int, float]]) -> str:
    """The markdown table: per precision, ms per pass, per row, and against one row's pass."""
    precisions = list(measured)
    fewest = min(measured[precisions[0]])
    lines = [f"Linears of {shape_name} (no attention, no LoRA), 1 thread, median ms per pass", "",
             "| rows | " + " | ".join(f"{p} ms | {p} per row | {p} vs {fewest} row{'s' * (fewest > 1)}"
                                     for p in precisions) + " |",
             "|---:|" + "---:|---:|---:|" * len(precisions)]
    for count in measured[precisions[0]]:
        cells = []
        for p in precisions:
            ms, one = measured[p][count], measured[p][fewest]
            cells += [f"{ms:.2f}", f"{ms / count:.2f}", f"{ms / one:.2f}x"]
        lines.append(f"| {count} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def measure_forms(forms: Sequence[str], xs: Sequence[int], unit: str, build_one: Callable[[str, int, Path], None],
                  rounds: int, threads: int = 1, builtin: Collection[str] = ()) -> dict[str, dict[int, float]]:
    """Median ms per pass by form and x: ``build_one(form, x, path)`` writes each graph,
    which then runs on ``threads`` XNNPACK threads (the forms in ``builtin``: on TFLite's
    own kernels) in :func:`in_alternating_rounds`."""
    with tempfile.TemporaryDirectory() as folder:
        graphs: dict[tuple[str, int], Timed] = {}
        for x in xs:
            for number, form in enumerate(forms):
                path = Path(folder) / f"{number}-{x}.tflite"
                print(f"building {form}, {x} {unit}", file=sys.stderr, flush=True)
                build_one(form, x, path)
                graphs[(form, x)] = Timed(path, threads, builtin=form in builtin)
        medians = in_alternating_rounds(graphs, rounds)
        return {form: {x: medians[(form, x)] for x in xs} for form in forms}


def positive_ints(parser: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """``text``'s comma-separated positive integers, sorted and distinct; a parser error
    naming ``flag`` otherwise."""
    try:
        values = sorted({int(part) for part in text.split(",")})
    except ValueError:
        values = []
    if not values or values[0] < 1:
        parser.error(f"{flag} {text!r}: expected positive integers, comma-separated")
    return values


def throughput_table(title: str, measured: dict[str, dict[int, float]], column: str,
                     bytes_of: Callable[[int], int]) -> str:
    """The markdown table of ``measured`` (form -> {x: ms}): per x, ms and the GB/s at which
    the ``bytes_of(x)`` bytes went through, a row per form, under ``title``."""
    xs = list(next(iter(measured.values())))
    lines = [title, "", "| form | " + " | ".join(f"{x} {column} ms | GB/s" for x in xs) + " |",
             "|---|" + "---:|---:|" * len(xs)]
    for form, by_x in measured.items():
        cells = [f"{by_x[x]:.3f} | {bytes_of(x) / by_x[x] / 1e6:.1f}" for x in xs]
        lines.append(f"| {form} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_results(out: Path, name: str, table: str, settings: dict, curves: dict[str, dict[int, float]],
                  key: str, xlabel: str, ylabel: str) -> None:
    """Prints ``table`` and writes it to ``{out}/{name}.md``; ``settings`` with the curves
    under ``key`` to ``{name}.json``; and a line per curve (its label: ``{x: y}``) to
    ``{name}.png``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(table)
    payload = {**settings, key: {label: {str(x): y for x, y in points.items()} for label, points in curves.items()}}
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    figure, axes = plt.subplots(figsize=(6, 3.5))
    for label, points in curves.items():
        axes.plot(list(points), list(points.values()), marker="o", label=label)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_ylim(bottom=0)
    axes.legend(fontsize=8)
    figure.savefig(out / f"{name}.png", dpi=110, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,2,4,6,7,8,12,14,15,16", help="row counts, comma-separated")
    parser.add_argument("--quantize", default="none,int8",
                        help="precisions: none (float32), int8, none-left (float32, weights as left operands)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="folder for batch_rows.json, .md and .png")
    args = parser.parse_args()
    rows = positive_ints(parser, "--rows", args.rows)
    quantizations = args.quantize.split(",")
    unknown = [q for q in quantizations if q not in PRECISIONS]
    if unknown or args.rounds < 1:
        parser.error(f"--quantize takes {', '.join(PRECISIONS)}; --rounds takes a positive integer")
    measured = measure(SHAPES[args.shape], rows, quantizations, args.rounds)
    table = render(args.shape, measured)
    settings = {"shape": {"name": args.shape, **asdict(SHAPES[args.shape])}, "rounds": args.rounds}
    write_results(args.out, "batch_rows", table, settings, measured, "ms_per_pass",
                  "rows in one pass (sessions in a batch)", "ms per pass, 1 thread")


if __name__ == "__main__":
    main()
