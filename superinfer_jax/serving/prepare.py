"""From HTTP body to engine input: ``read_body`` (bounded) and ``RequestPreparer`` (parse, validate, render the
chat template, tokenize, build ``SamplingParams``). The preparer is pure CPU work and runs in a thread pool,
never on the event loop; ``read_body`` runs on the loop but only awaits the client."""
from __future__ import annotations

from typing import Any, Sequence

from fastapi import Request

from superinfer_jax.engine.config import SamplingParams
from superinfer_jax.model.tokenizer import encode_text
from superinfer_jax.serving import protocol as P
from superinfer_jax.serving.chat import ChatTemplateError, render_chat
from superinfer_jax.serving.request_parsing import parse_json_body, parse_request


async def read_body(request: Request, max_body_bytes: int) -> bytes:
  """The body, or a 413 (``protocol.APIError``) once it exceeds ``max_body_bytes`` (the rest is read and
  dropped, so the client gets the answer rather than a connection reset, unless it announced more than 64x
  the limit)."""
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


class RequestPreparer:
  """Turns a raw body into ``(ParsedRequest, prompt token ids, SamplingParams)`` for the served models
  ``names`` over ``tokenizer`` (None: token-id prompts only), a vocabulary of ``vocab_size`` and a context of
  ``max_model_len`` tokens. Every refusal is a ``protocol.APIError`` naming the field."""

  def __init__(self, names: Sequence[str], tokenizer: Any, vocab_size: int, max_model_len: int):
    self.names, self.tokenizer = list(names), tokenizer
    self.vocab_size, self.max_model_len = vocab_size, max_model_len

  def __call__(self, raw: bytes, kind: str):
    req, messages = parse_request(parse_json_body(raw), kind, self.names)
    if kind == "chat":
      prompt_ids = self._chat_prompt(messages)
    elif isinstance(req.prompt, str):
      if self.tokenizer is None:
        raise P.APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
      prompt_ids = encode_text(self.tokenizer, req.prompt)
    else:
      prompt_ids = req.prompt
      bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
      if bad:
        raise P.APIError(400, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                         param="prompt")
    max_tokens = P.check_lengths(req, len(prompt_ids), self.max_model_len)
    if req.stop and self.tokenizer is None:
      raise P.APIError(400, "stop strings need a tokenizer", param="stop")
    try:
      params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                              top_k=req.top_k, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
                              ignore_eos=req.ignore_eos, presence_penalty=req.presence_penalty,
                              frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                              logit_bias=req.logit_bias, logprobs=req.logprobs,
                              ).validate(vocab_size=self.vocab_size)
    except ValueError as e:   # "SamplingParams.<field> ...": the field is the request's of the same name
      msg = str(e)
      field = msg.split(" ", 1)[0].removeprefix("SamplingParams.") if msg.startswith("SamplingParams.") else None
      raise P.APIError(400, msg.removeprefix("SamplingParams."), param=field) from None
    return req, prompt_ids, params

  def _chat_prompt(self, messages) -> list[int]:
    """The chat template's text of ``messages``, tokenized (no second BOS when the template wrote one)."""
    tok = self.tokenizer
    if tok is None:
      raise P.APIError(400, "this model has no tokenizer: chat needs one (use /v1/completions with token ids)",
                       param="messages")
    try:
      text = render_chat(tok, messages)
    except ChatTemplateError as e:
      raise P.APIError(400, str(e), param="messages") from None
    bos_id = getattr(tok, "bos_id", None)
    bos_text = tok.backend.id_to_token(bos_id) if bos_id is not None else None
    if bos_text and text.startswith(bos_text):
      return tok.encode(text, add_bos=False)
    return encode_text(tok, text)
