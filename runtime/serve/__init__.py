"""``python -m runtime serve``: an OpenAI-compatible HTTP server over one :class:`~runtime.Engine`.

Needs the optional ``serve`` extra (FastAPI, uvicorn, prometheus-client); the rest of the
runtime never imports this package. Requests name the base model, an adapter of the
catalog, ``base::adapter``, or a weighted blend (``lora: [{"name", "scale"}]``); each
runs on its own :class:`~runtime.Session` in a worker thread, never on the event loop.

* :mod:`runtime.serve.catalog`: adapter names, loading (from ``--adapters DIR``, a path
  inside it, or a URL) and unloading, and which requests use which adapter.
* :mod:`runtime.serve.download`: fetching an adapter from a URL, capped and checked.
* :mod:`runtime.serve.generation`: one request's generation on its session, as text deltas.
* :mod:`runtime.serve.protocol`: the OpenAI request bodies and response shapes.
* :mod:`runtime.serve.metrics`: the Prometheus ``/metrics`` page.
* :mod:`runtime.serve.errors`: errors as OpenAI-shaped JSON with a status code;
  :mod:`runtime.serve.error_handlers`: every exception mapped to one.
* :mod:`runtime.serve.settings`: what the server answers to, and its limits.
* :mod:`runtime.serve.admission`: how many requests run at once (429 past it).
* :mod:`runtime.serve.middleware`: what every request passes first (key, body cap).
* :mod:`runtime.serve.server`: the state every route shares.
* :mod:`runtime.serve.routes`: one module per endpoint family (generation, models,
  adapters, operations).
* :mod:`runtime.serve.app`: the ASGI application tying them together.
"""
