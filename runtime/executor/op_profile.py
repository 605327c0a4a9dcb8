"""Where a model's runs spend their time, op by op, from LiteRT's own profiler.

:meth:`runtime.Engine.profile_ops` records the runs of a block of code (an engine opened
with ``EngineSettings(profile_ops=True)``); :func:`summarize` turns the recorded events
into an :class:`OpProfile`: for every op name, how many times it ran and for how long.
The names are the library's: XNNPACK's operators (``Fully Connected (NC, F32) GEMM``,
``Batch Matrix Multiply (NC, F32) GEMM``) for what its delegate runs, and TFLite's builtin
names (``DYNAMIC_UPDATE_SLICE``) for the ops the interpreter runs itself. LiteRT's events
around a run (``LiteRT::Run[buffer registration]``, ``[Buffer sync]``) are left out: while
recording they read longer than a whole unrecorded run (on the committed test model 0.11
and 0.09 ms a step against 0.04-0.05 ms for the run), so they time the recording itself.

Recording costs time of its own (an event per op: a SmolLM2-135M int8 decode step of
~10 ms took ~18 ms while recorded), and the library counts whole microseconds per event,
so an op that takes less reads as 0: compare the large rows, and steps within one
recording, not recorded steps with unrecorded ones.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from runtime.executor.native import DELEGATE_OP_EVENTS, INTERPRETER_OP_EVENT, RUN_EVENT, ProfiledEvent

RUN_TAG = "Invoke"  # a signature run's event: the interpreter's whole run of its ops

KERNELS = {INTERPRETER_OP_EVENT: "TFLite", **dict.fromkeys(DELEGATE_OP_EVENTS, "XNNPACK")}


@dataclass(frozen=True)
class OpTime:
    """One op name's runs in a recording: who ran it (``XNNPACK`` or ``TFLite``), how
    many times, and the milliseconds they took in all."""

    name: str
    kernel: str
    count: int
    milliseconds: float


@dataclass(frozen=True)
class OpProfile:
    """A recording: ``runs`` signature runs taking ``run_milliseconds`` inside the
    interpreter in all, and ``ops``, longest first."""

    runs: int
    run_milliseconds: float
    ops: tuple[OpTime, ...]

    def table(self, steps: int | None = None) -> str:
        """A Markdown table of the ops, per step when ``steps`` is given (the recorded
        runs' count per step and milliseconds per step), else totals."""
        divisor = steps or 1
        unit = "per step" if steps else "in all"
        lines = [f"{self.runs} runs, {self.run_milliseconds / divisor:.3f} ms {unit} inside the interpreter",
                 "", f"| op | kernel | runs {unit} | ms {unit} | share of the runs |", "|---|---|---:|---:|---:|"]
        for op in self.ops:
            share = op.milliseconds / self.run_milliseconds if self.run_milliseconds else 0.0
            lines.append(f"| {op.name} | {op.kernel} | {op.count / divisor:g} | {op.milliseconds / divisor:.3f} | "
                         f"{share:.1%} |")
        return "\n".join(lines)


class OpRecording:
    """What :meth:`runtime.Engine.profile_ops` yields: ``profile`` is None while the
    runs are recorded and their :class:`OpProfile` once the recording has ended."""

    def __init__(self) -> None:
        self.profile: OpProfile | None = None


def summarize(events: Iterable[ProfiledEvent]) -> OpProfile:
    """The profile of a recording's events (:meth:`NativeModel.stop_profiling`)."""
    runs, run_us = 0, 0
    totals: dict[tuple[str, str], list[int]] = {}
    for event in events:
        if event.event_type == RUN_EVENT:
            if event.tag == RUN_TAG:
                runs += 1
                run_us += event.microseconds
            continue
        total = totals.setdefault((event.tag, KERNELS[event.event_type]), [0, 0])
        total[0] += 1
        total[1] += event.microseconds
    ops = (OpTime(name, kernel, count, us / 1000) for (name, kernel), (count, us) in totals.items())
    return OpProfile(runs, run_us / 1000, tuple(sorted(ops, key=lambda op: (-op.milliseconds, op.name))))
