"""OpenAI request parsing and validation, error bodies, and response/chunk builders (no HTTP, no JAX).

Every rejection is an ``APIError`` carrying the HTTP status and the OpenAI error body
``{"error": {"message", "type", "param", "code"}}``. Parsing is by hand (not pydantic) so each bad field
gets its own clear message and code:

=========================================  ======  ==========================  ==============================
input                                      status  type                        code
=========================================  ======  ==========================  ==============================
body is not a JSON object                  400     invalid_request_error       invalid_json
missing ``prompt`` / ``messages``           400     invalid_request_error       missing_required_parameter
a field of the wrong type                  400     invalid_request_error       invalid_type
a field the server does not implement      400     invalid_request_error       unsupported_parameter
invalid Unicode (a lone surrogate)         400     invalid_request_error       invalid_unicode
out-of-range value (max_tokens <= 0, ...)  400     invalid_request_error       invalid_value
prompt (+ max_tokens) beyond the context   400     invalid_request_error       context_length_exceeded
unknown model                              404     invalid_request_error       model_not_found
body larger than the limit                 413     invalid_request_error       request_too_large
admission queue full                       429     rate_limit_error            queue_full
engine failure                             500     server_error                engine_error
=========================================  ======  ==========================  ==============================

``FIELDS`` lists every request field each endpoint knows and what the server does with it (docs/serving.md
renders the same table); a field outside it, or one of ``REFUSED`` given a value other than its default,
is a 400 ``unsupported_parameter`` naming the field.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from typing import Any, Optional, Sequence

INVALID = "invalid_request_error"


class APIError(Exception):
  """An error answered to the client with ``status`` and the OpenAI error body."""

  def __init__(self, status: int, message: str, *, type: str = INVALID, code: str = "invalid_value",  # noqa: A002
               param: Optional[str] = None):
    super().__init__(message)
    self.status = status
    self.message = message
    self.type = type
    self.code = code
    self.param = param

  def body(self) -> dict:
    return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type: str = INVALID, code: str = "invalid_value",  # noqa: A002
               param: Optional[str] = None) -> dict:
  return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclasses.dataclass
class ParsedRequest:
  """A validated completions / chat request, ready for the engine."""
  kind: str                               # "completion" | "chat"
  model: str
  prompt: Any                             # text (str) or token ids (list[int])
  stream: bool
  include_usage: bool
  max_tokens: Optional[int]               # None: fill the context
  temperature: float
  top_p: float
  top_k: int
  seed: Optional[int]
  stop: tuple[str, ...]
  stop_token_ids: tuple[int, ...]
  ignore_eos: bool
  ttft_slo: Optional[float]
  tbt_slo: Optional[float]
  return_token_ids: bool = False
  request_id: str = ""
  n: int = 1
  logprobs: Optional[int] = None          # None: no logprobs; k: the sampled token's and the k most likely


MAX_LOGPROBS = 20

# Every field of the two endpoints: (endpoints, what the server does). "both", "completion" or "chat".
FIELDS: dict[str, tuple[str, str]] = {
    "model": ("both", "one of the served names (default: the first)"),
    "prompt": ("completion", "a string, a list of token ids, or a one-element list of either"),
    "messages": ("chat", "[{role, content}], content a string or a list of text parts; rendered with the "
                         "model's chat template"),
    "max_tokens": ("both", "output cap; completions default 16, chat default the rest of the context"),
    "max_completion_tokens": ("chat", "as max_tokens (wins over it)"),
    "temperature": ("both", "default 1; 0 = greedy"),
    "top_p": ("both", "nucleus sampling, (0, 1]"),
    "top_k": ("both", "keep the k most likely tokens; 0 or -1 = off"),
    "seed": ("both", "per-request seed in [0, 2**32); choice i of n uses seed + i"),
    "n": ("both", "choices per request, 1..16 (each an engine request of its own)"),
    "stop": ("both", "up to 16 strings, matched in the text across token boundaries; the text is cut before"),
    "stop_token_ids": ("both", "token ids that end the output"),
    "ignore_eos": ("both", "keep generating past EOS"),
    "stream": ("both", "server-sent events ending in data: [DONE]"),
    "stream_options": ("both", "include_usage: a last chunk with usage"),
    "logprobs": ("both", "completions: int 0..20, chat: bool; the sampled tokens' log-probabilities under "
                         "the model (raw logits, before temperature / top-k / top-p), non-streamed only"),
    "top_logprobs": ("chat", "0..20 alternatives per token with logprobs=true"),
    "return_token_ids": ("both", "each choice / chunk also carries its token_ids"),
    "ttft_slo": ("both", "TTFT SLO in seconds, handed to the scheduler"),
    "tbt_slo": ("both", "TBT SLO in seconds, handed to the scheduler"),
    "user": ("both", "accepted, not used (an end-user id for abuse monitoring at OpenAI)"),
    "echo": ("completion", "refused unless false"),
    "suffix": ("completion", "refused unless null or \"\""),
    "best_of": ("completion", "refused unless null or equal to n"),
    "presence_penalty": ("both", "refused unless 0 (the engine samples on device without penalties)"),
    "frequency_penalty": ("both", "refused unless 0 (as presence_penalty)"),
    "repetition_penalty": ("both", "refused unless 1 (as presence_penalty)"),
    "logit_bias": ("both", "refused unless null or {} (the engine has no logit processors)"),
    "response_format": ("chat", "refused unless {\"type\": \"text\"}"),
    "tools": ("chat", "refused unless null or []"),
    "tool_choice": ("chat", "refused unless null or \"none\""),
    "parallel_tool_calls": ("chat", "refused unless null"),
    "functions": ("chat", "refused unless null or []"),
    "function_call": ("chat", "refused unless null or \"none\""),
}

# Fields accepted only at these values (a value the server would otherwise have to ignore): field -> (the
# accepted values, why the others are refused).
REFUSED: dict[str, tuple[tuple, str]] = {
    "echo": ((False,), "echoing the prompt is not supported"),
    "suffix": (("",), "insertion (suffix) is not supported"),
    "presence_penalty": ((0,), "penalties are not supported (the engine samples on device without them)"),
    "frequency_penalty": ((0,), "penalties are not supported (the engine samples on device without them)"),
    "repetition_penalty": ((1,), "penalties are not supported (the engine samples on device without them)"),
    "logit_bias": (({},), "logit_bias is not supported (the engine has no logit processors)"),
    "response_format": (({"type": "text"},), "only response_format {\"type\": \"text\"} is supported"),
    "tools": (([],), "tool calling is not supported"),
    "tool_choice": (("none",), "tool calling is not supported"),
    "parallel_tool_calls": ((), "tool calling is not supported"),
    "functions": (([],), "function calling is not supported"),
    "function_call": (("none",), "function calling is not supported"),
}


def parse_json_body(raw: bytes) -> dict:
  try:
    body = json.loads(raw)
  except (ValueError, UnicodeDecodeError) as e:
    raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
  if not isinstance(body, dict):
    raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}",
                   code="invalid_json")
  _check_unicode(body, "")
  return body


def _check_unicode(v: Any, path: str) -> None:
  """Raises a 400 naming the first string (key or value) that is not valid Unicode: JSON's ``\\ud800``
  escapes decode to lone surrogates, which no tokenizer can encode."""
  if isinstance(v, str):
    try:
      v.encode("utf-8")
    except UnicodeEncodeError as e:
      raise APIError(400, f"'{path or 'body'}' is not valid Unicode: {e.reason} at character {e.start}",
                     code="invalid_unicode", param=path or None) from None
  elif isinstance(v, dict):
    for k, x in v.items():
      _check_unicode(k, path)
      _check_unicode(x, f"{path}.{k}" if path else k)
  elif isinstance(v, list):
    for i, x in enumerate(v):
      _check_unicode(x, f"{path}[{i}]")


def _check_fields(body: dict, kind: str) -> None:
  """400 ``unsupported_parameter`` for a field this endpoint does not know, or a refused field's value."""
  for name, v in body.items():
    where = FIELDS.get(name, (None,))[0]
    if where not in ("both", kind):
      endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
      raise APIError(400, f"'{name}' is not a field of {endpoint} on this server (docs/serving.md lists "
                          "them)", code="unsupported_parameter", param=name)
    if name in REFUSED and v is not None:
      accepted, why = REFUSED[name]
      if not any(type(v) is type(a) and v == a or _same_number(v, a) for a in accepted):
        raise APIError(400, f"'{name}'={json.dumps(v)[:80]}: {why}", code="unsupported_parameter", param=name)


