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
is a 400 ``unsupported_parameter`` naming the field. The parsing itself is ``request_parsing.py``; the
response bodies and stream chunks are ``responses.py``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from superinfer_jax.engine.request_book import MAX_CACHE_SALT_CHARS

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
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0
  logit_bias: tuple[tuple[int, float], ...] = ()
  cache_salt: Optional[str] = None        # prefix caching isolation: only requests of equal salt share blocks


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
    "logprobs": ("both", "completions: int 0..20, chat: bool; each sampled token's log-probability under "
                         "the model (log-softmax of the raw logits, before bias, penalties, temperature, "
                         "top-k and top-p, as vLLM's raw_logprobs), computed in the engine's step; streamed "
                         "too (in each chunk)"),
    "top_logprobs": ("chat", "0..20 alternatives per token with logprobs=true"),
    "return_token_ids": ("both", "each choice / chunk also carries its token_ids"),
    "ttft_slo": ("both", "TTFT SLO in seconds, handed to the scheduler"),
    "tbt_slo": ("both", "TBT SLO in seconds, handed to the scheduler"),
    "user": ("both", "accepted, not used (an end-user id for abuse monitoring at OpenAI)"),
    "cache_salt": ("both", f"a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters (vLLM's): only "
                           "requests with the same salt share prefix-cached KV blocks (docs/prefix_caching.md)"),
    "echo": ("completion", "refused unless false"),
    "suffix": ("completion", "refused unless null or \"\""),
    "best_of": ("completion", "refused unless null or equal to n"),
    "presence_penalty": ("both", "[-2, 2]: subtracted from the logit of every token already in the output"),
    "frequency_penalty": ("both", "[-2, 2]: times the token's count in the output, subtracted from its logit"),
    "repetition_penalty": ("both", "> 0 (1 = off): a logit of a token seen in the prompt or output is "
                                   "divided by it when positive, multiplied when negative (vLLM's)"),
    "logit_bias": ("both", "{token id: bias in [-100, 100]} added to the logits, before the penalties"),
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
    "response_format": (({"type": "text"},), "only response_format {\"type\": \"text\"} is supported"),
    "tools": (([],), "tool calling is not supported"),
    "tool_choice": (("none",), "tool calling is not supported"),
    "parallel_tool_calls": ((), "tool calling is not supported"),
    "functions": (([],), "function calling is not supported"),
    "function_call": (("none",), "function calling is not supported"),
}


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
