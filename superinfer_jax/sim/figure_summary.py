"""Reading a figure's runs: each point summarised over seeds, and the paper's claims checked on every seed.

``summarize_points`` gives, per (series, x) of one part, the mean / min / max over seeds of each metric and of
the contention figures (``CONTENTION``); ``check_claims`` evaluates a ``figures.Figure``'s ``Claim``s (a ratio of
two points against a bound) seed by seed; ``format_summary`` / ``format_claims`` print them. Plain data in,
plain data out; no JAX, no simulator run.
"""
from __future__ import annotations

import operator
from typing import Any, Optional, Sequence

from superinfer_jax.metrics import plots as plots_lib

# What says whether a point contended (pool occupancy and live KV demand over the pool, contended steps,
# rotations, preemptions): summarised beside every figure's metrics.
CONTENTION = ("pool_occupancy_p50", "pool_occupancy_p99", "kv_demand_p50", "kv_demand_p99", "kv_contended_steps",
              "kv_contended_share", "num_rotations", "num_recompute_preemptions")
OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}


def _matches(row: dict[str, Any], sel: dict[str, Any]) -> bool:
  for k, v in sel.items():
    got = row.get(k)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
      try:
        if abs(float(got) - float(v)) > 1e-9 * max(1.0, abs(float(v))):
          return False
      except (TypeError, ValueError):
        return False
    elif got != v:
      return False
  return True


def summarize_points(part: str, x_key: str, rows: Sequence[dict[str, Any]], metrics: Sequence[str]
                     ) -> list[dict[str, Any]]:
  """Per (series, x) of one part's rows (every seed's): ``{part, series, x, seeds, uncontended_seeds,
  <metric>: {mean, min, max}}`` for ``metrics`` and ``CONTENTION`` (a seed's point is uncontended when its
  live KV demand never exceeded the pool: ``kv_contended_steps == 0``)."""
  groups: dict[tuple[str, Any], list[dict[str, Any]]] = {}
  for r in rows:
    groups.setdefault((plots_lib.series_label(r, x_key), r.get(x_key)), []).append(r)
  out = []
  for (series, x), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], float(kv[0][1] or 0))):
    entry: dict[str, Any] = {"part": part, "series": series, "x_key": x_key, "x": x,
                             "seeds": sorted(r.get("seed") for r in rs),
                             "uncontended_seeds": sorted(r.get("seed") for r in rs if not r.get("kv_contended_steps"))}
    for m in dict.fromkeys(tuple(metrics) + CONTENTION):
      vals = [float(r[m]) for r in rs if r.get(m) is not None]
      entry[m] = {"mean": sum(vals) / len(vals), "min": min(vals), "max": max(vals)} if vals else None
    out.append(entry)
  return out


def check_claims(fig, rows: dict[str, list[dict[str, Any]]], rps_scale: float = 1.0, ignore_rps: bool = False
                 ) -> list[dict[str, Any]]:
  """Each of ``fig.claims`` on every seed: ``{text, metric, op, bound, ratios: {seed: ratio}, holds_on,
  seeds, uncontended_seeds, holds}``. ``ignore_rps``: the points are selected without their ``rps`` (a
  workload whose load is set by contention has one rate per window). ``holds`` only if the claim holds on every seed and, unless the claim
  says ``needs_contention=False``, both points contended on each (a missing point or a zero denominator is a
  failure)."""
  out = []
  for c in fig.claims:
    part_rows = rows.get(c.part, [])
    num = {k: v * rps_scale if k == "rps" else v for k, v in c.num.items() if not (ignore_rps and k == "rps")}
    den = {k: v * rps_scale if k == "rps" else v for k, v in c.den.items() if not (ignore_rps and k == "rps")}
    seeds = sorted({r.get("seed") for r in part_rows})
    ratios: dict[Any, Optional[float]] = {}
    uncontended = []
    for s in seeds:
      a = [r for r in part_rows if r.get("seed") == s and _matches(r, num)]
      b = [r for r in part_rows if r.get("seed") == s and _matches(r, den)]
      if len(a) != 1 or len(b) != 1 or a[0].get(c.metric) is None or not b[0].get(c.metric):
        ratios[s] = None
        continue
      ratios[s] = float(a[0][c.metric]) / float(b[0][c.metric])
      if not (a[0].get("kv_contended_steps") and b[0].get("kv_contended_steps")):
        uncontended.append(s)
    holds_on = [s for s, q in ratios.items() if q is not None and OPS[c.op](q, c.bound)]
    needs = getattr(c, "needs_contention", True)
    out.append({"text": c.text, "part": c.part, "metric": c.metric, "op": c.op, "bound": c.bound,
                "ratios": ratios, "seeds": seeds, "holds_on": holds_on, "uncontended_seeds": uncontended,
                "holds": bool(seeds) and len(holds_on) == len(seeds) and not (uncontended and needs)})
  return out


