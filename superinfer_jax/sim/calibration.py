"""Calibration: measure this machine's real engine and fit a hardware profile for the simulator.

``scripts/calibrate.py`` is the flag wrapper. Two measurements, both on the real code paths:

* **Model steps.** An ``LLMEngine`` (the run's engine config: bucket floors, pipeline, dtype) runs
  (a) *decode* points: ``B`` requests with ``c``-token prompts; after their prefills, each ``step()`` is one
  decode token per request, timed as the engine's step period (warm-up steps dropped, median of the rest);
  (b) *prefill* points: one request with a ``P``-token prompt and ``max_tokens=1``, the whole request timed
  (one prefill step plus the host's bookkeeping), warm-up repeats dropped, median of the rest.
  Every shape is compiled before timing (``precompile_steps`` with the configured floors, plus the warm-up).
* **Transfers.** A ``DuplexKV`` built as the engine builds it (same spec, mode, host memory kind, buckets)
  ``issue()``s ``N`` blocks D2H only, H2D only, and both at once; each timed to completion (``wait`` and
  ``block_until_ready``), median of repeats. ``naive`` mode is timed too, for the curve's small-segment point.

Fit (pure Python, ``fit_step_model`` / ``fit_link``), against the *cost model's own* formula
(``cost.step_cost``) on the batch shapes the measured steps really had (not the engine's padded buckets, so
the fitted factors absorb the padding, as the simulator needs):

  time = max(bytes / (hbm * mem_eff), flops / (peak * flop_eff)) + step_overhead

``hbm`` and ``peak`` are this machine's measured streaming bandwidth and f32 matmul rate (numpy; see
``measure_machine``); only the products ``hbm * mem_eff`` and ``peak * flop_eff`` are identifiable, so the
efficiencies are the fitted effective rates over those peaks (capped at 1, the peak raised to the fitted
rate where a fit exceeds it). The overhead is searched on a grid; for each candidate the two rates are
least-squares fits (relative error) of the points each bound claims, iterated to a fixed point. The link:
per direction ``t(N) = launch + N * block_bytes / bw`` (least squares over N), the duplex cap from the
both-ways times, and the curve's points at the naive segment (``block_bytes / 2L``) and the batched one
(``block_bytes``, block_first).

This module imports JAX only inside the measuring functions; the fitting and the profile writing are pure.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import statistics
import time
from typing import Any, Callable, Optional, Sequence

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


# ------------------------------------------------------------------------------------------ measurement
def measure_machine(seconds: float = 1.0) -> dict[str, float]:
  """This machine's streaming read bandwidth (GB/s, numpy sum over 256 MB f32) and f32 matmul rate
  (TFLOP/s, numpy 1024^3 matmul), each the best of a few repeats within about ``seconds``."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  a = np.ones(64 << 20, np.float32)        # 256 MB
  a.sum()
  best_bw = 0.0
  t_end = time.perf_counter() + seconds / 2
  while True:
    t = time.perf_counter()
    a.sum()
    dt = time.perf_counter() - t
    best_bw = max(best_bw, a.nbytes / dt / GB)
    if time.perf_counter() > t_end:
      break
  del a
  n = 1024
  x = np.ones((n, n), np.float32)
  x @ x
  best_fl = 0.0
  t_end = time.perf_counter() + seconds / 2
  while True:
    t = time.perf_counter()
    x @ x
    dt = time.perf_counter() - t
    best_fl = max(best_fl, 2.0 * n ** 3 / dt / 1e12)
    if time.perf_counter() > t_end:
      break
  return {"read_gbps": best_bw, "matmul_tflops": best_fl}


