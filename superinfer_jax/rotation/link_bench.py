"""Measuring the host link the way the paper's Table 1 does: DuplexKV's modes vs torch pinned copies.

``measure_table1`` moves ``n`` KV blocks each way (block-first, one block = one contiguous segment) with a
``DuplexKV`` engine in each mode, three ways per mode: D2H alone, H2D alone, both in one ``issue()``. When
torch with CUDA is given, the same bytes are also copied as ``n`` pinned-host segments with
``copy_(non_blocking=True)`` on one stream per direction (the reference a plain PyTorch server gets).
``table1_rows`` turns the timings into the paper's columns:

* D2H / H2D GB/s (1e9 bytes per second): each direction's rate. Serialized modes (``naive``, ``merged``,
  ``merged_kernel``, torch alone) from the direction run alone; ``duplex`` from the both-ways run (each
  direction's rate while the other is busy, as the paper reports it).
* total ms: the both-ways run (the serialized modes run one direction after the other inside it).
* % of ideal: ideal / total, where ideal = the bytes each way over the best per-direction rate measured with
  both directions busy (the fastest both-ways run of this table, torch's included).

Timings are host wall clock around the call, up to the copies having landed (``DuplexKV.wait`` and the
cache ready), the median of ``reps`` after ``warmup`` untimed runs. ``naive`` makes one copy per layer x
K/V x block, so it runs on at most ``naive_max_blocks`` blocks and its times are scaled to ``n`` (the row
says so). Nothing here changes engine state outside the engines it builds.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from superinfer_jax.kv.layout import KVCacheSpec
from superinfer_jax.rotation.config import DUPLEX, MODES, NAIVE
from superinfer_jax.rotation.duplexkv import DuplexKV

DIRECTIONS = ("d2h", "h2d", "both")


def median_time(fn: Callable[[], Any], reps: int, warmup: int) -> float:
  """Median wall-clock seconds of ``fn()`` over ``max(1, reps)`` runs after ``warmup`` untimed ones."""
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(max(1, reps)):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def blocks_that_fit(spec: KVCacheSpec, tokens: int, device=None, memory_share: float = 0.5) -> tuple[int, str]:
  """Blocks per direction for ``tokens`` tokens, cut to what ``memory_share`` of the device's memory holds
  (cache of 2n + 1 blocks plus n staging blocks each way); returns ``(n, note)``, the note empty unless cut.
  A device without memory statistics (CPU) is not cut."""
  want = max(1, -(-tokens // spec.block_size))
  stats = (device or jax.devices()[0]).memory_stats() or {}
  limit = stats.get("bytes_limit")
  if not limit:
    return want, ""
  fit = int(memory_share * limit // (4 * spec.block_bytes))
  if fit >= want:
    return want, ""
  return max(1, fit), (f"scaled: {fit * spec.block_size} of {tokens} tokens per direction "
                       f"({memory_share:.0%} of {limit / 2**30:.0f} GiB device memory)")


def time_mode(spec: KVCacheSpec, mode: str, n: int, reps: int, warmup: int) -> dict[str, float]:
  """Seconds to move ``n`` blocks D2H alone, H2D alone and both ways in one ``issue()`` (keys
  ``DIRECTIONS``), with a fresh ``DuplexKV`` in ``mode`` over a zero cache of ``2n + 1`` blocks."""
  eng = DuplexKV(spec, 2 * n, mode=mode)
  cache = jax.device_put(jnp.zeros(spec.shape(2 * n + 1), spec.dtype), jax.devices()[0])
  cache = eng.issue(cache, swap_out=[(1 + i, i) for i in range(n)])   # host 0..n-1: the swap-in sources
  eng.wait()
  plans = {"d2h": ([(1 + i, n + i) for i in range(n)], []),
           "h2d": ([], [(i, n + 1 + i) for i in range(n)]),
           "both": ([(1 + i, n + i) for i in range(n)], [(i, n + 1 + i) for i in range(n)])}
  state = {"cache": cache}

  def run(swap_out, swap_in):
    if mode == DUPLEX:
      eng.prefetch(swap_in)
    state["cache"] = eng.issue(state["cache"], swap_out=swap_out, swap_in=swap_in)
    eng.wait()
    state["cache"].block_until_ready()

  return {d: median_time(lambda so=so, si=si: run(so, si), reps, warmup) for d, (so, si) in plans.items()}


def time_torch(torch, segment_bytes: int, n: int, reps: int, warmup: int) -> dict[str, float]:
  """Seconds for torch to copy ``n`` segments of ``segment_bytes`` between CUDA and pinned host tensors:
  D2H alone, H2D alone, both (segments interleaved over one stream per direction); keys ``DIRECTIONS``."""
  dev = [torch.full((segment_bytes,), i % 251, dtype=torch.uint8, device="cuda") for i in range(n)]
  host = [torch.empty((segment_bytes,), dtype=torch.uint8, pin_memory=True) for _ in range(n)]
  host_src = [torch.full((segment_bytes,), i % 251, dtype=torch.uint8).pin_memory() for i in range(n)]
  dev_dst = [torch.empty((segment_bytes,), dtype=torch.uint8, device="cuda") for _ in range(n)]
  s_out, s_in = torch.cuda.Stream(), torch.cuda.Stream()
  torch.cuda.synchronize()

  def d2h():
    with torch.cuda.stream(s_out):
      for h, d in zip(host, dev):
        h.copy_(d, non_blocking=True)
    s_out.synchronize()

  def h2d():
    with torch.cuda.stream(s_in):
      for d, h in zip(dev_dst, host_src):
        d.copy_(h, non_blocking=True)
    s_in.synchronize()

  def both():
    for i in range(n):
      with torch.cuda.stream(s_out):
        host[i].copy_(dev[i], non_blocking=True)
      with torch.cuda.stream(s_in):
        dev_dst[i].copy_(host_src[i], non_blocking=True)
    s_out.synchronize()
    s_in.synchronize()

  return {d: median_time(fn, reps, warmup) for d, fn in zip(DIRECTIONS, (d2h, h2d, both))}


@dataclasses.dataclass
class Table1Row:
  """One row of the report: ``mode`` is a DuplexKV mode, ``torch`` or ``ideal``; rates in GB/s (1e9 B/s)."""
  mode: str
  d2h_gbps: float
  h2d_gbps: float
  total_ms: float
  pct_of_ideal: float
  blocks_measured: int
  note: str = ""


def table1_rows(times: dict[str, dict[str, float]], bytes_per_direction: int,
                measured_blocks: dict[str, int], n: int) -> list[Table1Row]:
  """The report's rows from ``times[mode][direction]`` seconds (``time_mode`` / ``time_torch``, already for
  ``n`` blocks each way), in the order of ``times``, then ``ideal``. ``measured_blocks[mode]`` is how many
  blocks the timing ran on (fewer than ``n`` for a scaled ``naive``)."""
  b = bytes_per_direction
  ideal_s = min(t["both"] for t in times.values())
  rows = []
  for mode, t in times.items():
    if mode == DUPLEX:
      d2h, h2d = b / t["both"], b / t["both"]
    else:
      d2h, h2d = b / t["d2h"], b / t["h2d"]
    k = measured_blocks.get(mode, n)
    rows.append(Table1Row(mode, d2h / 1e9, h2d / 1e9, 1e3 * t["both"], 100 * ideal_s / t["both"], k,
                          "" if k == n else f"timed on {k} blocks, scaled to {n}"))
  rows.append(Table1Row("ideal", b / ideal_s / 1e9, b / ideal_s / 1e9, 1e3 * ideal_s, 100.0, n,
                        "fastest both-ways run above"))
  return rows


def measure_table1(spec: KVCacheSpec, n: int, *, modes=MODES, reps: int = 3, warmup: int = 1,
                   naive_max_blocks: int = 16, torch=None,
                   out_of_time: Optional[Callable[[], bool]] = None) -> list[Table1Row]:
  """Times every mode of ``modes`` (and torch, if given: a module with CUDA) moving ``n`` blocks of ``spec``
  each way; returns ``table1_rows``. ``out_of_time()`` true skips the modes not yet timed."""
  times, measured = {}, {}
  for mode in modes:
    if out_of_time is not None and out_of_time():
      break
    k = min(n, naive_max_blocks) if mode == NAIVE else n
    t = time_mode(spec, mode, k, reps, warmup)
    times[mode] = {d: s * n / k for d, s in t.items()}
    measured[mode] = k
  if torch is not None and not (out_of_time is not None and out_of_time()):
    times["torch"] = time_torch(torch, spec.block_bytes, n, reps, warmup)
  if not times:
    return []
  return table1_rows(times, n * spec.block_bytes, measured, n)


def format_table1(rows: list[Table1Row], title: str) -> str:
  """Markdown: ``title``, then mode | D2H GB/s | H2D GB/s | total ms | % of ideal | note."""
  lines = [title, "", "| mode | D2H GB/s | H2D GB/s | total ms | % of ideal | note |", "|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r.mode} | {r.d2h_gbps:.2f} | {r.h2d_gbps:.2f} | {r.total_ms:.2f} | {r.pct_of_ideal:.1f} "
                 f"| {r.note} |")
  return "\n".join(lines) + "\n"
