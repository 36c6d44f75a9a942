"""The OpenAI-compatible HTTP app (FastAPI on uvicorn): routes, streaming, disconnects, errors.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as server-sent events ending in
``data: [DONE]``, or one JSON body), ``GET /v1/models``, ``GET /health`` (``?check=1`` also checks the
block manager's invariants in the engine thread and reports the pools), ``GET /metrics`` (Prometheus).
See docs/serving.md for the request fields (OpenAI's plus ``ignore_eos``, ``ttft_slo``, ``tbt_slo``,
``top_k``, ``stop_token_ids``, ``return_token_ids``) and the error table.

Handlers never touch the engine: they validate, tokenize, and hand the request to the ``EngineWorker``
(``worker.py``), then read its events from an ``asyncio.Queue``. A client that goes away (a stream
closed, or a non-streamed request whose connection dropped) has its request aborted, which frees its KV
blocks at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from superinfer_jax.engine.config import SamplingParams
from superinfer_jax.model.tokenizer import encode_text
from superinfer_jax.serving import protocol as P
from superinfer_jax.serving.chat import ChatTemplateError, chat_template_of, render_chat
from superinfer_jax.serving.metrics import CONTENT_TYPE, ServerMetrics
from superinfer_jax.serving.worker import EngineWorker

log = logging.getLogger("superinfer_jax.serving")


def error_response(e: P.APIError) -> JSONResponse:
  return JSONResponse(e.body(), status_code=e.status)


class _Ticket:
  """One accepted request's admission slot; ``close(abort)`` is idempotent."""

  def __init__(self, worker: EngineWorker, rid: str):
    self.worker, self.rid = worker, rid
    self.final = False
    self.closed = False

  def close(self) -> None:
    if self.closed:
      return
    self.closed = True
    if not self.final:
      self.worker.abort(self.rid)
    self.worker.done(self.rid)


def context_of(engine: Any) -> int:
  """The context the server offers over ``engine``: ``protocol.served_context`` (the engine's
  ``max_model_len`` capped at its device pool; ``ValueError`` if an explicit ``--max_model_len`` exceeds the
  pool). An engine without a pool size (the test fake) offers its ``max_model_len``."""
  nb = getattr(engine, "num_device_blocks", None)
  if nb is None:
    return engine.max_model_len
  return P.served_context(engine.max_model_len, nb, engine.config.block_size, engine.config.model.max_model_len)


