"""Server: the state every route shares (engine, adapter catalog, settings, admission,
worker pool, metrics)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from starlette.concurrency import run_in_threadpool

from runtime import Engine
from runtime.errors import FailedPreconditionError
from runtime.serve.admission import Admission
from runtime.serve.catalog import AdapterCatalog, CatalogEntry
from runtime.serve.errors import bad_request, model_not_found
from runtime.serve.generation import GenerationJob
from runtime.serve.metrics import ServerMetrics
from runtime.serve.protocol import ChatMessage
from runtime.serve.settings import ADAPTER_SEPARATOR, ServeSettings


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
        self.metrics = ServerMetrics(engine, catalog, settings.model_name, lambda: self.admission.running)
        # What runs a generation: on this engine, or (with --replicas) forwarded to a replica.
        self.job_class = GenerationJob

    @property
    def known_tokens(self) -> int:
        """How many token ids a request may give: ``[0, known_tokens)``, the ids both the
        model and its tokenizer know (Gemma 3's 262,208 embeddings outnumber its 262,144
        tokens; the ids past the tokenizer's have no text)."""
        return min(self.engine.spec.vocab_size, self.engine.tokenizer.vocab_size)

    def adapter_of(self, model: str) -> str | None:
        """The adapter a request's ``model`` names: ``None`` for the base model, the adapter
        for ``adapter`` or ``base::adapter`` (whether it is loaded is the catalog's to say);
        a 404 for another base, a 400 for nothing after ``::``."""
        base = self.settings.model_name
        if model == base:
            return None
        if ADAPTER_SEPARATOR not in model:
            return model
        prefix, _, adapter = model.partition(ADAPTER_SEPARATOR)
        if prefix != base:
            raise model_not_found(f"model {prefix!r:.100} is not served here; the base model is {base!r}")
        if not adapter:
            raise bad_request(f"model {model!r:.100}: name an adapter after '::'", param="model")
        return adapter

    def model_entry(self, model: str) -> CatalogEntry | None:
        """The loaded adapter ``model`` names (see :meth:`adapter_of`), ``None`` for the base
        model; a 404 for a model not served here."""
        adapter = self.adapter_of(model)
        entry = None if adapter is None else self.catalog.find(adapter)
        if adapter is not None and entry is None:
            raise model_not_found(f"model {model!r:.140} is not served here; GET /v1/models lists what is")
        return entry

    def drain(self) -> None:
        """The server begins to shut down: new generations are refused and running ones
        end now with a 503 error (a stream with its error event) rather than being cut
        off; any thread, any number of times."""
        self.admission.close("the server is shutting down; retry on another server or once it is back")

    def shutdown(self) -> None:
        """Drains the server (:meth:`drain`) and waits for the workers to finish."""
        self.drain()
        self.pool.shutdown(wait=True)

    async def chat_prompt(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        """A conversation as prompt text, by the model's chat template (off the event loop),
        ending with the assistant's turn opened when ``add_generation_prompt``."""
        template = self.engine.chat_template
        if template is None:
            raise bad_request(
                f"model {self.settings.model_name!r} has no chat template: start the server with "
                "--chat-template FILE (a Jinja2 template), or use /v1/completions", code="no_chat_template",
                param="messages")
        rendered = [message.as_template_input(i) for i, message in enumerate(messages)]
        return await run_in_threadpool(lambda: template.render(rendered, add_generation_prompt=add_generation_prompt))
