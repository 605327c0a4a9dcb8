"""The ingress side of ``--replicas``: a generation forwarded to an engine replica, the
``x-runtime-replica`` header, and the replicas' numbers on ``/metrics``.

:class:`RemoteJob` stands where a :class:`~runtime.serve.generation.GenerationJob` stands
in one process (the routes cannot tell them apart): it sends the validated request through
the deployment handle with its adapter set as the multiplexed model id and relays what the
replica streams. A replica that dies before anything came back is not the request's fault:
it is sent once more (Ray Serve's router then picks another replica); one that dies later
ends the request with a 503 naming the replica (in a stream: an error event), never a hang.
A replica that sends nothing of an answer (no token, not its end, no word that its engine
still runs steps while the request waits) for ``--replica-timeout`` seconds, hung in a step
or frozen whole, is given up on the same way: the request is
cancelled and ends with a 503 naming the replica and the time-out. Ray Serve's own request
time-out (``request_timeout_s``) belongs to its HTTP and gRPC proxies, which the ingress
does not use: a deployment handle's stream has none, hence this one.
"""

from __future__ import annotations

import contextvars
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.errors import FailedPreconditionError, InternalError, StatusError, UnavailableError
from runtime.serve.catalog import AdapterCatalog
from runtime.serve.cluster.replica import adapter_set_id
from runtime.serve.generation import GenerationRequest, Outcome
from runtime.serve.sampling import NonFiniteLogits

REPLICA_HEADER = "x-runtime-replica"
REPORT_MAX_AGE_S = 5.0  # a replica silent for longer is shown as down

_answer: contextvars.ContextVar[dict | None] = contextvars.ContextVar("runtime_replica_answer", default=None)