def measure_steps(engine, *, decode_batches: Sequence[int], decode_contexts: Sequence[int],
                  prefill_chunks: Sequence[int], warmup: int, repeats: int,
                  log: Callable[[str], None] = lambda s: None) -> list[StepPoint]:
  """Times ``engine`` (an idle ``LLMEngine``) at the decode and prefill points of the grid (module
  docstring). Token ids are random (ids >= 100 below the vocabulary size): their values do not change the
  step time."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from superinfer_jax.engine.config import SamplingParams  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  vocab = engine.model_config.vocab_size
  lo = min(100, vocab - 1)

  def prompt(n):
    return rng.integers(lo, vocab, size=n).tolist()

  # One untimed pass through the whole loop first (the first decode point measured slow without it:
  # first-use costs outside the compiled step buckets).
  if decode_batches and decode_contexts:
    b0, c0 = max(decode_batches), min(decode_contexts)
    sp = SamplingParams(max_tokens=warmup + 2, ignore_eos=True)
    ids = [engine.add_request(prompt(c0), sp) for _ in range(b0)]
    while engine.has_unfinished():
      engine.step()
    for i in ids:
      engine.release(i)
  points = []
  for c in decode_contexts:
    for b in decode_batches:
      chunks = -(-b * c // engine.config.scheduler.max_num_batched_tokens)   # steps the prefills may take
      sp = SamplingParams(max_tokens=warmup + repeats + chunks + 2, ignore_eos=True)
      ids = [engine.add_request(prompt(c), sp) for _ in range(b)]
      while engine.has_unfinished() and not all(engine.get_request(i).token_ids for i in ids):
        engine.step()
      times = []
      while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
      for i in ids:
        engine.release(i)
      samples = times[warmup:warmup + repeats] or times[:1]
      ctx = c + warmup + len(samples) // 2          # mid-run context of the timed steps
      p = StepPoint("decode", b, b, c, decode_shape(b, ctx), _median(samples), tuple(samples))
      log(f"[calibrate] decode batch {b:3d} context {c:5d}: {p.seconds * 1e3:8.2f} ms/step "
          f"({len(samples)} steps)")
      points.append(p)
  for n in prefill_chunks:
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    times = []
    for _ in range(warmup + repeats):
      t = time.perf_counter()
      rid = engine.add_request(prompt(n), sp)
      while engine.has_unfinished():
        engine.step()
      times.append(time.perf_counter() - t)
      engine.release(rid)
    samples = times[warmup:] or times[-1:]
    p = StepPoint("prefill", 1, n, 0, prefill_shape(n), _median(samples), tuple(samples))
    log(f"[calibrate] prefill {n:5d} tokens: {p.seconds * 1e3:8.2f} ms ({len(samples)} repeats)")
    points.append(p)
  return points


def measure_transfers(engine_config, model_cfg, *, block_counts: Sequence[int], warmup: int, repeats: int,
                      naive_blocks: Sequence[int] = (), log: Callable[[str], None] = lambda s: None
                      ) -> list[TransferPoint]:
  """Times ``DuplexKV.issue()`` (built as ``LLMEngine._make_duplex`` builds it) of ``N`` blocks D2H, H2D
  and both, for each ``N`` of ``block_counts`` in the config's transfer mode (naive mode for
  ``naive_blocks``)."""
  import jax  # pylint: disable=import-outside-toplevel
  from superinfer_jax.model.forward import init_kv_cache  # pylint: disable=import-outside-toplevel
  from superinfer_jax.rotation import DuplexKV  # pylint: disable=import-outside-toplevel
  rc = engine_config.rotation
  dtype = engine_config.model.dtype
  spec = model_cfg.kv_spec(engine_config.block_size, dtype=dtype)
  top = max(list(block_counts) + list(naive_blocks) + [1])
  device = jax.local_devices()[0]
  kinds = {m.kind for m in device.addressable_memories()}
  kind = "pinned_host" if "pinned_host" in kinds else "unpinned_host"
  points = []

  def run(mode: str, counts: Sequence[int]):
    dk = DuplexKV(spec, 2 * top, mode=mode, device=device, host_memory_kind=kind,
                  min_bucket=rc.rotation_min_bucket, max_bucket=rc.rotation_max_bucket)
    cache = init_kv_cache(model_cfg, 2 * top + 1, engine_config.block_size, dtype)
    # Seed host blocks top..2top-1 (the H2D sources) with one D2H.
    cache = dk.issue(cache, swap_out=[(1 + i, top + i) for i in range(top)])
    dk.wait()
    for n in counts:
      cases = {"d2h": dict(swap_out=[(1 + i, i) for i in range(n)]),
               "h2d": dict(swap_in=[(top + i, 1 + top + i) for i in range(n)]),
               "both": dict(swap_out=[(1 + i, i) for i in range(n)],
                            swap_in=[(top + i, 1 + top + i) for i in range(n)])}
      for name, kw in cases.items():
        times = []
        for _ in range(warmup + repeats):
          t = time.perf_counter()
          cache = dk.issue(cache, **kw)
          dk.wait()
          jax.block_until_ready(cache)
          times.append(time.perf_counter() - t)
        s = _median(times[warmup:] or times[-1:])
        out = len(kw.get("swap_out", ()))
        inn = len(kw.get("swap_in", ()))
        points.append(TransferPoint(mode, out, inn, s))
        log(f"[calibrate] {mode:6s} {name:4s} {n:3d} blocks x {spec.block_bytes / 2**20:.3f} MiB: "
            f"{s * 1e3:8.3f} ms ({(out + inn) * spec.block_bytes / s / GB:.2f} GB/s)")
    return cache

  run(rc.transfer_mode if rc.transfer_mode != "naive" else "duplex", block_counts)
  if naive_blocks:
    run("naive", naive_blocks)
  return points


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
  seg_batched = block_bytes
  seg_naive = block_bytes // (2 * num_layers)

  def curve(naive_gbps, gbps):
    pts = []
    if naive_gbps and seg_naive < seg_batched:
      pts.append([seg_naive, round(min(naive_gbps, gbps), 6)])
    pts.append([seg_batched, round(gbps, 6)])
    return pts

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
      "link": {
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
      },
  }
  profile_from_dict(d, path=f"<calibration {name}>")   # ProfileError if anything is off
  return d


def write_profile(path: str, profile: dict[str, Any]) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(profile, f, indent=2)
    f.write("\n")


def physical_memory_gb() -> float:
  import os  # pylint: disable=import-outside-toplevel
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
  except (ValueError, OSError, AttributeError):
    return 16.0
