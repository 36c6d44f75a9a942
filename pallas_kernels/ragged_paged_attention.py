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

*Backends.* The kernel body is written against plain Pallas ref indexing; ``_triton_tiled_attention`` builds
the ``pallas_call`` with Triton ``CompilerParams`` (selecting the Triton lowering explicitly on GPU) or runs it
in interpret mode on CPU. Another backend (e.g. Mosaic GPU) only has to implement ``TiledAttentionFn`` and be
registered in ``BACKENDS``; the tiling/merge wrapper is shared.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Protocol

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import attention_tuning
from pallas_kernels.attention_config import KernelConfig, auto_config, is_pow2, validate
from pallas_kernels.attention_tiles import TileMetadata, decode_tile_metadata, tile_metadata

try:  # Triton compiler params: jax 0.10.x and 0.11.x (deprecated there but working).
  from jax.experimental.pallas import triton as _plgpu
except ImportError:  # pragma: no cover - future JAX without the Triton backend.
  _plgpu = None

__all__ = ["KernelConfig", "TileMetadata", "auto_config", "decode_tile_metadata", "tile_metadata",
           "ragged_paged_attention", "paged_decode_attention", "select_config", "register_backend"]

_is_pow2 = is_pow2  # used by pallas_kernels.grouped_matmul
_LOG2E = math.log2(math.e)
# Finite "minus infinity" for masked logits (as JAX's own GPU kernels): keeps exp2 / max NaN-free.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Batches with at most max(S, this) token slots use the decode tiling (the model's token bucket floor is 8,
# so a decode step of S < 8 sequences still has T = 8).
_DECODE_TOKEN_FLOOR = 8


def default_interpret() -> bool:
  """Interpret mode unless a GPU is the default backend (Pallas compiles only there for this kernel)."""
  return jax.default_backend() != "gpu"


# ----------------------------------------------------------------------------------------------------------
# Kernel.


def _kv_step_range(*, nq, pos0, split, window, cfg: KernelConfig, keys_per_iter: int):
  """KV loop steps ``[start, end)`` of one split, and ``kv_len`` (keys the tile may see).

  A tile with queries at ``pos0 .. pos0 + nq - 1`` needs keys ``0 .. pos0 + nq - 1``; with a window
  (``window`` not None, ``<= 0`` = full) the steps wholly below the first query's window are skipped. The
  remaining steps are shared equally among ``cfg.num_splits`` splits (the last may get fewer or none).
  """
  kv_len = jnp.where(nq > 0, pos0 + nq, 0)
  n_iter = (kv_len + keys_per_iter - 1) // keys_per_iter
  first_iter = 0
  if window is not None:
    first_key = jnp.where(window > 0, jnp.maximum(pos0 - window + 1, 0), 0)
    first_iter = jnp.minimum(first_key // keys_per_iter, n_iter)
  per_split = (n_iter - first_iter + cfg.num_splits - 1) // cfg.num_splits
  start = first_iter + split * per_split
  return start, jnp.minimum(start + per_split, n_iter), kv_len


def _online_softmax_step(q, k, v, carry, *, mask, scale_log2: float, precision):
  """One KV step of the exp2-domain online soft-max: carry (o [M, D], m [M], l [M]) f32 -> updated carry.

  q [M, D]; k, v [K, D]; mask [M, K] (False = key not visible to the row)."""
  o, m, l = carry
  s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                      preferred_element_type=jnp.float32) * scale_log2   # [M, K]
  s = jnp.where(mask, s, _MASK_VALUE)
  m_new = jnp.maximum(m, jnp.max(s, axis=1))
  alpha = jnp.exp2(m - m_new)
  p = jnp.where(mask, jnp.exp2(s - m_new[:, None]), 0.0)
  l = l * alpha + jnp.sum(p, axis=1)
  pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                       preferred_element_type=jnp.float32)
  return o * alpha[:, None] + pv, m_new, l


def _write_outputs(out_refs, o, m, l, num_splits: int) -> None:
  """Normalised output (one split) or the un-normalised partials (o, m, l) for the jnp merge."""
  if num_splits == 1:
    (o_ref,) = out_refs
    inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
    o_ref[...] = (o * inv[:, None]).astype(o_ref.dtype)
  else:
    o_ref, m_ref, l_ref = out_refs
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def _attention_kernel(layer_ref, window_ref, block_tables_ref, t_seq_ref, t_tok_ref, t_nq_ref, t_pos_ref,
                      q_ref, kv_ref,                                                          # tensors
                      *out_refs, cfg: KernelConfig, block_size: int, scale_log2: float, precision,
                      windowed: bool):
  """One (query tile, kv head, split) program.

  Refs: layer_ref [1]; window_ref [1] (read only when ``windowed``; <= 0 = full attention);
  block_tables_ref [S, MBp]; t_*_ref [NT]; q_ref [Hkv, (T + tile_q) * Gp, D] (rows of a
  tile are contiguous); kv_ref [NB, L, 2, BS, Hkv, D]. Outputs: o_ref [M, D] (normalised, q dtype) when
  num_splits == 1, else (o_ref [M, D] f32, m_ref [M] f32 (log2 domain), l_ref [M] f32).
  """
  i, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows, bpi = cfg.rows, cfg.blocks_per_iter
  keys_per_iter = bpi * block_size
  head_dim = q_ref.shape[-1]
  seq, tok, nq, pos0 = t_seq_ref[i], t_tok_ref[i], t_nq_ref[i], t_pos_ref[i]
  layer = layer_ref[0]
  window = window_ref[0] if windowed else None
  start, end, kv_len = _kv_step_range(nq=nq, pos0=pos0, split=split, window=window, cfg=cfg,
                                      keys_per_iter=keys_per_iter)

  q = q_ref[h, pl.ds(tok * cfg.group_p, rows), :]                # [M, D]
  row_pos = pos0 + lax.div(jnp.arange(rows, dtype=jnp.int32), jnp.int32(cfg.group_p))  # [M]
  key_iota = jnp.arange(keys_per_iter, dtype=jnp.int32)

  def body(j, carry):
    ids = block_tables_ref[seq, pl.ds(j * bpi, bpi)]              # [bpi] block ids
    k = kv_ref[ids, layer, 0, :, h, :].reshape(keys_per_iter, head_dim)
    v = kv_ref[ids, layer, 1, :, h, :].reshape(keys_per_iter, head_dim)
    if k.dtype != q.dtype:  # e.g. f32 queries over a bf16 cache: compute in q's dtype
      k, v = k.astype(q.dtype), v.astype(q.dtype)
    key_pos = j * keys_per_iter + key_iota
    mask = (key_pos[None, :] <= row_pos[:, None]) & (key_pos[None, :] < kv_len)
    if windowed:
      mask &= (window <= 0) | (key_pos[None, :] > row_pos[:, None] - window)
    return _online_softmax_step(q, k, v, carry, mask=mask, scale_log2=scale_log2, precision=precision)

  o0 = jnp.zeros((rows, head_dim), jnp.float32)
  m0 = jnp.full((rows,), _MASK_VALUE, jnp.float32)
  l0 = jnp.zeros((rows,), jnp.float32)
  o, m, l = lax.fori_loop(start, end, body, (o0, m0, l0))
  _write_outputs(out_refs, o, m, l, cfg.num_splits)


