"""budget.plan: as many export workers as asked, no more than the memory holds, and a
clear refusal naming both numbers when even one cannot fit (no torch needed)."""

from __future__ import annotations

import pytest

from runtime.errors import InvalidArgumentError, ResourceExhaustedError
from runtime.export import budget
from runtime.export.budget import GB

SMOLLM2 = 134_515_008  # parameters
QWEN25_05B = 494_032_768
LLAMA32_1B = 1_235_814_400


def test_the_jobs_asked_for_run_when_they_fit() -> None:
    assert budget.plan(SMOLLM2, jobs=2, max_memory=24 * GB).jobs == 2
    assert budget.plan(SMOLLM2, jobs=1, max_memory=24 * GB).jobs == 1


def test_fewer_jobs_run_when_the_memory_is_tight() -> None:
    roomy = budget.plan(QWEN25_05B, jobs=8, max_memory=96 * GB)
    three = budget.plan(QWEN25_05B, jobs=3, max_memory=96 * GB)
    assert roomy.jobs == 8 and budget.plan(QWEN25_05B, jobs=8, max_memory=three.total_peak + GB // 10).jobs == 3
    # too tight for two workers side by side: the exporter does it all itself
    alone = budget.plan(QWEN25_05B, jobs=1, max_memory=96 * GB)
    assert budget.plan(QWEN25_05B, jobs=8, max_memory=alone.total_peak).jobs == 1


def test_the_default_is_one_job_per_core_within_the_memory_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budget, "available_memory", lambda: 24 * GB)
    monkeypatch.setattr(budget.os, "cpu_count", lambda: 3)
    assert budget.plan(SMOLLM2) == budget.plan(SMOLLM2, jobs=3, max_memory=24 * GB)


def test_a_model_that_cannot_fit_is_refused_with_both_numbers() -> None:
    with pytest.raises(ResourceExhaustedError, match=r"494,032,768 parameters needs about [0-9.]+ GB to export, more than "
                                                     r"the 2\.0 GB of --max-memory"):
        budget.plan(QWEN25_05B, max_memory=2 * GB)


@pytest.mark.parametrize("jobs, max_memory, match", [
    (0, None, "--jobs 0: expected at least 1"),
    (None, -1, "--max-memory .*: expected a positive size"),
])
def test_bad_limits_are_refused(jobs: int | None, max_memory: int | None, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        budget.plan(SMOLLM2, jobs=jobs, max_memory=max_memory)


def test_a_1b_model_fits_this_machine_and_the_estimates_cover_what_was_measured() -> None:
    assert budget.plan(LLAMA32_1B, jobs=2, max_memory=24 * GB).jobs == 2
    # measured, 2 jobs, f32 and int8 in one run (see budget.py): each process's peak and
    # all processes' RSS summed
    for parameters, exporter, worker, finisher, total in ((SMOLLM2, 1.86, 1.87, 2.09, 4.34),
                                                          (QWEN25_05B, 4.70, 3.37, 4.59, 6.90)):
        plan = budget.plan(parameters, jobs=2, max_memory=24 * GB)
        for estimate, measured in ((plan.exporter_peak, exporter), (plan.worker_peak, worker),
                                   (plan.finisher_peak, finisher)):
            assert measured * GB <= estimate <= 1.1 * measured * GB
        assert total * GB <= plan.total_peak <= 1.5 * total * GB
