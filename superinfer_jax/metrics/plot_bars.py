"""Single-load bar figures of a results directory (``plots.py``'s docstring lists them): grouped bars, one
group per policy and one bar per repeat in run order, hatched where ``perturbed``, a diamond at the mean.
Matplotlib is imported only inside the functions that draw.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from superinfer_jax.metrics.plot_common import (ATTAINMENT_METRICS, PERTURBED_HATCH, group_repeats, no_minor_labels,
                                                num_value, policy_colors, pyplot, row_repeat, save_figure, slo_note)
from superinfer_jax.metrics.timeline import format_rps


def _single_load_groups(rows: Sequence[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
  """[(policy, repeats in run order)] sorted by policy (rows assumed to share one rps)."""
  return [(policy, rs) for (policy, _), rs in group_repeats(rows).items()]


def _grouped_bars(ax, groups: Sequence[tuple[str, Sequence[dict[str, Any]]]], key: str,
                  colors: dict[str, str], *, scale: float = 1.0, fmt: str = "{:.3g}") -> list[float]:
  """One group per policy, one bar per repeat (hatched if perturbed), a diamond at the mean.

  Returns the plotted (scaled) values. A repeat without a value gets an "n/a" mark instead of a bar.
  """
  from matplotlib.transforms import blended_transform_factory
  width = 0.8 / max([len(rs) for _, rs in groups] + [1])
  base = blended_transform_factory(ax.transData, ax.transAxes)
  plotted = []
  for i, (policy, rs) in enumerate(groups):
    xs = i + (np.arange(len(rs)) - (len(rs) - 1) / 2.0) * width
    vals = []
    for x, r in zip(xs, rs):
      v = num_value(r.get(key))
      tag = f"#{r['run_index']}" if r.get("run_index") is not None else f"r{row_repeat(r)}"
      if v is None:
        ax.text(x, 0.02, f"{tag}\nn/a", transform=base, ha="center", va="bottom", fontsize=6)
        continue
      v *= scale
      vals.append(v)
      ax.bar(x, v, width * 0.9, color=colors[policy], edgecolor="k", lw=0.6,
             hatch=PERTURBED_HATCH if r.get("perturbed") else None, alpha=0.85)
      ax.text(x, 0.01, tag, transform=base, ha="center", va="bottom", fontsize=6,
              bbox=dict(fc="white", ec="none", pad=0.6, alpha=0.8))
    if vals:
      m = float(np.mean(vals))
      ax.plot([i], [m], marker="D", color="k", ms=6, ls="none", zorder=4)
      ax.annotate(fmt.format(m), (i + 0.4, m), xytext=(2, 0), textcoords="offset points", fontsize=7,
                  va="center", ha="left")
    plotted += vals
  ax.set_xticks(range(len(groups)))
  ax.set_xticklabels([f"{p}\n(n={len(rs)})" for p, rs in groups], fontsize=8)
  ax.set_xlim(-0.6, len(groups) - 0.4 + 0.3)
  ax.grid(alpha=0.3, axis="y")
  return plotted


def _bar_legend(fig, rows, extra_handles=()) -> None:
  from matplotlib.lines import Line2D
  from matplotlib.patches import Patch
  handles = [Patch(facecolor="white", edgecolor="k", label="one bar per repeat (#i: run order)"),
             Line2D([], [], marker="D", color="k", ls="none", label="mean over repeats")]
  if any(r.get("perturbed") for r in rows):
    handles.insert(1, Patch(facecolor="white", edgecolor="k", hatch=PERTURBED_HATCH,
                            label="perturbed (step-time drift)"))
  handles += list(extra_handles)
  fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)


_BAR_RECT = (0, 0.07, 1, 0.98)


def _load_title(rows) -> str:
  rps = sorted({float(r["rps"]) for r in rows})
  return f"at {format_rps(rps[0])} req/s" if len(rps) == 1 else ""


def plot_attainment_bars(rows: Sequence[dict[str, Any]], out_path: str) -> str:
  """SLO / TTFT / TBT attainment (%) per policy at one load, one bar per repeat -> ``out_path``."""
  plt = pyplot()
  groups = _single_load_groups(rows)
  colors = policy_colors(p for p, _ in groups)
  fig, axes = plt.subplots(1, 3, figsize=(max(10.0, 1.6 * 3 * len(groups) + 3), 4.2), sharey=True)
  for ax, (key, title) in zip(axes, ATTAINMENT_METRICS):
    _grouped_bars(ax, groups, key, colors, scale=100.0, fmt="{:.1f}")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(0, 105)
  axes[0].set_ylabel("attainment (%)")
  slo_note(fig, rows, prefix=_load_title(rows))
  _bar_legend(fig, rows)
  return save_figure(fig, plt, out_path, rect=_BAR_RECT)


def plot_latency_bars(rows: Sequence[dict[str, Any]], out_path: str) -> str:
  """P50 / P99 of TTFT and TBT (s) per policy at one load, one bar per repeat -> ``out_path``."""
  plt = pyplot()
  from matplotlib.lines import Line2D
  groups = _single_load_groups(rows)
  colors = policy_colors(p for p, _ in groups)
  fig, axes = plt.subplots(1, 4, figsize=(max(13.0, 1.3 * 4 * len(groups) + 3), 4.2))
  has_slo = False
  for ax, key, slo_key, title in zip(
      axes, ("ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s"),
      ("ttft_slo_s", "ttft_slo_s", "tbt_slo_s", "tbt_slo_s"),
      ("P50 TTFT", "P99 TTFT", "P50 TBT", "P99 TBT")):
    vals = _grouped_bars(ax, groups, key, colors)
    slos = {r[slo_key] for r in rows if r.get(slo_key)}
    for slo in slos:
      ax.axhline(slo, color="k", ls="--", lw=0.8)
      has_slo = True
    pos = [v for v in vals + list(slos) if v > 0]
    if pos and max(pos) / min(pos) > 20:
      ax.set_yscale("log")
      no_minor_labels(ax.yaxis)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel("seconds")
  slo_note(fig, rows, prefix=_load_title(rows))
  _bar_legend(fig, rows, [Line2D([], [], color="k", ls="--", lw=0.8, label="SLO")] if has_slo else [])
  return save_figure(fig, plt, out_path, rect=_BAR_RECT)


def plot_rotation_bars(rows: Sequence[dict[str, Any]], out_path: str) -> str:
  """Rotations per step and mean residency (steps) per policy at one load, per repeat -> ``out_path``."""
  plt = pyplot()
  groups = _single_load_groups(rows)
  colors = policy_colors(p for p, _ in groups)
  fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 1.4 * 2 * len(groups) + 3), 3.8))
  for ax, key, title, ylabel in zip(
      axes, ("rotations_per_step", "mean_residency_steps"),
      ("rotations per step", "mean residency (steps)"), ("rotations / step", "steps")):
    vals = _grouped_bars(ax, groups, key, colors)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1.15 * max(vals + [1e-9]))
  t = _load_title(rows)
  fig.suptitle("rotation behaviour" + (f" {t}" if t else ""), fontsize=9)
  _bar_legend(fig, rows)
  return save_figure(fig, plt, out_path, rect=(0, 0.09, 1, 0.98))
