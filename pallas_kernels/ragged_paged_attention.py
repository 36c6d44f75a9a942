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

try:  # Triton compiler params: jax 0.10.x and 0.11.x (deprecated there but working).
  from jax.experimental.pallas import triton as _plgpu
except ImportError:  # pragma: no cover - future JAX without the Triton backend.
  _plgpu = None

_LOG2E = math.log2(math.e)
# Finite "minus infinity" for masked logits (as JAX's own GPU kernels): keeps exp2 / max NaN-free.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_MIN_DOT_ROWS = 16  # Triton's tl.dot needs M, N, K >= 16.
# Batches with at most max(S, this) token slots use the decode tiling (the model's token bucket floor is 8,
# so a decode step of S < 8 sequences still has T = 8).
_DECODE_TOKEN_FLOOR = 8


def default_interpret() -> bool:
  """Interpret mode unless a GPU is the default backend (Pallas compiles only there for this kernel)."""
  return jax.default_backend() != "gpu"


# ----------------------------------------------------------------------------------------------------------
# Configuration.


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Static tiling of one kernel launch.

  Attributes:
    tile_q: query tokens per tile (power of two); rows per program are ``tile_q * group_p``.
    group_p: GQA group size padded to a power of two.
    blocks_per_iter: KV cache blocks read per inner-loop step (power of two); keys per step are
      ``blocks_per_iter * block_size``.
    num_splits: split-K factor (1 = no split; > 1 writes partials merged in jnp).
    num_warps / num_stages: Triton launch parameters (ignored in interpret mode).
  """
  tile_q: int
  group_p: int
  blocks_per_iter: int
  num_splits: int = 1
  num_warps: int = 4
  num_stages: int = 2

  @property
  def rows(self) -> int:
    return self.tile_q * self.group_p


def _num_gpu_cores(default: int = 132) -> int:
  try:
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", default) or default)
  except Exception:  # pragma: no cover
    return default


def auto_config(*, num_tokens: int, num_seqs: int, max_blocks: int, num_q_heads: int, num_kv_heads: int,
                block_size: int, decode: bool, interpret: bool, itemsize: int = 2,
                tile_q: Optional[int] = None,
                blocks_per_iter: Optional[int] = None, num_splits: Optional[int] = None,
                num_warps: Optional[int] = None, num_stages: Optional[int] = None) -> KernelConfig:
  """Picks a KernelConfig from static shapes; any explicit argument overrides the heuristic.

  decode: the batch is (mostly) one query per sequence -> minimal rows (``tile_q * group_p = 16``); else
    64-row tiles. Split-K (either mode, compiled only) when there are too few (tile, kv-head) programs to fill
    the GPU (target 4 programs per SM), keeping >= 4 KV steps per split.
  """
  group_p = pl.next_power_of_2(num_q_heads // num_kv_heads)
  if tile_q is None:
    target_rows = _MIN_DOT_ROWS if decode else 64
    tile_q = max(1, target_rows // group_p)
    if not decode:  # no point in tiles longer than the whole (bucketed) token axis
      tile_q = min(tile_q, pl.next_power_of_2(max(1, num_tokens)))
    tile_q = max(tile_q, max(1, _MIN_DOT_ROWS // group_p))
  if blocks_per_iter is None:
    # 64 keys x D 128 x 2 B per K/V tile -> ~38 KB smem per program with 2 stages (sm_90, checked with
    # pallas_kernels.triton_check); 4-byte dtypes take half the keys to keep occupancy.
    keys_per_iter = 64 if itemsize <= 2 else 32
    blocks_per_iter = max(1, keys_per_iter // block_size)
    blocks_per_iter = min(blocks_per_iter, pl.next_power_of_2(max_blocks))
    # Triton dot needs N >= 16 keys per step.
    while blocks_per_iter * block_size < 16:
      blocks_per_iter *= 2
  num_tiles = _num_tiles(num_tokens, num_seqs, tile_q)
  if num_splits is None:
    if interpret:
      num_splits = 1
    else:
      programs = num_tiles * num_kv_heads
      target = 4 * _num_gpu_cores()
      max_iters = -(-max_blocks // blocks_per_iter)
      num_splits = 1
      # Keep >= 4 KV steps per split so the merge stays cheap relative to the KV stream.
      while programs * num_splits < target and num_splits * 2 * 4 <= max_iters and num_splits < 16:
        num_splits *= 2
  return KernelConfig(tile_q=int(tile_q), group_p=int(group_p), blocks_per_iter=int(blocks_per_iter),
                      num_splits=int(num_splits), num_warps=int(num_warps or 4),
                      num_stages=int(num_stages or 2))


def _is_pow2(x: int) -> bool:
  return x >= 1 and (x & (x - 1)) == 0


def _validate(cfg: KernelConfig, *, head_dim: int, block_size: int, interpret: bool) -> None:
  """Compiled (Triton) kernels need power-of-two tile shapes and dot dims >= 16; interpret mode does not."""
  if cfg.tile_q < 1 or cfg.blocks_per_iter < 1 or cfg.num_splits < 1:
    raise ValueError(f"bad kernel config {cfg}")
  if interpret:
    return
  keys = cfg.blocks_per_iter * block_size
  problems = [f"{name}={v} must be a power of two >= 16" for name, v in
              (("rows (tile_q * group_p)", cfg.rows), ("keys per step (blocks_per_iter * block_size)", keys),
               ("head_dim", head_dim)) if not (_is_pow2(v) and v >= 16)]
  if problems:
    raise ValueError("compiled ragged_paged_attention: " + "; ".join(problems))


# ----------------------------------------------------------------------------------------------------------
# Tile metadata (jnp, traced inside the wrapper).


def _num_tiles(num_tokens: int, num_seqs: int, tile_q: int) -> int:
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
  num_tiles = _num_tiles(num_tokens, num_seqs, tile_q)
  q_len = jnp.maximum(qsl[1:] - qsl[:-1], 0)
  tiles_per_seq = (q_len + tile_q - 1) // tile_q
  tile_end = jnp.cumsum(tiles_per_seq).astype(jnp.int32)      # [S]
  tile_begin = tile_end - tiles_per_seq
  i = jnp.arange(num_tiles, dtype=jnp.int32)
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


# ----------------------------------------------------------------------------------------------------------
# Kernel.


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
  i = pl.program_id(0)
  h = pl.program_id(1)
  split = pl.program_id(2)
  rows = cfg.rows
  bpi = cfg.blocks_per_iter
  keys_per_iter = bpi * block_size
  head_dim = q_ref.shape[-1]

  seq = t_seq_ref[i]
  tok = t_tok_ref[i]
  nq = t_nq_ref[i]
  pos0 = t_pos_ref[i]
  layer = layer_ref[0]

  kv_len = jnp.where(nq > 0, pos0 + nq, 0)                       # keys this tile may see
  n_iter = (kv_len + keys_per_iter - 1) // keys_per_iter
  first_iter = 0
  if windowed:   # skip the steps wholly below the first query's window
    window = window_ref[0]
    first_key = jnp.where(window > 0, jnp.maximum(pos0 - window + 1, 0), 0)
    first_iter = jnp.minimum(first_key // keys_per_iter, n_iter)
  per_split = (n_iter - first_iter + cfg.num_splits - 1) // cfg.num_splits
  start = first_iter + split * per_split
  end = jnp.minimum(start + per_split, n_iter)

  q = q_ref[h, pl.ds(tok * cfg.group_p, rows), :]                # [M, D]
  row_pos = pos0 + lax.div(jnp.arange(rows, dtype=jnp.int32), jnp.int32(cfg.group_p))  # [M]
  key_iota = jnp.arange(keys_per_iter, dtype=jnp.int32)

  def body(j, carry):
    o, m, l = carry
    ids = block_tables_ref[seq, pl.ds(j * bpi, bpi)]              # [bpi] block ids
    k = kv_ref[ids, layer, 0, :, h, :].reshape(keys_per_iter, head_dim)
    v = kv_ref[ids, layer, 1, :, h, :].reshape(keys_per_iter, head_dim)
    if k.dtype != q.dtype:  # e.g. f32 queries over a bf16 cache: compute in q's dtype
      k, v = k.astype(q.dtype), v.astype(q.dtype)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * scale_log2   # [M, K]
    key_pos = j * keys_per_iter + key_iota
    mask = (key_pos[None, :] <= row_pos[:, None]) & (key_pos[None, :] < kv_len)
    if windowed:
      mask &= (window <= 0) | (key_pos[None, :] > row_pos[:, None] - window)
    s = jnp.where(mask, s, _MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.where(mask, jnp.exp2(s - m_new[:, None]), 0.0)
    l = l * alpha + jnp.sum(p, axis=1)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)
    o = o * alpha[:, None] + pv
    return o, m_new, l

  o0 = jnp.zeros((rows, head_dim), jnp.float32)
  m0 = jnp.full((rows,), _MASK_VALUE, jnp.float32)
  l0 = jnp.zeros((rows,), jnp.float32)
  o, m, l = lax.fori_loop(start, end, body, (o0, m0, l0))

  if cfg.num_splits == 1:
    (o_ref,) = out_refs
    inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
    o_ref[...] = (o * inv[:, None]).astype(o_ref.dtype)
  else:
    o_ref, m_ref, l_ref = out_refs
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


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
    backend: key of BACKENDS. tile_q / blocks_per_iter / num_splits / num_warps / num_stages: overrides of
      ``auto_config``.

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
  cfg = auto_config(num_tokens=num_tokens, num_seqs=num_seqs, max_blocks=max_blocks,
                    num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, block_size=block_size,
                    decode=decode, interpret=interpret, itemsize=jnp.dtype(kv_cache.dtype).itemsize,
                    tile_q=tile_q, blocks_per_iter=blocks_per_iter,
                    num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)
  _validate(cfg, head_dim=head_dim, block_size=block_size, interpret=interpret)
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
  cfg = auto_config(num_tokens=num_seqs, num_seqs=num_seqs, max_blocks=block_tables.shape[1],
                    num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, block_size=block_size, decode=True,
                    interpret=interpret, itemsize=jnp.dtype(kv_cache.dtype).itemsize, **kwargs)
  _validate(cfg, head_dim=kv_cache.shape[5], block_size=block_size, interpret=interpret)
  return _ragged_paged_attention_impl(q, kv_cache, layer, block_tables, context_lens, None, window,
                                      scale=float(scale), interpret=bool(interpret), cfg=cfg, backend=backend,
                                      one_query_per_seq=True)
