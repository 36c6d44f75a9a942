"""The head-sharded paged KV cache and the sharding of one rotated block.

The block-first cache ``[NB, L, 2, BS, Hkv', D]`` is sharded on the KV-head axis (``Hkv'`` = stored KV
heads, ``parallel/sharding.py``): device ``s`` holds heads ``[s Hkv'/tp, (s+1) Hkv'/tp)`` of every block, so
``1/tp`` of the cache bytes. Block tables are global: block ``b`` is the same block id on every device.

A rotated block ``[L, 2, BS, Hkv', D]`` keeps that sharding on its head axis; on host memory it is one
sharded array whose shard ``s`` is device ``s``'s slice in that device's host memory space
(``NamedSharding(..., memory_kind="pinned_host")``). ``rotation/duplexkv.py`` moves blocks with these
shardings, so each device copies only its own slice and no collective runs in a rotation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from superinfer_jax.model.params import DTYPES
from superinfer_jax.parallel.sharding import KV_BLOCK_SPEC, KV_CACHE_SPEC


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, KV_CACHE_SPEC)


def kv_block_sharding(mesh: Mesh) -> NamedSharding:
  """Device sharding of one block ``[L, 2, BS, Hkv', D]`` (``.with_memory_kind`` gives the host one)."""
  return NamedSharding(mesh, KV_BLOCK_SPEC)


def init_sharded_kv_cache(cfg, num_blocks: int, block_size: int, dtype: str, mesh: Mesh) -> jax.Array:
  """Zeroed cache ``cfg.kv_spec(block_size, dtype).shape(num_blocks)`` (``cfg``: the TP model config, with
  the stored KV heads), created directly sharded (no device ever holds the whole cache)."""
  if num_blocks < 2:
    raise ValueError(f"num_blocks must be >= 2 (block 0 is padding), got {num_blocks}")
  shape = cfg.kv_spec(block_size, dtype).shape(num_blocks)
  if shape[4] % mesh.size:
    raise ValueError(f"{shape[4]} KV heads do not split over {mesh.size} devices (use tp_model_config)")
  zeros = jax.jit(lambda: jnp.zeros(shape, DTYPES[dtype]), out_shardings=kv_cache_sharding(mesh))
  return zeros()
