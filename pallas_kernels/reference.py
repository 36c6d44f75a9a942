"""Pure-JAX reference for ragged paged attention over the block-first KV cache.

This file fixes the attention-backend contract that the model and every kernel in ``pallas_kernels`` share.

A *ragged batch* packs S sequences' new query tokens into one flat token axis of (padded) length T:

  q               [T, Hq, D]      queries (already RoPE'd). Hq is a multiple of Hkv (GQA).
  kv_cache        [NB, L, 2, BS, Hkv, D]  block-first cache (see superinfer_jax/kv/layout.py); the new
                                  tokens' K/V have ALREADY been written into it.
  layer           int or int32 scalar: which layer of the cache to read.
  block_tables    [S, MB] int32   block ids of each sequence, in token order; unused entries are 0.
  context_lens    [S] int32       tokens of sequence s in the cache after this step's writes, including
                                  its new query tokens. 0 for a padding sequence.
  query_start_loc [S+1] int32     sequence s's queries are q[query_start_loc[s]:query_start_loc[s+1]];
                                  non-decreasing; padding sequences have an empty range; tokens at or past
                                  query_start_loc[S] are padding.
  scale           python float    soft-max scale (usually head_dim ** -0.5).
  window          optional keyword: None (default) = full causal attention; else an int or int32 scalar
                  (may be traced) W: if W > 0 the query at position p sees only keys p - W < k <= p (a
                  sliding window of W keys, transformers' / Mistral's convention); W <= 0 = no window.

Query j of sequence s (q_len = query_start_loc[s+1] - query_start_loc[s]) sits at position
``context_lens[s] - q_len + j`` and attends to cached keys at positions 0..that position (causal inside the
chunk, full attention to earlier cached tokens). Returns [T, Hq, D] in q's dtype; padding tokens give 0.
Soft-max is computed in float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def token_metadata(query_start_loc: jax.Array, context_lens: jax.Array, num_tokens: int):
  """Per-token sequence index, position and validity for a ragged batch.

  Returns (seq_idx [T] int32 clipped to [0, S-1], pos [T] int32, valid [T] bool).
  """
  num_seqs = context_lens.shape[0]
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  # searchsorted(side="right") as one vectorised compare: jnp's default 'scan' method is a while loop.
  seq_idx = jnp.sum(query_start_loc[1:][None, :] <= t[:, None], axis=1, dtype=jnp.int32)
  valid = seq_idx < num_seqs
  seq_idx = jnp.minimum(seq_idx, num_seqs - 1)
  q_len = query_start_loc[seq_idx + 1] - query_start_loc[seq_idx]
  pos = context_lens[seq_idx] - q_len + (t - query_start_loc[seq_idx])
  return seq_idx, pos.astype(jnp.int32), valid


def window_mask(key_pos: jax.Array, query_pos: jax.Array, window) -> jax.Array:
  """True where a key is inside the sliding window of its query (broadcasting); all True for W <= 0."""
  w = jnp.asarray(window, jnp.int32)
  return (w <= 0) | (key_pos > query_pos - w)


def ragged_paged_attention_reference(q, kv_cache, layer, block_tables, context_lens, query_start_loc,
                                     *, scale: float, window=None):
  """Gather-based reference: each token gathers its sequence's blocks. Memory O(T * MB * BS * Hkv * D)."""
  T, Hq, D = q.shape
  Hkv = kv_cache.shape[4]
  BS = kv_cache.shape[3]
  if Hq % Hkv:
    raise ValueError(f"query heads {Hq} not a multiple of kv heads {Hkv}")
  group = Hq // Hkv
  MB = block_tables.shape[1]
  seq_idx, pos, valid = token_metadata(query_start_loc, context_lens, T)
  # Each token gathers its sequence's K and V blocks of this layer as whole rows of the cache seen as
  # [NB * L * 2, BS * Hkv * D] (a free reshape: one (block, layer, k|v) slab is contiguous). XLA CPU copies
  # such a row gather at memory speed, where indexing the 6-D cache as kv_cache[block_tables, layer] and then
  # k[seq_idx] lowers to an element-wise gather. Block ids are in range by contract: mode="clip" (no fill).
  NB, L = kv_cache.shape[0], kv_cache.shape[1]
  rows = kv_cache.reshape(NB * L * 2, BS * Hkv * D)
  k_rows = (block_tables[seq_idx] * L + layer) * 2          # [T, MB] row of (block, layer, K)
  k_tok = jnp.take(rows, k_rows, axis=0, mode="clip").reshape(T, MB * BS, Hkv, D).astype(jnp.float32)
  v_tok = jnp.take(rows, k_rows + 1, axis=0, mode="clip").reshape(T, MB * BS, Hkv, D).astype(jnp.float32)
  qf = q.astype(jnp.float32).reshape(T, Hkv, group, D)
  s = jnp.einsum("thgd,tkhd->thgk", qf, k_tok) * scale      # [T, Hkv, g, K]
  key_pos = jnp.arange(MB * BS, dtype=jnp.int32)
  mask = (key_pos[None, :] <= pos[:, None]) & valid[:, None]  # [T, K]
  if window is not None:
    mask &= window_mask(key_pos[None, :], pos[:, None], window)
  s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  o = jnp.einsum("thgk,tkhd->thgd", p, v_tok) / jnp.where(denom == 0, 1.0, denom)
  o = jnp.where(valid[:, None, None, None], o, 0.0)
  return o.reshape(T, Hq, D).astype(q.dtype)
