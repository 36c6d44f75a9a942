"""Per-request sampling and stopping parameters: the one definition of ``SamplingParams``.

It lives below ``parallel/`` and ``engine/`` because both carry it: ``parallel/events.py`` encodes it on
the wire between processes, the engine samples with it. ``engine.config`` re-exports it. No JAX import.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional, Sequence, Union

MAX_LOGPROBS = 20   # the most top logprobs a request may ask for per token (OpenAI's top_logprobs limit)


@dataclasses.dataclass
class SamplingParams:
  """Per-request sampling and stopping parameters (OpenAI / vLLM meanings).

  temperature 0 is greedy. top_k 0 (or -1) disables top-k; top_p 1 disables top-p. ``seed`` None: the
  engine derives one from its own seed and the request id (still reproducible run to run).
  Stop strings are searched in the detokenized output; the text is cut before the stop string and the
  finish reason is "stop" (token ids still include the token that completed the stop string).

  Logit processing (vLLM v1's order, applied to the raw logits before temperature / top-k / top-p, greedy
  included): ``logit_bias`` (token id -> value in [-100, 100], added), then ``repetition_penalty`` (> 0; on every
  token of the prompt or the output so far: a positive logit divided by it, a non-positive one multiplied; 1 is
  off), then ``frequency_penalty`` x (times the token occurs in the output so far) and ``presence_penalty`` x
  (1 if it occurs at all) subtracted (each in [-2, 2]; 0 is off). ``logit_bias`` normalises to a sorted tuple
  of ``(token_id, bias)`` pairs (a mapping or pairs go in).

  ``logprobs``: None -> none; k in [0, ``MAX_LOGPROBS``] -> each output token comes with its log-probability
  and the k most likely tokens with theirs, all from the log-softmax of the raw model logits (before logit
  processing and temperature: vLLM's ``raw_logprobs``).
  """
  max_tokens: int = 16
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0
  seed: Optional[int] = None
  stop_token_ids: Sequence[int] = ()
  stop: Sequence[str] = ()
  ignore_eos: bool = False
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0
  logit_bias: Union[Mapping[int, float], Sequence[tuple[int, float]]] = ()
  logprobs: Optional[int] = None

  @property
  def processes_logits(self) -> bool:
    """Whether any logit processing (bias or a penalty) is on: such a request's steps carry its token counts."""
    return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0 \
        or self.repetition_penalty != 1

  def validate(self, vocab_size: Optional[int] = None) -> "SamplingParams":
    """Raises ``ValueError`` naming the bad field; normalises sequences to tuples; returns self."""
    if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
      raise ValueError(f"SamplingParams.max_tokens must be an int >= 1, got {self.max_tokens!r}")
    if (not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature)
        or self.temperature < 0):
      raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature!r}")
    if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
    if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
      raise ValueError(f"SamplingParams.top_k must be an int >= -1 (0 or -1 = off), got {self.top_k!r}")
    if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                  or not 0 <= self.seed < 2**32):
      raise ValueError(f"SamplingParams.seed must be None or an int in [0, 2**32), got {self.seed!r}")
    if isinstance(self.stop, str):
      self.stop = (self.stop,)
    self.stop = tuple(self.stop)
    for s in self.stop:
      if not isinstance(s, str) or not s:
        raise ValueError(f"SamplingParams.stop entries must be non-empty strings, got {s!r}")
    self.stop_token_ids = tuple(self.stop_token_ids)
    for t in self.stop_token_ids:
      if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
        raise ValueError(f"SamplingParams.stop_token_ids entry {t!r} is not a token id"
                         + (f" in [0, {vocab_size})" if vocab_size is not None else ""))
    self._validate_logit_processing(vocab_size)
    return self

  def _validate_logit_processing(self, vocab_size: Optional[int]) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
        raise ValueError(f"SamplingParams.{name} must be a number in [-2, 2], got {v!r}")
    r = self.repetition_penalty
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not (math.isfinite(r) and r > 0):
      raise ValueError(f"SamplingParams.repetition_penalty must be a finite number > 0, got {r!r}")
    bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
    pairs = {}
    for entry in bias:
      try:
        tok, val = entry
        tok = int(tok) if isinstance(tok, str) and tok.strip().lstrip("-").isdigit() else tok
      except (TypeError, ValueError):
        raise ValueError(f"SamplingParams.logit_bias entries must be (token id, bias) pairs, got {entry!r}") from None
      if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0 or (vocab_size is not None and tok >= vocab_size):
        raise ValueError(f"SamplingParams.logit_bias key {tok!r} is not a token id"
                         + (f" in [0, {vocab_size})" if vocab_size is not None else ""))
      if isinstance(val, bool) or not isinstance(val, (int, float)) or not -100.0 <= val <= 100.0:
        raise ValueError(f"SamplingParams.logit_bias value for token {tok} must be a number in [-100, 100], "
                         f"got {val!r}")
      pairs[tok] = float(val)
    self.logit_bias = tuple(sorted(pairs.items()))
    k = self.logprobs
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
      raise ValueError(f"SamplingParams.logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {k!r}")
