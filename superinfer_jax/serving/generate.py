"""The generate path of ``/v1/completions`` and ``/v1/chat/completions``: ``Completions``.

A request is refused while the server starts or drains (503), its body read (bounded), then parsed,
validated and tokenized in the preparation threads, and its ``n`` choices queued on the ``EngineWorker``.
Streamed, the events become server-sent chunks ending in ``data: [DONE]``; otherwise they are collected
into one body. ``logprobs`` come with the engine's outputs (computed in its step), token by token, streamed
or not. ``usage`` (every body, and the last chunk of a stream asking ``include_usage``) counts the prompt once,
and its ``prompt_tokens_details.cached_tokens`` is the first choice's ``num_cached_tokens`` (prompt tokens
whose KV came from the prefix cache; the other choices of ``n`` > 1 may find more). A client that goes away
has its choices aborted, which frees their KV blocks at once. Never touches the engine.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from superinfer_jax.serving import protocol as P
from superinfer_jax.serving import responses as R
from superinfer_jax.serving.choices import Choices, submit_choices
from superinfer_jax.serving.errors import error_response
from superinfer_jax.serving.logprobs import as_text
from superinfer_jax.serving.prepare import RequestPreparer, read_body

log = logging.getLogger("superinfer_jax.serving")


class Completions:
  """Serves the generate routes over the app's ``state`` (``worker``, ``draining``).

  ``disconnect_poll_s``: how often a non-streamed request checks its client.
  """

  def __init__(self, state: dict, preparer: RequestPreparer, *, max_body_bytes: int, disconnect_poll_s: float):
    self.state, self.preparer = state, preparer
    self.max_body_bytes, self.disconnect_poll_s = max_body_bytes, disconnect_poll_s
    self.prep_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="prepare")

  def shutdown(self) -> None:
    self.prep_pool.shutdown(wait=False, cancel_futures=True)

  async def handle(self, request: Request, kind: str):
    """The response to one generate request of ``kind`` ("completion" or "chat")."""
    try:
      req, prompt_ids, choices = await self._admit(request, kind)
    except P.APIError as e:
      return error_response(e)
    created = R.now_s()
    if req.stream:
      return StreamingResponse(self._stream(req, choices, created, len(prompt_ids)), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                               background=BackgroundTask(choices.close))
    try:
      return await self._collect(request, req, choices, created, prompt_ids)
    finally:
      choices.close()

  async def _admit(self, request: Request, kind: str):
    """(ParsedRequest, prompt ids, queued ``Choices``), or ``APIError`` (503 starting / draining, 413, 400s)."""
    worker = self.state["worker"]
    if self.state.get("draining"):
      raise P.APIError(503, "the server is shutting down", type="server_error", code="unavailable")
    if not worker.ready:
      raise P.APIError(503, "the server is starting: the engine is warming up (GET /health says when it is "
                            "ready)", type="server_error", code="unavailable")
    raw = await read_body(request, self.max_body_bytes)
    req, prompt_ids, params = await asyncio.get_running_loop().run_in_executor(self.prep_pool, self.preparer,
                                                                               raw, kind)
    return req, prompt_ids, submit_choices(worker, req, prompt_ids, params)

  async def _next_event(self, request: Request, req, choices: Choices, next_check: list):
    """The next ``(index, kind, event)``, None after ``disconnect_poll_s`` without one, or "gone" when the
    client disconnected (checked at least every ``disconnect_poll_s``, as outputs may flow without pause)."""
    loop = asyncio.get_running_loop()
    item = None
    try:
      item = await asyncio.wait_for(choices.events.get(), timeout=self.disconnect_poll_s)
    except asyncio.TimeoutError:
      pass
    if item is None or loop.time() >= next_check[0]:
      next_check[0] = loop.time() + self.disconnect_poll_s
      if await request.is_disconnected():
        log.info("%s: client disconnected; aborting", req.request_id)
        return "gone"
    return item

  async def _collect(self, request: Request, req, choices: Choices, created: int, prompt_ids: list[int]):
    """The non-streamed body: every choice's text, tokens and finish reason (and logprobs when asked)."""
    asked = req.logprobs is not None
    out = [R.Choice("", [], None, [] if asked else None, [] if asked else None) for _ in range(req.n)]
    texts: list[list[str]] = [[] for _ in range(req.n)]
    cached = 0
    loop = asyncio.get_running_loop()
    next_check = [loop.time() + self.disconnect_poll_s]
    while not choices.all_final:
      item = await self._next_event(request, req, choices, next_check)
      if item == "gone":
        return Response(status_code=499)
      if item is None:
        continue
      i, ev_kind, ev = item
      if ev_kind == "error":
        choices.final[i] = True
        return error_response(ev)
      texts[i].append(ev.text)
      out[i].token_ids.extend(ev.token_ids)
      if i == 0 and ev.num_cached_tokens is not None:
        cached = ev.num_cached_tokens
      if asked:
        tokens, lps = self._logprobs(ev)
        out[i].tokens.extend(tokens)
        out[i].logprobs.extend(lps)
      if ev.finished:
        choices.final[i] = True
        out[i].text, out[i].finish_reason = "".join(texts[i]), ev.finish_reason
    return R.full_response(req, created, out, len(prompt_ids), cached)

  async def _stream(self, req, choices: Choices, created: int, n_prompt: int):
    """Server-sent chunks: the role first (chat), a chunk per output, a final chunk per choice, usage when
    asked, ``[DONE]``; an error ends every unfinished choice with finish_reason abort, then the error event."""
    try:
      first = [True] * req.n
      n_out = cached = 0
      if req.kind == "chat":   # the role comes first, as OpenAI sends it
        for i in range(req.n):
          yield R.sse(R.chunk(req, created, "", [], None, first=True, index=i))
          first[i] = False
      empty = "" if req.kind == "completion" else None
      while not choices.all_final:
        i, ev_kind, ev = await choices.events.get()
        if ev_kind == "error":
          for j, final in enumerate(choices.final):
            if not final:
              yield R.sse(R.chunk(req, created, empty, [], "abort", index=j))
          choices.final[i] = True
          yield R.sse(ev.body())
          break
        n_out += len(ev.token_ids)
        if i == 0 and ev.num_cached_tokens is not None:
          cached = ev.num_cached_tokens
        if ev.token_ids or ev.text:
          lp = R.logprobs_body(req, *self._logprobs(ev)) if req.logprobs is not None else None
          yield R.sse(R.chunk(req, created, ev.text, ev.token_ids, None, first=first[i], index=i, logprobs=lp))
          first[i] = False
        if ev.finished:
          choices.final[i] = True
          yield R.sse(R.chunk(req, created, empty, [], ev.finish_reason, index=i))
      else:
        if req.include_usage:
          yield R.sse(R.usage_chunk(req, created, n_prompt, n_out, cached))
      yield "data: [DONE]\n\n"
    finally:
      if not choices.all_final:
        log.info("%s: stream closed before the end; aborting", req.request_id)
      choices.close()

  def _token_text(self, t: int) -> str:
    tok = self.preparer.tokenizer
    return tok.decode([t]) if tok is not None else f"token_id:{t}"

  def _logprobs(self, ev):
    """(token texts, [(logprob, [(text, logprob)])]) of one engine output's tokens."""
    return as_text(ev.token_ids, ev.logprobs or [], self._token_text)
