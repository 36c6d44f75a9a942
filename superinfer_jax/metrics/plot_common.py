"""What every figure module of ``metrics/`` shares: the Agg pyplot import, repeat aggregation of result rows,
colours, axis formatting, the SLO title and saving. Used by ``plots.py`` (lines vs RPS, figure panels, the
results-directory driver), ``plot_bars.py`` (single-load bars) and ``plot_timelines.py`` (CDFs, timelines).
Matplotlib is imported only inside the functions that draw.
"""
from __future__ import annotations

import math
import os
from typing import Any, Sequence

import numpy as np

ATTAINMENT_METRICS = (("slo_attainment", "SLO attainment (TTFT & TPOT)"), ("ttft_attainment", "TTFT attainment"),
               ("tbt_attainment", "TBT attainment"))
PERTURBED_HATCH = "///"


def pyplot():
  """``matplotlib.pyplot`` on the Agg backend (imported on first call)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def row_repeat(row: dict[str, Any]) -> int:
  """The row's 0-based ``repeat`` (rows of older runs lack it: 0)."""
  r = row.get("repeat")
  return 0 if r is None else int(r)


def num_value(v) -> float | None:
  if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
    return None
  v = float(v)
  return v if math.isfinite(v) else None


def group_repeats(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, float], list[dict[str, Any]]]:
  """{(policy, rps): rows} with the repeats of each (policy, rps) sorted by (run_index, repeat).

  A later row with the same (policy, rps, repeat) replaces an earlier one (a rerun). Keys are sorted by
  (policy, rps).
  """
  latest: dict[tuple[str, float, int], dict[str, Any]] = {}
  for r in rows:
    latest[(r["policy"], float(r["rps"]), row_repeat(r))] = r
  out: dict[tuple[str, float], list[dict[str, Any]]] = {}
  for (policy, rps, _), r in sorted(latest.items()):
    out.setdefault((policy, rps), []).append(r)
  for rs in out.values():
    rs.sort(key=lambda r: (r.get("run_index") is None, r.get("run_index") or 0, row_repeat(r)))
  return out


def aggregate_repeats(rows: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
  """Per policy (sorted), one aggregate per rps (ascending) over that (policy, rps)'s repeats.

  Each aggregate: ``policy``, ``rps``, ``rows`` (the repeats, as ``group_repeats``), ``num_repeats``,
  ``num_perturbed`` and ``mean`` / ``min`` / ``max``: {key: float} over the repeats' finite numeric
  (non-bool) values of every key; a repeat whose value is None/missing is left out of that key, and a
  key without any value is absent (so ``agg["mean"].get(key)`` is None).
  """
  out: dict[str, list[dict[str, Any]]] = {}
  for (policy, rps), rs in group_repeats(rows).items():
    mean, lo, hi = {}, {}, {}
    for key in dict.fromkeys(k for r in rs for k in r):
      vals = [v for v in (num_value(r.get(key)) for r in rs) if v is not None]
      if vals:
        mean[key], lo[key], hi[key] = float(np.mean(vals)), min(vals), max(vals)
    out.setdefault(policy, []).append({
        "policy": policy, "rps": rps, "rows": rs, "num_repeats": len(rs),
        "num_perturbed": sum(1 for r in rs if r.get("perturbed")), "mean": mean, "min": lo, "max": hi})
  return out


def policy_colors(policies) -> dict[str, str]:
  return {p: f"C{i % 10}" for i, p in enumerate(sorted(set(policies)))}



def no_minor_labels(axis):
  """Log axis labelled at 1-2-5 steps in plain numbers (no overlapping minor-tick labels)."""
  from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
  axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
  axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
  axis.set_minor_formatter(NullFormatter())


def slo_note(fig, rows, prefix: str = ""):
  """Titles ``fig`` with ``prefix`` and, when all ``rows`` share one, their SLOs (TTFT s, TBT ms)."""
  slos = {(r.get("ttft_slo_s"), r.get("tbt_slo_s")) for r in rows}
  parts = [prefix] if prefix else []
  if len(slos) == 1:
    ttft, tbt = next(iter(slos))
    if ttft and tbt:
      parts.append(f"SLO: TTFT <= {ttft:g} s, TBT/TPOT <= {1000 * tbt:g} ms")
  if parts:
    fig.suptitle(" — ".join(parts), fontsize=9)


def save_figure(fig, plt, out_path: str, rect=None) -> str:
  """Lays ``fig`` out (``tight_layout(rect)``), writes it to ``out_path`` (110 dpi; parent made), closes
  it. -> ``out_path``."""
  d = os.path.dirname(out_path)
  if d:
    os.makedirs(d, exist_ok=True)
  fig.tight_layout(rect=rect)
  fig.savefig(out_path, dpi=110)
  plt.close(fig)
  return out_path



def plain_formatter(minor: bool = False):
  """Plain-number tick labels (``minor``: only at 2x and 5x a power of ten, so log axes stay legible)."""
  from matplotlib.ticker import FuncFormatter

  def fmt(v, _):
    if minor and not any(abs(v / 10 ** math.floor(math.log10(v)) - m) < 1e-6 for m in (2, 5)):
      return ""
    return f"{v:g}"
  return FuncFormatter(fmt)