def build_app(engine: Any, served_model_names: Sequence[str], *, max_queue: int = 256,
              engine_factory=None, disconnect_poll_s: float = 0.1, channel=None) -> FastAPI:
  """The app over ``engine`` (an ``LLMEngine``); the engine thread starts with the app's lifespan.
  ``channel``: process 0's ``parallel.events.EventChannel`` in a multi-process run (``worker.py``)."""
  names = list(served_model_names)
  tokenizer = engine.tokenizer
  max_model_len = context_of(engine)
  vocab_size = engine.model_config.vocab_size
  metrics = ServerMetrics()
  # Only the worker keeps the engine (so a rebuilt engine's predecessor can be freed).
  state: dict[str, Any] = {"engine": engine}
  del engine

  @contextlib.asynccontextmanager
  async def lifespan(app):
    eng = state.pop("engine")
    worker = EngineWorker(eng, asyncio.get_running_loop(), max_queue=max_queue, metrics=metrics,
                          engine_factory=engine_factory, channel=channel)
    metrics._admitted = lambda: worker.num_admitted  # pylint: disable=protected-access
    metrics.after_step(eng)
    del eng
    state["worker"] = worker
    worker.start()
    log.info("engine thread started; serving %s (context %d tokens, max_queue %d)", names, max_model_len,
             max_queue)
    try:
      yield
    finally:
      log.info("shutting down: cancelling %d requests still admitted", worker.num_admitted)
      await asyncio.get_running_loop().run_in_executor(None, worker.stop)

  app = FastAPI(title="superinfer-jax", lifespan=lifespan)
  app.state.metrics = metrics
  app.state.server_state = state

  @app.exception_handler(StarletteHTTPException)
  async def _http_error(request, exc):
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return JSONResponse(P.error_body(str(exc.detail), P.INVALID, code), status_code=exc.status_code)

  @app.exception_handler(Exception)
  async def _internal_error(request, exc):
    log.exception("unhandled error")
    return JSONResponse(P.error_body(f"internal server error: {type(exc).__name__}: {exc}", "server_error",
                                     "internal_error"), status_code=500)

  @app.get("/health")
  async def health(check: int = 0):
    worker: EngineWorker = state["worker"]
    if not worker.alive:
      return JSONResponse({"status": "unavailable", "error": worker.fatal}, status_code=503)
    out: dict[str, Any] = {"status": "ok", "admitted": worker.num_admitted, "max_queue": worker.max_queue,
                           "step_errors": worker.step_errors}
    if check:
      def probe(eng):
        eng.block_manager.check_invariants()
        bm, sch = eng.block_manager, eng.scheduler
        return {"invariants": "ok", "waiting": sch.num_waiting, "running": sch.num_running,
                "rotary": sch.num_rotary, "device_blocks_free": bm.num_free_device_blocks,
                "device_blocks": bm.num_device_blocks, "host_blocks_free": bm.num_free_host_blocks,
                "host_blocks": bm.num_host_blocks}
      try:
        out.update(await worker.call(probe))
      except Exception as e:  # pylint: disable=broad-except
        return JSONResponse({"status": "error", "invariants": f"{type(e).__name__}: {e}"}, status_code=500)
    return out

  @app.get("/metrics")
  async def prometheus_metrics():
    return Response(metrics.render(), media_type=CONTENT_TYPE)

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "superinfer-jax",
                                        "max_model_len": max_model_len} for n in names]}

  def _prepare(body: dict, kind: str):
    """Validates and tokenizes; returns (ParsedRequest, prompt ids, SamplingParams). Raises APIError."""
    req, messages = P.parse_request(body, kind, names)
    if kind == "chat":
      if tokenizer is None:
        raise P.APIError(400, "this model has no tokenizer: chat needs one (use /v1/completions with token "
                              "ids)", param="messages")
      try:
        text = render_chat(tokenizer, messages)
      except ChatTemplateError as e:
        raise P.APIError(400, str(e), param="messages") from None
      bos_id = getattr(tokenizer, "bos_id", None)
      bos_text = tokenizer.backend.id_to_token(bos_id) if bos_id is not None else None
      if bos_text and text.startswith(bos_text):   # the template wrote BOS: don't add another
        prompt_ids = tokenizer.encode(text, add_bos=False)
      else:
        prompt_ids = encode_text(tokenizer, text)
    elif isinstance(req.prompt, str):
      if tokenizer is None:
        raise P.APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
      prompt_ids = encode_text(tokenizer, req.prompt)
    else:
      prompt_ids = req.prompt
      bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
      if bad:
        raise P.APIError(400, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                         param="prompt")
    max_tokens = P.check_lengths(req, len(prompt_ids), max_model_len)
    if req.stop and tokenizer is None:
      raise P.APIError(400, "stop strings need a tokenizer", param="stop")
    try:
      params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                              top_k=req.top_k, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
                              ignore_eos=req.ignore_eos).validate(vocab_size=vocab_size)
    except ValueError as e:
      raise P.APIError(400, str(e)) from None
    return req, prompt_ids, params

  async def _generate(request: Request, kind: str):
    worker: EngineWorker = state["worker"]
    try:
      body = P.parse_json_body(await request.body())
      req, prompt_ids, params = _prepare(body, kind)
      q = worker.submit(req.request_id, prompt_ids, params, ttft_slo=req.ttft_slo, tbt_slo=req.tbt_slo)
    except P.APIError as e:
      return error_response(e)
    ticket = _Ticket(worker, req.request_id)
    created = P.now_s()
    n_prompt = len(prompt_ids)
    if req.stream:
      return StreamingResponse(_stream(req, q, ticket, created, n_prompt), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                               background=BackgroundTask(ticket.close))
    try:
      texts, ids = [], []
      loop = asyncio.get_running_loop()
      next_check = loop.time() + disconnect_poll_s
      while True:
        ev_kind = None
        try:
          ev_kind, ev = await asyncio.wait_for(q.get(), timeout=disconnect_poll_s)
        except asyncio.TimeoutError:
          pass
        if ev_kind is None or loop.time() >= next_check:   # outputs may flow without pause: poll by time
          next_check = loop.time() + disconnect_poll_s
          if await request.is_disconnected():
            log.info("%s: client disconnected; aborting", req.request_id)
            return Response(status_code=499)
        if ev_kind is None:
          continue
        if ev_kind == "error":
          ticket.final = True
          return error_response(ev)
        texts.append(ev.text)
        ids.extend(ev.token_ids)
        if ev.finished:
          ticket.final = True
          return P.full_response(req, created, "".join(texts), ids, ev.finish_reason, n_prompt)
    finally:
      ticket.close()

  async def _stream(req, q, ticket: _Ticket, created: int, n_prompt: int):
    try:
      first = True
      n_out = 0
      if req.kind == "chat":   # the role comes first, as OpenAI sends it
        yield P.sse(P.chunk(req, created, "", [], None, first=True))
        first = False
      while True:
        ev_kind, ev = await q.get()
        if ev_kind == "error":
          ticket.final = True
          yield P.sse(ev.body())
          break
        n_out += len(ev.token_ids)
        if ev.token_ids or ev.text:
          yield P.sse(P.chunk(req, created, ev.text, ev.token_ids, None, first=first))
          first = False
        if ev.finished:
          ticket.final = True
          yield P.sse(P.chunk(req, created, "" if req.kind == "completion" else None, [], ev.finish_reason))
          if req.include_usage:
            yield P.sse(P.usage_chunk(req, created, n_prompt, n_out))
          break
      yield "data: [DONE]\n\n"
    finally:
      if not ticket.final:
        log.info("%s: stream closed before the end; aborting", req.request_id)
      ticket.close()

  @app.post("/v1/completions")
  async def completions(request: Request):
    return await _generate(request, "completion")

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    return await _generate(request, "chat")

  app.state.chat_template_is_models = chat_template_of(tokenizer)[1] if tokenizer is not None else False
  return app
