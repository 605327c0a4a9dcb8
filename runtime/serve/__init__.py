"""``python -m runtime serve``: an OpenAI-compatible HTTP server over one :class:`~runtime.Engine`.

Needs the optional ``serve`` extra (FastAPI, uvicorn, prometheus-client); the rest of the
runtime never imports this package. Requests name the base model, an adapter of the
catalog, ``base::adapter``, or a weighted blend (``lora: [{"name", "scale"}]``); each
runs on its own :class:`~runtime.Session` in a worker thread, never on the event loop.

* :mod:`runtime.serve.catalog`: adapter names, loading (from ``--adapters DIR``, a path
  inside it, or a URL) and unloading, and which requests use which adapter (by the ids
  registered at load).
* :mod:`runtime.serve.download`: fetching an adapter from an allowed URL, capped, timed.
* :mod:`runtime.serve.hosts`: ``HOST[:PORT]`` patterns (allowed hosts, download hosts).
* :mod:`runtime.serve.generation`: one request's generation on its session, as text deltas.
* :mod:`runtime.serve.sampling`: vLLM's logits processing before the core's sampler.
* :mod:`runtime.serve.protocol`: the OpenAI request bodies and response shapes.
* :mod:`runtime.serve.metrics`: the Prometheus ``/metrics`` page.
* :mod:`runtime.serve.errors`: errors as OpenAI-shaped JSON with a status code;
  :mod:`runtime.serve.error_handlers`: every exception mapped to one.
* :mod:`runtime.serve.settings`: what the server answers to, and its limits.
* :mod:`runtime.serve.admission`: how many requests run at once (429 past it).
* :mod:`runtime.serve.middleware`: what every request passes first (host, origin, key,
  body cap and time limit).
* :mod:`runtime.serve.connection`: the header timeout uvicorn lacks, and uvicorn's settings.
* :mod:`runtime.serve.server`: the state every route shares.
* :mod:`runtime.serve.routes`: one module per endpoint family (generation, models,
  adapters, tokenize, operations, the chat page); the page's files are in ``web/``.
* :mod:`runtime.serve.app`: the ASGI application tying them together.
"""