class ReplicaHeader:
    """ASGI middleware: the response names the replica that served its generation."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        answer: dict = {}
        token = _answer.set(answer)

        async def naming(message: Message) -> None:
            if message["type"] == "http.response.start" and "replica" in answer:
                headers = list(message.get("headers", []))
                headers.append((REPLICA_HEADER.encode(), answer["replica"].encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self._app(scope, receive, naming)
        finally:
            _answer.reset(token)


class RemoteJob:
    """One generation on a replica; the interface of ``GenerationJob`` (prepare, run,
    cancel, close), made by :meth:`Forwarder.job`."""

    def __init__(self, forwarder: Forwarder, request: GenerationRequest, *, on_text=None, on_start=None,
                 on_close=None) -> None:
        self.request = request
        self._forwarder = forwarder
        self._on_text = on_text
        self._on_start = on_start
        self._on_close = on_close
        self._answer = _answer.get()  # this HTTP request's header, set when a replica answers
        self._admitted = time.perf_counter()
        self._queue_wait = 0.0
        self._cancelled = threading.Event()
        self._state = threading.Lock()
        self._closed = False
        self._response = None
        self._scales: dict[str, float] = {}
        self._model_id = ""
        self._sent = False  # whether anything of the answer went to the client

    def prepare(self) -> None:
        """Resolves the request's adapters (by the ingress's ids) to names and digests."""
        self._queue_wait = time.perf_counter() - self._admitted
        self._scales, digests = self._forwarder.names(self.request.adapters)
        self._model_id = adapter_set_id(digests)
        with self._state:
            if self._closed:
                raise FailedPreconditionError("the request ended before it ran")

    def run(self) -> Outcome:
        """Relays the replica's stream; closes the job."""
        try:
            for attempt in range(2):
                try:
                    return self._relay()
                except _BeforeAnything as failure:
                    if attempt == 1 or self._cancelled.is_set():
                        raise failure.error from None
        finally:
            self.close()

    def cancel(self) -> None:
        """Stops the generation (any thread; harmless when done)."""
        self._cancelled.set()
        response = self._response
        if response is not None:  # off the caller's thread: the handle's cancel may wait
            threading.Thread(target=_cancel, args=(response,), daemon=True).start()

    def close(self) -> None:
        """Releases what the job held; twice is harmless."""
        with self._state:
            if self._closed:
                return
            self._closed = True
        if self._on_close is not None:
            self._on_close()

    def _relay(self) -> Outcome:
        ray_errors = self._forwarder.ray_errors
        request = replace(self.request, adapters={})
        handle = self._forwarder.handle.options(multiplexed_model_id=self._model_id, stream=True)
        self._response = response = handle.generate.remote(request, self._scales)
        if self._cancelled.is_set():
            _cancel(response)
        replica = None
        first_token = None
        timeout = self._forwarder.timeout
        try:
            for item in _events(response, timeout):
                kind = item[0]
                if kind == "replica":
                    replica = item[1]
                    if self._answer is not None:
                        self._answer["replica"] = replica
                elif kind == "start":
                    first_token = time.perf_counter()
                    self._sent = True
                    if self._on_start is not None:
                        self._on_start()
                elif kind == "text":
                    self._sent = True
                    if self._on_text is not None:
                        self._on_text(item[1])
                elif kind == "alive":  # the replica's engine still runs steps: _events' time-out starts again
                    pass
                elif kind == "outcome":
                    outcome: Outcome = item[1]
                    ttft = first_token - self._admitted if first_token is not None else None
                    return replace(outcome, queue_wait_s=self._queue_wait, time_to_first_token_s=ttft)
                if self._cancelled.is_set():
                    _cancel(response)
        except ray_errors.task as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, (StatusError, NonFiniteLogits)):  # the request's, answered as in one process
                raise cause from None
            if isinstance(cause, ray_errors.dead) or isinstance(exc, ray_errors.dead):
                self._gone(replica, exc)
            failure = cause or exc
            raise InternalError(f"replica {replica or '?'}: {type(failure).__name__}: "
                                f"{' '.join(str(failure).split())[:300]}") from None
        except ray_errors.dead as exc:
            self._gone(replica, exc)
        except ray_errors.cancelled:
            pass
        except _Silent:
            threading.Thread(target=_cancel, args=(response,), daemon=True).start()
            if self._cancelled.is_set():
                return Outcome("", "cancelled", 0, 0, self._queue_wait, None, 0.0)
            what = f"replica {replica} sent nothing" if replica else "no replica took the request"
            raise UnavailableError(f"{what} for {timeout:g} s (--replica-timeout {timeout:g}): the request was "
                                   "cancelled; retry") from None
        if self._cancelled.is_set():
            return Outcome("", "cancelled", 0, 0, self._queue_wait, None, 0.0)
        raise UnavailableError(f"replica {replica or '?'} ended the stream without an outcome")

    def _gone(self, replica: str | None, exc: BaseException) -> None:
        error = UnavailableError(
            f"replica {replica or '?'} went away during the request ({type(exc).__name__}); Ray Serve restarts it, "
            "and the other replicas take new requests: retry")
        if not self._sent:
            raise _BeforeAnything(error)
        raise error


class _BeforeAnything(Exception):
    """A replica failed before the request produced anything: it may be sent again."""

    def __init__(self, error: StatusError) -> None:
        super().__init__(str(error))
        self.error = error


class _Silent(Exception):
    """The replica sent nothing for the forwarder's time-out."""


def _events(response, timeout: float = 0.0) -> Iterator[tuple]:
    """The events of a replica's stream (which sends them in lists); ``_Silent`` if nothing
    comes for ``timeout`` seconds (0: no limit). The stream is read by a thread of its own:
    Ray's iterator has no time-out, and a hung replica would hold this one forever."""
    if not timeout:
        for batch in response:
            yield from batch
        return
    batches: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        try:
            for batch in response:
                batches.put((batch, None))
        except BaseException as exc:  # noqa: BLE001 - raised again on the job's thread
            batches.put((None, exc))
        else:
            batches.put((None, None))

    threading.Thread(target=read, name="replica-stream", daemon=True).start()
    while True:
        try:
            batch, error = batches.get(timeout=timeout)
        except queue.Empty:
            raise _Silent from None
        if error is not None:
            raise error
        if batch is None:
            return
        yield from batch


def _cancel(response) -> None:
    try:
        response.cancel()
    except Exception:  # already finished, or the replica is gone
        pass


class RayErrors:
    """The exception classes of Ray that the forwarder tells apart (imported only with ray)."""

    def __init__(self) -> None:
        from ray import exceptions
        from ray.serve import exceptions as serve_exceptions

        self.task = exceptions.RayTaskError
        self.dead = (exceptions.RayActorError, exceptions.ActorUnavailableError,
                     serve_exceptions.DeploymentUnavailableError)
        self.cancelled = (exceptions.TaskCancelledError, serve_exceptions.RequestCancelledError)


