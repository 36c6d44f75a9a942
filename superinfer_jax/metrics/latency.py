"""Latency metrics and SLO attainment from per-request timelines, as vLLM's serving benchmark defines them.

Definitions (all times in seconds; ``RequestTimeline`` in ``timeline.py``):
  * TTFT = first token time - arrival.
  * TBT  = every gap between consecutive token timestamps of a request, pooled over requests (vLLM's ITL,
    SuperInfer's TBT). A rotation that parks a request on host shows up as one long gap.
  * Worst TBT (per request) = a request's largest gap; ``tbt_worst_*`` summarise it over the finished
    requests that have a gap (P99 over requests of the worst gap: one stall per request counts once,
    not as one gap among millions).
  * TPOT = (E2E - TTFT) / (output_len - 1); undefined (excluded) for 1-output-token requests.
  * E2E  = last token time - arrival.
  * Percentiles: ``numpy.percentile`` with linear interpolation (what vLLM reports); mean/P50/P90/P99.
    Empty samples give None (never NaN, so rows stay strict JSON).

Which requests count:
  * Latency distributions (TTFT, TBT, TPOT, E2E) use FINISHED requests only (vLLM uses successful ones).
  * ``ttft_attainment`` = #{finished requests with TTFT <= ttft_slo} / num_requests.
  * ``tbt_attainment``  = #{pooled TBT gaps <= tbt_slo} / #{pooled gaps} (gaps of finished requests;
    1.0 when there are no gaps — nothing violated).
  * ``tbt_request_attainment`` = #{finished requests all of whose gaps are <= tbt_slo} / num_requests
    (every gap, not a fraction of them: the paper does not say which; a request without gaps passes).
  * ``slo_attainment``  = #{finished requests with TTFT <= ttft_slo and TPOT <= tbt_slo} / num_requests.
    A 1-output-token request has no TPOT; it passes the TPOT condition vacuously and is judged on TTFT
    alone (vLLM's goodput treats its TPOT as 0 — same outcome).
  * Requests that did not finish count in ``num_requests`` and fail every per-request attainment.
  * Comparisons are ``<=`` (a request exactly at the SLO meets it).
Throughput: ``output_throughput_tok_s`` = sum(output_len of finished requests) / duration_s;
``request_throughput_req_s`` = num_finished / duration_s; duration_s defaults to
(last token time over all requests) - (first arrival).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from superinfer_jax.metrics.timeline import RequestTimeline

PERCENTILES = (50, 90, 99)


def summarize(values: Sequence[float] | np.ndarray, prefix: str,
              percentiles: Sequence[int] = PERCENTILES) -> dict[str, float | None]:
  """``{prefix_mean_s, prefix_p50_s, ...}`` of ``values`` (s); all None when empty."""
  x = np.asarray(values, dtype=np.float64)
  out: dict[str, float | None] = {f"{prefix}_mean_s": float(x.mean()) if x.size else None}
  for p in percentiles:
    out[f"{prefix}_p{p}_s"] = float(np.percentile(x, p)) if x.size else None
  return out


def latency_samples(timelines: Sequence[RequestTimeline]) -> dict[str, np.ndarray]:
  """Per-metric samples (s) over finished requests: 'ttft', 'tbt' (pooled gaps), 'tbt_worst' (each
  request's largest gap, requests with a gap only), 'tpot', 'e2e'."""
  fin = [t for t in timelines if t.finished]
  gaps = [t.tbt_gaps_s() for t in fin]
  return {
      "ttft": np.array([t.ttft_s for t in fin], dtype=np.float64),
      "tbt": np.concatenate(gaps) if gaps else np.zeros(0),
      "tbt_worst": np.array([float(np.max(g)) for g in gaps if len(g)], dtype=np.float64),
      "tpot": np.array([t.tpot_s for t in fin if t.tpot_s is not None], dtype=np.float64),
      "e2e": np.array([t.e2e_s for t in fin], dtype=np.float64),
  }


def request_meets_slo(t: RequestTimeline, ttft_slo_s: float, tbt_slo_s: float) -> bool:
  """Finished, TTFT <= ttft_slo_s and (TPOT <= tbt_slo_s, or a 1-output-token request)."""
  if not t.finished or t.ttft_s > ttft_slo_s:
    return False
  tpot = t.tpot_s
  return tpot is None or tpot <= tbt_slo_s


def compute_metrics(timelines: Sequence[RequestTimeline], *, ttft_slo_s: float, tbt_slo_s: float,
                    duration_s: float | None = None) -> dict[str, Any]:
  """All latency/attainment/throughput metrics of one run (see the module docstring).

  Returns keys: num_requests, num_finished, ttft|tbt|tbt_worst|tpot|e2e _{mean,p50,p90,p99}_s,
  ttft_attainment, tbt_attainment, tbt_request_attainment, slo_attainment, num_tbt_gaps, total_output_tokens, duration_s,
  output_throughput_tok_s, request_throughput_req_s, num_rotations_observed, num_preemptions_observed.
  """
  n = len(timelines)
  fin = [t for t in timelines if t.finished]
  s = latency_samples(timelines)
  out: dict[str, Any] = {"num_requests": n, "num_finished": len(fin)}
  for name in ("ttft", "tbt", "tbt_worst", "tpot", "e2e"):
    out.update(summarize(s[name], name))
  out["ttft_attainment"] = float(np.sum(s["ttft"] <= ttft_slo_s)) / n if n else 0.0
  out["tbt_attainment"] = float(np.mean(s["tbt"] <= tbt_slo_s)) if s["tbt"].size else 1.0
  # every finished request has a worst gap <= tbt_slo iff all its gaps are; gapless ones pass
  gapless = len(fin) - s["tbt_worst"].size
  out["tbt_request_attainment"] = ((gapless + float(np.sum(s["tbt_worst"] <= tbt_slo_s))) / n if n else 0.0)
  out["slo_attainment"] = (sum(request_meets_slo(t, ttft_slo_s, tbt_slo_s) for t in fin) / n
                           if n else 0.0)
  out["num_tbt_gaps"] = int(s["tbt"].size)
  total_out = int(sum(t.output_len for t in fin))
  out["total_output_tokens"] = total_out
  if duration_s is None:
    last = [t.token_times_s[-1] for t in timelines if t.token_times_s]
    duration_s = (max(last) - min(t.arrival_s for t in timelines)) if last else 0.0
  out["duration_s"] = float(duration_s)
  out["output_throughput_tok_s"] = total_out / duration_s if duration_s > 0 else 0.0
  out["request_throughput_req_s"] = len(fin) / duration_s if duration_s > 0 else 0.0
  out["num_rotations_observed"] = int(sum(t.num_rotations for t in timelines))
  out["num_preemptions_observed"] = int(sum(t.num_preemptions for t in timelines))
  return out