def _same_number(v: Any, a: Any) -> bool:
  num = (int, float)
  return (isinstance(v, num) and isinstance(a, num) and not isinstance(v, bool) and not isinstance(a, bool)
          and v == a)


def _type_error(name: str, want: str, v: Any) -> APIError:
  return APIError(400, f"'{name}' must be {want}, got {json.dumps(v)[:80]} ({type(v).__name__})",
                  code="invalid_type", param=name)


def _get_bool(body: dict, name: str, default: bool) -> bool:
  v = body.get(name, default)
  if v is None:
    return default
  if not isinstance(v, bool):
    raise _type_error(name, "a boolean", v)
  return v


def _get_int(body: dict, name: str, default: Optional[int]) -> Optional[int]:
  v = body.get(name, default)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, int):
    raise _type_error(name, "an integer", v)
  return v


def _get_float(body: dict, name: str, default: Optional[float]) -> Optional[float]:
  v = body.get(name, default)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    raise _type_error(name, "a number", v)
  if not math.isfinite(v):
    raise APIError(400, f"'{name}' must be finite, got {v}", param=name)
  return float(v)


def _get_str(body: dict, name: str) -> Optional[str]:
  v = body.get(name)
  if v is not None and not isinstance(v, str):
    raise _type_error(name, "a string", v)
  return v


