"""Where an export's time and memory go: seconds per stage and per signature, and the peak
resident memory of the export's whole process tree (the exporter and its workers together,
sampled) and of each process alone (the kernel's high-water mark).

The tree is measured two ways. RSS summed over the processes counts a page every process
maps once per process (the libraries, the memory-mapped weights the workers share). PSS
(proportional set size) divides each shared page among the processes mapping it, so its
sum is the memory the export takes from the machine.
"""

from __future__ import annotations

import ctypes
import resource
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil

_SAMPLE_SECONDS = 0.2


def tree_rss_bytes(process: psutil.Process) -> int:
    """The resident memory of ``process`` and all its descendants, in bytes."""
    return tree_memory_bytes(process)[0]


def tree_memory_bytes(process: psutil.Process) -> tuple[int, int]:
    """``(RSS, PSS)`` of ``process`` and all its descendants summed, in bytes."""
    rss = pss = 0
    for member in [process, *process.children(recursive=True)]:
        try:
            full = member.memory_full_info()
        except psutil.Error:  # a worker that exited between listing and reading
            continue
        rss += full.rss
        pss += getattr(full, "pss", full.rss)  # PSS is Linux's; elsewhere RSS stands in
    return rss, pss


def release_freed_memory() -> None:
    """Hands memory that Python and torch have freed back to the system (glibc keeps freed
    small blocks in its arenas, so a process that dropped a model still looks its size)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def process_peak_rss_bytes() -> int:
    """This process's own peak resident memory so far: Linux's ``VmHWM``, the high-water
    mark of the process's current memory. (``getrusage``'s ``ru_maxrss`` would do but for
    a process started by fork and exec, as the workers are: it keeps the parent's size at
    the fork as a floor.) Elsewhere ``ru_maxrss``, which reports kilobytes on Linux and
    bytes on macOS."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class MemoryWatch:
    """Samples the resident memory of this process and its descendants every 0.2 s in a
    background thread while entered; :attr:`peak_bytes` is the largest RSS sum seen and
    :attr:`peak_pss_bytes` the largest PSS sum (both also readable while running)."""

    def __init__(self) -> None:
        self.peak_bytes = 0
        self.peak_pss_bytes = 0
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="export-memory-watch", daemon=True)

    def sample(self) -> int:
        """Takes one sample now; returns its RSS sum."""
        rss, pss = tree_memory_bytes(self._process)
        self.peak_bytes = max(self.peak_bytes, rss)
        self.peak_pss_bytes = max(self.peak_pss_bytes, pss)
        return rss

    def restart(self) -> None:
        """Starts the peaks afresh from a sample taken now."""
        self.peak_bytes = self.peak_pss_bytes = 0
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(_SAMPLE_SECONDS):
            self.sample()

    def __enter__(self) -> MemoryWatch:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


@dataclass
class StageRecord:
    """One stage: its wall time and the process tree's peak memory while it ran (RSS and
    PSS, summed over the processes)."""

    name: str
    seconds: float
    peak_rss_bytes: int
    peak_pss_bytes: int


@dataclass
class SignatureRecord:
    """One signature: seconds tracing it (torch.export and litert-torch's graph passes) and
    lowering it to MLIR (decompositions and the MLIR module), in the worker that did it."""

    name: str
    trace_seconds: float
    lower_seconds: float
    worker: int


