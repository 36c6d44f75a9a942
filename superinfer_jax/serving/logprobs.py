"""Log-probabilities of generated tokens, computed by scoring the finished sequence with the model.

The engine samples on device and returns token ids only, so the server scores ``prompt + output`` once
more (``superinfer_jax.model.score``: next-token logits for every prefix) on its own copy of the weights
(``Scorer``, loaded on first use) and reads each output token's log-probability under the model's raw
distribution (log-softmax of the logits: before temperature, top-k and top-p, as vLLM reports them).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
  x = logits.astype(np.float64)
  m = x.max(axis=-1, keepdims=True)
  return (x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))).astype(np.float32)


def token_logprobs(next_logits: np.ndarray, prompt_len: int, output_ids: Sequence[int],
                   top: int) -> list[tuple[float, list[tuple[int, float]]]]:
  """Per output token: (its logprob, the ``top`` most likely token ids with theirs, most likely first).

  ``next_logits``: ``[prompt_len + len(output_ids) - 1, vocab]``, row j the logits after token j of
  ``prompt + output`` (``score`` of the sequence without its last token)."""
  rows = log_softmax(next_logits[prompt_len - 1:prompt_len - 1 + len(output_ids)])
  out = []
  for row, tok in zip(rows, output_ids):
    alts = np.argsort(-row, kind="stable")[:top] if top else []
    out.append((float(row[tok]), [(int(a), float(row[a])) for a in alts]))
  return out


class Scorer:
  """``scorer(token_ids) -> [len, vocab]`` next-token logits of every prefix, over weights loaded from
  ``model`` on the first call (``load``: a ``() -> (cfg, params)``; thread-safe, calls serialised)."""

  def __init__(self, load: Callable[[], tuple[Any, Any]]):
    self._load = load
    self._model: Optional[tuple[Any, Any]] = None
    self._lock = threading.Lock()

  def __call__(self, token_ids: Sequence[int]) -> np.ndarray:
    with self._lock:
      from superinfer_jax.model import score  # pylint: disable=import-outside-toplevel
      if self._model is None:
        self._model = self._load()
      cfg, params = self._model
      return np.asarray(score(params, cfg, list(token_ids)))
