"""PNG figures from a results directory (matplotlib, Agg backend; imported lazily).

A results directory holds ``results.jsonl`` (rows of ``results.py``) and, optionally, per-request files
``requests-<policy>-<rps>.jsonl`` or, for repeated runs, ``requests-<policy>-<rps>-rep<k>.jsonl``
(``timeline.py``). A (policy, rps) may have several REPEATS: rows with ``repeat`` (0-based; missing ->
0), ``run_index`` (execution order), ``perturbed`` (bool, missing -> False: the run's step times drifted
from the warm-up's), ``step_time_drift``, ``rotations_per_step`` and ``mean_residency_steps``.
``plot_results_dir`` writes:

  With rows at >= 2 distinct RPS values (one point per policy and RPS = the MEAN over its repeats,
  min-max error bars where there are several):
  * ``slo_attainment_vs_rps.png``  SLO / TTFT / TBT attainment (%) vs RPS, one line per policy;
  * ``p99_latency_vs_rps.png``     P99 TTFT and P99 TBT (s, log scale) vs RPS, one line per policy.

  With rows at a SINGLE RPS value (lines vs RPS would be lone points) — grouped bars, one group per
  policy, one bar per repeat in run order (hatched: ``perturbed``; small "#i" = ``run_index``), a black
  diamond for the mean over the repeats:
  * ``attainment_bars.png``  SLO / TTFT / TBT attainment (%);
  * ``latency_bars.png``     P50 and P99 of TTFT and of TBT (s, from the rows' ``ttft_p50_s``,
    ``ttft_p99_s``, ``tbt_p50_s``, ``tbt_p99_s``; log scale when they span > 20x), SLOs dashed;
  * ``rotation_bars.png``    rotations per step and mean residency (steps) — only if some row has
    ``rotations_per_step`` or ``mean_residency_steps`` (older rows lack them).

  From per-request files (any number of RPS values):
  * ``latency_cdf-rps<rps>.png``   TTFT and TBT CDFs per policy at each RPS; a policy's repeats are
    pooled into one curve, labelled "(n=<repeats>)" when there are several;
  * ``timeline-<policy>-<rps>.png`` per-request timeline of the lowest repeat of each (policy, rps)
    (repeat 0 or the only file; named ``timeline-<policy>-<rps>-rep<k>.png`` only if that lowest repeat
    is k > 0): one row per request, coloured by state (waiting / running / rotary / preempted), a tick
    per output token, a marker per rotation. Shows at most ``max_timeline_requests`` requests (those
    with the most rotations first, then by arrival). Later repeats are not drawn (runtime).

Rows with the same (policy, rps, repeat) — a rerun appended to the same file — use the last one.
"""
from __future__ import annotations

import glob
import math
import os
from typing import Any, Sequence

import numpy as np

from superinfer_jax.metrics.latency import latency_samples
from superinfer_jax.metrics.results import read_results
from superinfer_jax.metrics.timeline import (PREEMPTED, RUNNING, ROTARY, WAITING, RequestTimeline,
                                             format_rps, parse_requests_filename_full, read_timelines)

STATE_COLORS = {WAITING: "#c7c7c7", RUNNING: "#4c72b0", ROTARY: "#dd8452", PREEMPTED: "#c44e52"}
_OTHER_COLOR = "#8c8c8c"
_ATTAINMENT = (("slo_attainment", "SLO attainment (TTFT & TPOT)"), ("ttft_attainment", "TTFT attainment"),
               ("tbt_attainment", "TBT attainment"))
_PERTURBED_HATCH = "///"


def _plt():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def row_repeat(row: dict[str, Any]) -> int:
  """The row's 0-based ``repeat`` (rows of older runs lack it: 0)."""
  r = row.get("repeat")
  return 0 if r is None else int(r)


