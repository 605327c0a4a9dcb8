"""Benchmarks: what an adapter costs per token, per switch and per session, side by side.

    python benchmarks/run.py [--model M] [--repeats N] [--steps N]

Every figure is the median of ``--repeats`` runs; ratios compare figures measured in
the same run. Prints a markdown table and writes it to ``benchmarks/results/results.md``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime import Engine, EngineSettings, LoraSource, SessionConfig
from runtime.util.lora_data import LoraData
from runtime.util.lora_util import PROJECTIONS, SIDES, Convention, lora_input_name
from runtime.util.lora_writer import serialize_lora_tensors

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "tests" / "models" / "gqa_default.tflite"
ADAPTERS = ROOT / "tests" / "models" / "adapters"
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Row:
    """One line of the table."""

    what: str
    value: float
    unit: str
    note: str = ""


def median_time(action: Callable[[], object], repeats: int, per: int = 1) -> float:
    """Median wall time of ``action`` over ``repeats`` runs, divided by ``per``."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        samples.append((time.perf_counter() - start) / per)
    return statistics.median(samples)


def decode_steps(session, steps: int) -> Callable[[], None]:
    """A timed action: ``steps`` decode steps, rewinding the session to keep it in range."""
    def run() -> None:
        session.reset()
        session.run_prefill([1])
        for i in range(steps):
            session.run_decode(i % 200)
    return run


def bench_engine(model: Path, repeats: int, steps: int) -> list[Row]:
    """Decode, prefill, adapter switch and session switch on one model."""
    rows: list[Row] = []
    with Engine(model, EngineSettings(num_threads=1)) as engine:
        r4 = LoraSource(path=ADAPTERS / "torch_r4.tflite")
        r4_other = LoraSource(path=ADAPTERS / "litertlm_r4.tflite")
        r16 = LoraSource(path=ADAPTERS / "torch_r16.tflite")
        base = engine.create_session()
        one = engine.create_session(SessionConfig(loras=[r4]))
        other = engine.create_session(SessionConfig(loras=[r4_other]))
        wide = engine.create_session(SessionConfig(loras=[r16]))
        for session in (base, one, other, wide):  # warm up: materialize, bind, first run
            decode_steps(session, 4)()

        plain = median_time(decode_steps(base, steps), repeats, steps)
        with_r4 = median_time(decode_steps(one, steps), repeats, steps)
        with_r16 = median_time(decode_steps(wide, steps), repeats, steps)
        rows += [
            Row("decode step, base model", plain * 1e3, "ms"),
            Row("decode step, rank-4 adapter", with_r4 * 1e3, "ms", f"{with_r4 / plain:.2f}x base"),
            Row("decode step, rank-16 adapter", with_r16 * 1e3, "ms", f"{with_r16 / plain:.2f}x base"),
        ]

        prompt = list(range(32))
        for label, session in (("base model", base), ("rank-4 adapter", one)):
            def prefill(session=session) -> None:
                session.reset()
                session.run_prefill(prompt)
            rows.append(Row(f"prefill 32 tokens, {label}", median_time(prefill, repeats) * 1e3, "ms"))

        def alternate(a, b) -> Callable[[], None]:
            def run() -> None:
                for s in (a, b):
                    s.reset()
                    s.run_prefill([1])
                for i in range(steps // 2):
                    a.run_decode(i % 200)
                    b.run_decode(i % 200)
            return run

        twin = engine.create_session(SessionConfig(loras=[r4]))
        decode_steps(twin, 4)()
        same_adapter = median_time(alternate(one, twin), repeats, steps)
        other_adapter = median_time(alternate(one, other), repeats, steps)
        rows += [
            Row("decode step, alternating 2 sessions, same adapter", same_adapter * 1e3, "ms",
                f"{same_adapter / with_r4:.2f}x one session"),
            Row("decode step, alternating 2 sessions, different adapters", other_adapter * 1e3, "ms",
                f"{other_adapter / with_r4:.2f}x one session"),
        ]

        switcher = engine.create_session(SessionConfig(loras=[r4]))
        sources = [[r4_other], [r4]]

        def switch_and_decode() -> None:
            for loras in sources:
                switcher.set_adapters(loras, reset=True)
                switcher.run_decode(5)

        switch = median_time(switch_and_decode, repeats, len(sources)) - median_time(
            decode_steps(one, 1), repeats
        )
        rows.append(Row("switch a session between two resident adapters (+ first decode)",
                        (switch + with_r4) * 1e3, "ms", f"switch alone ~{switch * 1e6:.0f} us"))
    return rows


def write_adapter_file(path: Path, megabytes: int, external_data: bool, layers: int = 32) -> None:
    """A LoRA file of about ``megabytes`` MB: float16 rank-16 pairs for ``layers`` layers
    (256 tensors for 32 layers, as a 32-layer model's q/k/v/o adapter has), the hidden
    size chosen to reach the size."""
    tensor_count = layers * len(PROJECTIONS) * len(SIDES)
    width = max(1, megabytes * (1 << 20) // (tensor_count * 16 * 2))
    zeros = np.zeros((16, width), np.float16)
    tensors = {
        lora_input_name(Convention.LITERT_LM, layer, proj, side): zeros
        for layer in range(layers) for proj in PROJECTIONS for side in SIDES
    }
    path.write_bytes(serialize_lora_tensors(tensors, external_data=external_data, lora_rank=16))


def bench_register(sizes_mb: list[int], repeats: int) -> list[Row]:
    """Time to open and parse an adapter file (LoraData.create_from_file_path) by size."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for megabytes in sizes_mb:
            for external in (True, False):
                path = Path(tmp) / f"a{megabytes}_{external}.tflite"
                write_adapter_file(path, megabytes, external)

                def register(path=path) -> None:
                    LoraData.create_from_file_path(path).close()

                register()
                placement = "data after flatbuffer" if external else "inline data"
                rows.append(Row(f"LoraData.create_from_file_path, {path.stat().st_size / 1e6:.0f} MB file, {placement}",
                                median_time(register, repeats) * 1e3, "ms"))
            path.unlink()
    return rows


def render(rows: list[Row], model: Path) -> str:
    """The rows as a markdown table."""
    lines = [f"Model: `{model.name}`, 1 thread", "", "| measurement | value | note |", "|---|---:|---|"]
    lines += [f"| {r.what} | {r.value:.4f} {r.unit} | {r.note} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    rows = bench_engine(args.model, args.repeats, args.steps)
    rows += bench_register([1, 8, 64, 200], args.repeats)
    table = render(rows, args.model)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "results.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
