#!/usr/bin/env python3
"""What one decode step's attention over a KV cache costs in each form XNNPACK can run it,
against a plain read of the same cache: where a batched step's time beyond the linears goes.

    python3 -m benchmarks.experiments.attention_forms [--shape smollm2] [--spans 128,1024] [--rounds 7] \
        [--forms FORM,FORM] [--threads 1] [--out benchmarks/results]

For each span W, builds one graph per form (the export extra: litert-torch) of a decoder's
attention for one token of one session, layer after layer, every layer's K and V cache an
input of the graph as in our exports (the query of the next layer depends on the last, so
nothing runs ahead): ``G`` KV groups of ``q_per_kv`` query heads of ``head_dim``, over the
caches' first W positions. Then times them on ``--threads`` XNNPACK threads, every graph
taking its turn in each round, the order flipping every round, and prints the median
milliseconds per step and the GB/s at which each form gets through the caches' bytes.
Writes ``attention_forms.{json,md,png}``.

The forms (``K`` ``[G, T, hd]`` and ``V`` ``[G, hd, T]`` are our exports' transposed layout):

- ``cache on the right``: ``q K^T`` and ``p V^T`` as BATCH_MATMUL with the cache as the
  transposed right operand, which XNNPACK packs on every run (what our exports do);
- ``cache on the left``: ``(K q^T)^T`` and ``(V p^T)^T``: the cache as the left operand, read
  as it lies, against a right operand of ``q_per_kv`` columns (the kernel's 32 columns mostly
  padding);
- ``no transposed operand``: ``K`` stored ``[G, hd, T]`` and ``V`` ``[G, T, hd]``, so neither
  product transposes its right operand (packing copies rows);
- ``V in K's layout``: ``K`` as ours, ``V`` stored ``[G, T, hd]`` like it: ``q K^T`` as ours,
  ``p V`` without a transposed operand (the layout our kernel reads fastest at short spans,
  kernel_probe/RESULTS.md section 20: what it costs where XNNPACK runs the attention);
- ``multiply and sum``: elementwise products broadcast over the query heads, summed along
  the contracted axis (no matmul);
- ``TFLite's own kernels``: the exports' form (``cache on the right``) on the interpreter's
  built-in kernels instead of XNNPACK's (where a model's ops go when XNNPACK refuses them);
- ``read only``: each cache summed along its last axis: the bytes' floor on this machine.

What it showed (SmolLM2-135M's attention, 30 layers, 3 groups of 3 heads of 64; AMD EPYC,
1 thread, 2026-12-03, 11 rounds): at 1024 positions the matmul forms took 7.3-8.8 ms a step
for 47 MB of caches, 5.3-6.5 GB/s, where reading the caches took 2.0 ms (24 GB/s); the
exports' own form 8.6 ms. The form without a transposed operand was the fastest there (0.85x
of ours at 1024, 0.92x at 512) and the slowest of the matmuls at 128 positions (0.95 against
0.68 ms), where batched steps run; multiplying and summing was no faster anywhere. So a
step's attention is bounded by XNNPACK's batch matmul over a cache operand (about a quarter
of the machine's read bandwidth), not by the graph's form. Whether a window's slice of the
whole cache costs (``--spans 128,512,768 --rounds 9``, 2026-12-03, same box): a window of
128 of the 1024 cache took 0.93 ms against 0.73 ms over a cache of 128 (0.1-0.2 ms a row in
three runs, up to 1.6 ms of a batch of 8); windows of 512 and 768 were within the noise of
caches of their length (3.1 and 5.7 ms against 4.1 and 6.3 ms in a quiet run, 5.8 and 4.4
against 4.8 and 6.4 in one beside another process, 4.0 and 4.8 against 4.2 and 3.8 in a third,
quiet, with 1024 added: the same graph over 768 positions took 3.8 ms in one run and 6.3 in
another): caches the length of the window (KV-length buckets) would save a few percent of a
batched step at most. TFLite's own kernels instead of XNNPACK (``--spans 128,1024 --rounds 7
--out benchmarks/results/avx2``, AMD EPYC with AVX2, 2026-12-04): 3.0 and 28.5 ms against
0.52 and 6.8 ms for the same graph on XNNPACK, 1.7-1.9 GB/s: no way out there either. (In
that run the window of the whole 1024 cache took 4.8 ms against 6.8 ms for the same graph
without the slice; timed alone, 15 rounds, the two took 5.2 and 5.5 ms: identical ops, and a
gap of that size is this machine's noise.) V in K's layout, the layout our kernel reads
fastest at short spans, where XNNPACK runs the attention instead (``--spans 8,32,128,512,1024
--rounds 9 --forms "cache on the right,V in K's layout,no transposed operand,read only"
--out benchmarks/results/zen4``, AMD EPYC Zen 4 with AVX-512, 2026-12-08): 0.134 / 0.195 /
0.621 / 3.34 / 6.93 ms against ours' 0.134 / 0.199 / 0.637 / 3.59 / 7.76, and 0.544 / 2.07 /
7.54 against 0.574 / 3.40 / 8.49 ms at 128 / 512 / 1,024 in a second run: the standard form
loses nothing in that layout (its second product is a BATCH_MATMUL without adj_y, no
TRANSPOSE).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common import RESULTS
from benchmarks.experiments.batch_rows import measure_forms, positive_ints, throughput_table, write_results


@dataclass(frozen=True)
class Shape:
    """A decoder's attention: ``groups`` KV heads, each read by ``q_per_kv`` query heads of
    ``head_dim``, in each of ``layers`` blocks."""

    groups: int
    q_per_kv: int
    head_dim: int
    layers: int
    kv_length: int  # positions a session's cache holds (what an attention window is sliced from)


SHAPES = {
    "smollm2": Shape(groups=3, q_per_kv=3, head_dim=64, layers=30, kv_length=1024),  # SmolLM2-135M
    "tiny": Shape(groups=1, q_per_kv=2, head_dim=8, layers=2, kv_length=64),  # a quick check of the script itself
}
FORMS = ("cache on the right", "window of the whole cache", "cache on the left", "no transposed operand",
         "V in K's layout", "multiply and sum", "TFLite's own kernels", "read only")
BUILTIN = {"TFLite's own kernels"}  # forms timed without XNNPACK


def build(shape: Shape, span: int, form: str, out: Path) -> None:
    """Writes the graph of ``form`` over ``span`` cached positions to ``out``."""
    import torch
    from torch import nn

    from runtime.export.litert import bmm_4d, litert_torch

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One layer: q ``[1, G, q_per_kv, hd]``, k and v the layer's two cache inputs."""
        if form in ("cache on the right", "TFLite's own kernels"):  # k [1, G, T, hd], v [1, G, hd, T]
            return bmm_4d(torch.softmax(bmm_4d(q, k), dim=-1), v)
        if form == "window of the whole cache":  # the same, over the first T of kv_length positions
            return bmm_4d(torch.softmax(bmm_4d(q, k[:, :, :span]), dim=-1), v[..., :span])
        if form == "cache on the left":
            probs = torch.softmax(bmm_4d(k, q).transpose(-1, -2), dim=-1)
            return bmm_4d(v, probs).transpose(-1, -2)
        if form == "no transposed operand":  # k [1, G, hd, T], v [1, G, T, hd]
            return torch.matmul(torch.softmax(torch.matmul(q, k), dim=-1), v)
        if form == "V in K's layout":  # k and v [1, G, T, hd]
            return torch.matmul(torch.softmax(bmm_4d(q, k), dim=-1), v)
        if form == "multiply and sum":  # k [1, G, T, hd], v [1, G, hd, T]
            probs = torch.softmax((q.unsqueeze(3) * k.unsqueeze(2)).sum(-1), dim=-1)
            return (probs.unsqueeze(3) * v.unsqueeze(2)).sum(-1)
        return q + k.sum(-1)[..., :1, :1] + v.sum(-1)[..., :1, :1]  # read only

    class Attention(nn.Module):
        def forward(self, q: torch.Tensor, **caches: torch.Tensor) -> dict[str, torch.Tensor]:
            for layer in range(shape.layers):
                q = q + attend(q, caches[f"k_{layer}"], caches[f"v_{layer}"])
            return {"out": q}

    hd, g = shape.head_dim, shape.groups
    k_shape, v_shape = ((1, g, hd, span), (1, g, span, hd)) if form == "no transposed operand" else \
        ((1, g, span, hd), (1, g, span, hd)) if form == "V in K's layout" else ((1, g, span, hd), (1, g, hd, span))
    if form == "window of the whole cache":
        k_shape, v_shape = (1, g, shape.kv_length, hd), (1, g, hd, shape.kv_length)
    caches = {}
    for layer in range(shape.layers):
        caches[f"k_{layer}"], caches[f"v_{layer}"] = torch.zeros(k_shape), torch.zeros(v_shape)
    sample = {"q": torch.zeros((1, g, shape.q_per_kv, hd)), **caches}
    litert_torch.signature("attention", Attention().eval(), sample_kwargs=sample).convert().export(str(out))