def _num_value(v) -> float | None:
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
      vals = [v for v in (_num_value(r.get(key)) for r in rs) if v is not None]
      if vals:
        mean[key], lo[key], hi[key] = float(np.mean(vals)), min(vals), max(vals)
    out.setdefault(policy, []).append({
        "policy": policy, "rps": rps, "rows": rs, "num_repeats": len(rs),
        "num_perturbed": sum(1 for r in rs if r.get("perturbed")), "mean": mean, "min": lo, "max": hi})
  return out


def _policy_colors(policies) -> dict[str, str]:
  return {p: f"C{i % 10}" for i, p in enumerate(sorted(set(policies)))}


def _line_with_range(ax, aggs: Sequence[dict[str, Any]], key: str, scale: float, label: str,
                     color: str) -> None:
  """Mean over repeats vs rps, with min-max error bars when some point has several repeats."""
  pts = [(a["rps"], scale * a["mean"][key], scale * a["min"][key], scale * a["max"][key],
          a["num_repeats"]) for a in aggs if key in a["mean"]]
  if not pts:
    return
  x, y, lo, hi, n = (np.asarray(v, dtype=np.float64) for v in zip(*pts))
  yerr = np.vstack([y - lo, hi - y]) if (n > 1).any() else None
  ax.errorbar(x, y, yerr=yerr, marker="o", capsize=3 if yerr is not None else 0, label=label,
              color=color)


def _line_label(policy: str, aggs: Sequence[dict[str, Any]]) -> str:
  n = max(a["num_repeats"] for a in aggs)
  return f"{policy} (n={n})" if n > 1 else policy


def _line_legend(ax, aggs: dict[str, list[dict[str, Any]]]) -> None:
  several = any(a["num_repeats"] > 1 for ag in aggs.values() for a in ag)
  ax.legend(fontsize=8, title="mean of n repeats, bars: min-max" if several else None,
            title_fontsize=7)


def plot_attainment_vs_rps(rows: Sequence[dict[str, Any]], out_path: str) -> str:
  """SLO, TTFT and TBT attainment (%) vs RPS per policy (mean over repeats) -> ``out_path``."""
  plt = _plt()
  aggs = aggregate_repeats(rows)
  colors = _policy_colors(aggs)
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
  for ax, (key, title) in zip(axes, _ATTAINMENT):
    for policy, ag in aggs.items():
      _line_with_range(ax, ag, key, 100.0, _line_label(policy, ag), colors[policy])
    ax.set_title(title)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("attainment (%)")
  _line_legend(axes[0], aggs)
  _slo_note(fig, rows)
  return _save(fig, plt, out_path)


def plot_p99_vs_rps(rows: Sequence[dict[str, Any]], out_path: str) -> str:
  """P99 TTFT and P99 TBT (s) vs RPS per policy (mean over repeats), SLOs dashed -> ``out_path``."""
  plt = _plt()
  aggs = aggregate_repeats(rows)
  colors = _policy_colors(aggs)
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
  for ax, key, slo_key, title in zip(axes, ("ttft_p99_s", "tbt_p99_s"), ("ttft_slo_s", "tbt_slo_s"),
                                     ("P99 TTFT", "P99 TBT")):
    for policy, ag in aggs.items():
      _line_with_range(ax, ag, key, 1.0, _line_label(policy, ag), colors[policy])
    slos = {r[slo_key] for r in rows if r.get(slo_key)}
    for slo in slos:
      ax.axhline(slo, color="k", ls="--", lw=0.8)
    ax.set_title(title + (" (dashed: SLO)" if slos else ""))
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("seconds")
    if any(r.get(key) for r in rows):
      ax.set_yscale("log")
      _no_minor_labels(ax.yaxis)
    ax.grid(alpha=0.3, which="both")
  _line_legend(axes[0], aggs)
  return _save(fig, plt, out_path)


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
      v = _num_value(r.get(key))
      tag = f"#{r['run_index']}" if r.get("run_index") is not None else f"r{row_repeat(r)}"
      if v is None:
        ax.text(x, 0.02, f"{tag}\nn/a", transform=base, ha="center", va="bottom", fontsize=6)
        continue
      v *= scale
      vals.append(v)
      ax.bar(x, v, width * 0.9, color=colors[policy], edgecolor="k", lw=0.6,
             hatch=_PERTURBED_HATCH if r.get("perturbed") else None, alpha=0.85)
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
    handles.insert(1, Patch(facecolor="white", edgecolor="k", hatch=_PERTURBED_HATCH,
                            label="perturbed (step-time drift)"))
  handles += list(extra_handles)
  fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)


