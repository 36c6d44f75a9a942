"""Prefix caching's columns of a results row, from a scheduler's ``SchedulerStats.prefix_cache`` counters.

``prefix_cache_columns(counters, block_size)`` -> a dict of ``prefix_*`` columns: the full prompt blocks
queried at first admissions, the hits per tier and their rates (``hits / queried``; None when nothing was
queried, e.g. caching off or a workload without content), ``prefill_tokens_saved`` (hit blocks times
``block_size``: prompt tokens the step never computed), the re-hits of requests re-admitted after a
recompute preemption and the blocks swap-ins re-adopted (a request's own KV, never counted as hits), and the
evictions of cached blocks per tier. ``PREFIX_COLUMNS`` names them in order. Pure Python, no JAX.
"""
from __future__ import annotations

PREFIX_COLUMNS = ("prefix_queried_blocks", "prefix_device_hit_blocks", "prefix_host_hit_blocks",
                  "prefix_hit_rate", "prefix_device_hit_rate", "prefix_host_hit_rate", "prefill_tokens_saved",
                  "prefix_rehit_blocks", "prefix_readopted_blocks", "prefix_device_evictions",
                  "prefix_host_evictions")


def prefix_cache_columns(counters: dict, block_size: int) -> dict:
  """The ``PREFIX_COLUMNS`` of a run whose scheduler reported ``counters`` (module docstring); an empty
  ``counters`` (a scheduler without prefix caching) gives zeros and None rates."""
  q = counters.get("queried", 0)
  dev = counters.get("device_hits", 0)
  host = counters.get("host_hits", 0)

  def rate(n):
    return n / q if q else None
  return {"prefix_queried_blocks": q, "prefix_device_hit_blocks": dev, "prefix_host_hit_blocks": host,
          "prefix_hit_rate": rate(dev + host), "prefix_device_hit_rate": rate(dev),
          "prefix_host_hit_rate": rate(host), "prefill_tokens_saved": (dev + host) * block_size,
          "prefix_rehit_blocks": counters.get("rehits", 0),
          "prefix_readopted_blocks": counters.get("readopted_blocks", 0),
          "prefix_device_evictions": counters.get("device_evictions", 0),
          "prefix_host_evictions": counters.get("host_evictions", 0)}
