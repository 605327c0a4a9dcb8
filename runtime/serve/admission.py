"""Admission: how many requests run at once; past the limit a new one gets 429, and once
the server shuts down every new one gets 503."""

from __future__ import annotations

import threading

from runtime.errors import UnavailableError
from runtime.serve.errors import ApiError
from runtime.serve.generation import GenerationJob

RETRY_AFTER_S = 1  # what a 429 tells the client to wait


class Admission:
    """The running jobs; past the limit, a new one is refused with 429; once closed, every
    new one is refused as unavailable. Thread-safe."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._jobs: set[GenerationJob] = set()
        self._lock = threading.Lock()
        self._closed_because: str | None = None  # why no job is admitted any more

    @property
    def running(self) -> int:
        """How many jobs run now."""
        return len(self._jobs)

    def admit(self, job: GenerationJob) -> int:
        """Counts ``job`` in; returns how many run now (it included)."""
        with self._lock:
            refusal = self.refusal()
            if refusal is not None:
                raise refusal
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

    def close(self, reason: str) -> None:
        """Admits nothing from now on and asks every running job to stop; what a stopped
        job and a refused request answer is :meth:`refusal`, saying ``reason``. Closing
        again keeps the first reason."""
        with self._lock:
            if self._closed_because is None:
                self._closed_because = reason
            jobs = list(self._jobs)
        for job in jobs:
            job.cancel()

    def refusal(self) -> UnavailableError | None:
        """Once closed, the error that ends a job it stopped and refuses a new one (a 503
        answer); ``None`` while open."""
        reason = self._closed_because
        return None if reason is None else UnavailableError(reason)