_BAR_RECT = (0, 0.07, 1, 0.98)


def _load_title(rows) -> str:
  rps = sorted({float(r["rps"]) for r in rows})
  return f"at {format_rps(rps[0])} req/s" if len(rps) == 1 else ""


def plot_attainment_bars(rows: Sequence[dict[str, Any]], out_path: str) -> str:
  """SLO / TTFT / TBT attainment (%) per policy at one load, one bar per repeat -> ``out_path``."""
  plt = _plt()
  groups = _single_load_groups(rows)
  colors = _policy_colors(p for p, _ in groups)
  fig, axes = plt.subplots(1, 3, figsize=(max(10.0, 1.6 * 3 * len(groups) + 3), 4.2), sharey=True)
  for ax, (key, title) in zip(axes, _ATTAINMENT):
    _grouped_bars(ax, groups, key, colors, scale=100.0, fmt="{:.1f}")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(0, 105)
  axes[0].set_ylabel("attainment (%)")
  _slo_note(fig, rows, prefix=_load_title(rows))
  _bar_legend(fig, rows)
  return _save(fig, plt, out_path, rect=_BAR_RECT)


def plot_latency_bars(rows: Sequence[dict[str, Any]], out_path: str) -> str:
  """P50 / P99 of TTFT and TBT (s) per policy at one load, one bar per repeat -> ``out_path``."""
  plt = _plt()
  from matplotlib.lines import Line2D
  groups = _single_load_groups(rows)
  colors = _policy_colors(p for p, _ in groups)
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
      _no_minor_labels(ax.yaxis)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel("seconds")
  _slo_note(fig, rows, prefix=_load_title(rows))
  _bar_legend(fig, rows, [Line2D([], [], color="k", ls="--", lw=0.8, label="SLO")] if has_slo else [])
  return _save(fig, plt, out_path, rect=_BAR_RECT)


def plot_rotation_bars(rows: Sequence[dict[str, Any]], out_path: str) -> str:
  """Rotations per step and mean residency (steps) per policy at one load, per repeat -> ``out_path``."""
  plt = _plt()
  groups = _single_load_groups(rows)
  colors = _policy_colors(p for p, _ in groups)
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
  return _save(fig, plt, out_path, rect=(0, 0.09, 1, 0.98))


def _cdf(ax, x: np.ndarray, label: str):
  if x.size:
    xs = np.sort(x)
    ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=label)


def plot_latency_cdfs(timelines_by_policy: dict[str, Sequence[RequestTimeline]], out_path: str, *,
                      title: str = "", ttft_slo_s: float | None = None,
                      tbt_slo_s: float | None = None, labels: dict[str, str] | None = None) -> str:
  """Empirical CDFs of TTFT and of pooled TBT gaps (s, log x) per policy -> ``out_path``.

  ``labels``: optional legend text per policy (default: the policy name).
  """
  plt = _plt()
  labels = labels or {}
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
  for policy, tls in sorted(timelines_by_policy.items()):
    s = latency_samples(tls)
    _cdf(axes[0], s["ttft"], labels.get(policy, policy))
    _cdf(axes[1], s["tbt"], labels.get(policy, policy))
  for ax, name, slo in zip(axes, ("TTFT", "TBT"), (ttft_slo_s, tbt_slo_s)):
    if slo:
      ax.axvline(slo, color="k", ls="--", lw=0.8)
    ax.set_xlabel(f"{name} (s)")
    ax.set_ylabel("CDF")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    if ax.has_data():
      ax.set_xscale("log")
      _no_minor_labels(ax.xaxis)
      ax.legend()
    ax.set_title(f"{name} CDF" + (f" — {title}" if title else ""))
  return _save(fig, plt, out_path)


