"""Jitted device-side kernels of the rotation engine: bucketed block gather and scatter, segment split/join.

All kernels work on a paged KV cache in either layout (``superinfer_jax/kv/layout.py``):

* block-first ``[NB, L, 2, BS, H, D]`` (block axis 0): one block is one contiguous segment;
* layer-first ``[L, 2, NB, BS, H, D]`` (block axis 2): one block is ``2 * L`` segments of ``[BS, H, D]``.

Whatever the layout, a block leaves these kernels as one array ``[L, 2, BS, H, D]`` (the host-side block
format), and enters them the same way.

The number of blocks per call is a *bucket* (the length of ``ids``; the caller pads to a power of two with
``PADDING_BLOCK``), so each kernel compiles once per (cache shape, dtype, bucket). Indices are traced int32
arrays, never Python ints, so no kernel recompiles for new block ids.

These are plain device computations: none of them reads or writes host (``pinned_host``) memory, which keeps
clear of the XLA bugs on scatter / dynamic-update-slice into host arrays inside jit (docs/platform.md).
"""
from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnames=("block_axis",))
def gather_blocks(cache: jax.Array, ids: jax.Array, *, block_axis: int) -> tuple[jax.Array, ...]:
  """Copies blocks ``ids`` out of ``cache``: one output array per block.

  Args:
    cache: the paged KV cache, block axis ``block_axis`` (0 block-first, 2 layer-first).
    ids: int32 ``[n]`` block ids (padding rows point at ``PADDING_BLOCK``; their outputs are dropped).
    block_axis: static.

  Returns:
    ``n`` arrays ``[L, 2, BS, H, D]`` (one per block, so each is one contiguous transfer segment and each
    host copy stays individually addressable; see ``duplexkv.py``).
  """
  return tuple(
      lax.dynamic_index_in_dim(cache, ids[i], axis=block_axis, keepdims=False) for i in range(ids.shape[0]))


@functools.partial(jax.jit, static_argnames=("block_axis",), donate_argnums=(0,))
def scatter_blocks(cache: jax.Array, ids: jax.Array, blocks: tuple[jax.Array, ...], *,
                   block_axis: int) -> jax.Array:
  """Writes ``blocks[i]`` into block ``ids[i]`` of the donated ``cache`` (in place), in order.

  Args:
    cache: donated paged KV cache.
    ids: int32 ``[n]`` destination block ids; padding rows point at ``PADDING_BLOCK`` (garbage allowed there).
    blocks: ``n`` arrays ``[L, 2, BS, H, D]`` on device.
    block_axis: static.

  Returns:
    The updated cache (same buffer when donation is honoured).
  """
  for i, blk in enumerate(blocks):
    cache = lax.dynamic_update_index_in_dim(cache, blk, ids[i], axis=block_axis)
  return cache


@jax.jit
def split_block(block: jax.Array) -> tuple[jax.Array, ...]:
  """``[L, 2, BS, H, D]`` -> ``2 * L`` segments ``[BS, H, D]`` ordered (layer, K/V) — the naive mode's unit."""
  num_layers = block.shape[0]
  return tuple(block[l, kv] for l in range(num_layers) for kv in range(2))


@jax.jit
def join_block(segments: tuple[jax.Array, ...]) -> jax.Array:
  """Inverse of ``split_block``: ``2 * L`` segments ``[BS, H, D]`` -> ``[L, 2, BS, H, D]``."""
  num_layers = len(segments) // 2
  return jnp.stack([jnp.stack(segments[2 * l:2 * l + 2]) for l in range(num_layers)])


KERNELS = (gather_blocks, scatter_blocks, split_block, join_block)


def compiled_variants() -> int | None:
  """Compiled variants held by the rotation kernels' jit caches (process-wide); None if jax hides it."""
  try:
    return sum(k._cache_size() for k in KERNELS)  # pylint: disable=protected-access
  except AttributeError:
    return None
