"""The engine core's request book: admission checks, per-request state, engine stop checks and outputs.

``RequestBook`` holds every request the engine knows (``EngineRequest``), validates new ones against the
model and the device pool (``RequestError`` names what is wrong, and nothing changes), appends sampled tokens
and decides the engine's stops (eos unless ``ignore_eos``, stop token ids, stop strings), and turns what
changed since the last call into ``RequestOutput``s. The length stop (``max_tokens``, capped by the context
length at admission) is not decided here: the scheduler decides it in ``on_step_done`` and the step loop
finishes the request with it. The book never touches the device and never calls the scheduler; the step
loop (``engine/step_loop.py``), the scheduler's one caller, drives it. Host-side only; no JAX.
"""
from __future__ import annotations

import dataclasses
import itertools
import zlib
from collections import Counter
from typing import Optional, Sequence, Union

from superinfer_jax.engine.config import FINISH_STOP, CompletionOutput, RequestOutput, SamplingParams, TokenLogprobs
from superinfer_jax.engine.detokenizer import IncrementalDetokenizer
from superinfer_jax.kv.layout import blocks_for
from superinfer_jax.model.tokenizer import encode_text

PromptType = Union[str, Sequence[int]]


def derive_seed(engine_seed: int, request_id: str) -> int:
  """A 32-bit seed for a request that gave none: a stable hash of (engine seed, request id)."""
  return zlib.crc32(f"{engine_seed}:{request_id}".encode()) & 0xFFFFFFFF


class RequestError(ValueError):
  """A request was rejected at ``add_request`` (empty / too long prompt, can never fit, bad params)."""


MAX_CACHE_SALT_CHARS = 1024


def check_cache_salt(cache_salt) -> None:
  """``RequestError`` naming ``cache_salt`` unless it is None or a non-empty string of at most
  ``MAX_CACHE_SALT_CHARS`` characters."""
  if cache_salt is None:
    return
  if not isinstance(cache_salt, str) or not cache_salt or len(cache_salt) > MAX_CACHE_SALT_CHARS:
    raise RequestError(f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                       f"characters, got {cache_salt!r:.80}")


@dataclasses.dataclass
class EngineRequest:
  """Engine-side state of one request: its tokens, timestamps, stop state and the output not yet returned."""
  request_id: str
  prompt_token_ids: list[int]
  params: SamplingParams
  seed: int
  max_total_len: int             # prompt + output tokens allowed (max_tokens and context capped)
  arrival_time: float
  ttft_slo: Optional[float]
  tbt_slo: Optional[float]
  detok: Optional[IncrementalDetokenizer]
  cache_salt: Optional[str] = None  # prefix caching isolation: only requests of equal salt share KV blocks
  # Prompt tokens its first admission found in the prefix cache (None until admitted).
  num_cached_tokens: Optional[int] = None
  output_token_ids: list[int] = dataclasses.field(default_factory=list)
  timestamps: list[float] = dataclasses.field(default_factory=list)
  text: str = ""
  finish_reason: Optional[str] = None
  error: Optional[str] = None
  # Streaming cursor: outputs not yet returned by step().
  pending_tokens: list[int] = dataclasses.field(default_factory=list)
  pending_times: list[float] = dataclasses.field(default_factory=list)
  pending_text: str = ""
  pending_states: list[tuple[float, str]] = dataclasses.field(default_factory=list)
  pending_logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
  reported_final: bool = False
  # One entry per output token when ``params.logprobs`` is set, else empty.
  logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
  # Occurrences of each output token (kept only when ``params.processes_logits``: the penalties read it).
  output_counts: Counter = dataclasses.field(default_factory=Counter)
  # (temperature, top_k (0 = off), top_p, seed): the per-row sampling parameters of its steps (fixed).
  sampling: tuple[float, int, float, int] = dataclasses.field(init=False)

  def __post_init__(self):
    p = self.params
    self.sampling = (p.temperature, max(p.top_k, 0), p.top_p, self.seed)

  @property
  def finished(self) -> bool:
    return self.finish_reason is not None

  @property
  def max_tokens(self) -> int:
    """Output tokens allowed: the scheduler finishes the request ("length") when it has this many."""
    return self.max_total_len - len(self.prompt_token_ids)

  def tokens(self, start: int, stop: int) -> list[int]:
    p = len(self.prompt_token_ids)
    if stop <= p:
      return self.prompt_token_ids[start:stop]
    if start >= p:
      return self.output_token_ids[start - p:stop - p]
    return self.prompt_token_ids[start:] + self.output_token_ids[:stop - p]


