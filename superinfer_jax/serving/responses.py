"""OpenAI response bodies and server-sent stream chunks for a ``protocol.ParsedRequest`` (no HTTP, no JAX)."""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Optional, Sequence

from superinfer_jax.serving.protocol import ParsedRequest


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: Optional[int] = 0) -> dict:
  """OpenAI's ``usage`` (vLLM's shape): ``prompt_tokens_details.cached_tokens`` is the prompt tokens whose KV
  came from the prefix cache (the engine's ``num_cached_tokens``; None, not admitted yet: 0)."""
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens,
          "prompt_tokens_details": {"cached_tokens": cached_tokens or 0}}


def finish_reason_out(reason: Optional[str]) -> Optional[str]:
  """The engine's finish reason as the client sees it: stop, length, or abort (the server ended it)."""
  return reason if reason in ("stop", "length", "abort") else (None if reason is None else "stop")


@dataclasses.dataclass
class Choice:
  """One finished choice of a non-streamed response. ``logprobs``: per output token, (its logprob, the top
  alternatives as [(token text, logprob)]), with ``tokens`` the token texts; None when not asked for."""
  text: str
  token_ids: list[int]
  finish_reason: Optional[str]
  tokens: Optional[list[str]] = None
  logprobs: Optional[list[tuple[float, list[tuple[str, float]]]]] = None


def logprobs_body(req: ParsedRequest, tokens: list[str], lps: list[tuple[float, list[tuple[str, float]]]]) -> dict:
  """A choice's ``logprobs`` in the endpoint's format: chat ``{"content": [{token, logprob, bytes,
  top_logprobs}]}``, completions ``{tokens, token_logprobs, top_logprobs, text_offset}``."""
  if req.kind == "chat":
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")),
                         "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode("utf-8"))}
                                          for a, alp in top]}
                        for t, (lp, top) in zip(tokens, lps)]}
  offsets, pos = [], 0
  for t in tokens:
    offsets.append(pos)
    pos += len(t)
  return {"tokens": list(tokens), "token_logprobs": [lp for lp, _ in lps],
          "top_logprobs": [dict(top) for _, top in lps], "text_offset": offsets}


def full_response(req: ParsedRequest, created: int, choices: Sequence[Choice], prompt_tokens: int,
                  cached_tokens: Optional[int] = 0) -> dict:
  out = []
  for i, c in enumerate(choices):
    lp = logprobs_body(req, c.tokens, c.logprobs) if c.logprobs is not None else None
    if req.kind == "chat":
      choice = {"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                "finish_reason": finish_reason_out(c.finish_reason)}
    else:
      choice = {"index": i, "text": c.text, "logprobs": lp, "finish_reason": finish_reason_out(c.finish_reason)}
    if req.return_token_ids:
      choice["token_ids"] = list(c.token_ids)
    out.append(choice)
  return {"id": req.request_id, "object": "chat.completion" if req.kind == "chat" else "text_completion",
          "created": created, "model": req.model, "choices": out,
          "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices), cached_tokens)}


def chunk(req: ParsedRequest, created: int, text: Optional[str], token_ids: Sequence[int],
          finish_reason: Optional[str], *, first: bool = False, index: int = 0,
          logprobs: Optional[dict] = None) -> dict:
  """One streamed chunk of choice ``index`` (a text delta, possibly empty, or the final one with its finish
  reason); ``logprobs`` (``logprobs_body`` of the delta's tokens) when the request asked."""
  if req.kind == "chat":
    delta: dict = {}
    if first:
      delta["role"] = "assistant"
    if text is not None:
      delta["content"] = text
    choice = {"index": index, "delta": delta, "logprobs": logprobs,
              "finish_reason": finish_reason_out(finish_reason)}
    obj = "chat.completion.chunk"
  else:
    choice = {"index": index, "text": text or "", "logprobs": logprobs,
              "finish_reason": finish_reason_out(finish_reason)}
    obj = "text_completion"
  if req.return_token_ids:
    choice["token_ids"] = list(token_ids)
  return {"id": req.request_id, "object": obj, "created": created, "model": req.model, "choices": [choice]}


def usage_chunk(req: ParsedRequest, created: int, prompt_tokens: int, completion_tokens: int,
                cached_tokens: Optional[int] = 0) -> dict:
  obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
  return {"id": req.request_id, "object": obj, "created": created, "model": req.model, "choices": [],
          "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def sse(data: Any) -> str:
  return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"


def now_s() -> int:
  return int(time.time())
