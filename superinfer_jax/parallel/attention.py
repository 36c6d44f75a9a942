"""``ShardedAttention``: an attention backend run once per tensor-parallel shard through ``shard_map``.

XLA SPMD partitions the model's matmuls from the shardings of params and cache, but the Pallas kernel is a
custom call it cannot partition (it would gather the whole cache to one device). Attention is independent
per KV head, so each shard runs the backend on its own heads:

  q               [T, Hq, D]              sharded by query heads   (P(None, "tp", None))
  kv_cache        [NB, L, 2, BS, Hkv', D] sharded by KV heads      (parallel.sharding.KV_CACHE_SPEC)
  layer, block_tables, context_lens, query_start_loc               replicated (one plan drives every shard)
  window (optional, sliding-window layers: int32 scalar)            replicated
  -> out          [T, Hq, D]              sharded by query heads

Shard ``s`` holds query heads ``[s Hq/tp, (s+1) Hq/tp)`` and stored KV heads ``[s Hkv'/tp, (s+1) Hkv'/tp)``;
the GQA grouping inside the shard is the global one (``parallel/sharding.py``), so the per-shard call is
the backend's own contract on smaller head counts. No collective runs inside attention.

An instance is hashable by value (mesh, backend): it is a static argument of the jitted step, and two
engines on the same mesh share compilations. ``backend`` is a registry name or a hashable function with the
backend contract (e.g. ``functools.partial(ragged_paged_attention, interpret=False)`` to lower for CUDA).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec as P

from superinfer_jax.model.attention import resolve_attention
from superinfer_jax.parallel.mesh import TP_AXIS
from superinfer_jax.parallel.sharding import KV_CACHE_SPEC

_HEADS = P(None, TP_AXIS, None)


@dataclasses.dataclass(frozen=True)
class ShardedAttention:
  """Calls backend ``backend`` ("auto", "reference", "pallas", or a function) per shard of ``mesh``."""
  mesh: Mesh
  backend: Any = "auto"

  def __call__(self, q, kv_cache, layer, block_tables, context_lens, query_start_loc, *, scale: float,
               window=None):
    """The backend's contract; ``window`` (the model passes it only for sliding-window layers) is forwarded
    replicated, so a backend without that keyword serves every other model."""
    backend = resolve_attention(self.backend)
    args = (q, kv_cache, layer, block_tables, context_lens, query_start_loc)
    specs = (_HEADS, KV_CACHE_SPEC, P(), P(), P(), P())
    if window is None:
      attn = functools.partial(backend, scale=scale)
    else:
      def attn(*a):
        return backend(*a[:-1], scale=scale, window=a[-1])
      args, specs = args + (window,), specs + (P(),)
    per_shard = jax.shard_map(attn, mesh=self.mesh, out_specs=_HEADS, in_specs=specs, check_vma=False)
    return per_shard(*args)
