"""Calibration's format: the simulator's hardware profile fitted from measured step and transfer points.

The points are plain data (``StepPoint``, ``TransferPoint``); the real-run measurement that produces them (an
``LLMEngine`` timed at a grid of decode and prefill shapes, ``DuplexKV.issue()`` timed at a range of block
counts, this machine's numpy bandwidth and matmul rate) lives in ``experiment/calibrate.py``, and
``scripts/calibrate.py`` is the flag wrapper joining the two.

Fit (pure Python, ``fit_step_model`` / ``fit_link``), against the *cost model's own* formula
(``cost.step_cost``) on the batch shapes the measured steps really had (not the engine's padded buckets, so
the fitted factors absorb the padding, as the simulator needs):

  time = max(bytes / (hbm * mem_eff), flops / (peak * flop_eff)) + step_overhead

``hbm`` and ``peak`` are this machine's measured streaming bandwidth and f32 matmul rate (the ``machine``
dict of ``build_profile``); only the products ``hbm * mem_eff`` and ``peak * flop_eff`` are identifiable, so
the efficiencies are the fitted effective rates over those peaks (capped at 1, the peak raised to the fitted
rate where a fit exceeds it). The overhead is searched on a grid; for each candidate the two rates are
least-squares fits (relative error) of the points each bound claims, iterated to a fixed point. The link:
per direction ``t(N) = launch + N * block_bytes / bw`` (least squares over N), the duplex cap from the
both-ways times, and the curve's points at the naive segment (``block_bytes / 2L``) and the batched one
(``block_bytes``, block_first).

This module imports no JAX, engine or experiment code; it never measures anything.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import statistics
from typing import Any, Optional, Sequence

from superinfer_jax.sim import cost as cost_lib
from superinfer_jax.sim.profiles import profile_from_dict

GB = 1e9


# ------------------------------------------------------------------------------------------- data points
@dataclasses.dataclass(frozen=True)
class StepPoint:
  """One measured step: what it ran (``kind``, batch, context) and its median wall time (s)."""
  kind: str                     # "decode" | "prefill"
  batch: int                    # sequences
  tokens: int                   # new tokens in the step (T)
  context: int                  # prompt / context tokens per sequence before the step
  shape: cost_lib.BatchShape
  seconds: float
  samples: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class TransferPoint:
  """One measured ``issue()``: blocks each way, the mode, median seconds."""
  mode: str
  blocks_out: int
  blocks_in: int
  seconds: float


def decode_shape(batch: int, context: int) -> cost_lib.BatchShape:
  """A decode step of ``batch`` seqs, one new token each on ``context`` computed ones."""
  return cost_lib.BatchShape(num_tokens=batch, num_seqs=batch, context_tokens=batch * (context + 1),
                             attn_pairs=float(batch * (context + 1)))


def prefill_shape(tokens: int) -> cost_lib.BatchShape:
  """One prefill of ``tokens`` tokens from scratch."""
  return cost_lib.BatchShape(num_tokens=tokens, num_seqs=1, context_tokens=tokens,
                             attn_pairs=float(tokens * (tokens + 1) // 2))


def padded_points(points: Sequence[StepPoint], buckets: cost_lib.Buckets) -> list[StepPoint]:
  """The points with the shapes the engine really ran (``cost.padded_shape``): what a ``pad_to_buckets``
  profile is fitted on. A decode point is ``batch`` seqs of one token on ``context``; a prefill one seq."""
  out = []
  for p in points:
    seqs = [(1, p.context)] * p.batch if p.kind == "decode" else [(p.tokens, p.context)]
    out.append(dataclasses.replace(p, shape=cost_lib.padded_shape(seqs, buckets)))
  return out


def _median(xs: Sequence[float]) -> float:
  return float(statistics.median(xs))


# ------------------------------------------------------------------------------------------------- fits
@dataclasses.dataclass(frozen=True)
class StepFit:
  """Fitted step model: effective rates and overhead, and the fit's relative errors per point."""
  mem_gbps: float               # hbm * mem_eff
  flop_tflops: float            # peak * flop_eff
  overhead_s: float
  rel_errors: tuple[float, ...]

  def predict(self, shape: cost_lib.BatchShape, model: cost_lib.ModelProfile) -> float:
    return _predict(shape, model, 1.0 / (self.mem_gbps * GB), 1.0 / (self.flop_tflops * 1e12), self.overhead_s)


