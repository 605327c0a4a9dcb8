"""How many worker processes an export runs: as many as asked (default: one per core), but
no more than the memory budget holds, by an estimate of each process's peak memory that
scales with the model's float32 weight bytes (measured on SmolLM2-135M and a 0.5B Qwen2.5
shape, see the factors' notes)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from runtime.errors import InvalidArgumentError, ResourceExhaustedError

GB = 1_000_000_000
# Resident memory of a process with torch, transformers and litert-torch imported.
PROCESS_BASE_BYTES = int(0.9 * GB)
# Peaks, measured with 2 jobs exporting f32 and int8 in one run (``--quantize none,int8``):
# SmolLM2-135M (0.54 GB of float32 weights, 42 signatures) exporter 3.78 GB, workers 1.89 GB;
# a Qwen2.5-0.5B shape (1.98 GB, 12 signatures) exporter 8.63 GB, workers 4.73 GB. A line
# through both: the exporter 1.07 GB (graph bookkeeping) + 3.37 per weight byte (its
# serialized flatbuffer and the quantizer's copies) over the process base, a worker 1.98 per
# weight byte (its memory-mapped weights, counted in its RSS though shared, its module and
# their conversion). The constants round those up; a 1B model (4.9 GB) comes to 19.4 GB.
EXPORTER_FIXED_BYTES = int(1.2 * GB)
EXPORTER_PER_WEIGHT_BYTE = 3.5
WORKER_PER_WEIGHT_BYTE = 2.1
# What the exporter holds while its workers run (it has dropped the model by then).
EXPORTER_IDLE_PER_WEIGHT_BYTE = 1.0


@dataclass(frozen=True)
class Plan:
    """The chosen number of workers and the estimates behind it (bytes)."""

    jobs: int
    max_memory: int
    exporter_peak: int
    worker_peak: int

    def describe(self) -> str:
        """One line for ``--verbose``."""
        return (f"{self.jobs} job(s) within {self.max_memory / GB:.1f} GB (estimated peaks: exporter "
                f"{self.exporter_peak / GB:.1f} GB, each worker {self.worker_peak / GB:.1f} GB)")


def available_memory() -> int:
    """The memory available now (what the default budget is)."""
    import psutil  # the export extra's; this module is also imported by the command line without it

    return int(psutil.virtual_memory().available)


def plan(parameters: int, jobs: int | None = None, max_memory: int | None = None) -> Plan:
    """The workers for a model of ``parameters`` weights: ``jobs`` (default: the cores) but
    no more than fit in ``max_memory`` bytes (default: the memory available now). Raises
    ``ResourceExhaustedError`` naming both numbers when even one cannot fit."""
    if jobs is not None and jobs < 1:
        raise InvalidArgumentError(f"--jobs {jobs}: expected at least 1")
    if max_memory is not None and max_memory <= 0:
        raise InvalidArgumentError(f"--max-memory {max_memory / GB:g} GB: expected a positive size")
    budget = available_memory() if max_memory is None else max_memory
    weight_bytes = 4 * parameters
    exporter_peak = PROCESS_BASE_BYTES + EXPORTER_FIXED_BYTES + math.ceil(EXPORTER_PER_WEIGHT_BYTE * weight_bytes)
    worker_peak = PROCESS_BASE_BYTES + math.ceil(WORKER_PER_WEIGHT_BYTE * weight_bytes)
    idle = PROCESS_BASE_BYTES + math.ceil(EXPORTER_IDLE_PER_WEIGHT_BYTE * weight_bytes)
    if exporter_peak > budget:  # one job: everything in the exporter
        raise ResourceExhaustedError(
            f"a model of {parameters:,} parameters needs about {exporter_peak / GB:.1f} GB to export, more than the "
            f"{budget / GB:.1f} GB "
            + ("of --max-memory" if max_memory is not None else "available now (free memory or give --max-memory)"))
    wanted = jobs if jobs is not None else os.cpu_count() or 1
    fitting = (budget - idle) // worker_peak  # workers run side by side while the exporter idles
    return Plan(jobs=max(1, min(wanted, fitting if fitting >= 2 else 1)), max_memory=budget,
                exporter_peak=exporter_peak, worker_peak=worker_peak)
