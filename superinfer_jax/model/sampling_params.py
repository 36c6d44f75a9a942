"""Per-request sampling and stopping parameters: the one definition of ``SamplingParams``.

It lives below ``parallel/`` and ``engine/`` because both carry it: ``parallel/events.py`` encodes it on
the wire between processes, the engine samples with it. ``engine.config`` re-exports it. No JAX import.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence


@dataclasses.dataclass
class SamplingParams:
  """Per-request sampling and stopping parameters (OpenAI / vLLM meanings).

  temperature 0 is greedy. top_k 0 (or -1) disables top-k; top_p 1 disables top-p. ``seed`` None: the
  engine derives one from its own seed and the request id (still reproducible run to run).
  Stop strings are searched in the detokenized output; the text is cut before the stop string and the
  finish reason is "stop" (token ids still include the token that completed the stop string).
  """
  max_tokens: int = 16
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0
  seed: Optional[int] = None
  stop_token_ids: Sequence[int] = ()
  stop: Sequence[str] = ()
  ignore_eos: bool = False

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
    return self
