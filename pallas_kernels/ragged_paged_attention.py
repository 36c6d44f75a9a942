"""Ragged paged attention as a Pallas kernel over the block-first KV cache.

Public entry points (contract: ``pallas_kernels/reference.py``):

  ragged_paged_attention(q[T,Hq,D], kv_cache[NB,L,2,BS,Hkv,D], layer, block_tables[S,MB],
                         context_lens[S], query_start_loc[S+1], *, scale, interpret=None, ...) -> [T,Hq,D]
  paged_decode_attention(q[B,Hq,D], kv_cache, layer, block_tables[B,MB], context_lens[B], *, scale, ...)
      -> [B,Hq,D]   (one query per sequence; the decode-specialised configuration of the same kernel)

Design
------
*Query tiles.* Each sequence's query range is cut into tiles of ``tile_q`` consecutive tokens (a tile never
spans two sequences). The number of tiles is bounded statically by ``min(T, min(S, T) + T // tile_q)``; the
per-tile metadata (sequence id, first flat token, number of valid queries, position of the first query) is
computed with jnp inside the wrapper, so the signature stays the reference one and nothing runs on the host.
Tiles past the real ones are inactive (no KV is read, output discarded).

*Rows.* With GQA group ``G = Hq // Hkv`` (padded to a power of two ``Gp``), a tile for KV head ``h`` is a
``[M = tile_q * Gp, D]`` matrix: row ``r`` is query token ``r // Gp`` of the tile and query head
``h * G + r % Gp``. So all query heads sharing a KV head read each K/V block once, and ``M >= 16`` keeps
Triton's ``dot`` happy even for decode (``tile_q = 16 // Gp``).

*Grid.* ``(num_tiles, Hkv, num_splits)``. Program ``(i, h, s)`` walks the KV blocks of tile ``i``'s sequence
(up to the tile's last query position) through the block table, ``blocks_per_iter`` blocks per step, reading
``kv_cache[block_ids, layer, 0|1, :, h, :]`` straight from the cache (no dense gather), and keeps an online
soft-max in float32 (exp2 domain). ``num_splits > 1`` is split-K (flash-decoding): split ``s`` takes an equal
share of that tile's KV steps and writes un-normalised partials ``(o, m, l)``, merged in jnp afterwards.
``layer`` is passed as an int32 array so it may be a traced scalar (the model scans over layers).

*Sliding window.* With ``window=W`` (an int32 scalar input, may be traced per layer; ``W <= 0`` = full), a
tile's first query at ``pos_start`` sees no key below ``pos_start - W + 1``, so the KV walk starts at the
step holding that key: blocks wholly outside the window are never read. Keys inside the walked steps but
outside a row's window are masked.

*Configuration.* ``select_config`` picks the tunables at trace time: explicit arguments, else the per-card
tuning table (``pallas_kernels.attention_tuning``), else ``attention_config.auto_config``.

*Backends.* The kernel body (``pallas_kernels.attention_kernel``) is written against plain Pallas ref
indexing; ``_triton_tiled_attention`` there builds the ``pallas_call`` with Triton ``CompilerParams``
(selecting the Triton lowering explicitly on GPU) or runs it in interpret mode on CPU. Another backend (e.g.
Mosaic GPU) only has to implement ``TiledAttentionFn`` and be registered in ``BACKENDS``; the tiling/merge
wrapper is shared.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from pallas_kernels import attention_tuning
from pallas_kernels.attention_config import KernelConfig, auto_config, is_pow2, validate
from pallas_kernels.attention_kernel import (BACKENDS, TiledAttentionFn, _full_spec, _plgpu,  # noqa: F401
                                             register_backend)
from pallas_kernels.attention_tiles import TileMetadata, decode_tile_metadata, tile_metadata

__all__ = ["KernelConfig", "TileMetadata", "TiledAttentionFn", "auto_config", "decode_tile_metadata",
           "tile_metadata", "ragged_paged_attention", "paged_decode_attention", "select_config",
           "register_backend", "BACKENDS"]

_is_pow2 = is_pow2  # with _full_spec and _plgpu, used by pallas_kernels.grouped_matmul
# Batches with at most max(S, this) token slots use the decode tiling (the model's token bucket floor is 8,
# so a decode step of S < 8 sequences still has T = 8).
_DECODE_TOKEN_FLOOR = 8


def default_interpret() -> bool:
  """Interpret mode unless a GPU is the default backend (Pallas compiles only there for this kernel)."""
  return jax.default_backend() != "gpu"


# ----------------------------------------------------------------------------------------------------------
# Public wrappers.


def _prepare_q(q: jax.Array, num_kv_heads: int, cfg: KernelConfig) -> jax.Array:
  """[T, Hq, D] -> [Hkv, (T + tile_q) * Gp, D]; padded heads/tokens are zeros."""
  num_tokens, num_q_heads, head_dim = q.shape
  group = num_q_heads // num_kv_heads
  qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
  qg = jnp.pad(qg, ((0, cfg.tile_q), (0, 0), (0, cfg.group_p - group), (0, 0)))
  qg = jnp.transpose(qg, (1, 0, 2, 3))
  return qg.reshape(num_kv_heads, (num_tokens + cfg.tile_q) * cfg.group_p, head_dim)


def _merge_splits(o, m, l):
  """Merges split-K partials [P, ...] -> normalised [...] (f32)."""
  m_max = jnp.max(m, axis=0)
  w = jnp.exp2(m - m_max[None])
  l_tot = jnp.sum(l * w, axis=0)
  o_tot = jnp.sum(o * w[..., None], axis=0)
  return o_tot / jnp.where(l_tot > 0, l_tot, 1.0)[..., None]


def _device_kind() -> str:
  try:
    dev = jax.devices()[0]
    return str(getattr(dev, "device_kind", dev.platform))
  except Exception:  # pragma: no cover - no backend at all
    return "unknown"


def select_config(*, num_tokens: int, num_seqs: int, max_blocks: int, num_q_heads: int, num_kv_heads: int,
                  head_dim: int, block_size: int, kv_dtype, decode: bool, interpret: bool,
                  overrides: Optional[dict] = None, device_kind: Optional[str] = None,
                  table_path: Optional[str] = None):
  """The launch's KernelConfig and the ``TuningChoice`` behind it (all static; runs at trace time).

  Precedence: explicit ``overrides`` (non-None values) > the tuning-table entry for (card, heads, dtype,
  block size, decode|mixed, context / batch bucket) > ``auto_config``. device_kind: the card to look up
  (default: the default device's ``device_kind``; on CPU that is "cpu", which only a test table holds).
  table_path: default ``attention_tuning.table_path()``. Raises ValueError for a config the compiled kernel
  cannot run.
  """
  explicit = {k: v for k, v in (overrides or {}).items() if v is not None}
  key = attention_tuning.make_key(
      device_kind=device_kind if device_kind is not None else _device_kind(), num_q_heads=num_q_heads,
      num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=jnp.dtype(kv_dtype).name, block_size=block_size,
      decode=decode, max_blocks=max_blocks, num_seqs=num_seqs)
  choice = attention_tuning.select(key, table_path)
  merged = attention_tuning.merge_overrides(choice.config, explicit)
  if explicit:
    choice = dataclasses.replace(choice, reason=f"{choice.reason}; explicit {sorted(explicit)}")
  cfg = auto_config(num_tokens=num_tokens, num_seqs=num_seqs, max_blocks=max_blocks, num_q_heads=num_q_heads,
                    num_kv_heads=num_kv_heads, block_size=block_size, decode=decode, interpret=interpret,
                    itemsize=jnp.dtype(kv_dtype).itemsize, **merged)
  validate(cfg, head_dim=head_dim, block_size=block_size, interpret=interpret)
  return cfg, choice


def ragged_paged_attention(q, kv_cache, layer, block_tables, context_lens, query_start_loc, *,
                           scale: float, window=None, interpret: Optional[bool] = None,
                           decode: Optional[bool] = None,
                           backend: str = "triton", tile_q: Optional[int] = None,
                           blocks_per_iter: Optional[int] = None, num_splits: Optional[int] = None,
                           num_warps: Optional[int] = None, num_stages: Optional[int] = None):
  """Ragged paged attention (same contract as ``reference.ragged_paged_attention_reference``).

  Args:
    q: [T, Hq, D] queries, f32 or bf16; Hq a multiple of Hkv.
    kv_cache: [NB, L, 2, BS, Hkv, D] block-first cache, new tokens already written.
    layer: int or int32 scalar (may be traced).
    block_tables: [S, MB] int32. context_lens: [S] int32 (incl. new tokens). query_start_loc: [S+1] int32.
    scale: soft-max scale.
    window: None (full causal attention) or a sliding window W (int or int32 scalar, may be traced; the
      query at p sees keys p - W < k <= p; W <= 0 = full). KV blocks wholly outside it are not read.
    interpret: None -> interpret mode unless running on GPU.
    decode: tiling hint; None -> ``T <= max(S, 8)`` (a decode-sized batch). Only speed depends on it, never
      results.
    backend: key of BACKENDS. tile_q / blocks_per_iter / num_splits / num_warps / num_stages: explicit
      tunables; they win over the tuning table and ``auto_config`` (see ``select_config``).

  Returns:
    [T, Hq, D] in q's dtype; padding tokens are 0.
  """
  num_tokens, num_q_heads, head_dim = q.shape
  num_blocks, _, two, block_size, num_kv_heads, head_dim_kv = kv_cache.shape
  if two != 2 or head_dim_kv != head_dim:
    raise ValueError(f"bad kv_cache shape {kv_cache.shape} for q {q.shape}")
  if num_q_heads % num_kv_heads:
    raise ValueError(f"query heads {num_q_heads} not a multiple of kv heads {num_kv_heads}")
  num_seqs, max_blocks = block_tables.shape
  if interpret is None:
    interpret = default_interpret()
  if decode is None:
    decode = num_tokens <= max(num_seqs, _DECODE_TOKEN_FLOOR)
  cfg, _ = select_config(num_tokens=num_tokens, num_seqs=num_seqs, max_blocks=max_blocks,
                         num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         block_size=block_size, kv_dtype=kv_cache.dtype, decode=decode, interpret=interpret,
                         overrides=dict(tile_q=tile_q, blocks_per_iter=blocks_per_iter, num_splits=num_splits,
                                        num_warps=num_warps, num_stages=num_stages))
  return _ragged_paged_attention_impl(q, kv_cache, layer, block_tables, context_lens, query_start_loc,
                                      window, scale=float(scale), interpret=bool(interpret), cfg=cfg,
                                      backend=backend)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "cfg", "backend", "one_query_per_seq"))
def _ragged_paged_attention_impl(q, kv_cache, layer, block_tables, context_lens, query_start_loc,
                                 window=None, *, scale: float, interpret: bool, cfg: KernelConfig,
                                 backend: str, one_query_per_seq: bool = False):
  """Shared core. one_query_per_seq: q[b] is sequence b's only query (query_start_loc ignored).
  window: None (static: no window code at all) or an int32 scalar."""
  num_tokens, num_q_heads, head_dim = q.shape
  num_kv_heads = kv_cache.shape[4]
  group = num_q_heads // num_kv_heads
  max_blocks = block_tables.shape[1]
  if one_query_per_seq:
    tiles, token_tile, token_row, token_valid = decode_tile_metadata(context_lens)
  else:
    tiles, token_tile, token_row, token_valid = tile_metadata(query_start_loc, context_lens, num_tokens,
                                                              cfg.tile_q)
  pad_blocks = -max_blocks % cfg.blocks_per_iter
  bt = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, pad_blocks)))
  layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
  q_rows = _prepare_q(q, num_kv_heads, cfg)
  kw = {} if window is None else {"window": jnp.asarray(window, jnp.int32).reshape(1)}
  o, m, l = BACKENDS[backend](q_rows, kv_cache, layer_arr, bt, tiles, cfg=cfg, scale=scale,
                              interpret=interpret, **kw)
  # Rows back to tokens: token t, kv head h, group member g -> [tile(t), h, row(t) * Gp + g]; gathered
  # before the split merge so the merge only touches real rows.
  row = token_row[:, None] * cfg.group_p + jnp.arange(group, dtype=jnp.int32)[None, :]   # [T, G]
  idx = (token_tile[:, None, None], jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :, None],
         row[:, None, :])
  if cfg.num_splits == 1:
    out = o[0][idx]                                                # [T, Hkv, G, D]
  else:
    out = _merge_splits(o[(slice(None),) + idx], m[(slice(None),) + idx], l[(slice(None),) + idx])
  out = jnp.where(token_valid[:, None, None, None], out, 0)
  return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def paged_decode_attention(q, kv_cache, layer, block_tables, context_lens, *, scale: float, window=None,
                           interpret: Optional[bool] = None, **kwargs):
  """Decode: one query per sequence. q [B, Hq, D], block_tables [B, MB], context_lens [B] -> [B, Hq, D].

  Sequences with context_len 0 are padding (output 0). Uses the decode configuration of the ragged kernel
  (16-row tiles, split-K over long contexts) with tile b = sequence b, so no ragged tile metadata is built.
  kwargs: the tiling overrides of ``ragged_paged_attention`` (tile_q, blocks_per_iter, num_splits, ...).
  """
  num_seqs, num_q_heads, _ = q.shape
  if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
    raise ValueError(f"decode batch: q {q.shape}, block_tables {block_tables.shape}, "
                     f"context_lens {context_lens.shape}")
  num_kv_heads, block_size = kv_cache.shape[4], kv_cache.shape[3]
  if num_q_heads % num_kv_heads:
    raise ValueError(f"query heads {num_q_heads} not a multiple of kv heads {num_kv_heads}")
  if interpret is None:
    interpret = default_interpret()
  backend = kwargs.pop("backend", "triton")
  unknown = set(kwargs) - set(attention_tuning.TUNABLES)
  if unknown:
    raise TypeError(f"paged_decode_attention: unknown arguments {sorted(unknown)}")
  cfg, _ = select_config(num_tokens=num_seqs, num_seqs=num_seqs, max_blocks=block_tables.shape[1],
                         num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=kv_cache.shape[5],
                         block_size=block_size, kv_dtype=kv_cache.dtype, decode=True, interpret=interpret,
                         overrides=kwargs)
  return _ragged_paged_attention_impl(q, kv_cache, layer, block_tables, context_lens, None, window,
                                      scale=float(scale), interpret=bool(interpret), cfg=cfg, backend=backend,
                                      one_query_per_seq=True)
