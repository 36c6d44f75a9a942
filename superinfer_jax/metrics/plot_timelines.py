"""Per-request figures of a results directory (``plots.py``'s docstring lists them): TTFT / TBT CDFs per
policy and the per-request state timeline. Matplotlib is imported only inside the functions that draw.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from superinfer_jax.metrics.latency import latency_samples
from superinfer_jax.metrics.plot_common import no_minor_labels, pyplot, save_figure
from superinfer_jax.metrics.timeline import PREEMPTED, RUNNING, ROTARY, WAITING, RequestTimeline

STATE_COLORS = {WAITING: "#c7c7c7", RUNNING: "#4c72b0", ROTARY: "#dd8452", PREEMPTED: "#c44e52"}
_OTHER_COLOR = "#8c8c8c"


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
  plt = pyplot()
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
      no_minor_labels(ax.xaxis)
      ax.legend()
    ax.set_title(f"{name} CDF" + (f" — {title}" if title else ""))
  return save_figure(fig, plt, out_path)


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
  plt = pyplot()
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
  return save_figure(fig, plt, out_path)
