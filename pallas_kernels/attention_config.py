"""Static tiling of the ragged paged attention kernel: ``KernelConfig``, the shape heuristic, validation.

``auto_config`` maps static shapes to a ``KernelConfig``; ``pallas_kernels.attention_tuning`` may supply
per-card values for some fields first, and explicit arguments override both.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
from jax.experimental import pallas as pl

from pallas_kernels.attention_tiles import num_tiles as _num_tiles

MIN_DOT_ROWS = 16  # Triton's tl.dot needs M, N, K >= 16.
_MIN_DOT_ROWS = MIN_DOT_ROWS



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
    # 64 keys per step keeps two pipelined K/V tiles of D 128 in shared memory with room for several programs
    # per SM (pallas_kernels.triton_check compiles it for sm_90); 4-byte dtypes take half the keys.
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


def is_pow2(x: int) -> bool:
  return x >= 1 and (x & (x - 1)) == 0


def validate(cfg: KernelConfig, *, head_dim: int, block_size: int, interpret: bool) -> None:
  """Compiled (Triton) kernels need power-of-two tile shapes and dot dims >= 16; interpret mode does not."""
  if cfg.tile_q < 1 or cfg.blocks_per_iter < 1 or cfg.num_splits < 1:
    raise ValueError(f"bad kernel config {cfg}")
  if interpret:
    return
  keys = cfg.blocks_per_iter * block_size
  problems = [f"{name}={v} must be a power of two >= 16" for name, v in
              (("rows (tile_q * group_p)", cfg.rows), ("keys per step (blocks_per_iter * block_size)", keys),
               ("head_dim", head_dim)) if not (is_pow2(v) and v >= 16)]
  if problems:
    raise ValueError("compiled ragged_paged_attention: " + "; ".join(problems))


