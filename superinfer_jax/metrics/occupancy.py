"""Pool occupancy over time and rotations per step, read from per-request timelines, and their plots.

Both series come from the ``metrics.timeline`` schema alone, so a real run and a simulated one are measured the
same way:

* ``resident_blocks``: at each time ``t``, the device KV blocks held by the requests in state ``running`` at
  ``t``: ``ceil((prompt_len + output tokens emitted by t) / block_size)`` each. It counts a prefill's whole
  prompt from admission (a chunked prefill allocates it over a few steps), so it can sit a little above the
  block manager's count; it never includes requests that are waiting, rotary or preempted.
* ``rotation_steps``: the state changes into ``rotary`` grouped by their timestamp. Every change one plan makes
  carries that plan's time, so each group is one step's rotations out.

``plot_occupancy`` and ``plot_rotations_per_step`` draw one panel per policy with a line per source (e.g.
``real`` and ``sim``) and write a PNG; ``plot_transfer_split`` draws each policy's KV copy time split into the
part hidden behind compute and the part exposed (stacked bars, a bar per source). Host-side: numpy and
matplotlib (Agg) only, no JAX.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import numpy as np

from superinfer_jax.metrics.timeline import ROTARY, RUNNING, RequestTimeline

Series = tuple[np.ndarray, np.ndarray]    # (times in s from the run's first arrival, values)


def run_start(timelines: Sequence[RequestTimeline]) -> float:
  """The run's first arrival (s, the timelines' clock); 0 for no timelines."""
  return min((t.arrival_s for t in timelines), default=0.0)


def _running_intervals(tl: RequestTimeline, end: float) -> list[tuple[float, float]]:
  """[start, stop) intervals during which ``tl`` was ``running`` (the last one closed at ``end``)."""
  out, start = [], None
  for ts, state in tl.state_changes:
    if state == RUNNING and start is None:
      start = ts
    elif state != RUNNING and start is not None:
      out.append((start, ts))
      start = None
  if start is not None:
    out.append((start, end))
  return out


def resident_blocks(timelines: Sequence[RequestTimeline], block_size: int, times: Sequence[float]) -> np.ndarray:
  """Device blocks held by running requests at each of ``times`` (same clock as the timelines), int64 [len]."""
  if block_size < 1:
    raise ValueError(f"block_size must be >= 1, got {block_size}")
  t = np.asarray(times, dtype=np.float64)
  total = np.zeros(t.shape, dtype=np.int64)
  end = max((x for tl in timelines for x in tl.token_times_s[-1:]), default=0.0)
  end = max([end] + [ts for tl in timelines for ts, _ in tl.state_changes[-1:]])
  for tl in timelines:
    tokens = np.asarray(tl.token_times_s, dtype=np.float64)
    for a, b in _running_intervals(tl, end):
      inside = (t >= a) & (t < b)
      if not inside.any():
        continue
      emitted = np.searchsorted(tokens, t[inside], side="right")
      total[inside] += -(-(tl.prompt_len + emitted) // block_size)
  return total


def occupancy_series(timelines: Sequence[RequestTimeline], block_size: int, *, num_points: int = 400) -> Series:
  """``resident_blocks`` on ``num_points`` evenly spaced times from the first arrival to the last event."""
  if not timelines:
    return np.zeros(0), np.zeros(0, dtype=np.int64)
  t0 = run_start(timelines)
  end = max([t0] + [x for tl in timelines for x in tl.token_times_s[-1:]]
            + [ts for tl in timelines for ts, _ in tl.state_changes[-1:]])
  times = np.linspace(t0, end, max(2, num_points))
  return times - t0, resident_blocks(timelines, block_size, times)


def rotation_steps(timelines: Sequence[RequestTimeline]) -> Series:
  """(time from the first arrival of each step that rotated, rotations out in that step), by time."""
  t0 = run_start(timelines)
  stamps = np.asarray([ts for tl in timelines for ts, s in tl.state_changes if s == ROTARY], dtype=np.float64)
  if not stamps.size:
    return np.zeros(0), np.zeros(0, dtype=np.int64)
  times, counts = np.unique(stamps, return_counts=True)
  return times - t0, counts.astype(np.int64)


def _panels(n: int):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  cols = min(3, max(1, n))
  rows = math.ceil(n / cols)
  fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.0 * rows), squeeze=False, sharex=False)
  return plt, fig, [ax for row in axes for ax in row]


STYLES = {"real": dict(color="tab:blue", lw=1.4), "sim": dict(color="tab:orange", lw=1.2, ls="--"),
          "real (block manager)": dict(color="tab:green", lw=0.8, alpha=0.7)}


def _style(source: str) -> dict:
  return STYLES.get(source, STYLES.get(source.split(" ")[0], {}))


def _finish(plt, fig, axes, used: int, out_path: str, title: str) -> str:
  for ax in axes[used:]:
    ax.set_visible(False)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout(rect=(0, 0, 1, 0.95))
  fig.savefig(out_path, dpi=110)
  plt.close(fig)
  return out_path


def plot_occupancy(by_policy: Mapping[str, Mapping[str, Series]], out_path: str, *, pool_blocks: Optional[int],
                   title: str = "device KV pool occupancy") -> str:
  """One panel per policy: blocks over time (s from the first arrival), a line per source, and the pool size
  as a dotted line. ``by_policy[policy][source] = (times, blocks)``. Returns ``out_path``."""
  plt, fig, axes = _panels(len(by_policy))
  for ax, (policy, sources) in zip(axes, by_policy.items()):
    for source, (t, y) in sources.items():
      ax.plot(t, y, label=source, **_style(source))
    if pool_blocks:
      ax.axhline(pool_blocks, color="grey", ls=":", lw=1, label="pool")
    ax.set_title(policy, fontsize=9)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("blocks")
    ax.legend(fontsize=7)
  return _finish(plt, fig, axes, len(by_policy), out_path, title)


def plot_rotations_per_step(by_policy: Mapping[str, Mapping[str, Series]], out_path: str, *,
                            title: str = "rotations out per step") -> str:
  """One panel per policy: each rotating step's rotations out at its time, a marker series per source, and the
  cumulative count on a second axis. ``by_policy[policy][source] = (times, counts)``. Returns ``out_path``."""
  plt, fig, axes = _panels(len(by_policy))
  for ax, (policy, sources) in zip(axes, by_policy.items()):
    twin = ax.twinx()
    for source, (t, y) in sources.items():
      style = _style(source)
      ax.plot(t, y, ".", ms=3, color=style.get("color"), label=f"{source} ({int(np.sum(y))})")
      twin.step(t, np.cumsum(y), where="post", color=style.get("color"), ls=style.get("ls", "-"), lw=0.8)
    ax.set_title(policy, fontsize=9)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("rotations in the step")
    twin.set_ylabel("cumulative", fontsize=7)
    ax.legend(fontsize=7, loc="upper left")
  return _finish(plt, fig, axes, len(by_policy), out_path, title)


def plot_transfer_split(by_policy: Mapping[str, Mapping[str, tuple[float, float]]], out_path: str, *,
                        title: str = "KV copy time: hidden behind compute vs exposed") -> str:
  """Stacked bars, a group per policy and a bar per source: hidden (bottom) and exposed (top) copy time in
  ms. ``by_policy[policy][source] = (hidden_s, exposed_s)``, both >= 0 and finite. Returns ``out_path``."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  sources = list(dict.fromkeys(src for v in by_policy.values() for src in v))
  width = 0.8 / max(1, len(sources))
  fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(by_policy) + 2), 3.4))
  x = np.arange(len(by_policy))
  for i, src in enumerate(sources):
    hidden = np.array([1e3 * v.get(src, (0.0, 0.0))[0] for v in by_policy.values()])
    exposed = np.array([1e3 * v.get(src, (0.0, 0.0))[1] for v in by_policy.values()])
    if not (np.all(np.isfinite(hidden)) and np.all(np.isfinite(exposed)) and hidden.min(initial=0) >= 0
            and exposed.min(initial=0) >= 0):
      raise ValueError(f"copy times of {src!r} must be finite and >= 0: {hidden}, {exposed}")
    color = _style(src).get("color")
    pos = x + (i - (len(sources) - 1) / 2) * width
    ax.bar(pos, hidden, width, color=color, alpha=0.45, label=f"{src} hidden")
    ax.bar(pos, exposed, width, bottom=hidden, color=color, label=f"{src} exposed")
  ax.set_xticks(x)
  ax.set_xticklabels(list(by_policy), fontsize=8, rotation=20)
  ax.set_ylabel("copy time (ms)")
  ax.set_title(title, fontsize=10)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out_path, dpi=110)
  plt.close(fig)
  return out_path


__all__ = ["Series", "occupancy_series", "plot_occupancy", "plot_rotations_per_step", "plot_transfer_split",
           "resident_blocks", "rotation_steps", "run_start"]
