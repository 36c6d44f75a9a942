"""Where KV blocks live: the memory-kind check of a host pool's sharding, and reading a device block back.

Both touch JAX arrays only through their public API; ``read_device_block`` copies the whole cache to host
(tests and debugging, never the step loop).
"""
from __future__ import annotations

import jax
import numpy as np

from superinfer_jax.kv.layout import KVCacheSpec


def check_memory_kind(sharding: jax.sharding.Sharding, kind: str) -> None:
  """``ValueError`` unless every local device of ``sharding`` has memory kind ``kind``."""
  for d in sharding.device_set:
    if d.process_index != jax.process_index():
      continue
    kinds = {m.kind for m in d.addressable_memories()}
    if kind not in kinds:
      raise ValueError(f"{d} has no {kind!r} memory (has {sorted(kinds)})")


def read_device_block(cache: jax.Array, spec: KVCacheSpec, block_id: int) -> np.ndarray:
  """Block ``block_id`` of a device cache as numpy ``[L, 2, BS, H, D]`` (tests, debugging; copies the cache)."""
  arr = np.asarray(cache)
  if spec.block_axis == 0:
    return arr[block_id]
  return arr[:, :, block_id]
