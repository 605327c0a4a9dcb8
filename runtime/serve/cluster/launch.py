"""Joining a Ray cluster (or starting a local one), deploying the engine replicas, stopping.

Without ``--ray-address`` a local Ray is started with the server (on the loopback address,
``num_cpus`` enough for the replicas) and stopped with it: after the server exits, none of
its processes is left. With ``--ray-address HOST:PORT`` the server joins that cluster (it
must be reachable; with Ray's token authentication, ``RAY_AUTH_MODE=token`` and the cluster's
token in ``RAY_AUTH_TOKEN`` or ``~/.ray/auth_token``), and on exit removes only its own
application and catalogue.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool

from runtime.errors import InvalidArgumentError, UnavailableError
from runtime.serve.errors import ApiError
from runtime.serve.cluster import import_ray
from runtime.serve.cluster.ingress import Forwarder, ReplicaHeader
from runtime.serve.cluster.replica import EngineReplica, ReplicaConfig
from runtime.serve.cluster.state import STATE_ACTOR, ClusterCatalog, ClusterState
from runtime.serve.server import Server

log = logging.getLogger("runtime.serve")

NAMESPACE = "runtime"
APPLICATION = "runtime"  # each server's own Serve application: this, a dash and a random suffix
CONNECT_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 20.0  # for the replicas to finish what they run and go
REPLICA_TIMEOUT_S = 60.0  # the default --replica-timeout
HEALTH_CACHE_S = 1.0  # /health asks Ray Serve's controller at most this often
DEPLOYMENT = "EngineReplica"
# Ray's switch for a Ray on one machine: every address it uses stays on the loopback.
_LOCAL_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_WORKER_NICENESS = "RAY_worker_niceness"


@dataclass(frozen=True)
class ClusterOptions:
    """``--replicas``, ``--ray-address``, ``--max-adapters-per-replica``, ``--replica-timeout``,
    and the ``--threads`` and ``--executors`` of each replica (what it runs, so what it asks Ray
    for: :attr:`cpus_per_replica`), checked."""

    replicas: int
    address: str | None = None
    max_adapters: int = 8
    max_ongoing: int = 16  # requests one replica takes at once (the server's --max-concurrent)
    threads: int = 1
    executors: int = 1
    replica_timeout: float = REPLICA_TIMEOUT_S  # seconds a replica may send nothing of an answer; 0: no limit

    def __post_init__(self) -> None:
        if type(self.replicas) is not int or self.replicas < 1:
            raise InvalidArgumentError(f"--replicas {self.replicas!r}: expected an integer >= 1")
        if type(self.max_adapters) is not int or self.max_adapters < 1:
            raise InvalidArgumentError(f"--max-adapters-per-replica {self.max_adapters!r}: expected an integer >= 1")
        if type(self.threads) is not int or self.threads < 1:
            raise InvalidArgumentError(f"--threads {self.threads!r}: expected an integer >= 1 with --replicas (each "
                                       "replica asks Ray for that many CPUs; 0, all the machine's, is no number)")
        if type(self.executors) is not int or self.executors < 1:
            raise InvalidArgumentError(f"--executors {self.executors!r}: expected an integer >= 1")
        if type(self.replica_timeout) not in (int, float) or not 0 <= self.replica_timeout < 1e9:  # NaN too
            raise InvalidArgumentError(f"--replica-timeout {self.replica_timeout!r}: expected seconds >= 0 "
                                       "(0: no limit)")
        if self.address is not None and not self.address.strip():
            raise InvalidArgumentError("--ray-address must not be empty")

    @property
    def cpus_per_replica(self) -> int:
        """The CPUs one replica asks Ray for: what it runs at once, ``--executors`` copies of
        the model each stepping on ``--threads`` threads (the one place this rule lives)."""
        return self.threads * self.executors

    def check_fits(self, cpus: int) -> None:
        """``InvalidArgumentError`` naming ``--replicas``, ``--threads`` (and ``--executors``)
        and ``cpus`` unless the replicas' CPUs fit in ``cpus`` (a local Ray's: the machine's)."""
        needed = self.replicas * self.cpus_per_replica
        if needed <= cpus:
            return
        executors = f" x --executors {self.executors}" if self.executors != 1 else ""
        most = cpus // self.cpus_per_replica
        raise InvalidArgumentError(
            f"--replicas {self.replicas} x --threads {self.threads}{executors} needs {needed} CPUs (each replica "
            f"reserves --threads x --executors), and this machine has {cpus} available: at most {most} replicas "
            f"with these --threads{' and --executors' if executors else ''}, or fewer threads, or a Ray cluster "
            "with --ray-address")

    def wait_notice(self, free: float, total: float) -> str | None:
        """What a server joining a Ray cluster (``--ray-address``) says when the replicas'
        CPUs are not free there (``free`` of ``total``): Ray Serve then waits for them,
        and the server's start with it; ``None`` when they fit."""
        needed = self.replicas * self.cpus_per_replica
        if needed <= free:
            return None
        executors = f" x --executors {self.executors}" if self.executors != 1 else ""
        has = f"{free:g} free of {total:g}" if needed <= total else f"{total:g} in all"
        when = "as CPUs free up" if needed <= total else "only once nodes join it (an autoscaling cluster adds them)"
        return (f"--replicas {self.replicas} x --threads {self.threads}{executors} ask the Ray cluster for {needed} "
                f"CPUs and it has {has}: the replicas start {when}, and the server waits for them (Ctrl-C stops)")


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class Cluster:
    """Ray, the catalogue actor and the replicas of one server; :meth:`stop` undoes :meth:`start`."""

    def __init__(self, ray, serve, options: ClusterOptions, application: str, state, handle) -> None:
        self._ray = ray
        self._serve = serve
        self.options = options
        self.application = application
        self.state = state
        self.handle = handle
        self._health_cache: tuple[float, tuple[int, str]] | None = None

    @classmethod
    def start(cls, options: ClusterOptions, config: ReplicaConfig) -> Cluster:
        """Joins or starts Ray, then deploys ``options.replicas`` engine replicas (built
        from ``config``, ``options.threads`` CPUs each) and waits until they are ready. The Serve
        application and the catalogue actor are named for this server alone: servers
        joined to one cluster neither share nor replace each other's."""
        if options.address is None:
            cpus = available_cpus()
            options.check_fits(cpus)
            os.environ[_LOCAL_ONLY] = "0"
            # Ray starts its workers at nice 15; the replicas do the serving, not background work.
            os.environ.setdefault(_WORKER_NICENESS, "0")
            # The replicas import the same runtime package as this process.
            root = str(Path(__file__).resolve().parents[3])
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        else:
            check_reachable(options.address)
        ray, serve = import_ray()
        try:
            if options.address is None:
                ray.init(num_cpus=cpus, include_dashboard=False,
                         namespace=NAMESPACE, logging_level=logging.WARNING, configure_logging=True)
            else:
                ray.init(address=options.address, namespace=NAMESPACE, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            where = f"the Ray cluster at --ray-address {options.address}" if options.address else "a local Ray"
            hint = (" (a cluster with token authentication, Ray's default, needs RAY_AUTH_MODE=token here and its "
                    "token in RAY_AUTH_TOKEN or ~/.ray/auth_token)" if options.address else "")
            raise UnavailableError(f"cannot start or join {where}: {' '.join(str(exc).split())[:300]}{hint}") from None
        if options.address is not None:
            notice = options.wait_notice(ray.available_resources().get("CPU", 0), ray.cluster_resources().get("CPU", 0))
            if notice is not None:
                log.warning("%s", notice)
        suffix = uuid.uuid4().hex[:12]
        application, state_actor = f"{APPLICATION}-{suffix}", f"{STATE_ACTOR}-{suffix}"
        state = None
        try:
            serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
            _remove_orphans(ray, serve)
            state = ray.remote(ClusterState).options(name=state_actor, namespace=NAMESPACE, num_cpus=0).remote()
            config = ReplicaConfig(**{**config.__dict__, "state_actor": state_actor, "namespace": NAMESPACE,
                                      "stall_s": options.replica_timeout})
            try:
                handle = serve.run(deployment(serve, options).bind(config), name=application,
                                   route_prefix=None)
            except RuntimeError as exc:  # Ray Serve gave up starting them: one line, with the replicas' error
                raise UnavailableError(f"the replicas did not start: {_replica_error(serve, application, exc)}"
                                       ) from None
        except BaseException:
            _stop(ray, serve, options, application, state)
            raise
        return cls(ray, serve, options, application, state, handle)

    def catalog(self, *args, **kwargs) -> ClusterCatalog:
        """The ingress's adapter catalogue, publishing to every replica."""
        return ClusterCatalog(*args, publish=self._publish, **kwargs)

    def extend(self, app: FastAPI, server: Server) -> None:
        """Makes the app of one process the ingress: generations go to the replicas, each
        answer names its replica, ``/metrics`` shows the replicas' numbers."""
        forwarder = Forwarder(self.handle, server.catalog, server.catalog.digest, self._reports,
                              timeout=self.options.replica_timeout)
        server.job_class = forwarder.job
        server.metrics.registry.register(forwarder)
        app.add_middleware(ReplicaHeader)
        # /health of one process says the process is up; the ingress's is up while a replica
        # is: this route goes first, before the one of one process (behind the same gate).
        app.router.routes.insert(0, APIRoute("/health", self._health, methods=["GET", "HEAD"]))

    async def _health(self) -> dict:
        running, detail = await run_in_threadpool(self.running_replicas)
        if not running:
            raise ApiError(503, f"no replica of the engine is running ({detail}): generations wait for one (Ray "
                           "Serve replaces the replicas that die) or end after --replica-timeout",
                           "server_error", "unavailable")
        return {"status": "ok", "replicas": running}

    def running_replicas(self) -> tuple[int, str]:
        """How many replicas Ray Serve's controller counts as running (healthy), and its
        count of each replica state (asked at most every ``HEALTH_CACHE_S``)."""
        now = time.monotonic()
        cached = self._health_cache
        if cached is not None and now - cached[0] < HEALTH_CACHE_S:
            return cached[1]
        try:
            application = self._serve.status().applications.get(self.application)
            deployment = None if application is None else application.deployments.get(DEPLOYMENT)
            states = {str(getattr(state, "value", state)): count
                      for state, count in (deployment.replica_states if deployment is not None else {}).items()}
            found = (states.get("RUNNING", 0), ", ".join(f"{count} {state.lower()}" for state, count in
                                                          sorted(states.items())) or "none deployed")
        except Exception as exc:  # the controller is gone or does not answer
            found = (0, f"Ray Serve did not answer: {type(exc).__name__}")
        self._health_cache = (now, found)
        return found

    def stop(self) -> None:
        """Removes the replicas (each finishing what it runs), then stops a local Ray."""
        _stop(self._ray, self._serve, self.options, self.application, self.state)

    def _publish(self, entries: dict[str, dict[str, str]]) -> None:
        self._ray.get(self.state.publish.remote(entries))

    def _reports(self) -> dict[str, tuple[float, dict]]:
        return self._ray.get(self.state.reports.remote(), timeout=2)


def deployment(serve, options: ClusterOptions):
    """The replicas' Ray Serve deployment: :class:`EngineReplica` with its multiplexed
    loader bounded by ``options.max_adapters``."""
    loader = serve.multiplexed(max_num_models_per_replica=options.max_adapters)(EngineReplica.load_adapter_set)
    replica_class = type("EngineReplica", (EngineReplica,), {"load_adapter_set": loader})
    return serve.deployment(replica_class, name=DEPLOYMENT, num_replicas=options.replicas,
                            ray_actor_options={"num_cpus": options.cpus_per_replica},
                            max_ongoing_requests=options.max_ongoing,
                            health_check_period_s=2, health_check_timeout_s=30, graceful_shutdown_timeout_s=5,
                            logging_config={"log_level": "WARNING"})


def _stop(ray, serve, options: ClusterOptions, application: str, state) -> None:
    def remove() -> None:
        try:
            if options.address is None:
                serve.shutdown()
            else:
                serve.delete(application)
                if state is not None:
                    ray.kill(state)
        except Exception as exc:  # stopping goes on: Ray itself is stopped below
            print(f"warning: stopping the replicas: {exc}", file=sys.stderr, flush=True)

    # Serve's own shutdown waits for its controller; if Ray's processes are gone already (a
    # Ctrl-C reaches the whole process group) it would wait forever: Ray is stopped anyway.
    remover = threading.Thread(target=remove, name="serve-shutdown", daemon=True)
    remover.start()
    remover.join(STOP_TIMEOUT_S)
    ray.shutdown()


def _replica_error(serve, application: str, exc: RuntimeError) -> str:
    """Why the replicas of ``application`` did not start: the last line of the traceback Ray
    Serve kept (the replica's own error, e.g. a model file not at that path on its node)."""
    try:
        deployments = serve.status().applications[application].deployments.values()
        lines = [line.strip() for state in deployments for line in (state.message or "").splitlines()]
    except Exception:  # Ray Serve's own message, then
        lines = []
    return next((line for line in reversed(lines) if line), str(exc))[:500]


def _remove_orphans(ray, serve) -> None:
    """Deletes the applications of servers that exited without removing theirs (killed):
    a server's catalogue actor lives only as long as the server, its application does not."""
    for name in serve.status().applications:
        suffix = name.removeprefix(f"{APPLICATION}-")
        if suffix == name:
            continue
        try:
            ray.get_actor(f"{STATE_ACTOR}-{suffix}", namespace=NAMESPACE)
        except ValueError:  # no such actor: its server is gone
            serve.delete(name, _blocking=False)


def check_reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """``UnavailableError`` naming ``address`` unless a TCP connection to it opens."""
    if address == "auto":
        return
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidArgumentError(f"--ray-address {address!r}: expected HOST:PORT (the head node's GCS address) "
                                   "or 'auto'")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise UnavailableError(f"--ray-address {address}: cannot reach the Ray cluster there "
                               f"({exc.strerror or exc}); is `ray start --head` running, and the port open?") from None

