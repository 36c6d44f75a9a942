"""Arrival processes: Poisson at a given rate, and Gamma-renewal with burstiness in two named conventions.

All functions return ``n`` non-decreasing arrival times in seconds (float64 numpy), drawn from
``numpy.random.default_rng(seed)``: the same arguments always give the same times.

Inter-arrival gaps are i.i.d. Gamma(shape k, scale theta) with mean ``k * theta = 1 / rps`` in both
conventions; they differ in what "burstiness" b means:

  * ``VLLM`` (vLLM ``benchmarks/benchmark_serving.py``, ``--burstiness``): ``k = b``,
    ``theta = 1 / (rps * b)``. Squared coefficient of variation of the gaps CV^2 = 1 / b: b < 1 is
    burstier than Poisson, b > 1 more regular, b = 1 is Poisson.
  * ``SUPERINFER`` (SuperInfer ``benchmarks/superinfer/sampler.py``, ``src="gamma"``): ``k = 1 / b``,
    ``theta = 1 / (rps * k) = b / rps``. CV^2 = b: b > 1 is burstier, b = 1 is Poisson. The paper's runs
    use b = 1 with client seed 42 (docs/paper.md §5).

So vLLM burstiness b is SuperInfer burstiness 1 / b. Timing of the first request: vLLM sends request 0
at t = 0 and sleeps a gap after each request; SuperInfer's client delays request 0 by one gap too
(``delay_last += gamma(...)`` before the first request). ``start_at_zero=True`` (default) gives vLLM's
timing (times = 0, g1, g1+g2, ...); ``False`` gives SuperInfer's (g1, g1+g2, ...). The random streams are
numpy's, not the reference clients' (which use ``np.random`` global state / ``random.Random``), so the
times are distributed the same way but are not bit-identical to theirs.

Recent vLLM versions additionally rescale the cumulative delays so the last request is sent at exactly
``n / rps``; we do not (each gap stays i.i.d.), so the realised rate over a short run fluctuates around
rps. Use the same seed for every policy at one rps so all policies see identical arrivals.

``rps = inf`` puts every arrival at t = 0 (vLLM's "send all at once").
"""
from __future__ import annotations

import math

import numpy as np

VLLM = "vllm"
SUPERINFER = "superinfer"
CONVENTIONS = (VLLM, SUPERINFER)


def gamma_shape_scale(rps: float, burstiness: float, convention: str) -> tuple[float, float]:
  """(shape k, scale theta in seconds) of the inter-arrival gap for ``convention`` (see module doc)."""
  if not rps > 0:
    raise ValueError(f"rps must be > 0, got {rps}")
  if not burstiness > 0:
    raise ValueError(f"burstiness must be > 0, got {burstiness}")
  if convention == VLLM:
    shape = burstiness
  elif convention == SUPERINFER:
    shape = 1.0 / burstiness
  else:
    raise ValueError(f"unknown gamma convention {convention!r}; use one of {CONVENTIONS}")
  return shape, 1.0 / (rps * shape)


def _cumulate(gaps: np.ndarray, start_at_zero: bool, start_s: float) -> np.ndarray:
  times = np.cumsum(gaps)
  if start_at_zero and len(times):
    times = times - times[0]
  return times + start_s


def gamma_arrivals(n: int, rps: float, burstiness: float, convention: str, *, seed: int = 0,
                   start_at_zero: bool = True, start_s: float = 0.0) -> np.ndarray:
  """``n`` arrival times (s) of a Gamma renewal process with mean rate ``rps`` (requests/s)."""
  if n < 0:
    raise ValueError(f"n must be >= 0, got {n}")
  if math.isinf(rps):
    return np.full(n, float(start_s))
  shape, scale = gamma_shape_scale(rps, burstiness, convention)
  gaps = np.random.default_rng(seed).gamma(shape, scale, size=n)
  return _cumulate(gaps, start_at_zero, start_s)


def poisson_arrivals(n: int, rps: float, *, seed: int = 0, start_at_zero: bool = True,
                     start_s: float = 0.0) -> np.ndarray:
  """``n`` arrival times (s) of a Poisson process at ``rps`` (exponential gaps, mean 1 / rps)."""
  if n < 0:
    raise ValueError(f"n must be >= 0, got {n}")
  if math.isinf(rps):
    return np.full(n, float(start_s))
  if not rps > 0:
    raise ValueError(f"rps must be > 0, got {rps}")
  gaps = np.random.default_rng(seed).exponential(1.0 / rps, size=n)
  return _cumulate(gaps, start_at_zero, start_s)


ARRIVAL_PROCESSES = ("poisson", "gamma", "uniform")


def arrival_times(n: int, rps: float, *, process: str = "poisson", burstiness: float = 1.0,
                  convention: str = VLLM, seed: int = 0, start_at_zero: bool = True) -> np.ndarray:
  """Dispatch: ``process`` is 'poisson', 'gamma' (with ``burstiness``/``convention``) or 'uniform'.

  'uniform' spaces arrivals exactly 1 / rps apart (a deterministic load, burstiness -> inf).
  """
  if process == "poisson":
    return poisson_arrivals(n, rps, seed=seed, start_at_zero=start_at_zero)
  if process == "gamma":
    return gamma_arrivals(n, rps, burstiness, convention, seed=seed, start_at_zero=start_at_zero)
  if process == "uniform":
    if math.isinf(rps):
      return np.zeros(n)
    t = np.arange(n, dtype=np.float64) / rps
    return t if start_at_zero else t + 1.0 / rps
  raise ValueError(f"unknown arrival process {process!r}")
