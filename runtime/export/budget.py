"""How many worker processes an export runs: as many as asked (default: one per core), but
no more than the memory budget holds, by an estimate of each process's peak memory that
scales with the model's float32 weight bytes (measured on SmolLM2-135M and a 0.5B Qwen2.5
shape, see the factors' notes): the exporter's, each worker's (all at once) and the
finishing process's."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from runtime.errors import InvalidArgumentError, ResourceExhaustedError

GB = 1_000_000_000
# Resident memory of a process with torch, transformers and litert-torch imported.
PROCESS_BASE_BYTES = int(0.9 * GB)
# ... and of the finishing process (runtime.export.finish), which imports neither.
FINISHER_BASE_BYTES = int(0.2 * GB)
# Peaks per process, measured with 2 jobs exporting f32 and int8 in one run (``--quantize
# none,int8``), as ``w`` grows from SmolLM2-135M (0.54 GB of float32 weights, 42 signatures)
# to a Qwen2.5-0.5B shape (1.98 GB, 12 signatures):
# - the exporter, building the litert-torch decoder beside the loaded checkpoint (both in
#   float32 for a moment): 1.86 -> 4.70 GB, the base + 2.0 w;
# - a worker (the memory-mapped weights, counted in its RSS though shared, its module and
#   the conversion): 1.87 -> 3.37 GB, the base + 0.45 GB + 1.05 w;
# - the finishing process (every worker's copy of the weights parsed, then the float model
#   and the quantizer's copies): 2.09 -> 4.59 GB, its base + 1.0 GB + 0.9 w per worker;
# - the exporter while the others run (it has dropped the model): below the base + w.
# The constants round those up; a 1B model (4.9 GB) comes to 18.9 GB with 2 jobs.
EXPORTER_PER_WEIGHT_BYTE = 2.0
WORKER_FIXED_BYTES = int(0.45 * GB)
WORKER_PER_WEIGHT_BYTE = 1.05
FINISHER_FIXED_BYTES = int(1.0 * GB)
FINISHER_PER_WEIGHT_BYTE_AND_WORKER = 0.9
EXPORTER_IDLE_PER_WEIGHT_BYTE = 1.0


@dataclass(frozen=True)
class Plan:
    """The chosen number of workers and the estimates behind it (bytes): each process's
    peak, and the most the export holds at once with ``jobs`` workers."""

    jobs: int
    max_memory: int
    exporter_peak: int
    worker_peak: int
    finisher_peak: int
    total_peak: int

    def describe(self) -> str:
        """One line for ``--verbose``."""
        return (f"{self.jobs} job(s) within {self.max_memory / GB:.1f} GB (estimated peaks: exporter "
                f"{self.exporter_peak / GB:.1f} GB, each worker {self.worker_peak / GB:.1f} GB, finishing "
                f"{self.finisher_peak / GB:.1f} GB; all at once {self.total_peak / GB:.1f} GB)")


def available_memory() -> int:
    """The memory available now (what the default budget is)."""
    import psutil  # the export extra's; this module is also imported by the command line without it

    return int(psutil.virtual_memory().available)


def _peaks(weight_bytes: int, jobs: int) -> tuple[int, int, int, int]:
    """(exporter, worker, finisher, all at once) peaks of an export of ``weight_bytes``
    float32 weight bytes with ``jobs`` workers (one: the exporter lowers them itself)."""
    exporter = PROCESS_BASE_BYTES + math.ceil(EXPORTER_PER_WEIGHT_BYTE * weight_bytes)
    worker = PROCESS_BASE_BYTES + WORKER_FIXED_BYTES + math.ceil(WORKER_PER_WEIGHT_BYTE * weight_bytes)
    finisher = FINISHER_BASE_BYTES + FINISHER_FIXED_BYTES + math.ceil(
        FINISHER_PER_WEIGHT_BYTE_AND_WORKER * max(jobs, 2) * weight_bytes)  # quantizing needs 2 at least
    idle = PROCESS_BASE_BYTES + math.ceil(EXPORTER_IDLE_PER_WEIGHT_BYTE * weight_bytes)
    lowering = idle + jobs * worker  # one job: the exporter lowers itself, counted as idling beside a worker
    return exporter, worker, finisher, max(exporter, lowering, idle + finisher)


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
    alone = _peaks(weight_bytes, 1)[3]
    if alone > budget:
        raise ResourceExhaustedError(
            f"a model of {parameters:,} parameters needs about {alone / GB:.1f} GB to export, more than the "
            f"{budget / GB:.1f} GB "
            + ("of --max-memory" if max_memory is not None else "available now (free memory or give --max-memory)"))
    chosen = 1
    for count in range(2, (jobs if jobs is not None else os.cpu_count() or 1) + 1):
        if _peaks(weight_bytes, count)[3] > budget:
            break
        chosen = count
    return Plan(chosen, budget, *_peaks(weight_bytes, chosen))