def _fmt(v: Optional[dict[str, float]], scale: float = 1.0, digits: int = 3) -> str:
  if v is None:
    return "-"
  return f"{scale * v['mean']:.{digits}g} [{scale * v['min']:.{digits}g}, {scale * v['max']:.{digits}g}]"


_TABLE_METRICS = (("slo_attainment", "SLO%", 100.0), ("ttft_p99_s", "TTFT p99 s", 1.0),
                  ("tbt_p99_s", "TBT p99 s", 1.0), ("tbt_worst_p99_s", "worst TBT p99 s", 1.0),
                  ("tbt_request_attainment", "TBT req%", 100.0), ("kv_demand_p50", "KV/pool p50", 1.0),
                  ("kv_demand_p99", "KV/pool p99", 1.0), ("pool_occupancy_p99", "occ p99", 1.0),
                  ("kv_contended_share", "contended", 1.0), ("num_rotations", "rotations", 1.0),
                  ("num_recompute_preemptions", "preemptions", 1.0))


def format_summary(summary: Sequence[dict[str, Any]]) -> str:
  """A text table of ``summarize_points`` entries: mean [min, max] over the seeds; "!" marks a point
  where nothing contended on some seed."""
  head = ["series", "x", "n"] + [h for _, h, _ in _TABLE_METRICS]
  cells = [head]
  for e in summary:
    mark = "!" if e["uncontended_seeds"] else ""
    cells.append([e["series"] + mark, f"{e['x']:g}" if isinstance(e["x"], (int, float)) else str(e["x"]),
                  str(len(e["seeds"]))] + [_fmt(e.get(m), s) for m, _, s in _TABLE_METRICS])
  widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
  lines = ["  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip() for c in cells]
  lines.insert(1, "  ".join("-" * w for w in widths))
  if any(e["uncontended_seeds"] for e in summary):
    lines.append("! = on some seed nothing contended at this point (live KV never exceeded the pool)")
  return "\n".join(lines)


def format_claims(claims: Sequence[dict[str, Any]]) -> str:
  lines = []
  for c in claims:
    rs = [q for q in c["ratios"].values() if q is not None]
    spread = f"ratio mean {sum(rs) / len(rs):.3g} [{min(rs):.3g}, {max(rs):.3g}]" if rs else "no ratio"
    verdict = "HOLDS" if c["holds"] else "does not hold"
    extra = f"; uncontended on seeds {c['uncontended_seeds']}" if c["uncontended_seeds"] else ""
    lines.append(f"[{verdict}] {c['text']} ({c['metric']} {c['op']} {c['bound']:.3g}): on "
                 f"{len(c['holds_on'])}/{len(c['seeds'])} seeds, {spread}{extra}")
  return "\n".join(lines)


def claims_markdown(figure: str, workload: str, claims: Sequence[dict[str, Any]]) -> str:
  """The claims of one figure run as the markdown table of ``docs/results/simulator.md``: one row per claim,
  ``| figure | workload | claim | holds on | ratio mean [min, max] |`` (holds on: "**yes** k/n" when the
  claim holds on every seed, else "no k/n"; the ratio over the seeds that have one)."""
  lines = ["| figure | workload | claim | holds on | ratio mean [min, max] |", "|---|---|---|---|---|"]
  for c in claims:
    rs = [q for q in c["ratios"].values() if q is not None]
    spread = f"{sum(rs) / len(rs):.3g} [{min(rs):.3g}, {max(rs):.3g}]" if rs else "no ratio"
    verdict = f"{'**yes**' if c['holds'] else 'no'} {len(c['holds_on'])}/{len(c['seeds'])}"
    lines.append(f"| {figure} | {workload} | {c['text']} | {verdict} | {spread} |")
  return "\n".join(lines)


__all__ = ["CONTENTION", "OPS", "check_claims", "claims_markdown", "format_claims", "format_summary",
           "summarize_points"]