def _terms(shape: cost_lib.BatchShape, model: cost_lib.ModelProfile) -> tuple[float, float]:
  """(bytes, FLOPs) of ``shape`` under the cost model (unit rates: a profile with 1 B/s and 1 FLOP/s)."""
  unit = _UnitHw()
  c = cost_lib.step_cost(shape, model, unit)
  return c.weight_bytes + c.kv_bytes, c.flops


@dataclasses.dataclass(frozen=True)
class _UnitHw:
  hbm_bandwidth_gbps: float = 1.0 / GB
  mem_efficiency: float = 1.0
  peak_tflops: float = 1e-12
  flop_efficiency: float = 1.0
  step_overhead_s: float = 0.0
  tp_latency_s: float = 0.0
  tp_bandwidth_gbps: float = 1.0


def _predict(shape, model, rm: float, rf: float, o: float) -> float:
  b, f = _terms(shape, model)
  return max(rm * b, rf * f) + o


def fit_step_model(points: Sequence[StepPoint], model: cost_lib.ModelProfile, *,
                   overhead_grid: int = 400) -> StepFit:
  """Fits ``t = max(rm * bytes, rf * flops) + o`` to the points (relative least squares; module docstring)."""
  if not points:
    raise ValueError("no step measurements to fit")
  data = [(_terms(p.shape, model), p.seconds) for p in points]
  if any(t <= 0 or not math.isfinite(t) for _, t in data):
    raise ValueError(f"step times must be finite and > 0, got {[t for _, t in data]}")
  tmin = min(t for _, t in data)

  def ls(rows):   # minimise sum(((r * x + o) - t) / t)^2 over r for rows (x, t - o, t)
    num = sum(x * y / (t * t) for x, y, t in rows)
    den = sum(x * x / (t * t) for x, y, t in rows)
    return num / den if den > 0 else None

  best = None
  for k in range(overhead_grid):
    o = tmin * 0.98 * k / overhead_grid
    rm = max(1e-30, min((t - o) / b for (b, f), t in data if b > 0))     # every point memory-bound at most
    rf = max(1e-30, min((t - o) / f for (b, f), t in data if f > 0))
    for _ in range(30):
      mem = [(b, t - o, t) for (b, f), t in data if rm * b >= rf * f]
      cmp = [(f, t - o, t) for (b, f), t in data if rm * b < rf * f]
      nrm = ls(mem) if mem else rm
      nrf = ls(cmp) if cmp else rf
      nrm = max(nrm, 1e-30)
      nrf = max(nrf, 1e-30)
      if not cmp:   # no point is compute-bound: the rate is only bounded; keep the tightest bound
        nrf = min(nrf, min((t - o) / f for (b, f), t in data if f > 0))
      if abs(nrm - rm) <= 1e-12 * rm and abs(nrf - rf) <= 1e-12 * rf:
        rm, rf = nrm, nrf
        break
      rm, rf = nrm, nrf
    errs = [(max(rm * b, rf * f) + o - t) / t for (b, f), t in data]
    loss = sum(e * e for e in errs)
    if best is None or loss < best[0]:
      best = (loss, rm, rf, o, errs)
  _, rm, rf, o, errs = best
  return StepFit(mem_gbps=1.0 / rm / GB, flop_tflops=1.0 / rf / 1e12, overhead_s=o, rel_errors=tuple(errs))


@dataclasses.dataclass(frozen=True)
class LinkFit:
  d2h_gbps: float
  h2d_gbps: float
  duplex_cap_gbps: float
  launch_s: float
  naive_d2h_gbps: Optional[float]
  naive_h2d_gbps: Optional[float]


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
  """Least-squares (intercept, slope); through the origin-free mean line; one point: slope = y/x."""
  if len(set(xs)) < 2:
    return 0.0, sum(ys) / sum(xs)
  mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
  slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
  return my - slope * mx, slope


