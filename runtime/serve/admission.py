"""Admission: how many requests run at once; past the limit a new one gets 429."""

from __future__ import annotations

import threading

from runtime.serve.errors import ApiError
from runtime.serve.generation import GenerationJob

RETRY_AFTER_S = 1  # what a 429 tells the client to wait


class Admission:
    """The running jobs; past the limit, a new one is refused with 429. Thread-safe."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._jobs: set[GenerationJob] = set()
        self._lock = threading.Lock()

    @property
    def running(self) -> int:
        """How many jobs run now."""
        return len(self._jobs)

    def admit(self, job: GenerationJob) -> int:
        """Counts ``job`` in; returns how many run now (it included)."""
        with self._lock:
            if len(self._jobs) >= self._limit:
                raise ApiError(429, f"{self._limit} requests are running, the server's --max-concurrent; "
                               "retry later", "rate_limit_error", "too_many_requests",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
            self._jobs.add(job)
            return len(self._jobs)

    def finish(self, job: GenerationJob) -> None:
        """Counts ``job`` out."""
        with self._lock:
            self._jobs.discard(job)

    def cancel_all(self) -> None:
        """Asks every running job to stop (at shutdown)."""
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.cancel()