def measure(shape: Shape, forms: list[str], spans: list[int], rounds: int,
            threads: int) -> dict[str, dict[int, float]]:
    """Median ms per step by form and span, on ``threads`` XNNPACK threads."""
    return measure_forms(forms, spans, "positions", lambda form, span, path: build(shape, span, form, path),
                         rounds, threads, builtin=BUILTIN)


def cache_bytes(shape: Shape, span: int) -> int:
    """The bytes of every layer's K and V over ``span`` positions (float32)."""
    return 2 * shape.layers * shape.groups * span * shape.head_dim * 4


def render(shape_name: str, shape: Shape, measured: dict[str, dict[int, float]], threads: int) -> str:
    """The markdown table: per span, ms per step and GB/s through the caches, per form."""
    title = (f"Attention of one decode step over a KV cache, {shape_name} ({shape.layers} layers, {shape.groups} "
             f"groups of {shape.q_per_kv} heads of {shape.head_dim}), {threads} thread{'s' * (threads > 1)}, "
             "median ms per step")
    return throughput_table(title, measured, "positions", lambda span: cache_bytes(shape, span))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    parser.add_argument("--spans", default="128,1024", help="cached positions attended, comma-separated")
    parser.add_argument("--forms", default=",".join(FORMS),
                        help=f"the forms to time, comma-separated (default: all of {', '.join(FORMS)})")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="XNNPACK threads per graph")
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="folder for attention_forms.json, .md and .png")
    args = parser.parse_args()
    spans = positive_ints(parser, "--spans", args.spans)
    if args.rounds < 1 or args.threads < 1:
        parser.error("--rounds and --threads take positive integers")
    forms = [form.strip() for form in args.forms.split(",")]
    if unknown := [form for form in forms if form not in FORMS]:
        parser.error(f"--forms: {', '.join(map(repr, unknown))} not among {', '.join(FORMS)}")
    shape = SHAPES[args.shape]
    if max(spans) > shape.kv_length:
        parser.error(f"--spans {args.spans}: a span is at most {args.shape}'s {shape.kv_length} cached positions")
    measured = measure(shape, forms, spans, args.rounds, args.threads)
    table = render(args.shape, shape, measured, args.threads)
    settings = {"shape": {"name": args.shape, **asdict(shape)}, "forms": forms, "rounds": args.rounds, "threads": args.threads}
    write_results(args.out, "attention_forms", table, settings, measured, "ms_per_step", "cached positions attended",
                  f"ms per step, {args.threads} thread{'s' * (args.threads > 1)}")


if __name__ == "__main__":
    main()