def _parse_logprobs(body: dict, kind: str) -> Optional[int]:
  """None (no logprobs) or how many alternatives per token: completions' ``logprobs`` (int), chat's
  ``logprobs`` (bool) with ``top_logprobs`` (int)."""
  if kind == "completion":
    k, name = _get_int(body, "logprobs", None), "logprobs"
  else:
    on = _get_bool(body, "logprobs", False)
    k, name = _get_int(body, "top_logprobs", None), "top_logprobs"
    if k is not None and not on:
      raise APIError(400, "'top_logprobs' needs logprobs=true", param="top_logprobs")
    if on and k is None:
      k = 0
  if k is not None and not 0 <= k <= MAX_LOGPROBS:
    raise APIError(400, f"'{name}' must be in [0, {MAX_LOGPROBS}], got {k}", param=name)
  return k


def _is_token_list(v: Any) -> bool:
  return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def _parse_prompt(body: dict) -> Any:
  if "prompt" not in body or body["prompt"] is None:
    raise APIError(400, "'prompt' is a required property", code="missing_required_parameter", param="prompt")
  p = body["prompt"]
  if isinstance(p, str):
    return p
  if _is_token_list(p):
    return list(p)
  if isinstance(p, list) and len(p) == 1 and (isinstance(p[0], str) or _is_token_list(p[0])):
    return p[0]
  if isinstance(p, list) and len(p) > 1 and (all(isinstance(x, str) for x in p)
                                             or all(_is_token_list(x) for x in p)):
    raise APIError(400, "batched prompts are not supported: send one prompt per request", param="prompt")
  if isinstance(p, list) and not p:
    raise APIError(400, "'prompt' is empty", param="prompt")
  raise _type_error("prompt", "a string, a list of token ids, or a one-element list of either", p)


def _parse_messages(body: dict) -> list[dict]:
  if "messages" not in body or body["messages"] is None:
    raise APIError(400, "'messages' is a required property", code="missing_required_parameter",
                   param="messages")
  msgs = body["messages"]
  if not isinstance(msgs, list):
    raise _type_error("messages", "a list of {role, content} objects", msgs)
  if not msgs:
    raise APIError(400, "'messages' is empty", param="messages")
  out = []
  for i, m in enumerate(msgs):
    if not isinstance(m, dict):
      raise _type_error(f"messages[{i}]", "an object", m)
    role, content = m.get("role"), m.get("content")
    if not isinstance(role, str):
      raise _type_error(f"messages[{i}].role", "a string", role)
    if role not in ("system", "user", "assistant", "developer", "tool"):
      raise APIError(400, f"messages[{i}].role {role!r} is not one of system, user, assistant, developer, "
                          "tool", param=f"messages[{i}].role")
    if content is None:
      content = ""
    if isinstance(content, list):   # [{"type": "text", "text": ...}, ...]
      parts = []
      for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
          raise _type_error(f"messages[{i}].content", "a string or a list of text parts", content)
        parts.append(part["text"])
      content = "".join(parts)
    if not isinstance(content, str):
      raise _type_error(f"messages[{i}].content", "a string or a list of text parts", content)
    out.append({"role": role, "content": content})
  return out