def fit_link(points: Sequence[TransferPoint], block_bytes: int) -> LinkFit:
  """Per-direction bandwidth and launch cost from ``t(N) = launch + N * block_bytes / bw`` (batched
  modes), the duplex cap from the both-ways times, and naive mode's per-direction bandwidth."""
  batched = [p for p in points if p.mode != "naive"]
  naive = [p for p in points if p.mode == "naive"]
  if not batched:
    raise ValueError("no batched-mode transfer measurements to fit")

  def direction(ps, attr):
    xs = [getattr(p, attr) * block_bytes for p in ps]
    ys = [p.seconds for p in ps]
    a, s = _line(xs, ys)
    if s <= 0:                                  # noisy: fall back to the largest transfer's mean rate
      i = max(range(len(xs)), key=lambda k: xs[k])
      a, s = 0.0, ys[i] / xs[i]
    return max(0.0, a), s

  d2h = [p for p in batched if p.blocks_out and not p.blocks_in]
  h2d = [p for p in batched if p.blocks_in and not p.blocks_out]
  both = [p for p in batched if p.blocks_in and p.blocks_out]
  if not d2h or not h2d:
    raise ValueError("need D2H-only and H2D-only transfer measurements")
  a_out, s_out = direction(d2h, "blocks_out")
  a_in, s_in = direction(h2d, "blocks_in")
  launch = (a_out + a_in) / 2
  cap_rates = []
  for p in both:
    raw = max(p.seconds - launch, 1e-9)
    per_dir = max(p.blocks_out * block_bytes * s_out, p.blocks_in * block_bytes * s_in)
    total = (p.blocks_out + p.blocks_in) * block_bytes
    # The duplex cap binds only if both ways together took longer than the slower direction alone.
    cap_rates.append(total / max(raw, per_dir * 1.0001))
  cap = (max(cap_rates) if cap_rates else 2.0 / min(s_out, s_in)) / GB
  nd = nh = None
  if naive:
    def rate(ps, attr):
      ps = [p for p in ps if getattr(p, attr)]
      if not ps:
        return None
      return max(getattr(p, attr) * block_bytes / max(p.seconds - launch, 1e-9) for p in ps) / GB
    nd = rate([p for p in naive if not p.blocks_in], "blocks_out")
    nh = rate([p for p in naive if not p.blocks_out], "blocks_in")
  return LinkFit(d2h_gbps=1.0 / s_out / GB, h2d_gbps=1.0 / s_in / GB, duplex_cap_gbps=cap, launch_s=launch,
                 naive_d2h_gbps=nd, naive_h2d_gbps=nh)


# ------------------------------------------------------------------------------------------------ profile
def _link_entry(src: str, link_fit: LinkFit, block_bytes: int, num_layers: int) -> dict[str, Any]:
  """The profile's ``link`` section from a link fit: D2H / H2D rate curves by segment size (bytes) with a
  point at the naive segment (``block_bytes / 2L``, where naive mode was measured) and one at the batched
  segment (``block_bytes``), the duplex cap (GB/s) and the launch cost (s); every number sourced by ``src``."""
  seg_batched = block_bytes
  seg_naive = block_bytes // (2 * num_layers)

  def curve(naive_gbps, gbps):
    pts = []
    if naive_gbps and seg_naive < seg_batched:
      pts.append([seg_naive, round(min(naive_gbps, gbps), 6)])
    pts.append([seg_batched, round(gbps, 6)])
    return pts

  return {
      "name": "host memcpy (device and host pools share DRAM), as DuplexKV moves it",
      "d2h_gbps_by_segment": {"points": curve(link_fit.naive_d2h_gbps, link_fit.d2h_gbps), "source": (
          f"{src}: DuplexKV.issue() of N blocks D2H, t = launch + bytes/bw least squares over N, at the "
          f"block_first segment ({seg_batched} B); the naive segment ({seg_naive} B) from naive mode")},
      "h2d_gbps_by_segment": {"points": curve(link_fit.naive_h2d_gbps, link_fit.h2d_gbps), "source": (
          f"{src}: DuplexKV.issue() of N blocks H2D, as d2h")},
      "duplex_cap_gbps": {"value": round(link_fit.duplex_cap_gbps, 4), "source": (
          f"{src}: DuplexKV.issue() of N blocks each way at once: (bytes out + in) / (t - launch)")},
      "launch_overhead_s": {"value": round(link_fit.launch_s, 7), "source": (
          f"{src}: intercept of the per-direction fits")},
  }


