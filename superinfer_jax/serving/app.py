"""The OpenAI-compatible HTTP app (FastAPI on uvicorn): routes, streaming, disconnects, errors.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as server-sent events ending in
``data: [DONE]``, or one JSON body), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health`` (503
until the engine has warmed up and while draining, 200 when it serves; ``?check=1`` also checks the block
manager's invariants in the engine thread and reports the pools), ``GET /metrics`` (Prometheus).

Every request field is honoured or refused (``protocol.FIELDS``; docs/serving.md has the table and the
errors). A request with ``n`` > 1 is ``n`` engine requests (choice i seeded ``seed + i``); ``logprobs`` are
computed once a choice has finished, by scoring its tokens with the model (``logprobs.py``) in a thread of
their own.

Handlers never touch the engine: the generate path (``generate.py``) reads the body (up to
``max_body_bytes``), parses, validates and tokenizes it in a thread pool (``prepare.py``: a large or slow
request never stalls the event loop, which carries every stream), hands the choices to the ``EngineWorker``
(``worker.py``, ``choices.py``), then reads their events from an ``asyncio.Queue``. A client that goes away
(a stream closed, or a non-streamed request whose connection dropped) has its request aborted, which frees
its KV blocks at once. This module builds the app: lifespan (the engine thread), graceful drain, health,
models, metrics, and the routes.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Callable, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from superinfer_jax.serving import protocol as P
from superinfer_jax.serving.chat import chat_template_of
from superinfer_jax.serving.errors import RETRY_AFTER_S, error_response
from superinfer_jax.serving.generate import Completions
from superinfer_jax.serving.metrics import CONTENT_TYPE, ServerMetrics
from superinfer_jax.serving.prepare import RequestPreparer
from superinfer_jax.serving.worker import EngineWorker

log = logging.getLogger("superinfer_jax.serving")

DEFAULT_MAX_BODY_BYTES = 4 << 20


def context_of(engine: Any) -> int:
  """The context the server offers over ``engine``: ``protocol.served_context`` (the engine's
  ``max_model_len`` capped at its device pool; ``ValueError`` if an explicit ``--max_model_len`` exceeds the
  pool). An engine without a pool size (the test fake) offers its ``max_model_len``."""
  nb = getattr(engine, "num_device_blocks", None)
  if nb is None:
    return engine.max_model_len
  return P.served_context(engine.max_model_len, nb, engine.config.block_size, engine.config.model.max_model_len)


def _pools(eng: Any) -> dict:
  """The block manager's invariant check and pools, and the requests per state (run in the engine thread)."""
  eng.check_invariants()
  sch = eng.scheduler_stats()
  return {"invariants": "ok", "waiting": sch.num_waiting, "running": sch.num_running, "rotary": sch.num_rotary,
          "device_blocks_free": sch.free_device_blocks, "device_blocks": sch.device_blocks,
          "host_blocks_free": sch.free_host_blocks, "host_blocks": sch.host_blocks}


def _lifespan(state: dict, metrics: ServerMetrics, completions: Completions, names: list, max_model_len: int,
              **worker_kw):
  """The app's lifespan: the ``EngineWorker`` over ``state["engine"]`` (taken out of ``state``, so only the
  worker keeps the engine) starts with the app and stops with it."""

  @contextlib.asynccontextmanager
  async def lifespan(app):
    del app
    eng = state.pop("engine")
    worker = EngineWorker(eng, asyncio.get_running_loop(), metrics=metrics, **worker_kw)
    metrics._admitted = lambda: worker.num_admitted  # pylint: disable=protected-access
    metrics.after_step(eng)
    del eng
    state["worker"] = worker
    worker.start()
    log.info("engine thread started; serving %s (context %d tokens, max_queue %d)", names, max_model_len,
             worker.max_queue)
    try:
      yield
    finally:
      log.info("shutting down: cancelling %d requests still admitted", worker.num_admitted)
      await asyncio.get_running_loop().run_in_executor(None, worker.stop)
      completions.shutdown()

  return lifespan


def _drain_of(state: dict):
  """``drain(timeout, poll_s)`` over the app's ``state`` (``app.state.drain``)."""

  async def drain(timeout: float, poll_s: float = 0.05) -> dict:
    """Graceful drain: from now on requests get 503 (``Retry-After``) and ``/health`` 503 "draining"; the
    admitted requests get ``timeout`` seconds to finish, then the rest are aborted (a stream ends with a
    chunk per unfinished choice with finish_reason abort, the 503 error event and ``[DONE]``; a non-streamed
    request gets the 503). Returns ``_pools`` (invariants checked) once every handler is done, with the counts
    admitted at the start, aborted, and admitted at the end."""
    worker: EngineWorker = state["worker"]
    state["draining"] = True
    loop = asyncio.get_running_loop()
    n = worker.num_admitted
    log.info("draining: %d requests admitted; %.1f s to finish", n, timeout)
    deadline = loop.time() + timeout
    while worker.num_admitted and loop.time() < deadline:
      await asyncio.sleep(poll_s)
    aborted = worker.num_admitted
    if aborted:
      log.info("drain: aborting the %d requests still admitted", aborted)
      worker.abort_all()
      deadline = loop.time() + 10.0
      while worker.num_admitted and loop.time() < deadline:
        await asyncio.sleep(poll_s)
    pools = await worker.call(_pools) if worker.alive else {}
    return dict(pools, admitted_at_start=n, aborted=aborted, admitted=worker.num_admitted)

  return drain


