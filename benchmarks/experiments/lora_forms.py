#!/usr/bin/env python3
"""What the rows' own LoRA products cost in a batched decode step, in each form XNNPACK can
run them, against a plain read of the same adapter weights.

    python3 -m benchmarks.experiments.lora_forms [--shape smollm2] [--rows 1,8] [--rank 8] [--forms F,F,...] \
        [--rounds 7] [--out benchmarks/results]

For each row count B, builds one graph per form (the export extra: litert-torch) of
``x_i A_i B_i`` on q, k, v and o of every layer for B rows, each row's ``A`` and ``B`` a
slice of a stacked graph input as in our batched exports (the next layer's ``x`` depends on
the last, so nothing runs ahead). Times them on 1 thread in alternating rounds and prints the
median milliseconds per step and the GB/s at which each form gets through the adapters'
bytes. Writes ``lora_forms.{json,md,png}``.

The forms:

- ``stacked matmuls``: ``(x A) B`` as batched matmuls over ``A`` ``[B, in, r]`` and ``B``
  ``[B, r, out]`` (what our exports do; XNNPACK packs both weights on every run, ``A``'s r = 8
  columns padded to its kernel's 32 on this AVX-512 CPU);
- ``fully connected``: each row's own two FULLY_CONNECTED ops over ``A`` ``[B, r, in]`` and
  ``B`` ``[B, out, r]`` (PEFT's own layout, packed by XNNPACK as dynamic FULLY_CONNECTED
  weights);
- ``rows side by side``: every row's ``A`` side by side in one ``[in, B r]`` input and
  every ``B`` stacked in one ``[B r, out]``: one matmul of all rows against all ``A``
  (nothing padded: B r columns), a constant block mask keeping each row's own r columns,
  one matmul against all ``B`` (the masked zeros add nothing);
- ``weights on the left``: ``A^T`` ``[B, r, in]`` and ``B^T`` ``[B, out, r]`` as the left
  operands, read as they lie (then ``x`` is packed instead, padded alike);
- ``multiply and sum``: elementwise products summed along the contracted axis (no matmul);
- ``read only``: each weight summed: the bytes' floor on this machine.

What it showed (SmolLM2-135M's q/k/v/o, 30 layers, rank 8; AMD EPYC, 1 thread, 2026-12-03,
9 rounds): at 8 rows the exports' form took 6.6 ms a step (4.5 GB/s through 29.5 MB of
adapter weights), a fifth to a quarter of an int8 batched step of 8 rows (26-30 ms), where
reading the weights took 1.6 ms (18 GB/s); multiplying and summing 5.8 ms (0.88x), the
weights on the left 11.7 ms. One row: 1.0 ms, 0.7 ms and 2.1 ms; reading 0.4 ms. Rows side
by side (2026-12-03, same box, 7 rounds): 7.3 ms against 7.5 ms for the exports' form in the
same run: packing ``A`` without padding its 8 columns to 32 saves nothing, so the padding is
not the cost (an earlier stop measured the same layout through FULLY_CONNECTED: slower).
Fully connected, one row (2026-12-03, same box, 9 rounds, ``--rows 1 --forms "stacked
matmuls,fully connected,read only"``): rank 8 0.53 ms against 0.70 ms for the exports' form,
rank 64 7.07 ms against 3.58 ms: what rank 8 would gain, rank 64 loses twice over, so the
exports keep ``A`` ``[in, r]`` and ``B`` ``[r, out]``.

On an AMD EPYC with AVX2 and no AVX-512 (2026-12-04, 7 rounds, ``--rows 1 --rank R --forms
"stacked matmuls,fully connected,weights on the left,multiply and sum,read only"``, tables
in ``benchmarks/results/avx2/lora_forms_r{8,64}_1row.md``): one row at rank 64, the exports'
form 3.91 ms, fully connected 5.08, weights on the left 4.70, multiply and sum 2.42, reading
1.58; at rank 8 0.57, 0.66, 1.04, 0.65 and 0.31 ms; the exports' form against multiplying and
summing at rank 32 1.33 and 0.87 ms, at rank 16 0.70 and 0.69. So since 2026-12-04 one token
of one row at rank 32 and above is multiplied and summed in the exports
(``runtime.export.mlp_lora.lora_product``): a whole rank-64 SmolLM2 step took 0.93x (f32)
and 0.82x (int8) the matmul form's time there. Batched rows keep the batched matmuls (at 8
rows and rank 8 the two forms were 4.23 and 4.38 ms).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common import RESULTS
from benchmarks.experiments.batch_rows import measure_forms, positive_ints, throughput_table, write_results


@dataclass(frozen=True)
class Shape:
    """The projections LoRA runs on in each of ``layers`` blocks: ``hidden`` in, and out of
    q and o; ``kv`` out of k and v."""

    hidden: int
    kv: int
    layers: int

    def projections(self) -> dict[str, tuple[int, int]]:
        """``{name: (in, out)}`` of q, k, v and o."""
        return {"q": (self.hidden, self.hidden), "k": (self.hidden, self.kv), "v": (self.hidden, self.kv),
                "o": (self.hidden, self.hidden)}


SHAPES = {
    "smollm2": Shape(hidden=576, kv=192, layers=30),  # SmolLM2-135M
    "tiny": Shape(hidden=16, kv=8, layers=2),  # a quick check of the script itself
}
FORMS = ("stacked matmuls", "fully connected", "rows side by side", "weights on the left", "multiply and sum",
         "read only")


def build(shape: Shape, rows: int, rank: int, form: str, out: Path) -> None:
    """Writes the graph of ``form`` for ``rows`` rows to ``out``."""
    import torch
    from torch import nn

    from runtime.export.litert import litert_torch

    left = form == "weights on the left"
    transposed = left or form == "fully connected"
    side = form == "rows side by side"
    mask = torch.kron(torch.eye(rows), torch.ones((1, rank))) if side else None  # [B, B r]: each row's own columns

    def delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``x A B`` for every row: x ``[B, 1, in]`` -> ``[B, 1, out]``."""
        if form == "stacked matmuls":
            return torch.matmul(torch.matmul(x, a), b)
        if form == "fully connected":  # a [B, r, in], b [B, out, r]: each row's own two FULLY_CONNECTED
            return torch.stack([nn.functional.linear(nn.functional.linear(x[row], a[row]), b[row])
                                for row in range(rows)])
        if form == "rows side by side":  # a [in, B r], b [B r, out]
            own = torch.matmul(x.reshape(rows, -1), a) * mask
            return torch.matmul(own, b).reshape(rows, 1, -1)
        if left:  # a [B, r, in], b [B, out, r]
            return torch.matmul(b, torch.matmul(a, x.transpose(1, 2))).transpose(1, 2)
        if form == "multiply and sum":
            hidden = (x.transpose(1, 2) * a).sum(1, keepdim=True)  # [B, 1, r]
            return (hidden.transpose(1, 2) * b).sum(1, keepdim=True)
        return x[..., :1] + a.sum((1, 2)).reshape(-1, 1, 1) + b.sum((1, 2)).reshape(-1, 1, 1)  # read only

    class Lora(nn.Module):
        def forward(self, x: torch.Tensor, **weights: torch.Tensor) -> dict[str, torch.Tensor]:
            for layer in range(shape.layers):
                step = x
                for name in shape.projections():
                    d = delta(x, weights[f"a_{name}_{layer}"], weights[f"b_{name}_{layer}"])
                    step = step + d[..., :shape.kv].sum(-1, keepdim=True) if name in "kv" else step + d
                x = step
            return {"out": x}

    sample = {"x": torch.zeros((rows, 1, shape.hidden))}
    for layer in range(shape.layers):
        for name, (fan_in, fan_out) in shape.projections().items():
            if side:
                sample[f"a_{name}_{layer}"] = torch.zeros((fan_in, rows * rank))
                sample[f"b_{name}_{layer}"] = torch.zeros((rows * rank, fan_out))
                continue
            sample[f"a_{name}_{layer}"] = torch.zeros((rows, rank, fan_in) if transposed else (rows, fan_in, rank))
            sample[f"b_{name}_{layer}"] = torch.zeros((rows, fan_out, rank) if transposed else (rows, rank, fan_out))
    litert_torch.signature("lora", Lora().eval(), sample_kwargs=sample).convert().export(str(out))


