"""Server: the state every route shares (engine, adapter catalog, settings, admission,
worker pool, metrics)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from runtime import Engine
from runtime.errors import FailedPreconditionError
from runtime.serve.admission import Admission
from runtime.serve.catalog import AdapterCatalog
from runtime.serve.metrics import ServerMetrics
from runtime.serve.settings import ServeSettings


class Server:
    """The state behind the routes: engine, catalog, settings, worker pool, metrics."""

    def __init__(self, engine: Engine, catalog: AdapterCatalog, settings: ServeSettings) -> None:
        if engine.tokenizer is None:
            raise FailedPreconditionError(
                "serving needs a tokenizer: a .litertlm bundle's, --tokenizer FILE, or --byte-tokens"
            )
        self.engine = engine
        self.catalog = catalog
        self.settings = settings
        self.started = int(time.time())
        self.admission = Admission(settings.max_concurrent)
        # One thread per admitted request (prepare, then run) and one for closing jobs
        # whose request went away before they ran.
        self.pool = ThreadPoolExecutor(settings.max_concurrent + 1, thread_name_prefix="serve-request")
        self.metrics = ServerMetrics(engine, catalog, lambda: self.admission.running)

    def shutdown(self) -> None:
        """Cancels running generations and waits for the workers to finish."""
        self.admission.cancel_all()
        self.pool.shutdown(wait=True)
