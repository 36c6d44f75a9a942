"""Parsing and validating an OpenAI request body into a ``protocol.ParsedRequest`` (no HTTP, no JAX).

``parse_json_body`` (bytes -> JSON object) and ``parse_request`` (the object -> ``(ParsedRequest, messages)``);
every refusal is a ``protocol.APIError`` naming the field (the table in ``protocol``'s docstring).
"""
from __future__ import annotations

import json
import math
import uuid
from typing import Any, Optional, Sequence

from superinfer_jax.engine.request_book import RequestError, check_cache_salt
from superinfer_jax.model.sampling_params import MAX_LOGPROBS
from superinfer_jax.serving.protocol import FIELDS, REFUSED, APIError, ParsedRequest


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


def _parse_logit_processing(body: dict) -> dict[str, Any]:
  """presence / frequency / repetition penalties (numbers) and ``logit_bias`` (``{"token id": bias}`` -> sorted
  ``(id, bias)`` pairs), type-checked here; their ranges are ``SamplingParams.validate``'s (``prepare.py``
  answers its ``ValueError`` with a 400 naming the field). The engine applies them to the raw logits."""
  out: dict[str, Any] = {name: _get_float(body, name, default) for name, default in (
      ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0))}
  bias = body.get("logit_bias")
  if bias is None:
    bias = {}
  if not isinstance(bias, dict):
    raise _type_error("logit_bias", "an object {token id: bias}", bias)
  pairs = {}
  for key, v in bias.items():
    try:
      pairs[int(key)] = v
    except ValueError:
      raise APIError(400, f"'logit_bias' key {key!r} is not a token id", param="logit_bias") from None
  out["logit_bias"] = tuple(sorted(pairs.items()))
  return out


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


def _parse_model(body: dict, served_model_names: Sequence[str]) -> str:
  """The served model named by ``model`` (default: the first served name); 404 for another."""
  model = body.get("model")
  if model is None:
    model = served_model_names[0]
  if not isinstance(model, str):
    raise _type_error("model", "a string", model)
  if model not in served_model_names:
    raise APIError(404, f"The model '{model}' does not exist (served: {', '.join(served_model_names)})",
                   code="model_not_found", param="model")
  return model


def _parse_max_tokens(body: dict, kind: str) -> Optional[int]:
  """``max_tokens`` (chat: ``max_completion_tokens`` first; completions default 16, OpenAI's); None: the rest
  of the context (chat without either)."""
  max_tokens = _get_int(body, "max_tokens", None)
  if kind == "chat":
    mct = _get_int(body, "max_completion_tokens", None)
    max_tokens = mct if mct is not None else max_tokens
  elif max_tokens is None:
    max_tokens = 16
  if max_tokens is not None and max_tokens <= 0:
    raise APIError(400, f"'max_tokens' must be >= 1, got {max_tokens}", param="max_tokens")
  return max_tokens


def _parse_sampling(body: dict) -> dict[str, Any]:
  """temperature, top_p, top_k, seed and n, each range-checked."""
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
  return dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, n=n)


def _parse_stops(body: dict) -> tuple[tuple[str, ...], tuple[int, ...]]:
  """(stop strings: at most 16, non-empty; stop token ids: non-negative ints)."""
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
  return stop, tuple(stop_token_ids)


def _parse_stream(body: dict) -> tuple[bool, bool]:
  """(stream, include_usage from ``stream_options``)."""
  stream = _get_bool(body, "stream", False)
  so = body.get("stream_options")
  if so is not None and not isinstance(so, dict):
    raise _type_error("stream_options", "an object", so)
  return stream, bool(so and so.get("include_usage"))


def _parse_slos(body: dict) -> dict[str, Optional[float]]:
  """The request's own ``ttft_slo`` / ``tbt_slo`` (seconds, > 0; None: the server's)."""
  slos = {}
  for name in ("ttft_slo", "tbt_slo"):
    v = _get_float(body, name, None)
    if v is not None and not v > 0:
      raise APIError(400, f"'{name}' must be > 0 seconds, got {v}", param=name)
    slos[name] = v
  return slos


def _parse_cache_salt(body: dict) -> Optional[str]:
  """``cache_salt`` (vLLM's): None or a string the engine's ``check_cache_salt`` accepts, checked here so the
  400 names the field."""
  salt = _get_str(body, "cache_salt")
  try:
    check_cache_salt(salt)
  except RequestError as e:
    raise APIError(400, str(e), param="cache_salt") from None
  return salt


def parse_request(body: dict, kind: str, served_model_names: Sequence[str]) -> tuple[ParsedRequest, Any]:
  """Validates ``body`` of a /v1/completions (``kind="completion"``) or /v1/chat/completions
  (``kind="chat"``) request. Returns (ParsedRequest with prompt None for chat, messages or None)."""
  _check_fields(body, kind)
  model = _parse_model(body, served_model_names)
  messages = _parse_messages(body) if kind == "chat" else None
  prompt = None if kind == "chat" else _parse_prompt(body)
  max_tokens = _parse_max_tokens(body, kind)
  sampling = _parse_sampling(body)
  processing = _parse_logit_processing(body)
  logprobs = _parse_logprobs(body, kind)
  stop, stop_token_ids = _parse_stops(body)
  stream, include_usage = _parse_stream(body)
  ignore_eos = _get_bool(body, "ignore_eos", False)
  _get_str(body, "user")
  return_token_ids = _get_bool(body, "return_token_ids", False)
  slos = _parse_slos(body)
  cache_salt = _parse_cache_salt(body)
  prefix = "chatcmpl" if kind == "chat" else "cmpl"
  req = ParsedRequest(kind=kind, model=model, prompt=prompt, stream=stream, include_usage=include_usage,
                      max_tokens=max_tokens, stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                      return_token_ids=return_token_ids, request_id=f"{prefix}-{uuid.uuid4().hex[:24]}",
                      logprobs=logprobs, cache_salt=cache_salt, **sampling, **processing, **slos)
  return req, messages
