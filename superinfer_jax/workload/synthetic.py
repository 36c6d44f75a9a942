"""Synthetic workloads with given prompt/output length distributions (token counts).

A ``LengthDist`` draws integer lengths (tokens), clipped to ``[lo, hi]`` (``lo >= 1``):

  * ``fixed:N``                     always N;
  * ``uniform:LO,HI``               integers uniform in [LO, HI] (inclusive);
  * ``lognormal:MEAN,SIGMA[,LO,HI]``  round(exp(N(mu, SIGMA))) with mu chosen so the (unclipped) mean is
                                    MEAN tokens: mu = ln(MEAN) - SIGMA^2 / 2;
  * ``normal:MEAN,STD[,LO,HI]``     round(N(MEAN, STD));
  * ``choice:A,B,C``                uniform over the listed values.

The same strings parse with ``LengthDist.parse`` (for ``--dataset=synthetic`` style flags). Prompts are
random token ids (uniform in ``[token_id_lo, vocab_size)``); the text is ``tokenizer.decode(ids)`` when a
tokenizer with ``decode`` is given, else "". Everything is drawn from ``numpy.random.default_rng(seed)``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from superinfer_jax.workload.types import RequestSpec, Workload

KINDS = ("fixed", "uniform", "lognormal", "normal", "choice")


@dataclasses.dataclass(frozen=True)
class LengthDist:
  """A distribution over token lengths. ``params`` depend on ``kind`` (see the module docstring)."""
  kind: str
  params: tuple[float, ...]
  lo: int = 1
  hi: int | None = None

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"unknown length distribution {self.kind!r}; use one of {KINDS}")
    want = {"fixed": 1, "uniform": 2, "lognormal": 2, "normal": 2}.get(self.kind)
    if want is not None and len(self.params) != want:
      raise ValueError(f"{self.kind} takes {want} parameters, got {self.params}")
    if self.kind == "choice" and not self.params:
      raise ValueError("choice needs at least one value")
    if self.lo < 1 or (self.hi is not None and self.hi < self.lo):
      raise ValueError(f"bad bounds lo={self.lo} hi={self.hi}")

  @classmethod
  def parse(cls, spec: str) -> "LengthDist":
    """'fixed:128', 'uniform:32,512', 'lognormal:256,1.0', 'lognormal:256,1.0,4,2048', 'choice:8,64'."""
    kind, _, rest = spec.partition(":")
    vals = [float(v) for v in rest.split(",") if v.strip()]
    kind = kind.strip().lower()
    if kind in ("lognormal", "normal") and len(vals) == 4:
      return cls(kind, tuple(vals[:2]), lo=int(vals[2]), hi=int(vals[3]))
    return cls(kind, tuple(vals))

  def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` lengths (int64 tokens), each within [lo, hi]."""
    p = self.params
    if self.kind == "fixed":
      x = np.full(n, p[0])
    elif self.kind == "uniform":
      x = rng.integers(int(p[0]), int(p[1]), size=n, endpoint=True)
    elif self.kind == "lognormal":
      mean, sigma = p
      x = np.rint(rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma, size=n))
    elif self.kind == "normal":
      x = np.rint(rng.normal(p[0], p[1], size=n))
    else:
      x = rng.choice(np.asarray(p), size=n)
    return np.clip(x, self.lo, self.hi if self.hi is not None else None).astype(np.int64)


def _as_dist(d: LengthDist | str | int) -> LengthDist:
  if isinstance(d, LengthDist):
    return d
  if isinstance(d, (int, np.integer)):
    return LengthDist("fixed", (float(d),))
  return LengthDist.parse(d)


def synthetic_workload(num_requests: int, prompt_len: LengthDist | str | int,
                       output_len: LengthDist | str | int, *, seed: int = 0, vocab_size: int = 32000,
                       token_id_lo: int = 1, tokenizer: Any = None,
                       max_total_len: int | None = None, name: str = "synthetic") -> Workload:
  """``num_requests`` requests with lengths drawn from the given distributions (tokens).

  Args:
    num_requests: number of requests.
    prompt_len, output_len: a LengthDist, a spec string for ``LengthDist.parse``, or an int (fixed).
    seed: the RNG seed; same arguments -> the same workload.
    vocab_size: prompt token ids are drawn uniformly from [token_id_lo, vocab_size).
    token_id_lo: lowest id drawn (skip special ids such as 0).
    tokenizer: optional; if it has ``decode(list[int]) -> str`` the prompt text is filled in.
    max_total_len: if set, output_len is cut so prompt_len + output_len <= max_total_len (prompt_len is
      cut to max_total_len - 1 first), so every request fits the model's context.
    name: the workload's name.
  """
  rng = np.random.default_rng(seed)
  p = _as_dist(prompt_len).sample(rng, num_requests)
  o = _as_dist(output_len).sample(rng, num_requests)
  if max_total_len is not None:
    p = np.minimum(p, max_total_len - 1)
    o = np.maximum(np.minimum(o, max_total_len - p), 1)
  decode = getattr(tokenizer, "decode", None)
  reqs = []
  for i in range(num_requests):
    ids = tuple(int(t) for t in rng.integers(token_id_lo, vocab_size, size=int(p[i])))
    text = decode(list(ids)) if decode is not None else ""
    reqs.append(RequestSpec(request_id=str(i), prompt=text, prompt_len=int(p[i]), output_len=int(o[i]),
                            prompt_token_ids=ids, source="synthetic"))
  return Workload(reqs, name)