def build_profile(*, name: str, description: str, command: str, date: Optional[str] = None,
                  machine: dict[str, float], step_fit: StepFit, link_fit: LinkFit, model: cost_lib.ModelProfile,
                  block_bytes: int, num_layers: int, step_points: Sequence[StepPoint],
                  memory_gb: float, pad_to_buckets: bool = False) -> dict[str, Any]:
  """The profile JSON (``configs/hardware/*.json`` format) of a calibration; every number sourced with the
  exact command and date. Validated with ``profiles.profile_from_dict`` before it is returned."""
  date = date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  src = f"measured by `{command}` on {date}"
  hbm = max(machine["read_gbps"], step_fit.mem_gbps)
  peak = max(machine["matmul_tflops"], step_fit.flop_tflops)
  errs = ", ".join(f"{p.kind} B={p.batch} T={p.tokens} c={p.context}: {p.seconds * 1e3:.1f} ms "
                   f"({e * 100:+.0f}%)" for p, e in zip(step_points, step_fit.rel_errors))
  fit_src = (f"{src}: fit of t = max(bytes/(hbm*mem_eff), flops/(peak*flop_eff)) + overhead to the engine's "
             f"step times of {model.name} ({model.itemsize * 8}-bit) [{errs}]")
  d = {
      "name": name,
      "description": description,
      "hbm_bandwidth_gbps": {"value": round(hbm, 4), "source": (
          f"{src}: numpy streaming read of 256 MB f32, best of repeats ({machine['read_gbps']:.2f} GB/s)"
          + ("" if hbm == machine["read_gbps"] else "; raised to the step fit's effective rate"))},
      "hbm_capacity_gb": {"value": round(memory_gb, 3), "source": f"{src}: physical memory (os.sysconf)"},
      "peak_tflops": {"value": round(peak, 6), "source": (
          f"{src}: numpy f32 1024^3 matmul, best of repeats ({machine['matmul_tflops'] * 1e3:.1f} GFLOP/s)"
          + ("" if peak == machine["matmul_tflops"] else "; raised to the step fit's effective rate"))},
      "mem_efficiency": {"value": round(min(1.0, step_fit.mem_gbps / hbm), 6),
                         "source": f"{fit_src}: effective {step_fit.mem_gbps:.3f} GB/s"},
      "flop_efficiency": {"value": round(min(1.0, step_fit.flop_tflops / peak), 6),
                          "source": f"{fit_src}: effective {step_fit.flop_tflops * 1e3:.2f} GFLOP/s"},
      "step_overhead_s": {"value": round(step_fit.overhead_s, 6), "source": f"{fit_src}: fitted overhead"},
      "tp_bandwidth_gbps": {"value": round(link_fit.duplex_cap_gbps, 4), "source": (
          f"{src}: no tensor parallelism on this machine; set to the measured duplex copy rate")},
      "tp_latency_s": {"value": round(link_fit.launch_s, 7), "source": (
          f"{src}: no tensor parallelism on this machine; set to the measured copy launch cost")},
      "host_memory_gb": {"value": round(memory_gb, 3), "source": (
          f"{src}: physical memory (os.sysconf); device and host pools share it")},
      "pad_to_buckets": {"value": bool(pad_to_buckets), "source": (
          f"{src}: the step fit is on the engine's padded shapes (T, S, block-table width bucketed)"
          if pad_to_buckets else f"{src}: the step fit is on the batches as formed (no padding)")},
      "copies_overlap_compute": {"value": False, "source": (
          f"{src}: on the CPU backend a KV copy is a memcpy on the same cores as the model step, so the "
          f"simulator does not hide copies behind the step in flight")},
      "link": _link_entry(src, link_fit, block_bytes, num_layers),
  }
  profile_from_dict(d, path=f"<calibration {name}>")   # ProfileError if anything is off
  return d


def write_profile(path: str, profile: dict[str, Any]) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(profile, f, indent=2)
    f.write("\n")