def _spans(tl: RequestTimeline) -> list[tuple[float, float, str]]:
  """(start, end, state) spans from arrival to the last event; derived if there are no state changes."""
  end = max([tl.arrival_s] + list(tl.token_times_s[-1:]) + [t for t, _ in tl.state_changes])
  changes = list(tl.state_changes)
  if not changes:
    changes = [(tl.arrival_s, WAITING)]
    if tl.token_times_s:
      changes.append((tl.first_scheduled_s or tl.token_times_s[0], RUNNING))
  elif changes[0][0] > tl.arrival_s:
    changes.insert(0, (tl.arrival_s, WAITING))
  spans = []
  for (t0, s), (t1, _) in zip(changes, changes[1:] + [(end, "")]):
    if t1 > t0 and s != "finished":
      spans.append((t0, t1, s))
  return spans


def plot_request_timeline(timelines: Sequence[RequestTimeline], out_path: str, *, title: str = "",
                          max_requests: int = 40) -> str:
  """Per-request timeline (state spans, token ticks, rotation markers) -> ``out_path``."""
  plt = _plt()
  from matplotlib.patches import Patch
  chosen = sorted(timelines, key=lambda t: (-t.num_rotations, t.arrival_s))[:max_requests]
  chosen.sort(key=lambda t: t.arrival_s)
  t0 = min((t.arrival_s for t in chosen), default=0.0)
  fig, ax = plt.subplots(figsize=(12, max(2.5, 0.28 * len(chosen) + 1.2)))
  used = set()
  for y, tl in enumerate(chosen):
    for a, b, s in _spans(tl):
      ax.barh(y, b - a, left=a - t0, height=0.6, color=STATE_COLORS.get(s, _OTHER_COLOR), lw=0)
      used.add(s)
    if tl.token_times_s:
      tt = np.asarray(tl.token_times_s) - t0
      ax.vlines(tt, y - 0.3, y + 0.3, color="k", lw=0.4)
    rot = [t - t0 for t, s in tl.state_changes if s == ROTARY]
    if rot:
      ax.plot(rot, [y] * len(rot), "v", color="#dd8452", mec="k", ms=6)
  ax.set_yticks(range(len(chosen)))
  ax.set_yticklabels([t.request_id for t in chosen], fontsize=7)
  ax.invert_yaxis()
  ax.set_xlabel("time since first arrival (s)")
  ax.set_ylabel("request")
  handles = [Patch(color=STATE_COLORS.get(s, _OTHER_COLOR), label=s) for s in
             sorted(used, key=lambda s: list(STATE_COLORS).index(s) if s in STATE_COLORS else 99)]
  ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
  ax.set_title(title or "per-request timeline (ticks: output tokens, triangles: rotations out)")
  return _save(fig, plt, out_path)


def _no_minor_labels(axis):
  """Log axis labelled at 1-2-5 steps in plain numbers (no overlapping minor-tick labels)."""
  from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
  axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
  axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
  axis.set_minor_formatter(NullFormatter())


def _slo_note(fig, rows, prefix: str = ""):
  slos = {(r.get("ttft_slo_s"), r.get("tbt_slo_s")) for r in rows}
  parts = [prefix] if prefix else []
  if len(slos) == 1:
    ttft, tbt = next(iter(slos))
    if ttft and tbt:
      parts.append(f"SLO: TTFT <= {ttft:g} s, TBT/TPOT <= {1000 * tbt:g} ms")
  if parts:
    fig.suptitle(" — ".join(parts), fontsize=9)


def _save(fig, plt, out_path: str, rect=None) -> str:
  d = os.path.dirname(out_path)
  if d:
    os.makedirs(d, exist_ok=True)
  fig.tight_layout(rect=rect)
  fig.savefig(out_path, dpi=110)
  plt.close(fig)
  return out_path