async def _health(state: dict, check: int):
  """``GET /health``: 503 while the engine is down, warming up or draining; 200 with the admission counts
  (and, with ``check``, the pools and the invariant check) when it serves."""
  worker: EngineWorker = state["worker"]
  if not worker.alive:
    return JSONResponse({"status": "unavailable", "error": worker.fatal}, status_code=503)
  if not worker.ready:
    return JSONResponse({"status": "starting", "detail": "the engine is warming up (compiling step shapes)"},
                        status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
  if state.get("draining"):
    return JSONResponse({"status": "draining", "admitted": worker.num_admitted}, status_code=503,
                        headers={"Retry-After": str(RETRY_AFTER_S)})
  out: dict[str, Any] = {"status": "ok", "admitted": worker.num_admitted, "max_queue": worker.max_queue,
                         "step_errors": worker.step_errors}
  if check:
    try:
      out.update(await worker.call(_pools))
    except Exception as e:  # pylint: disable=broad-except
      return JSONResponse({"status": "error", "invariants": f"{type(e).__name__}: {e}"}, status_code=500)
  return out


def _add_error_handlers(app: FastAPI) -> None:
  @app.exception_handler(StarletteHTTPException)
  async def _http_error(request, exc):
    del request
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return JSONResponse(P.error_body(str(exc.detail), P.INVALID, code), status_code=exc.status_code)

  @app.exception_handler(Exception)
  async def _internal_error(request, exc):
    del request
    log.exception("unhandled error")
    return JSONResponse(P.error_body(f"internal server error: {type(exc).__name__}: {exc}", "server_error",
                                     "internal_error"), status_code=500)


def _add_routes(app: FastAPI, state: dict, metrics: ServerMetrics, completions: Completions, names: list,
                max_model_len: int) -> None:
  def model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "superinfer-jax",
            "max_model_len": max_model_len}

  @app.get("/health")
  async def health(check: int = 0):
    return await _health(state, check)

  @app.get("/metrics")
  async def prometheus_metrics():
    return Response(metrics.render(), media_type=CONTENT_TYPE)

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [model_card(n) for n in names]}

  @app.get("/v1/models/{model_id:path}")
  async def model(model_id: str):
    if model_id not in names:
      return error_response(P.APIError(404, f"The model '{model_id}' does not exist (served: {', '.join(names)})",
                                       code="model_not_found", param="model"))
    return model_card(model_id)

  @app.post("/v1/completions")
  async def completions_route(request: Request):
    return await completions.handle(request, "completion")

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    return await completions.handle(request, "chat")


def build_app(engine: Any, served_model_names: Sequence[str], *, max_queue: int = 256,
              engine_factory=None, disconnect_poll_s: float = 0.1, channel=None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              warmup: Optional[Callable[[Any], None]] = None) -> FastAPI:
  """The app over ``engine`` (an ``LLMEngine``); the engine thread starts with the app's lifespan.
  ``channel``: process 0's ``parallel.events.EventChannel`` in a multi-process run (``worker.py``).
  ``max_body_bytes``: a larger body gets a 413.
  ``warmup(engine)``: run in the engine thread once the server listens (precompilation); until it is done
  ``/health`` and requests answer 503 with ``Retry-After``."""
  names = list(served_model_names)
  tokenizer = engine.tokenizer
  max_model_len = context_of(engine)
  metrics = ServerMetrics()
  preparer = RequestPreparer(names, tokenizer, engine.model_config.vocab_size, max_model_len)
  state: dict[str, Any] = {"engine": engine}   # the lifespan hands it to the worker
  del engine
  completions = Completions(state, preparer, max_body_bytes=max_body_bytes, disconnect_poll_s=disconnect_poll_s)
  app = FastAPI(title="superinfer-jax", lifespan=_lifespan(
      state, metrics, completions, names, max_model_len, max_queue=max_queue, engine_factory=engine_factory,
      channel=channel, warmup=warmup))
  app.state.drain = _drain_of(state)
  app.state.metrics = metrics
  app.state.server_state = state
  _add_error_handlers(app)
  _add_routes(app, state, metrics, completions, names, max_model_len)
  app.state.chat_template_is_models = chat_template_of(tokenizer)[1] if tokenizer is not None else False
  return app
