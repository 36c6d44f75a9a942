"""Query-tile metadata of the ragged paged attention kernel (jnp, traced inside the kernel's wrapper).

A tile is ``tile_q`` consecutive query tokens of one sequence; see ``pallas_kernels.ragged_paged_attention``.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp



def num_tiles(num_tokens: int, num_seqs: int, tile_q: int) -> int:
  """Static upper bound on sum_s ceil(q_len_s / tile_q) given sum_s q_len_s <= T."""
  return max(1, min(num_tokens, min(num_seqs, num_tokens) + num_tokens // tile_q))


@dataclasses.dataclass(frozen=True)
class TileMetadata:
  """Per-tile int32 arrays, each [num_tiles].

  seq: sequence of the tile (0 for inactive tiles). tok_start: flat index of the tile's first query token.
  num_q: valid query tokens in the tile (0 = inactive). pos_start: position of the first query in its
  sequence. The tile attends to keys ``0 .. pos_start + num_q - 1`` (causal per row).
  """
  seq: jax.Array
  tok_start: jax.Array
  num_q: jax.Array
  pos_start: jax.Array


jax.tree_util.register_dataclass(TileMetadata, data_fields=["seq", "tok_start", "num_q", "pos_start"],
                                 meta_fields=[])


def _searchsorted_right(sorted_arr: jax.Array, x: jax.Array) -> jax.Array:
  """searchsorted(side="right") as one vectorised compare (jnp's default 'scan' is a while loop, which on
  GPU costs a host round-trip per step)."""
  return jnp.sum(sorted_arr[None, :] <= x[:, None], axis=1, dtype=jnp.int32)


def decode_tile_metadata(context_lens: jax.Array):
  """Metadata of a one-query-per-sequence batch (q[b] is sequence b's query): tile b = sequence b."""
  ctx = context_lens.astype(jnp.int32)
  b = jnp.arange(ctx.shape[0], dtype=jnp.int32)
  nq = (ctx > 0).astype(jnp.int32)
  meta = TileMetadata(seq=b, tok_start=b, num_q=nq, pos_start=jnp.maximum(ctx - 1, 0))
  return meta, b, jnp.zeros_like(b), jnp.ones(b.shape, bool)


def tile_metadata(query_start_loc: jax.Array, context_lens: jax.Array, num_tokens: int, tile_q: int):
  """Cuts each sequence's query range into tiles of ``tile_q`` tokens.

  Returns (TileMetadata, token_tile [T], token_row [T], token_valid [T]) where token_tile/token_row say which
  tile holds flat token t and at which tile-local query index (row block), and token_valid is False for
  padding tokens (at or past query_start_loc[S]).
  """
  qsl = query_start_loc.astype(jnp.int32)
  ctx = context_lens.astype(jnp.int32)
  num_seqs = ctx.shape[0]
  n_tiles = num_tiles(num_tokens, num_seqs, tile_q)
  q_len = jnp.maximum(qsl[1:] - qsl[:-1], 0)
  tiles_per_seq = (q_len + tile_q - 1) // tile_q
  tile_end = jnp.cumsum(tiles_per_seq).astype(jnp.int32)      # [S]
  tile_begin = tile_end - tiles_per_seq
  i = jnp.arange(n_tiles, dtype=jnp.int32)
  seq = jnp.minimum(_searchsorted_right(tile_end, i), num_seqs - 1)
  active = i < tile_end[-1]
  local = (i - tile_begin[seq]) * tile_q
  tok_start = qsl[seq] + local
  num_q = jnp.clip(qsl[seq + 1] - tok_start, 0, tile_q)
  num_q = jnp.where(active, num_q, 0)
  pos_start = ctx[seq] - q_len[seq] + local
  meta = TileMetadata(seq=jnp.where(active, seq, 0), tok_start=jnp.where(active, tok_start, 0),
                      num_q=num_q.astype(jnp.int32), pos_start=jnp.where(active, pos_start, 0))
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  tok_seq = _searchsorted_right(qsl[1:], t)
  tok_valid = tok_seq < num_seqs
  tok_seq = jnp.minimum(tok_seq, num_seqs - 1)
  tok_local = t - qsl[tok_seq]
  token_tile = jnp.where(tok_valid, tile_begin[tok_seq] + tok_local // tile_q, 0)
  token_row = jnp.where(tok_valid, tok_local % tile_q, 0)
  return meta, token_tile.astype(jnp.int32), token_row.astype(jnp.int32), tok_valid