def measure(shape: Shape, forms: list[str], rows: list[int], rank: int, rounds: int) -> dict[str, dict[int, float]]:
    """Median ms per step by form and rows."""
    return measure_forms(forms, rows, "rows", lambda form, count, path: build(shape, count, rank, form, path), rounds)


def weight_bytes(shape: Shape, rows: int, rank: int) -> int:
    """The bytes of every row's ``A`` and ``B`` over all layers (float32)."""
    return 4 * rows * rank * shape.layers * sum(i + o for i, o in shape.projections().values())


def render(shape_name: str, rank: int, shape: Shape, measured: dict[str, dict[int, float]]) -> str:
    """The markdown table: per row count, ms per step and GB/s through the weights, per form."""
    title = (f"LoRA rank {rank} on q/k/v/o of {shape_name} ({shape.layers} layers), each row its own adapter, "
             "1 thread, median ms per step")
    return throughput_table(title, measured, "rows", lambda rows: weight_bytes(shape, rows, rank))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,8", help="rows (sessions) in a batch, comma-separated")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--forms", default=",".join(FORMS), help=f"forms to time, comma-separated, of {FORMS}")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="folder for lora_forms.json, .md and .png")
    args = parser.parse_args()
    rows = positive_ints(parser, "--rows", args.rows)
    if args.rank < 1 or args.rounds < 1:
        parser.error("--rank and --rounds take positive integers")
    forms = [form.strip() for form in args.forms.split(",")]
    if unknown := sorted(set(forms) - set(FORMS)):
        parser.error(f"--forms: unknown {unknown}, expected some of {FORMS}")
    shape = SHAPES[args.shape]
    measured = measure(shape, forms, rows, args.rank, args.rounds)
    table = render(args.shape, args.rank, shape, measured)
    settings = {"shape": {"name": args.shape, **asdict(shape)}, "rank": args.rank, "forms": forms,
                "rounds": args.rounds}
    write_results(args.out, "lora_forms", table, settings, measured, "ms_per_step", "rows in one batch",
                  "ms per step, 1 thread")


if __name__ == "__main__":
    main()
