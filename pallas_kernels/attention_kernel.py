"""The ragged paged attention kernel body and its Pallas + Triton backend.

One program handles one (query tile, KV head, split); see ``pallas_kernels.ragged_paged_attention`` for the
tiling, the grid and the contract. ``BACKENDS`` maps a name to a ``TiledAttentionFn``; the wrappers in
``ragged_paged_attention`` look the backend up there.
"""
from __future__ import annotations

import functools
import math
from typing import Protocol

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.attention_config import KernelConfig
from pallas_kernels.attention_tiles import TileMetadata

try:  # Triton compiler params: jax 0.10.x and 0.11.x (deprecated there but working).
  from jax.experimental.pallas import triton as _plgpu
except ImportError:  # pragma: no cover - future JAX without the Triton backend.
  _plgpu = None

_LOG2E = math.log2(math.e)
# Finite "minus infinity" for masked logits (as JAX's own GPU kernels): keeps exp2 / max NaN-free.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


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