@dataclass
class Measurements:
    """Everything measured during one export (:meth:`as_dict` is its JSON form)."""

    stages: list[StageRecord] = field(default_factory=list)
    signatures: list[SignatureRecord] = field(default_factory=list)
    # Per worker: its own peak resident memory; the exporter's own, and the finishing
    # process's (runtime.export.finish).
    worker_peak_rss_bytes: list[int] = field(default_factory=list)
    exporter_peak_rss_bytes: int = 0
    finisher_peak_rss_bytes: int = 0
    # Per worker: seconds converting its module to TFLite ops (litert-torch's passes).
    worker_convert_seconds: list[float] = field(default_factory=list)
    jobs: int = 1
    # The tree's peaks: RSS summed (never below any one process's own high-water mark) and
    # PSS summed (shared pages counted once: what the export takes from the machine).
    peak_rss_bytes: int = 0
    peak_pss_bytes: int = 0
    seconds: float = 0.0

    @contextmanager
    def stage(self, name: str, watch: MemoryWatch) -> Iterator[None]:
        """Times the body as stage ``name``; its peak is the watch's peak over the body."""
        start = time.perf_counter()
        watch.restart()
        try:
            yield
        finally:
            self.record(name, time.perf_counter() - start, watch)

    def record(self, name: str, seconds: float, watch: MemoryWatch) -> None:
        """Records stage ``name``, done in ``seconds``, with the watch's peaks since it was
        last restarted; restarts it for the next stage."""
        watch.sample()
        self.stages.append(StageRecord(name, seconds, watch.peak_bytes, watch.peak_pss_bytes))
        watch.restart()

    def as_dict(self) -> dict[str, object]:
        """The measurements as JSON-ready data (seconds rounded to 0.1, memory in bytes)."""
        return {
            "seconds": round(self.seconds, 1),
            "peak_rss_bytes": self.peak_rss_bytes,
            "peak_pss_bytes": self.peak_pss_bytes,
            "jobs": self.jobs,
            "exporter_peak_rss_bytes": self.exporter_peak_rss_bytes,
            "finisher_peak_rss_bytes": self.finisher_peak_rss_bytes,
            "worker_peak_rss_bytes": self.worker_peak_rss_bytes,
            "worker_convert_seconds": [round(value, 1) for value in self.worker_convert_seconds],
            "stages": [{"name": s.name, "seconds": round(s.seconds, 1), "peak_rss_bytes": s.peak_rss_bytes,
                        "peak_pss_bytes": s.peak_pss_bytes} for s in self.stages],
            "signatures": [{"name": s.name, "trace_seconds": round(s.trace_seconds, 1),
                            "lower_seconds": round(s.lower_seconds, 1), "worker": s.worker}
                           for s in self.signatures],
        }

    def table(self) -> str:
        """The breakdown as text lines, for ``--verbose``."""
        lines = [f"{'stage':<34} {'seconds':>8} {'peak RSS':>10} {'peak PSS':>10}"]
        lines += [f"{s.name:<34} {s.seconds:8.1f} {_gb(s.peak_rss_bytes):>10} {_gb(s.peak_pss_bytes):>10}"
                  for s in self.stages]
        lines.append(f"{'total':<34} {self.seconds:8.1f} {_gb(self.peak_rss_bytes):>10} {_gb(self.peak_pss_bytes):>10}")
        lines.append("(RSS and PSS summed over the exporter and the processes it starts; PSS counts shared pages once)")
        if self.signatures:
            lines.append(f"{'signature (worker)':<34} {'trace s':>8} {'lower s':>10}")
            lines += [f"{s.name + f' ({s.worker})':<34} {s.trace_seconds:8.1f} {s.lower_seconds:10.1f}"
                      for s in self.signatures]
        if self.worker_convert_seconds:
            lines.append("seconds converting to TFLite ops in each worker: "
                         + ", ".join(f"{value:.1f}" for value in self.worker_convert_seconds))
        lines.append(f"peak RSS of the exporter process alone: {_gb(self.exporter_peak_rss_bytes)}"
                     + ("; of each worker: " + ", ".join(_gb(value) for value in self.worker_peak_rss_bytes)
                        if self.worker_peak_rss_bytes else "")
                     + f"; of the finishing process: {_gb(self.finisher_peak_rss_bytes)}")
        return "\n".join(lines)


def _gb(value: int) -> str:
    return f"{value / 1e9:.2f} GB"
