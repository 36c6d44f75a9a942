"""Transfer model: the time one step's KV copies take on the device <-> host link, per DuplexKV mode.

Units: bytes, seconds; bandwidths in GB/s (1e9 B/s). Pure functions (no JAX, no numpy).

Bandwidth by segment size (``curve_bandwidth``): a profile gives per-direction points ``(segment bytes,
GB/s)``, the paper's Fig. 5 curves (docs/paper.md §5 rows 6-7). Between points the bandwidth is linear in
``log(segment size)``; above the last point it stays at the plateau; below the first it falls in proportion
to the size (a latency-bound copy takes constant time per segment).

Modes, as ``rotation/duplexkv.py`` runs them (docs/duplexkv.md, docs/paper.md §4.3, Table 1), for ``n_out``
D2H blocks (swap-out + eager write-back pairs: both are D2H traffic) and ``n_in`` H2D blocks of
``block_bytes`` each (``B_out``, ``B_in`` bytes); ``L`` launch cost per direction:

* ``naive``: one copy per layer x K/V x block, i.e. segments of ``block_bytes / (2 L)`` whatever the layout,
  one at a time: ``t = L + B_out / bw_d2h(seg) + L + B_in / bw_h2d(seg)`` (D2H then H2D; the per-copy
  costs are inside the curve, which is measured copy by copy).
* ``merged`` (merged segments): one copy per segment of the layout's ``segment_bytes`` (``block_bytes`` for
  block_first; ``block_bytes / (2 L)`` for layer_first), D2H then H2D: the same formula at that ``seg``.
* ``merged_kernel`` (merged kernels): one launch per direction moves the whole batch, D2H then H2D:
  ``t = L + B_out / k_d2h + L + B_in / k_h2d``, where ``k`` is the link's kernel rate per direction
  (``LinkProfile.kernel_*_gbps``) or, on a profile without one, the segment curve ``bw(seg)`` (the batch's
  copies then run at the copy engines' per-segment rate, as ``merged``).
* ``duplex``: as ``merged_kernel`` with both directions at once, limited by the duplex cap:
  ``t = L + max(B_out / k_d2h, B_in / k_h2d, (B_out + B_in) / duplex_cap)``.

A direction with no blocks costs nothing (no launch). How the time meets the model step (pipeline overlap)
is the loop's business (``event_loop.py``): with the pipeline on, a plan's copies overlap the step in flight and
only what exceeds it is exposed; with it off they add to the step.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from superinfer_jax.kv.layout import KVCacheSpec
from superinfer_jax.rotation.config import (DUPLEX, MERGED, MERGED_KERNEL, MODES,  # noqa: F401 (the engine's)
                                            NAIVE)

GB = 1e9


def curve_bandwidth(points: Sequence[tuple[float, float]], segment_bytes: float) -> float:
  """GB/s of copies of ``segment_bytes`` under a curve of ``(segment bytes, GB/s)`` points (sizes increasing):
  piecewise-linear in log(size) between points, flat above the last, proportional to size below the first."""
  if segment_bytes <= 0:
    raise ValueError(f"segment size must be > 0 bytes, got {segment_bytes}")
  s0, b0 = points[0]
  if segment_bytes <= s0:
    return b0 * segment_bytes / s0
  for (sa, ba), (sb, bb) in zip(points, points[1:]):
    if segment_bytes <= sb:
      f = (math.log(segment_bytes) - math.log(sa)) / (math.log(sb) - math.log(sa))
      return ba + f * (bb - ba)
  return points[-1][1]


def segment_bytes(spec: KVCacheSpec, mode: str) -> int:
  """Bytes of one contiguous copy: ``naive`` copies layer x K/V pieces; batched modes the layout's segments."""
  if mode not in MODES:
    raise ValueError(f"unknown transfer mode {mode!r}; known: {MODES}")
  if mode == NAIVE:
    return spec.block_bytes // (2 * spec.num_layers)
  return spec.segment_bytes


@dataclasses.dataclass(frozen=True)
class TransferCost:
  """One step's copies: bytes and segments each way, and the time they take (s)."""
  bytes_out: int
  bytes_in: int
  segments_out: int
  segments_in: int
  segment_bytes: int
  d2h_s: float          # the D2H side alone (launch included when there is one)
  h2d_s: float
  time_s: float         # both, as the mode combines them


NO_TRANSFER = TransferCost(0, 0, 0, 0, 0, 0.0, 0.0, 0.0)


def kernel_rates(link, seg: int) -> tuple[float, float]:
  """GB/s per direction of one launch moving a batch of ``seg``-byte segments (``merged_kernel`` / ``duplex``):
  the link's kernel rates where the profile has them, else the segment curve at ``seg``."""
  d2h = link.kernel_d2h_gbps if link.kernel_d2h_gbps is not None else curve_bandwidth(link.d2h_curve, seg)
  h2d = link.kernel_h2d_gbps if link.kernel_h2d_gbps is not None else curve_bandwidth(link.h2d_curve, seg)
  return d2h, h2d


def transfer_cost(blocks_out: int, blocks_in: int, spec: KVCacheSpec, link, mode: str) -> TransferCost:
  """Time of ``blocks_out`` D2H and ``blocks_in`` H2D blocks of ``spec`` on ``link`` (a
  ``profiles.LinkProfile``) in DuplexKV ``mode`` (module docstring)."""
  if blocks_out < 0 or blocks_in < 0:
    raise ValueError(f"block counts must be >= 0, got {blocks_out}, {blocks_in}")
  if not blocks_out and not blocks_in:
    return NO_TRANSFER
  seg = segment_bytes(spec, mode)
  per_block = spec.block_bytes // seg
  b_out = blocks_out * spec.block_bytes
  b_in = blocks_in * spec.block_bytes
  launch = link.launch_overhead_s
  if mode in (MERGED_KERNEL, DUPLEX):
    bw_out, bw_in = kernel_rates(link, seg)
  else:
    bw_out, bw_in = curve_bandwidth(link.d2h_curve, seg), curve_bandwidth(link.h2d_curve, seg)
  raw_out = b_out / (bw_out * GB) if blocks_out else 0.0
  raw_in = b_in / (bw_in * GB) if blocks_in else 0.0
  d2h = launch + raw_out if blocks_out else 0.0
  h2d = launch + raw_in if blocks_in else 0.0
  if mode == DUPLEX:
    t = launch + max(raw_out, raw_in, (b_out + b_in) / (link.duplex_cap_gbps * GB))
  else:
    t = d2h + h2d
  return TransferCost(bytes_out=b_out, bytes_in=b_in, segments_out=blocks_out * per_block,
                      segments_in=blocks_in * per_block, segment_bytes=seg, d2h_s=d2h, h2d_s=h2d, time_s=t)


def transfer_time(blocks_out: int, blocks_in: int, spec: KVCacheSpec, link, mode: str) -> float:
  """Seconds of one step's copies (``transfer_cost(...).time_s``)."""
  return transfer_cost(blocks_out, blocks_in, spec, link, mode).time_s
