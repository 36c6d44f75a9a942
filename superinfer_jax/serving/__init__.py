"""OpenAI-compatible HTTP serving over the engine (docs/serving.md).

* ``protocol`` — request parsing / validation, OpenAI error bodies, response and chunk builders.
* ``chat`` — the model's chat template (Jinja, as transformers renders it) or a documented fallback.
* ``worker`` — ``EngineWorker``: the one thread that owns and steps the engine; handlers talk to it
  through a thread-safe command queue and per-request asyncio queues.
* ``metrics`` — the Prometheus metrics behind ``GET /metrics``.
* ``app`` — ``build_app(engine, names, max_queue=...)``: the FastAPI app ``scripts/serve.py`` runs.

Imports nothing heavy here: ``app`` needs the ``serve`` extra (fastapi, uvicorn, prometheus-client, jinja2).
"""
