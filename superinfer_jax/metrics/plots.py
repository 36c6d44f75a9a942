"""PNG figures from a results directory (matplotlib, Agg backend; imported lazily), and the paper figures' panels.

The bar figures are drawn in ``plot_bars.py``, the CDFs and timelines in ``plot_timelines.py``, the shared
helpers (repeat aggregation, colours, saving) live in ``plot_common.py``; this module holds the lines vs RPS,
``plot_results_dir`` (which draws them all) and ``plot_figure_panels``.

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
import os
from typing import Any, Sequence

import numpy as np

from superinfer_jax.metrics.plot_bars import plot_attainment_bars, plot_latency_bars, plot_rotation_bars
from superinfer_jax.metrics.plot_common import (ATTAINMENT_METRICS, aggregate_repeats, no_minor_labels, num_value,
                                                plain_formatter, policy_colors, pyplot, save_figure, slo_note)
from superinfer_jax.metrics.plot_timelines import plot_latency_cdfs, plot_request_timeline
from superinfer_jax.metrics.results import read_results
from superinfer_jax.metrics.timeline import (RequestTimeline, format_rps, parse_requests_filename_full,
                                             read_timelines)


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
  plt = pyplot()
  aggs = aggregate_repeats(rows)
  colors = policy_colors(aggs)
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
  for ax, (key, title) in zip(axes, ATTAINMENT_METRICS):
    for policy, ag in aggs.items():
      _line_with_range(ax, ag, key, 100.0, _line_label(policy, ag), colors[policy])
    ax.set_title(title)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("attainment (%)")
  _line_legend(axes[0], aggs)
  slo_note(fig, rows)
  return save_figure(fig, plt, out_path)


def plot_p99_vs_rps(rows: Sequence[dict[str, Any]], out_path: str) -> str:
  """P99 TTFT and P99 TBT (s) vs RPS per policy (mean over repeats), SLOs dashed -> ``out_path``."""
  plt = pyplot()
  aggs = aggregate_repeats(rows)
  colors = policy_colors(aggs)
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
      no_minor_labels(ax.yaxis)
    ax.grid(alpha=0.3, which="both")
  _line_legend(axes[0], aggs)
  return save_figure(fig, plt, out_path)



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
    if any(num_value(r.get(k)) is not None for r in rows
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
    "prefix_hit_rate": ("prefix hit rate, both tiers (% of prompt blocks)", 100.0, False),
    "prefix_host_hit_rate": ("prefix hit rate, host tier (% of prompt blocks)", 100.0, False),
    "prefill_tokens_saved": ("prefill tokens saved", 1.0, False),
    "prefix_host_evictions": ("host-tier evictions (blocks)", 1.0, False),
}

X_LABELS = {"rps": "request rate (req/s)", "swap_bandwidth_gbps": "swap bandwidth per direction (GB/s)",
            "proactive_swap_budget": "B_xfer (blocks per step)", "alpha": "alpha", "beta_f": "beta_F",
            "beta_b": "beta_B", "tensor_parallel_size": "tensor-parallel GPUs",
            "load_target": "contention target (fcfs P99 live KV / pool)"}


def series_label(row: dict[str, Any], x_key: str) -> str:
  """A row's line in a figure: its base policy plus the variant settings other than the x axis's."""
  variant = {k: v for k, v in (row.get("variant") or {}).items() if k != x_key}
  base = row.get("base_policy") or row["policy"]
  return f"{base}[{','.join(f'{k}={v}' for k, v in variant.items())}]" if variant else base


def _panel_layout(num_panels: int, num_metrics: int) -> tuple[int, int, list[tuple[int, int, tuple[int, int]]]]:
  """The axes grid of ``plot_figure_panels``: ``(nrows, ncols, cells)``, each cell ``(panel index, metric
  index, (row, col))``. One panel: its metrics in a grid of up to 4 columns; several: a column per panel and
  a row per metric."""
  if num_panels == 1:
    ncols = min(num_metrics, 4)
    nrows = -(-num_metrics // ncols)
    return nrows, ncols, [(0, i, divmod(i, ncols)) for i in range(num_metrics)]
  return num_metrics, num_panels, [(j, i, (i, j)) for j in range(num_panels) for i in range(num_metrics)]


def _draw_metric(ax, rows: Sequence[dict[str, Any]], x_key: str, key: str, colors: dict[str, str], *,
                 log_x: bool) -> bool:
  """Draws metric ``key`` (of ``FIGURE_METRICS``, scaled) of ``rows`` against ``row[x_key]`` on ``ax``: a
  line per ``series_label`` at the mean of the rows at each x, their min-max range shaded where there are
  several; the latency metrics' SLOs dashed; log y for the log metrics, log2 x when ``log_x``; a grid.
  Rows missing x or the metric are skipped. -> whether any line was drawn."""
  _, scale, log_y = FIGURE_METRICS[key]
  samples: dict[str, dict[float, list[float]]] = {}
  for r in rows:
    x, y = num_value(r.get(x_key)), num_value(r.get(key))
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
    ax.yaxis.set_major_formatter(plain_formatter())
    ax.yaxis.set_minor_formatter(plain_formatter(minor=True))
  if log_x:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(plain_formatter())
  ax.grid(alpha=0.3, which="both")
  return bool(points)


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
  plt = pyplot()
  labels = sorted({series_label(r, x_key) for _, x_key, rows in panels for r in rows})
  colors = {lab: f"C{i % 10}" for i, lab in enumerate(labels)}
  nrows, ncols, cells = _panel_layout(len(panels), len(metrics))
  fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols + 1.0, 3.0 * nrows + 0.4), squeeze=False)
  used = set()
  for j, i, (ri, ci) in cells:
    panel_title, x_key, rows = panels[j]
    ax = axes[ri][ci]
    used.add((ri, ci))
    drew = _draw_metric(ax, rows, x_key, metrics[i], colors, log_x=x_key in log_x)
    name = FIGURE_METRICS[metrics[i]][0]
    if len(panels) == 1:
      ax.set_title(name, fontsize=9)
    else:
      if ri == 0:
        ax.set_title(panel_title, fontsize=10)
      if ci == 0:
        ax.set_ylabel(name, fontsize=9)
    if len(panels) == 1 or ri == nrows - 1:
      ax.set_xlabel(X_LABELS.get(x_key, x_key), fontsize=9)
    if (ri, ci) == (0, 0) and drew:
      ax.legend(fontsize=7)
  for ri in range(nrows):
    for ci in range(ncols):
      if (ri, ci) not in used:
        axes[ri][ci].set_visible(False)
  slo_note(fig, [r for _, _, rows in panels for r in rows], prefix=title)
  return save_figure(fig, plt, out_path, rect=(0, 0, 1, 0.96) if title else None)
