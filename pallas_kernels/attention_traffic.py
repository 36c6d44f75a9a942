"""Memory traffic of one ragged paged attention launch, derived from the shapes and the chosen KernelConfig.

``traffic(seqs, ...)`` walks the kernel's tiles the way the kernel does (tile = ``tile_q`` queries of one
sequence; each (tile, kv head, split) program reads whole ``blocks_per_iter``-block steps up to the tile's last
query position) and returns byte counts; nothing is measured. Keys of ``seqs``: ``(q_len, context_len)`` per
sequence, as in ``pallas_kernels.testing``.

Returned dict (bytes unless named otherwise):
  required_kv: K and V of every sequence read once per KV head (the floor any kernel must read).
  read_kv: what the programs read: whole steps (partial blocks and partial steps rounded up), once per
    query tile (a prefill chunk cut into n tiles re-reads its causal prefix), once per KV head group (all
    query heads of a group share one read; never once per query head).
  read_block_table: int32 block ids the programs read. read_q / write_out: query rows (padded GQA rows
    included) and outputs (split-K partials in f32 plus their merge read).
  overhead: (read_kv + read_block_table + read_q + write_out) / required_kv.
  programs: grid size (tiles incl. inactive ones x kv heads x splits); programs_per_core: over ``num_cores``.
  rows, real_rows: query rows per program and how many of them carry a real (token, head) pair on average.
  pipeline_stages / bytes_in_flight_per_program: Triton's software pipelining depth of the KV loop and the
    K/V bytes it keeps in flight per program (``num_stages * keys per step * D * 2 * itemsize``).
  smem_per_program / resident_programs_per_core / waves: an upper-bound occupancy estimate from shared memory
    alone (pipelined K/V buffers plus the query tile; registers may allow fewer) and the grid's waves at it.
"""
from __future__ import annotations

from typing import Optional, Sequence

from pallas_kernels.attention_config import KernelConfig
from pallas_kernels.attention_tiles import num_tiles as static_num_tiles

SMEM_PER_CORE = 227 * 1024   # shared memory one SM of an H100 / H200 can give its resident programs


def traffic(seqs: Sequence[tuple[int, int]], *, cfg: KernelConfig, num_q_heads: int, num_kv_heads: int,
            head_dim: int, block_size: int, itemsize: int, decode_layout: bool,
            num_tokens: Optional[int] = None, num_cores: int = 132,
            smem_per_core: int = SMEM_PER_CORE) -> dict:
  """Byte counts of one launch (see the module docstring). decode_layout: the ``paged_decode_attention`` grid
  (one tile per sequence); else the ragged grid with its static tile bound over ``num_tokens`` slots."""
  group = num_q_heads // num_kv_heads
  keys_per_step = cfg.blocks_per_iter * block_size
  kv_token_bytes = num_kv_heads * head_dim * 2 * itemsize      # K and V of one token, all kv heads
  required = sum(ctx for _, ctx in seqs) * kv_token_bytes
  read_steps = 0       # KV steps summed over (tile, split) for one kv head
  block_ids = 0
  real_tiles = 0
  for q_len, ctx in seqs:
    tile_q = 1 if decode_layout else cfg.tile_q
    for start in range(0, q_len, tile_q):
      nq = min(tile_q, q_len - start)
      kv_len = ctx - q_len + start + nq
      steps = -(-kv_len // keys_per_step)
      read_steps += steps
      block_ids += steps * cfg.blocks_per_iter
      real_tiles += 1
  total_tokens = sum(q for q, _ in seqs)
  slots = num_tokens if num_tokens is not None else total_tokens
  grid_tiles = len(seqs) if decode_layout else static_num_tiles(slots, len(seqs), cfg.tile_q)
  read_kv = read_steps * keys_per_step * kv_token_bytes
  read_bt = block_ids * 4 * num_kv_heads
  q_rows = (slots + cfg.tile_q) * cfg.group_p * num_kv_heads
  read_q = q_rows * head_dim * itemsize * cfg.num_splits
  out_rows = grid_tiles * num_kv_heads * cfg.rows
  if cfg.num_splits == 1:
    write_out = out_rows * head_dim * itemsize
  else:   # f32 partials (o, m, l) written, then the real rows read back by the merge
    write_out = cfg.num_splits * (out_rows * (head_dim + 2) * 4 + total_tokens * num_q_heads * (head_dim + 2) * 4)
  programs = grid_tiles * num_kv_heads * cfg.num_splits
  in_flight = cfg.num_stages * keys_per_step * head_dim * 2 * itemsize
  smem = in_flight + cfg.rows * head_dim * itemsize
  resident = max(1, smem_per_core // smem)
  total = read_kv + read_bt + read_q + write_out
  return dict(required_kv=required, read_kv=read_kv, read_block_table=read_bt, read_q=read_q,
              write_out=write_out, total=total, overhead=(total / required) if required else None,
              kv_reread_factor=(read_kv / required) if required else None,
              programs=programs, active_tiles=real_tiles, grid_tiles=grid_tiles,
              programs_per_core=programs / num_cores, rows=cfg.rows,
              real_rows=(total_tokens * group / max(real_tiles, 1)), keys_per_step=keys_per_step,
              pipeline_stages=cfg.num_stages, num_warps=cfg.num_warps, num_splits=cfg.num_splits,
              bytes_in_flight_per_program=in_flight, smem_per_program=smem,
              resident_programs_per_core=resident, waves=programs / (num_cores * resident))


def format_traffic(t: dict) -> str:
  """One line for the bench output."""
  return (f"required {t['required_kv'] / 1e6:.1f} MB, kernel moves {t['total'] / 1e6:.1f} MB "
          f"(KV x{t['kv_reread_factor']:.2f}, total x{t['overhead']:.2f}); {t['programs']} programs "
          f"({t['programs_per_core']:.1f}/SM), {t['rows']} rows ({t['real_rows']:.1f} real), "
          f"{t['keys_per_step']} keys/step, {t['pipeline_stages']} stages "
          f"({t['bytes_in_flight_per_program'] / 1024:.0f} KiB in flight/program, <= "
          f"{t['resident_programs_per_core']} resident/SM, {t['waves']:.2f} waves), splits {t['num_splits']}")
