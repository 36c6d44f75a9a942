"""The OpenAI-compatible HTTP app (FastAPI on uvicorn): routes, streaming, disconnects, errors.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as server-sent events ending in
``data: [DONE]``, or one JSON body), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health`` (503
until the engine has warmed up and while draining, 200 when it serves; ``?check=1`` also checks the block
manager's invariants in the engine thread and reports the pools), ``GET /metrics`` (Prometheus).

Every request field is honoured or refused (``protocol.FIELDS``; docs/serving.md has the table and the
errors). A request with ``n`` > 1 is ``n`` engine requests (choice i seeded ``seed + i``); ``logprobs`` are
computed once a choice has finished, by scoring its tokens with the model (``logprobs.py``) in a thread of
their own.

Handlers never touch the engine: they read the body (up to ``max_body_bytes``), parse, validate and tokenize
it in a thread pool (so a large or slow request never stalls the event loop, which carries every stream),
and hand the request to the ``EngineWorker``
(``worker.py``), then read its events from an ``asyncio.Queue``. A client that goes away (a stream
closed, or a non-streamed request whose connection dropped) has its request aborted, which frees its KV
blocks at once.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import dataclasses
from typing import Any, Callable, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from superinfer_jax.engine.config import SamplingParams
from superinfer_jax.model.tokenizer import encode_text
from superinfer_jax.serving import protocol as P
from superinfer_jax.serving.chat import ChatTemplateError, chat_template_of, render_chat
from superinfer_jax.serving.logprobs import token_logprobs
from superinfer_jax.serving.metrics import CONTENT_TYPE, ServerMetrics
from superinfer_jax.serving.worker import EngineWorker

log = logging.getLogger("superinfer_jax.serving")


DEFAULT_MAX_BODY_BYTES = 4 << 20
RETRY_AFTER_S = 1   # what a 429 (queue full) or 503 (starting, draining) tells the client to wait


def error_response(e: P.APIError) -> JSONResponse:
  """The error body; a 429 or 503 also says when to retry (``Retry-After``, seconds)."""
  headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status in (429, 503) else None
  return JSONResponse(e.body(), status_code=e.status, headers=headers)


class _Choices:
  """The engine requests of one HTTP request (one per choice, ``n`` of them), their admission slots, and
  one queue their events arrive on as ``(index, kind, event)``. ``close()`` (idempotent) aborts the
  choices that have not finished and frees every slot."""

  def __init__(self, worker: EngineWorker):
    self.worker = worker
    self.rids: list[str] = []
    self.final: list[bool] = []
    self.events: asyncio.Queue = asyncio.Queue()
    self._pumps: list[asyncio.Task] = []
    self.closed = False

  def add(self, rid: str, q: asyncio.Queue) -> None:
    i = len(self.rids)
    self.rids.append(rid)
    self.final.append(False)
    self._pumps.append(asyncio.ensure_future(self._pump(i, q)))

  async def _pump(self, i: int, q: asyncio.Queue) -> None:
    while True:
      kind, ev = await q.get()
      self.events.put_nowait((i, kind, ev))
      if kind == "error" or ev.finished:
        return

  @property
  def all_final(self) -> bool:
    return all(self.final)

  def close(self) -> None:
    if self.closed:
      return
    self.closed = True
    for rid, final, pump in zip(self.rids, self.final, self._pumps):
      pump.cancel()
      if not final:
        self.worker.abort(rid)
      self.worker.done(rid)


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
  eng.block_manager.check_invariants()
  bm, sch = eng.block_manager, eng.scheduler
  return {"invariants": "ok", "waiting": sch.num_waiting, "running": sch.num_running, "rotary": sch.num_rotary,
          "device_blocks_free": bm.num_free_device_blocks, "device_blocks": bm.num_device_blocks,
          "host_blocks_free": bm.num_free_host_blocks, "host_blocks": bm.num_host_blocks}


def build_app(engine: Any, served_model_names: Sequence[str], *, max_queue: int = 256,
              engine_factory=None, disconnect_poll_s: float = 0.1, channel=None,
              scorer: Optional[Callable[[list[int]], Any]] = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              warmup: Optional[Callable[[Any], None]] = None) -> FastAPI:
  """The app over ``engine`` (an ``LLMEngine``); the engine thread starts with the app's lifespan.
  ``channel``: process 0's ``parallel.events.EventChannel`` in a multi-process run (``worker.py``).
  ``scorer``: ``token ids -> [len, vocab]`` next-token logits (``logprobs.Scorer``), run off the event loop
  for ``logprobs``; without one, ``logprobs`` is refused. ``max_body_bytes``: a larger body gets a 413.
  ``warmup(engine)``: run in the engine thread once the server listens (precompilation); until it is done
  ``/health`` and requests answer 503 with ``Retry-After``."""
  names = list(served_model_names)
  tokenizer = engine.tokenizer
  max_model_len = context_of(engine)
  vocab_size = engine.model_config.vocab_size
  metrics = ServerMetrics()
  score_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="score")
  prep_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="prepare")
  # Only the worker keeps the engine (so a rebuilt engine's predecessor can be freed).
  state: dict[str, Any] = {"engine": engine}
  del engine

  @contextlib.asynccontextmanager
  async def lifespan(app):
    eng = state.pop("engine")
    worker = EngineWorker(eng, asyncio.get_running_loop(), max_queue=max_queue, metrics=metrics,
                          engine_factory=engine_factory, channel=channel, warmup=warmup)
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
      score_pool.shutdown(wait=False, cancel_futures=True)
      prep_pool.shutdown(wait=False, cancel_futures=True)

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

  app = FastAPI(title="superinfer-jax", lifespan=lifespan)
  app.state.drain = drain
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

  @app.get("/metrics")
  async def prometheus_metrics():
    return Response(metrics.render(), media_type=CONTENT_TYPE)

  def model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "superinfer-jax",
            "max_model_len": max_model_len}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [model_card(n) for n in names]}

  @app.get("/v1/models/{model_id:path}")
  async def model(model_id: str):
    if model_id not in names:
      return error_response(P.APIError(404, f"The model '{model_id}' does not exist (served: {', '.join(names)})",
                                       code="model_not_found", param="model"))
    return model_card(model_id)

  async def _read_body(request: Request) -> bytes:
    """The body, or a 413 once it exceeds ``max_body_bytes`` (the rest is read and dropped, so the client
    gets the answer rather than a connection reset, unless it announced more than 64x the limit)."""
    announced = request.headers.get("content-length", "")
    too_large = P.APIError(413, f"the request body exceeds the limit of {max_body_bytes} bytes "
                                "(--max_request_bytes)", code="request_too_large")
    if announced.isdigit() and int(announced) > 64 * max_body_bytes:
      raise too_large
    chunks, size = [], 0
    async for part in request.stream():
      size += len(part)
      if size <= max_body_bytes:
        chunks.append(part)
    if size > max_body_bytes:
      raise too_large
    return b"".join(chunks)

  def _prepare(raw: bytes, kind: str):
    """Parses, validates and tokenizes (in the preparation threads, off the event loop); returns
    (ParsedRequest, prompt ids, SamplingParams). Raises APIError."""
    req, messages = P.parse_request(P.parse_json_body(raw), kind, names)
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

  def _submit(worker: EngineWorker, req, prompt_ids, params) -> _Choices:
    """Queues the request's ``n`` choices (choice i's seed: ``seed + i``); on a refusal, the ones queued
    already are aborted and the error raised."""
    choices = _Choices(worker)
    try:
      for i in range(req.n):
        rid = req.request_id if req.n == 1 else f"{req.request_id}-{i}"
        p = params if i == 0 or params.seed is None else dataclasses.replace(params, seed=(params.seed + i) % 2**32)
        choices.add(rid, worker.submit(rid, prompt_ids, p, ttft_slo=req.ttft_slo, tbt_slo=req.tbt_slo))
    except P.APIError:
      choices.close()
      raise
    return choices

  def _token_text(t: int) -> str:
    return tokenizer.decode([t]) if tokenizer is not None else f"token_id:{t}"

  def _logprobs(prompt_ids: list[int], output_ids: list[int], top: int):
    """(token texts, [(logprob, [(text, logprob)])]) of one choice's output; runs in the scoring thread."""
    if not output_ids:
      return [], []
    lps = token_logprobs(scorer(prompt_ids + output_ids[:-1]), len(prompt_ids), output_ids, top)
    return ([_token_text(t) for t in output_ids],
            [(lp, [(_token_text(a), alp) for a, alp in alts]) for lp, alts in lps])

  async def _generate(request: Request, kind: str):
    worker: EngineWorker = state["worker"]
    try:
      if state.get("draining"):
        raise P.APIError(503, "the server is shutting down", type="server_error", code="unavailable")
      if not worker.ready:
        raise P.APIError(503, "the server is starting: the engine is warming up (GET /health says when it is "
                              "ready)", type="server_error", code="unavailable")
      raw = await _read_body(request)
      req, prompt_ids, params = await asyncio.get_running_loop().run_in_executor(prep_pool, _prepare, raw, kind)
      if req.logprobs is not None and scorer is None:
        raise P.APIError(400, "'logprobs' needs the model's weights to score with, which this server has not "
                              "(a multi-process run, or an engine given without a model path)",
                         code="unsupported_parameter", param="logprobs")
      choices = _submit(worker, req, prompt_ids, params)
    except P.APIError as e:
      return error_response(e)
    created = P.now_s()
    n_prompt = len(prompt_ids)
    if req.stream:
      return StreamingResponse(_stream(req, choices, created, n_prompt), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                               background=BackgroundTask(choices.close))
    try:
      out = [P.Choice("", [], None) for _ in range(req.n)]
      texts: list[list[str]] = [[] for _ in range(req.n)]
      loop = asyncio.get_running_loop()
      next_check = loop.time() + disconnect_poll_s
      while not choices.all_final:
        item = None
        try:
          item = await asyncio.wait_for(choices.events.get(), timeout=disconnect_poll_s)
        except asyncio.TimeoutError:
          pass
        if item is None or loop.time() >= next_check:   # outputs may flow without pause: poll by time
          next_check = loop.time() + disconnect_poll_s
          if await request.is_disconnected():
            log.info("%s: client disconnected; aborting", req.request_id)
            return Response(status_code=499)
        if item is None:
          continue
        i, ev_kind, ev = item
        if ev_kind == "error":
          choices.final[i] = True
          return error_response(ev)
        texts[i].append(ev.text)
        out[i].token_ids.extend(ev.token_ids)
        if ev.finished:
          choices.final[i] = True
          out[i].text, out[i].finish_reason = "".join(texts[i]), ev.finish_reason
      if req.logprobs is not None:
        for c in out:
          c.tokens, c.logprobs = await loop.run_in_executor(score_pool, _logprobs, prompt_ids, c.token_ids,
                                                            req.logprobs)
      return P.full_response(req, created, out, n_prompt)
    finally:
      choices.close()

  async def _stream(req, choices: _Choices, created: int, n_prompt: int):
    try:
      first = [True] * req.n
      n_out = 0
      if req.kind == "chat":   # the role comes first, as OpenAI sends it
        for i in range(req.n):
          yield P.sse(P.chunk(req, created, "", [], None, first=True, index=i))
          first[i] = False
      while not choices.all_final:
        i, ev_kind, ev = await choices.events.get()
        if ev_kind == "error":   # every unfinished choice ends with finish_reason abort, then the error
          for j, final in enumerate(choices.final):
            if not final:
              yield P.sse(P.chunk(req, created, "" if req.kind == "completion" else None, [], "abort", index=j))
          choices.final[i] = True
          yield P.sse(ev.body())
          break
        n_out += len(ev.token_ids)
        if ev.token_ids or ev.text:
          yield P.sse(P.chunk(req, created, ev.text, ev.token_ids, None, first=first[i], index=i))
          first[i] = False
        if ev.finished:
          choices.final[i] = True
          yield P.sse(P.chunk(req, created, "" if req.kind == "completion" else None, [], ev.finish_reason,
                              index=i))
      else:
        if req.include_usage:
          yield P.sse(P.usage_chunk(req, created, n_prompt, n_out))
      yield "data: [DONE]\n\n"
    finally:
      if not choices.all_final:
        log.info("%s: stream closed before the end; aborting", req.request_id)
      choices.close()

  @app.post("/v1/completions")
  async def completions(request: Request):
    return await _generate(request, "completion")

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    return await _generate(request, "chat")

  app.state.chat_template_is_models = chat_template_of(tokenizer)[1] if tokenizer is not None else False
  return app
