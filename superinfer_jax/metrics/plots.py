"""PNG figures from a results directory (matplotlib, Agg backend; imported lazily).

A results directory holds ``results.jsonl`` (rows of ``results.py``) and, optionally, per-request files
``requests-<policy>-<rps>.jsonl`` (``timeline.py``). ``plot_results_dir`` writes:

  * ``slo_attainment_vs_rps.png``  SLO / TTFT / TBT attainment (%) vs RPS, one line per policy;
  * ``p99_latency_vs_rps.png``     P99 TTFT and P99 TBT (s, log scale) vs RPS, one line per policy;
  * ``latency_cdf-rps<rps>.png``   TTFT and TBT CDFs per policy at each RPS with per-request files;
  * ``timeline-<policy>-<rps>.png`` per-request timelines: one row per request, coloured by state
    (waiting / running / rotary / preempted), a tick per output token, a marker per
    rotation. Shows at most ``max_timeline_requests`` requests (those with the most rotations first, then
    by arrival).

Rows with several entries for the same (policy, rps) use the last one.
"""
from __future__ import annotations

import glob
import os
from typing import Any, Sequence

import numpy as np

from superinfer_jax.metrics.latency import latency_samples
from superinfer_jax.metrics.results import read_results
from superinfer_jax.metrics.timeline import (PREEMPTED, RUNNING, ROTARY, WAITING, RequestTimeline,
                                             format_rps, parse_requests_filename, read_timelines)

STATE_COLORS = {WAITING: "#c7c7c7", RUNNING: "#4c72b0", ROTARY: "#dd8452", PREEMPTED: "#c44e52"}
_OTHER_COLOR = "#8c8c8c"


def _plt():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def _by_policy(rows: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
  latest: dict[tuple[str, float], dict[str, Any]] = {}
  for r in rows:
    latest[(r["policy"], float(r["rps"]))] = r
  out: dict[str, list[dict[str, Any]]] = {}
  for (policy, _), r in sorted(latest.items(), key=lambda kv: (kv[0][0], kv[0][1])):
    out.setdefault(policy, []).append(r)
  return out


def plot_attainment_vs_rps(rows: Sequence[dict[str, Any]], out_path: str) -> str:
  """SLO, TTFT and TBT attainment (%) vs RPS per policy -> ``out_path``."""
  plt = _plt()
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
  for ax, key, title in zip(axes, ("slo_attainment", "ttft_attainment", "tbt_attainment"),
                            ("SLO attainment (TTFT & TPOT)", "TTFT attainment", "TBT attainment")):
    for policy, rs in _by_policy(rows).items():
      ax.plot([r["rps"] for r in rs], [100.0 * r[key] for r in rs], marker="o", label=policy)
    ax.set_title(title)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("attainment (%)")
  axes[0].legend()
  _slo_note(fig, rows)
  return _save(fig, plt, out_path)


def plot_p99_vs_rps(rows: Sequence[dict[str, Any]], out_path: str) -> str:
  """P99 TTFT and P99 TBT (s) vs RPS per policy, with the SLOs dashed -> ``out_path``."""
  plt = _plt()
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
  for ax, key, slo_key, title in zip(axes, ("ttft_p99_s", "tbt_p99_s"), ("ttft_slo_s", "tbt_slo_s"),
                                     ("P99 TTFT", "P99 TBT")):
    for policy, rs in _by_policy(rows).items():
      pts = [(r["rps"], r[key]) for r in rs if r.get(key) is not None]
      if pts:
        ax.plot(*zip(*pts), marker="o", label=policy)
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
  axes[0].legend()
  return _save(fig, plt, out_path)


def _cdf(ax, x: np.ndarray, label: str):
  if x.size:
    xs = np.sort(x)
    ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=label)


def plot_latency_cdfs(timelines_by_policy: dict[str, Sequence[RequestTimeline]], out_path: str, *,
                      title: str = "", ttft_slo_s: float | None = None,
                      tbt_slo_s: float | None = None) -> str:
  """Empirical CDFs of TTFT and of pooled TBT gaps (s, log x) per policy -> ``out_path``."""
  plt = _plt()
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
  for policy, tls in sorted(timelines_by_policy.items()):
    s = latency_samples(tls)
    _cdf(axes[0], s["ttft"], policy)
    _cdf(axes[1], s["tbt"], policy)
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


def _slo_note(fig, rows):
  slos = {(r.get("ttft_slo_s"), r.get("tbt_slo_s")) for r in rows}
  if len(slos) == 1:
    ttft, tbt = next(iter(slos))
    fig.suptitle(f"SLO: TTFT <= {ttft:g} s, TBT/TPOT <= {1000 * tbt:g} ms", fontsize=9)


def _save(fig, plt, out_path: str) -> str:
  d = os.path.dirname(out_path)
  if d:
    os.makedirs(d, exist_ok=True)
  fig.tight_layout()
  fig.savefig(out_path, dpi=110)
  plt.close(fig)
  return out_path


def find_request_files(results_dir: str) -> dict[tuple[str, float], str]:
  """{(policy, rps): path} of the ``requests-<policy>-<rps>.jsonl`` files in ``results_dir``."""
  out = {}
  for path in sorted(glob.glob(os.path.join(results_dir, "requests-*.jsonl"))):
    key = parse_requests_filename(path)
    if key is not None:
      out[key] = path
  return out


def plot_results_dir(results_dir: str, out_dir: str | None = None, *,
                     max_timeline_requests: int = 40) -> list[str]:
  """Writes every figure of the module docstring for ``results_dir`` into ``out_dir``; returns paths.

  ``out_dir`` defaults to ``results_dir``. Needs ``results.jsonl`` or at least one per-request file.
  """
  out_dir = out_dir or results_dir
  os.makedirs(out_dir, exist_ok=True)
  written = []
  res_path = os.path.join(results_dir, "results.jsonl")
  rows = read_results(res_path) if os.path.isfile(res_path) else []
  req_files = find_request_files(results_dir)
  if not rows and not req_files:
    raise FileNotFoundError(f"{results_dir}: neither results.jsonl nor requests-*.jsonl found")
  if rows:
    written.append(plot_attainment_vs_rps(rows, os.path.join(out_dir, "slo_attainment_vs_rps.png")))
    written.append(plot_p99_vs_rps(rows, os.path.join(out_dir, "p99_latency_vs_rps.png")))
  slo = {(r["policy"], float(r["rps"])): (r["ttft_slo_s"], r["tbt_slo_s"]) for r in rows}
  loaded = {key: read_timelines(path) for key, path in req_files.items()}
  for rps in sorted({rps for _, rps in loaded}):
    by_policy = {p: tls for (p, r), tls in loaded.items() if r == rps}
    slos = [slo[(p, rps)] for p in by_policy if (p, rps) in slo]
    ttft_slo, tbt_slo = slos[0] if slos else (None, None)
    written.append(plot_latency_cdfs(
        by_policy, os.path.join(out_dir, f"latency_cdf-rps{format_rps(rps)}.png"),
        title=f"rps {format_rps(rps)}", ttft_slo_s=ttft_slo, tbt_slo_s=tbt_slo))
  for (policy, rps), tls in sorted(loaded.items()):
    if tls:
      written.append(plot_request_timeline(
          tls, os.path.join(out_dir, f"timeline-{policy}-{format_rps(rps)}.png"),
          title=f"{policy} @ {format_rps(rps)} req/s: states, tokens (ticks), rotations (triangles)",
          max_requests=max_timeline_requests))
  return written