@dataclasses.dataclass(frozen=True)
class ModelLimits:
  """What the request book checks requests against: vocabulary, context, eos ids and the device pool."""
  vocab_size: int
  max_model_len: int
  eos_token_ids: frozenset
  num_device_blocks: int
  block_size: int

  def blocks_for_tokens(self, n: int) -> int:
    return blocks_for(n, self.block_size)


class RequestBook:
  """Every request of one engine, by id (module docstring). ``engine_seed`` seeds requests that give none."""

  def __init__(self, limits: ModelLimits, tokenizer, clock, engine_seed: int):
    self.limits = limits
    self.tokenizer = tokenizer
    self.clock = clock
    self.engine_seed = engine_seed
    self.reqs: dict[str, EngineRequest] = {}
    self.unfinished: set[str] = set()
    self.pending_out: dict[str, None] = {}   # requests with output not yet returned (insertion order)
    self._ids = itertools.count()

  # ------------------------------------------------------------------------------------------- admission
  def new_request(self, prompt: PromptType, params: Optional[SamplingParams], *, request_id: Optional[str],
                  ttft_slo: Optional[float], tbt_slo: Optional[float],
                  arrival_time: Optional[float], cache_salt: Optional[str] = None) -> EngineRequest:
    """A validated request (``RequestError`` if bad), not in the book yet: ``add`` it once the scheduler has
    queued it. ``cache_salt``: a non-empty string of at most ``MAX_CACHE_SALT_CHARS`` characters, or None."""
    check_cache_salt(cache_salt)
    params = dataclasses.replace(params) if params is not None else SamplingParams()
    lim = self.limits
    try:
      params.validate(vocab_size=lim.vocab_size)
    except ValueError as e:
      raise RequestError(str(e)) from None
    prompt_ids = self._prompt_ids(prompt)
    if params.stop and self.tokenizer is None:
      raise RequestError("stop strings need a tokenizer")
    for slo in (ttft_slo, tbt_slo):
      if slo is not None and not slo > 0:
        raise RequestError(f"SLOs must be > 0 seconds, got {slo!r}")
    max_total = min(len(prompt_ids) + params.max_tokens, lim.max_model_len)
    need = lim.blocks_for_tokens(max_total - 1)   # the last sampled token is never fed back
    if need > lim.num_device_blocks:
      raise RequestError(f"request needs up to {need} KV blocks ({max_total - 1} tokens) but the device pool has "
                         f"only {lim.num_device_blocks}: it can never run")
    request_id = self._new_id(request_id)
    seed = params.seed if params.seed is not None else derive_seed(self.engine_seed, request_id)
    now = self.clock.now() if arrival_time is None else arrival_time
    detok = (IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop)
             if self.tokenizer is not None else None)
    return EngineRequest(request_id=request_id, prompt_token_ids=prompt_ids, params=params, seed=seed,
                         max_total_len=max_total, arrival_time=now, ttft_slo=ttft_slo, tbt_slo=tbt_slo,
                         detok=detok, cache_salt=cache_salt)

  def add(self, r: EngineRequest) -> None:
    """Puts a request made by ``new_request`` (and queued by the scheduler) in the book, unfinished."""
    if r.request_id in self.reqs:
      raise RequestError(f"duplicate request id {r.request_id!r}")
    self.reqs[r.request_id] = r
    self.unfinished.add(r.request_id)

  def _prompt_ids(self, prompt: PromptType) -> list[int]:
    lim = self.limits
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise RequestError("text prompt given but the engine has no tokenizer; pass token ids")
      prompt_ids = encode_text(self.tokenizer, prompt)
    else:
      try:
        prompt_ids = [int(t) for t in prompt]
      except (TypeError, ValueError):
        raise RequestError(f"prompt must be a string or a sequence of token ids, got {type(prompt)}") from None
    if not prompt_ids:
      raise RequestError("empty prompt")
    bad = [t for t in prompt_ids if not 0 <= t < lim.vocab_size]
    if bad:
      raise RequestError(f"prompt token ids {bad[:5]} out of the vocabulary [0, {lim.vocab_size})")
    if len(prompt_ids) >= lim.max_model_len:
      raise RequestError(f"prompt of {len(prompt_ids)} tokens leaves no room to generate within the model's "
                         f"context of {lim.max_model_len} tokens")
    return prompt_ids

  def _new_id(self, request_id: Optional[str]) -> str:
    if request_id is None:
      request_id = f"req-{next(self._ids)}"
      while request_id in self.reqs:
        request_id = f"req-{next(self._ids)}"
    elif request_id in self.reqs:
      raise RequestError(f"duplicate request id {request_id!r}")
    return request_id

  # ----------------------------------------------------------------------------------------- lifecycle
  def get(self, request_id: str) -> CompletionOutput:
    """The accumulated result of a request (finished or not); ``KeyError`` if unknown or released."""
    r = self.reqs[request_id]
    return CompletionOutput(request_id=r.request_id, prompt_token_ids=list(r.prompt_token_ids),
                            token_ids=list(r.output_token_ids), text=r.text, finish_reason=r.finish_reason,
                            timestamps=list(r.timestamps), arrival_time=r.arrival_time,
                            logprobs=list(r.logprobs) if r.params.logprobs is not None else None,
                            num_cached_tokens=r.num_cached_tokens)

  def record_cached(self, request_id: str, num_cached_tokens: int) -> None:
    """Records the prompt tokens a request's first admission found cached (later admissions are ignored)."""
    r = self.reqs.get(request_id)
    if r is not None and r.num_cached_tokens is None:
      r.num_cached_tokens = num_cached_tokens

  def record_state(self, request_id: str, t: float, state: str) -> None:
    """Queues a scheduling state change (``RequestOutput.state_changes``) of an unfinished request."""
    r = self.reqs.get(request_id)
    if r is not None and not r.finished:
      r.pending_states.append((t, state))
      self.pending_out[request_id] = None

  def append_token(self, r: EngineRequest, tok: int, now: float, logprobs=None) -> Optional[str]:
    """Appends a sampled token; returns ``FINISH_STOP`` if it stops the request (eos, a stop id, a stop
    string), else None: the length stop is the scheduler's (module docstring). ``logprobs``: the step's row
    ``(values [1 + k], ids [k])`` when the step computed logprobs (kept only if the request asked)."""
    r.output_token_ids.append(tok)
    if r.params.processes_logits:
      r.output_counts[tok] += 1
    if r.params.logprobs is not None:
      if logprobs is None:
        raise RuntimeError(f"request {r.request_id!r} asked for logprobs but its step computed none")
      entry = TokenLogprobs.of_row(logprobs[0], logprobs[1], r.params.logprobs)
      r.logprobs.append(entry)
      r.pending_logprobs.append(entry)
    r.timestamps.append(now)
    r.pending_tokens.append(tok)
    r.pending_times.append(now)
    self.pending_out[r.request_id] = None
    if r.detok is not None:
      r.pending_text += r.detok.add_token(tok)
      r.text = r.detok.text
      if r.detok.stopped:
        return FINISH_STOP
    p = r.params
    if not p.ignore_eos and tok in self.limits.eos_token_ids:
      return FINISH_STOP
    if tok in p.stop_token_ids:
      return FINISH_STOP
    return None

  def finish(self, r: EngineRequest, reason: str) -> None:
    """Marks ``r`` finished with ``reason`` (idempotent); its final output comes with the next ``outputs()``."""
    if r.finished:
      return
    r.finish_reason = reason
    self.pending_out[r.request_id] = None
    if r.detok is not None:
      r.pending_text += r.detok.flush()
      r.text = r.detok.text
    self.unfinished.discard(r.request_id)

  def outputs(self) -> list[RequestOutput]:
    """One ``RequestOutput`` per request with tokens, text or state changes not yet returned, in the order they
    first had some; a finished request's last one has ``finished=True`` and it gets none after."""
    outs = []
    pending, self.pending_out = self.pending_out, {}
    for rid in pending:
      r = self.reqs[rid]
      if r.reported_final:
        continue
      outs.append(RequestOutput(request_id=r.request_id, token_ids=r.pending_tokens, text=r.pending_text,
                                timestamps=r.pending_times, finished=r.finished,
                                finish_reason=r.finish_reason, prompt_token_ids=r.prompt_token_ids,
                                error=r.error, state_changes=r.pending_states,
                                logprobs=r.pending_logprobs if r.params.logprobs is not None else None,
                                num_cached_tokens=r.num_cached_tokens))
      r.pending_tokens, r.pending_times, r.pending_text, r.pending_states = [], [], "", []
      r.pending_logprobs = []
      if r.finished:
        r.reported_final = True
    return outs