def parse_request(body: dict, kind: str, served_model_names: Sequence[str]) -> tuple[ParsedRequest, Any]:
  """Validates ``body`` of a /v1/completions (``kind="completion"``) or /v1/chat/completions
  (``kind="chat"``) request. Returns (ParsedRequest with prompt None for chat, messages or None)."""
  _check_fields(body, kind)
  model = body.get("model")
  if model is None:
    model = served_model_names[0]
  if not isinstance(model, str):
    raise _type_error("model", "a string", model)
  if model not in served_model_names:
    raise APIError(404, f"The model '{model}' does not exist (served: {', '.join(served_model_names)})",
                   code="model_not_found", param="model")
  messages = None
  prompt = None
  if kind == "chat":
    messages = _parse_messages(body)
  else:
    prompt = _parse_prompt(body)
  max_tokens = _get_int(body, "max_tokens", None)
  if kind == "chat":
    mct = _get_int(body, "max_completion_tokens", None)
    max_tokens = mct if mct is not None else max_tokens
  elif max_tokens is None:
    max_tokens = 16   # OpenAI's completions default
  if max_tokens is not None and max_tokens <= 0:
    raise APIError(400, f"'max_tokens' must be >= 1, got {max_tokens}", param="max_tokens")
  temperature = _get_float(body, "temperature", 1.0)
  if temperature < 0:
    raise APIError(400, f"'temperature' must be >= 0, got {temperature}", param="temperature")
  top_p = _get_float(body, "top_p", 1.0)
  if not 0.0 < top_p <= 1.0:
    raise APIError(400, f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
  top_k = _get_int(body, "top_k", 0)
  if top_k < -1:
    raise APIError(400, f"'top_k' must be >= -1 (0 or -1 = off), got {top_k}", param="top_k")
  seed = _get_int(body, "seed", None)
  if seed is not None and not 0 <= seed < 2**32:
    raise APIError(400, f"'seed' must be in [0, 2**32), got {seed}", param="seed")
  n = _get_int(body, "n", 1)
  if not 1 <= n <= 16:
    raise APIError(400, f"'n' must be in [1, 16], got {n}", param="n")
  best_of = _get_int(body, "best_of", None)
  if best_of is not None and best_of != n:
    raise APIError(400, f"'best_of'={best_of}: only best_of = n (or unset) is supported (no server-side "
                        "ranking of choices)", code="unsupported_parameter", param="best_of")
  logprobs = _parse_logprobs(body, kind)
  stop = body.get("stop")
  if stop is None:
    stop = ()
  elif isinstance(stop, str):
    stop = (stop,)
  elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
    stop = tuple(stop)
  else:
    raise _type_error("stop", "a string or a list of strings", stop)
  if any(not s for s in stop):
    raise APIError(400, "'stop' strings must be non-empty", param="stop")
  if len(stop) > 16:
    raise APIError(400, f"at most 16 stop strings, got {len(stop)}", param="stop")
  stop_token_ids = body.get("stop_token_ids") or []
  if not (isinstance(stop_token_ids, list)
          and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_token_ids)):
    raise _type_error("stop_token_ids", "a list of non-negative integers", stop_token_ids)
  stream = _get_bool(body, "stream", False)
  so = body.get("stream_options")
  if so is not None and not isinstance(so, dict):
    raise _type_error("stream_options", "an object", so)
  include_usage = bool(so and so.get("include_usage"))
  ignore_eos = _get_bool(body, "ignore_eos", False)
  if logprobs is not None and stream:
    raise APIError(400, "'logprobs' with stream=true is not supported: the engine returns no per-step "
                        "log-probabilities (send the request without stream)", code="unsupported_parameter",
                   param="logprobs")
  _get_str(body, "user")
  return_token_ids = _get_bool(body, "return_token_ids", False)
  slos = {}
  for name in ("ttft_slo", "tbt_slo"):
    v = _get_float(body, name, None)
    if v is not None and not v > 0:
      raise APIError(400, f"'{name}' must be > 0 seconds, got {v}", param=name)
    slos[name] = v
  prefix = "chatcmpl" if kind == "chat" else "cmpl"
  req = ParsedRequest(kind=kind, model=model, prompt=prompt, stream=stream, include_usage=include_usage,
                      max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                      stop=stop, stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos,
                      return_token_ids=return_token_ids, request_id=f"{prefix}-{uuid.uuid4().hex[:24]}",
                      n=n, logprobs=logprobs, **slos)
  return req, messages