class TiledAttentionFn(Protocol):
  """Backend contract: runs the tiled kernel, returns (o, m, l).

  Args: q_rows [Hkv, (T + tile_q) * Gp, D]; kv_cache [NB, L, 2, BS, Hkv, D]; layer [1] int32;
  window None (full attention) or [1] int32 (sliding window, <= 0 = full); block_tables [S, MBp] int32
  (MBp a multiple of blocks_per_iter); tiles (TileMetadata, [NT] each).
  Returns with num_splits == 1: (o [1, NT, Hkv, M, D] in q dtype, normalised; None; None); else
  (o [P, NT, Hkv, M, D] f32 un-normalised, m [P, NT, Hkv, M] f32 running max in log2 units, l [P, NT, Hkv, M]).
  """

  def __call__(self, q_rows, kv_cache, layer, block_tables, tiles: TileMetadata, *, cfg: KernelConfig,
               scale: float, interpret: bool, window=None): ...


def _full_spec(shape):
  return pl.BlockSpec(tuple(shape), lambda *_: (0,) * len(shape))


def _triton_tiled_attention(q_rows, kv_cache, layer, block_tables, tiles: TileMetadata, *,
                            cfg: KernelConfig, scale: float, interpret: bool, window=None):
  """Pallas + Triton backend (interpret mode on CPU)."""
  num_kv_heads = kv_cache.shape[4]
  head_dim = kv_cache.shape[5]
  block_size = kv_cache.shape[3]
  num_tiles = tiles.seq.shape[0]
  rows = cfg.rows
  splits = cfg.num_splits
  precision = lax.Precision.HIGHEST if q_rows.dtype == jnp.float32 else None
  windowed = window is not None
  kernel = functools.partial(_attention_kernel, cfg=cfg, block_size=block_size,
                             scale_log2=float(scale) * _LOG2E, precision=precision, windowed=windowed)
  grid = (num_tiles, num_kv_heads, splits)
  window_arr = window if windowed else jnp.zeros((1,), jnp.int32)
  scalar_inputs = (layer, window_arr, block_tables, tiles.seq, tiles.tok_start, tiles.num_q, tiles.pos_start)
  in_specs = [_full_spec(x.shape) for x in scalar_inputs] + [_full_spec(q_rows.shape),
                                                             _full_spec(kv_cache.shape)]
  if splits == 1:
    out_shape = [jax.ShapeDtypeStruct((1, num_tiles, num_kv_heads, rows, head_dim), q_rows.dtype)]
    out_specs = [pl.BlockSpec((None, None, None, rows, head_dim), lambda i, h, s: (s, i, h, 0, 0))]
  else:
    out_shape = [jax.ShapeDtypeStruct((splits, num_tiles, num_kv_heads, rows, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct((splits, num_tiles, num_kv_heads, rows), jnp.float32),
                 jax.ShapeDtypeStruct((splits, num_tiles, num_kv_heads, rows), jnp.float32)]
    out_specs = [pl.BlockSpec((None, None, None, rows, head_dim), lambda i, h, s: (s, i, h, 0, 0)),
                 pl.BlockSpec((None, None, None, rows), lambda i, h, s: (s, i, h, 0)),
                 pl.BlockSpec((None, None, None, rows), lambda i, h, s: (s, i, h, 0))]
  kwargs = {}
  if not interpret and _plgpu is not None:
    kwargs["compiler_params"] = _plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
  outs = pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      interpret=interpret, name=f"ragged_paged_attention_q{cfg.tile_q}_g{cfg.group_p}_p{splits}",
      **kwargs)(*scalar_inputs, q_rows, kv_cache)
  if splits == 1:
    return outs[0], None, None
  return tuple(outs)


BACKENDS: dict[str, TiledAttentionFn] = {"triton": _triton_tiled_attention}


def register_backend(name: str, fn: TiledAttentionFn) -> None:
  """Registers an alternative kernel backend (e.g. Mosaic GPU) under ``name``."""
  BACKENDS[name] = fn


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