def find_request_files(results_dir: str) -> dict[tuple[str, float, int], str]:
  """{(policy, rps, repeat): path} of the per-request files in ``results_dir``, sorted by key.

  ``requests-<policy>-<rps>.jsonl`` counts as repeat 0, ``requests-<policy>-<rps>-rep<k>.jsonl`` as
  repeat k; if both a plain and a ``-rep0`` file exist, the ``-rep0`` one is used.
  """
  out: dict[tuple[str, float, int], str] = {}
  explicit = set()
  for path in sorted(glob.glob(os.path.join(results_dir, "requests-*.jsonl"))):
    parsed = parse_requests_filename_full(path)
    if parsed is None:
      continue
    policy, rps, rep = parsed
    key = (policy, rps, 0 if rep is None else rep)
    if rep is None and key in explicit:
      continue
    out[key] = path
    if rep is not None:
      explicit.add(key)
  return dict(sorted(out.items()))


def plot_results_dir(results_dir: str, out_dir: str | None = None, *,
                     max_timeline_requests: int = 40, timelines: bool = True) -> list[str]:
  """Writes every figure of the module docstring for ``results_dir`` into ``out_dir``; returns paths.

  ``out_dir`` defaults to ``results_dir``. Needs ``results.jsonl`` or at least one per-request file.
  ``timelines=False`` skips the per-request timeline figures (seconds each: sweeps of many runs).
  """
  out_dir = out_dir or results_dir
  os.makedirs(out_dir, exist_ok=True)
  written = []
  res_path = os.path.join(results_dir, "results.jsonl")
  rows = read_results(res_path) if os.path.isfile(res_path) else []
  req_files = find_request_files(results_dir)
  if not rows and not req_files:
    raise FileNotFoundError(f"{results_dir}: neither results.jsonl nor requests-*.jsonl found")
  rps_values = {float(r["rps"]) for r in rows}
  if len(rps_values) >= 2:
    written.append(plot_attainment_vs_rps(rows, os.path.join(out_dir, "slo_attainment_vs_rps.png")))
    written.append(plot_p99_vs_rps(rows, os.path.join(out_dir, "p99_latency_vs_rps.png")))
  elif len(rps_values) == 1:
    written.append(plot_attainment_bars(rows, os.path.join(out_dir, "attainment_bars.png")))
    written.append(plot_latency_bars(rows, os.path.join(out_dir, "latency_bars.png")))
    if any(_num_value(r.get(k)) is not None for r in rows
           for k in ("rotations_per_step", "mean_residency_steps")):
      written.append(plot_rotation_bars(rows, os.path.join(out_dir, "rotation_bars.png")))
  # rps matched as written in file names (format_rps), so a rounded name still finds its row's SLOs.
  slo = {(r["policy"], format_rps(r["rps"])): (r["ttft_slo_s"], r["tbt_slo_s"]) for r in rows}
  loaded = {key: read_timelines(path) for key, path in req_files.items()}
  for rps in sorted({rps for _, rps, _ in loaded}):
    pooled: dict[str, list[RequestTimeline]] = {}
    repeats: dict[str, int] = {}
    for (p, r, _), tls in loaded.items():
      if r == rps:
        pooled.setdefault(p, []).extend(tls)
        repeats[p] = repeats.get(p, 0) + 1
    labels = {p: f"{p} (n={n})" if n > 1 else p for p, n in repeats.items()}
    slos = [slo[(p, format_rps(rps))] for p in pooled if (p, format_rps(rps)) in slo]
    ttft_slo, tbt_slo = slos[0] if slos else (None, None)
    written.append(plot_latency_cdfs(
        pooled, os.path.join(out_dir, f"latency_cdf-rps{format_rps(rps)}.png"),
        title=f"rps {format_rps(rps)}", ttft_slo_s=ttft_slo, tbt_slo_s=tbt_slo, labels=labels))
  lowest: dict[tuple[str, float], int] = {}
  for policy, rps, rep in (loaded if timelines else ()):
    lowest[(policy, rps)] = min(rep, lowest.get((policy, rps), rep))
  for (policy, rps), rep in sorted(lowest.items()):
    tls = loaded[(policy, rps, rep)]
    if tls:
      suffix = f"-rep{rep}" if rep > 0 else ""
      several = any(k[:2] == (policy, rps) and k[2] != rep for k in loaded)
      rep_note = f" (repeat {rep})" if rep > 0 or several else ""
      written.append(plot_request_timeline(
          tls, os.path.join(out_dir, f"timeline-{policy}-{format_rps(rps)}{suffix}.png"),
          title=f"{policy} @ {format_rps(rps)} req/s{rep_note}: states, tokens (ticks), "
                "rotations (triangles)",
          max_requests=max_timeline_requests))
  return written


