"""``runtime serve --replicas N``: the same app as one process, over N engine replicas on Ray Serve.

Needs the optional ``cluster`` extra (``ray[serve]``); nothing else in the runtime imports
this package, and ``ray`` is imported only here, only when ``--replicas`` is given.

The ingress is the server of one process (:mod:`runtime.serve.app`: auth, limits, Host
checks, the page, ``/metrics``, the adapter catalogue and its checks), listening where it
always does; only its generations leave it. Each is sent through a Ray Serve deployment
handle with the request's adapter set as the multiplexed model id, so Ray Serve's router
picks a replica that already holds it; the replica (one :class:`~runtime.Engine` over the
same model file) loads the set on its first request through ``@serve.multiplexed``
(least recently used beyond ``--max-adapters-per-replica``) and streams the text back.

* :mod:`runtime.serve.cluster.state`: the one catalogue every replica reads (names, files,
  SHA-256), and the numbers replicas report (a Ray actor).
* :mod:`runtime.serve.cluster.replica`: the engine replica deployment.
* :mod:`runtime.serve.cluster.ingress`: the job that forwards a generation to a replica,
  the ``x-runtime-replica`` header, the per-replica metrics.
* :mod:`runtime.serve.cluster.launch`: joining or starting Ray, deploying, stopping.
"""

from __future__ import annotations

from types import ModuleType

from runtime.errors import FailedPreconditionError

INSTALL_HINT = 'pip install -e ".[cluster]"'


def import_ray() -> tuple[ModuleType, ModuleType]:
    """``ray`` and ``ray.serve``, or one clear line naming the extra to install."""
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise FailedPreconditionError(
            f"--replicas needs the cluster extra ({exc.name or 'ray'} is missing): {INSTALL_HINT}") from None
    return ray, serve