def served_context(model_len: int, num_device_blocks: int, block_size: int,
                   explicit: Optional[int] = None) -> int:
  """The context (prompt + output tokens of one request) the server offers: ``model_len`` (the engine's,
  from the model's positions or ``--max_model_len``) capped at what the device KV pool holds for one
  sequence (``num_device_blocks * block_size``), so every request the server accepts can run.

  ``explicit`` (the ``--max_model_len`` the user gave, or None) may not exceed the pool: ``ValueError``
  with one line naming both numbers (a server that could never fill the context it advertises)."""
  pool = num_device_blocks * block_size
  if explicit is not None and explicit > pool:
    raise ValueError(f"--max_model_len={explicit} exceeds the {pool} tokens the device KV pool holds for one "
                     f"sequence ({num_device_blocks} blocks x {block_size}): lower --max_model_len or raise "
                     "--num_device_blocks")
  return min(model_len, pool)


def check_lengths(req: ParsedRequest, prompt_len: int, max_model_len: int) -> int:
  """Checks the prompt and max_tokens against the context; returns the max_tokens to run with."""
  if prompt_len == 0:
    raise APIError(400, "the prompt is empty (0 tokens)", param="prompt" if req.kind == "completion"
                   else "messages")
  if prompt_len >= max_model_len:
    raise APIError(400, f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                        f"{prompt_len} tokens, which leaves no room to generate.",
                   code="context_length_exceeded", param="prompt" if req.kind == "completion" else "messages")
  if req.max_tokens is None:
    return max_model_len - prompt_len
  if prompt_len + req.max_tokens > max_model_len:
    raise APIError(400, f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                        f"{prompt_len} tokens and max_tokens is {req.max_tokens} ({prompt_len + req.max_tokens} "
                        "in all).", code="context_length_exceeded", param="max_tokens")
  return req.max_tokens


# ------------------------------------------------------------------------------------------ responses

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


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


def full_response(req: ParsedRequest, created: int, choices: Sequence[Choice], prompt_tokens: int) -> dict:
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
          "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices))}


def chunk(req: ParsedRequest, created: int, text: Optional[str], token_ids: Sequence[int],
          finish_reason: Optional[str], *, first: bool = False, index: int = 0) -> dict:
  """One streamed chunk of choice ``index`` (a text delta, possibly empty, or the final one with its finish
  reason)."""
  if req.kind == "chat":
    delta: dict = {}
    if first:
      delta["role"] = "assistant"
    if text is not None:
      delta["content"] = text
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason_out(finish_reason)}
    obj = "chat.completion.chunk"
  else:
    choice = {"index": index, "text": text or "", "logprobs": None,
              "finish_reason": finish_reason_out(finish_reason)}
    obj = "text_completion"
  if req.return_token_ids:
    choice["token_ids"] = list(token_ids)
  return {"id": req.request_id, "object": obj, "created": created, "model": req.model, "choices": [choice]}


def usage_chunk(req: ParsedRequest, created: int, prompt_tokens: int, completion_tokens: int) -> dict:
  obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
  return {"id": req.request_id, "object": obj, "created": created, "model": req.model, "choices": [],
          "usage": usage(prompt_tokens, completion_tokens)}


def sse(data: Any) -> str:
  return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"


def now_s() -> int:
  return int(time.time())