# Figure metrics: (row key, axis title, scale, log axis). ``plot_figure_panels`` takes a list of these keys.
FIGURE_METRICS = {
    "ttft_p99_s": ("P99 TTFT (s)", 1.0, True), "tbt_p99_s": ("P99 TBT (s)", 1.0, True),
    "ttft_p50_s": ("P50 TTFT (s)", 1.0, True), "tbt_p50_s": ("P50 TBT (s)", 1.0, True),
    "slo_attainment": ("SLO attainment (%)", 100.0, False),
    "ttft_attainment": ("TTFT attainment (%)", 100.0, False),
    "tbt_attainment": ("TBT attainment (%)", 100.0, False),
    "output_throughput_tok_s": ("output tokens/s", 1.0, False),
    "rotations_per_step": ("rotations per step", 1.0, False),
    "blocks_in_per_step": ("blocks in (H2D) per step", 1.0, False),
    "exposed_transfer_share": ("exposed copy time (share of run)", 1.0, False),
    "tbt_worst_p99_s": ("P99 over requests of worst TBT (s)", 1.0, True),
    "tbt_request_attainment": ("TBT attainment, per request (%)", 100.0, False),
    "kv_demand_p50": ("live KV / pool, P50", 1.0, False),
}

X_LABELS = {"rps": "request rate (req/s)", "swap_bandwidth_gbps": "swap bandwidth per direction (GB/s)",
            "proactive_swap_budget": "B_xfer (blocks per step)", "alpha": "alpha", "beta_f": "beta_F",
            "beta_b": "beta_B", "tensor_parallel_size": "tensor-parallel GPUs"}


def series_label(row: dict[str, Any], x_key: str) -> str:
  """A row's line in a figure: its base policy plus the variant settings other than the x axis's."""
  variant = {k: v for k, v in (row.get("variant") or {}).items() if k != x_key}
  base = row.get("base_policy") or row["policy"]
  return f"{base}[{','.join(f'{k}={v}' for k, v in variant.items())}]" if variant else base