class Forwarder:
    """What the ingress needs to forward generations: the replicas' deployment handle, the
    catalogue (the ingress's adapter ids -> names and digests), the replicas' reports."""

    def __init__(self, handle, catalog: AdapterCatalog, digest: Callable[[str], str],
                 reports: Callable[[], dict[str, tuple[float, dict]]], timeout: float = 0.0) -> None:
        self.handle = handle
        self.timeout = timeout  # --replica-timeout: seconds a replica may send nothing (0: no limit)
        self.ray_errors = RayErrors()
        self._catalog = catalog
        self._digest = digest
        self._reports = reports

    def job(self, _engine, request: GenerationRequest, **callbacks) -> RemoteJob:
        """A job for ``request`` (the signature of ``GenerationJob``'s)."""
        return RemoteJob(self, request, **callbacks)

    def names(self, adapters: dict[int, float]) -> tuple[dict[str, float], dict[str, str]]:
        """The ingress's adapter ids -> (name -> scale, name -> SHA-256)."""
        by_id = {entry.lora_id: entry.name for entry in self._catalog.entries()}
        scales = {by_id[lora_id]: scale for lora_id, scale in adapters.items()}
        return scales, {name: self._digest(name) for name in scales}

    def collect(self) -> Iterator[Metric]:
        """The replicas' numbers, for ``/metrics`` (a prometheus collector)."""
        try:
            reports = self._reports()
        except Exception:
            reports = {}
        now = time.time()
        families = {key: kind(name, text, labels=["replica"]) for key, kind, name, text in _REPLICA_SERIES}
        for replica, (when, report) in sorted(reports.items()):
            families["up"].add_metric([replica], 1.0 if now - when < REPORT_MAX_AGE_S else 0.0)
            for key, family in families.items():
                if key != "up":
                    family.add_metric([replica], float(report.get(key, 0)))
        held = GaugeMetricFamily("runtime_replica_adapter_held", "1 for each adapter a replica holds",
                                 labels=["replica", "adapter"])
        for replica, (_, report) in sorted(reports.items()):
            for name in report.get("adapters", ()):
                held.add_metric([replica, name], 1.0)
        yield from families.values()
        yield held


_G, _C = GaugeMetricFamily, CounterMetricFamily
# Per replica on /metrics: (the report's key, kind, series, help).
_REPLICA_SERIES = (
    ("up", _G, "runtime_replica_up", "1 while the replica reports (every 0.5 s)"),
    ("pid", _G, "runtime_replica_pid", "The replica's process id on its node"),
    ("catalogue_version", _G, "runtime_replica_catalogue_version", "The version of the adapter catalogue the "
     "replica has seen (each load or unload adds one)"),
    ("running", _G, "runtime_replica_running_requests", "Requests running on the replica (its queue)"),
    ("resident_sets", _G, "runtime_replica_adapter_sets", "Adapter sets (multiplexed ids) the replica holds, at "
     "most --max-adapters-per-replica"),
    ("registered_adapters", _G, "runtime_replica_adapters", "Adapters registered on the replica"),
    ("adapter_bytes", _G, "runtime_replica_adapter_bytes", "Bytes of the adapters' weights the replica holds"),
    ("resident_bytes", _G, "runtime_replica_resident_bytes", "Bytes of the replica's materialized adapter buffers"),
    ("loads", _C, "runtime_replica_adapter_loads", "Adapter sets the replica loaded"),
    ("load_seconds", _C, "runtime_replica_adapter_load_seconds", "Time the replica spent loading adapter sets"),
    ("evictions", _C, "runtime_replica_adapter_evictions", "Adapter sets the replica let go (least recently used, "
     "or unloaded)"),
    ("hits", _C, "runtime_replica_adapter_hits", "Requests whose adapter set the replica held already"),
    ("misses", _C, "runtime_replica_adapter_misses", "Requests whose adapter set the replica had to load"),
    ("requests", _C, "runtime_replica_requests", "Generations the replica ran"),
    ("generated_tokens", _C, "runtime_replica_generated_tokens", "Tokens the replica generated (rate() of it is "
     "its tokens/s)"),
)
