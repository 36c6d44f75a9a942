"""The load of a trace window set by a contention target (``--trace_arrivals=contention``).

One request rate for every window of a trace makes figures window-fragile: at a rate where some windows
contend for KV memory, another window may not contend at all, and its comparisons say nothing about
scheduling under memory pressure. ``contention_rps(workload, setup, target)`` instead finds, for one window,
the rate (arrivals stretched as ``workload.traces.rescale_to_rps`` does, keeping the burstiness) at which
**fcfs without prefix caching** reaches ``target`` as the P99 over its plans of the live KV demand per device
pool (resident plus queued requests' blocks, ``SimResult.kv_demand``; 1.0 = the pool exactly full of live
and waiting KV). fcfs without caching is the reference because it is what every arm is compared against, and
its demand does not depend on the policy's own choices.

Search: the demand grows with the rate; starting at the window's recorded mean rate, the rate is doubled or
halved until the target is bracketed (at most ``max_doublings`` times each way), then bisected in log space
``iterations`` times; the result is the bracket's end whose P99 is closest to the target (reported with its
P99 and every probe). Each probe is one ``simulate`` of the window. ``contention_summary`` gives the P50 / P99
of a run's pool occupancy and live KV demand (the rows' contention columns). Pure Python over the simulator
(no JAX).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from superinfer_jax.sim.event_loop import simulate


@dataclasses.dataclass
class ContentionLoad:
  """The rate found for one window: ``rps``, the P99 live KV demand / pool it gave (``kv_demand_p99``), the
  ``target``, and every probe as ``(rps, P99)`` in the order run."""
  rps: float
  kv_demand_p99: float
  target: float
  probes: list[tuple[float, float]]


def contention_summary(occupancy, kv_demand) -> dict[str, Optional[float]]:
  """P50 / P99 over a run's plans of the device pool's occupancy and of the live KV demand (resident plus
  queued blocks), as fractions of the pool (``SimResult``); None for a run without plans."""
  out: dict[str, Optional[float]] = {}
  for name, xs in (("pool_occupancy", occupancy), ("kv_demand", kv_demand)):
    xs = sorted(xs)
    for q in (50, 99):
      out[f"{name}_p{q}"] = xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else None
  return out


def contention_rps(workload, engine_config, cost, target: float, start_rps: float, *, iterations: int = 6,
                   max_doublings: int = 8, time_limit_s: float | None = None) -> ContentionLoad:
  """The rate of ``workload`` (a trace window) at which fcfs without prefix caching reaches ``target`` P99 live
  KV demand per pool (module docstring). ``engine_config`` / ``cost``: the run's (its policy and caching are
  replaced); ``start_rps``: the first probe (the window's recorded mean rate)."""
  from superinfer_jax.workload.traces import rescale_to_rps  # pylint: disable=import-outside-toplevel
  if not (target > 0 and math.isfinite(target)):
    raise ValueError(f"contention target must be a finite number > 0, got {target!r}")
  if not (start_rps > 0 and math.isfinite(start_rps)):
    raise ValueError(f"start_rps must be a finite number > 0, got {start_rps!r}")
  cfg = engine_config.replace(policy="fcfs", enable_prefix_caching=False)
  probes: list[tuple[float, float]] = []

  def demand(rps: float) -> float:
    res = simulate(rescale_to_rps(workload, rps), cfg, cost, time_limit_s=time_limit_s, prefix_content="none")
    p = contention_summary(res.occupancy, res.kv_demand)["kv_demand_p99"] or 0.0
    probes.append((rps, p))
    return p

  lo = hi = start_rps
  d = demand(start_rps)
  d_lo = d_hi = d
  for _ in range(max_doublings):
    if d_hi >= target:
      break
    lo, d_lo = hi, d_hi
    hi *= 2.0
    d_hi = demand(hi)
  for _ in range(max_doublings):
    if d_lo < target:
      break
    hi, d_hi = lo, d_lo
    lo /= 2.0
    d_lo = demand(lo)
  if lo != hi:
    for _ in range(iterations):
      mid = math.sqrt(lo * hi)
      d_mid = demand(mid)
      if d_mid >= target:
        hi, d_hi = mid, d_mid
      else:
        lo, d_lo = mid, d_mid
  rps, p = min(((lo, d_lo), (hi, d_hi)), key=lambda x: abs(x[1] - target))
  return ContentionLoad(rps=rps, kv_demand_p99=p, target=target, probes=probes)


def load_columns(load: ContentionLoad) -> dict[str, Any]:
  """A results row's columns for the load found: ``load_target``, ``load_rps``, ``load_kv_demand_p99``,
  ``load_probes``."""
  return {"load_target": load.target, "load_rps": load.rps, "load_kv_demand_p99": load.kv_demand_p99,
          "load_probes": len(load.probes)}