def plot_figure_panels(panels: Sequence[tuple[str, str, Sequence[dict[str, Any]]]], out_path: str, *,
                       metrics: Sequence[str], title: str = "", log_x: Sequence[str] = ()) -> str:
  """One figure of a paper experiment: a column per panel (``(panel title, x_key, rows)``), a row of axes
  per metric (keys of ``FIGURE_METRICS``), one line per ``series_label`` with ``row[x_key]`` on the x axis
  (rows missing x or the metric are skipped). Several rows at one (series, x), e.g. one per seed, draw
  their mean with the min-max range shaded. SLOs of the latency metrics dashed; x keys in ``log_x`` on a
  log2 axis. -> ``out_path``."""
  unknown = [m for m in metrics if m not in FIGURE_METRICS]
  if unknown or not metrics or not panels:
    raise ValueError(f"plot_figure_panels: need panels and metrics from {sorted(FIGURE_METRICS)}, got "
                     f"{len(panels)} panels, metrics {list(metrics)}")
  plt = _plt()
  labels = sorted({series_label(r, x_key) for _, x_key, rows in panels for r in rows})
  colors = {lab: f"C{i % 10}" for i, lab in enumerate(labels)}
  if len(panels) == 1:   # one panel: its metrics in a grid of up to 4 columns, each axis titled
    ncols = min(len(metrics), 4)
    nrows = -(-len(metrics) // ncols)
    cells = [(0, i, divmod(i, ncols)) for i in range(len(metrics))]
  else:                  # a column per panel, a row per metric
    nrows, ncols = len(metrics), len(panels)
    cells = [(j, i, (i, j)) for j in range(len(panels)) for i in range(len(metrics))]
  fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols + 1.0, 3.0 * nrows + 0.4), squeeze=False)
  used = set()
  for j, i, (ri, ci) in cells:
    panel_title, x_key, rows = panels[j]
    key = metrics[i]
    name, scale, log_y = FIGURE_METRICS[key]
    ax = axes[ri][ci]
    used.add((ri, ci))
    samples: dict[str, dict[float, list[float]]] = {}
    for r in rows:
      x, y = _num_value(r.get(x_key)), _num_value(r.get(key))
      if x is not None and y is not None:
        samples.setdefault(series_label(r, x_key), {}).setdefault(x, []).append(scale * y)
    points = {lab: {x: sum(ys) / len(ys) for x, ys in pts.items()} for lab, pts in samples.items()}
    for lab, pts in sorted(samples.items()):
      xs = sorted(pts)
      ax.plot(xs, [points[lab][x] for x in xs], marker="o", label=lab, color=colors[lab])
      if any(len(pts[x]) > 1 for x in xs):
        ax.fill_between(xs, [min(pts[x]) for x in xs], [max(pts[x]) for x in xs], color=colors[lab], alpha=0.2,
                        lw=0)
    slo_key = {"ttft_p99_s": "ttft_slo_s", "ttft_p50_s": "ttft_slo_s", "tbt_p99_s": "tbt_slo_s",
               "tbt_p50_s": "tbt_slo_s"}.get(key)
    for slo in sorted({r[slo_key] for r in rows if slo_key and r.get(slo_key)}):
      ax.axhline(slo, color="k", ls="--", lw=0.8)
    if log_y and any(v > 0 for pts in points.values() for v in pts.values()):
      ax.set_yscale("log")
      ax.yaxis.set_major_formatter(_plain_formatter())
      ax.yaxis.set_minor_formatter(_plain_formatter(minor=True))
    if x_key in log_x:
      ax.set_xscale("log", base=2)
      ax.xaxis.set_major_formatter(_plain_formatter())
    if len(panels) == 1:
      ax.set_title(name, fontsize=9)
    else:
      if ri == 0:
        ax.set_title(panel_title, fontsize=10)
      if ci == 0:
        ax.set_ylabel(name, fontsize=9)
    if len(panels) == 1 or ri == nrows - 1:
      ax.set_xlabel(X_LABELS.get(x_key, x_key), fontsize=9)
    ax.grid(alpha=0.3, which="both")
    if (ri, ci) == (0, 0) and points:
      ax.legend(fontsize=7)
  for ri in range(nrows):
    for ci in range(ncols):
      if (ri, ci) not in used:
        axes[ri][ci].set_visible(False)
  _slo_note(fig, [r for _, _, rows in panels for r in rows], prefix=title)
  return _save(fig, plt, out_path, rect=(0, 0, 1, 0.96) if title else None)


def _plain_formatter(minor: bool = False):
  """Plain-number tick labels (``minor``: only at 2x and 5x a power of ten, so log axes stay legible)."""
  from matplotlib.ticker import FuncFormatter

  def fmt(v, _):
    if minor and not any(abs(v / 10 ** math.floor(math.log10(v)) - m) < 1e-6 for m in (2, 5)):
      return ""
    return f"{v:g}"
  return FuncFormatter(fmt)
