"""Ragged batch inputs of one model step, built on the host with numpy and padded to shape buckets.

A step mixes prefill chunks and decode tokens of S sequences, flattened on one token axis. Every array
dimension is rounded up to a power of two with a floor (T tokens, S sequences, MB block-table width,
R logit rows), so a serving run compiles a bounded set of shapes.

Padding conventions (pallas_kernels/reference.py contract): padding tokens have token id 0, position 0 and
write their K/V into slots of the reserved block ``PADDING_BLOCK`` (0); padding sequences have
``context_len 0`` and an empty query range at ``query_start_loc[S_real]``; unused block-table entries and
padding logit rows are 0.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple, Sequence

import numpy as np

from superinfer_jax.kv.layout import PADDING_BLOCK
from superinfer_jax.util import cdiv, next_power_of_2

TOKEN_FLOOR = 8
SEQ_FLOOR = 1
BLOCKS_FLOOR = 4
ROWS_FLOOR = 1


class BatchInputs(NamedTuple):
  """One step's ragged batch (a pytree of int32 arrays; numpy on the host, jax.Array on device).

  token_ids       [T]    input token ids (0 for padding).
  positions       [T]    absolute position of each token in its sequence.
  slot_mapping    [T]    cache slot ``block * BS + offset`` the token's K/V are written to.
  block_tables    [S,MB] block ids of each sequence in token order (0 = unused).
  context_lens    [S]    tokens in the cache after this step's writes (0 for padding sequences).
  query_start_loc [S+1]  sequence s's tokens are ``[query_start_loc[s], query_start_loc[s+1])``.
  logits_indices  [R]    flat token index of each logit row wanted.
  """
  token_ids: np.ndarray
  positions: np.ndarray
  slot_mapping: np.ndarray
  block_tables: np.ndarray
  context_lens: np.ndarray
  query_start_loc: np.ndarray
  logits_indices: np.ndarray


def bucket(n: int, floor: int = 1) -> int:
  """Smallest power of two >= max(n, floor, 1)."""
  return next_power_of_2(max(int(n), int(floor)))


def build_batch(seqs: Sequence[tuple[Sequence[int], int, Sequence[int]]], block_size: int, *,
                logits: str = "last", token_floor: int = TOKEN_FLOOR, seq_floor: int = SEQ_FLOOR,
                blocks_floor: int = BLOCKS_FLOOR, rows_floor: int = ROWS_FLOOR
                ) -> tuple[BatchInputs, int]:
  """Packs sequences into one padded ragged batch.

  Args:
    seqs: per sequence ``(new_token_ids, num_computed_tokens, block_table)``: the tokens to run now, how
      many tokens of the sequence are already in the cache, and its block ids (must cover
      ``num_computed_tokens + len(new_token_ids)`` tokens; extra entries are ignored).
    block_size: tokens per cache block (BS).
    logits: "last" -> one logit row per sequence (its last new token, for sampling);
      "all" -> one row per real token, in token order (for scoring).
    token_floor, seq_floor, blocks_floor, rows_floor: minimum bucket of T, S, MB, R.
  Returns:
    ``(batch, num_rows)``: numpy ``BatchInputs`` padded to the buckets, and the number of real logit rows
    (the first ``num_rows`` rows of the step's logits are real).
  Raises:
    ValueError on an empty batch, a sequence without new tokens, a too-short block table, or a block
    table that uses the padding block.
  """
  if block_size <= 0:
    raise ValueError(f"block_size must be positive, got {block_size}")
  if not seqs:
    raise ValueError("build_batch needs at least one sequence")
  if logits not in ("last", "all"):
    raise ValueError(f"logits must be 'last' or 'all', got {logits!r}")
  new_lens, needed_blocks, computeds, tables = _checked_lengths(seqs, block_size)
  t_real, s_real = sum(new_lens), len(seqs)
  r_real = s_real if logits == "last" else t_real
  T, S = bucket(t_real, token_floor), bucket(s_real, seq_floor)
  MB, R = bucket(max(needed_blocks), blocks_floor), bucket(r_real, rows_floor)

  lens = np.array(new_lens, np.int32)
  computed = np.array(computeds, np.int32)
  starts = np.zeros(s_real + 1, np.int32)
  np.cumsum(lens, out=starts[1:])                                      # query start of each sequence
  block_tables = _block_table_array(tables, np.array(needed_blocks, np.int32), S, MB)

  token_ids = np.zeros(T, np.int32)
  token_ids[:t_real] = np.fromiter(itertools.chain.from_iterable(s[0] for s in seqs), np.int32, count=t_real)
  seq_of_token = np.repeat(np.arange(s_real, dtype=np.int32), lens)
  pos = np.arange(t_real, dtype=np.int32) + np.repeat(computed - starts[:-1], lens)
  positions = np.zeros(T, np.int32)
  positions[:t_real] = pos
  slot_mapping = (np.arange(T, dtype=np.int32) % block_size) + PADDING_BLOCK * block_size
  slot_mapping[:t_real] = block_tables[seq_of_token, pos // block_size] * block_size + pos % block_size
  context_lens = np.zeros(S, np.int32)
  context_lens[:s_real] = computed + lens
  query_start_loc = np.full(S + 1, t_real, np.int32)
  query_start_loc[:s_real] = starts[:-1]
  logits_indices = np.zeros(R, np.int32)
  if logits == "last":
    logits_indices[:s_real] = starts[1:] - 1
  else:
    logits_indices[:t_real] = np.arange(t_real, dtype=np.int32)
  batch = BatchInputs(token_ids, positions, slot_mapping, block_tables, context_lens, query_start_loc,
                      logits_indices)
  return batch, r_real


def _checked_lengths(seqs, block_size: int) -> tuple[list[int], list[int], list[int], list]:
  """Per sequence: new-token count, blocks needed, tokens already cached, and its block table cut to the
  blocks needed. ValueError for a sequence without new tokens, a negative cached count or a short table.

  One pass of plain Python over the sequences; the caller does the rest with whole-array numpy, since
  numpy calls per sequence would dominate the cost of a large decode batch."""
  new_lens, needed_blocks, computeds, tables = [], [], [], []
  for i, (tokens, computed, table) in enumerate(seqs):
    n = len(tokens)
    if n == 0:
      raise ValueError(f"sequence {i} has no new tokens")
    if computed < 0:
      raise ValueError(f"sequence {i} has negative num_computed_tokens {computed}")
    nb = cdiv(computed + n, block_size)
    if len(table) < nb:
      raise ValueError(f"sequence {i}: block table has {len(table)} blocks, needs {nb} for "
                       f"{computed + n} tokens at block_size {block_size}")
    new_lens.append(n)
    needed_blocks.append(nb)
    computeds.append(computed)
    tables.append(table if len(table) == nb else table[:nb])
  return new_lens, needed_blocks, computeds, tables


def _block_table_array(tables: Sequence[Sequence[int]], nbs: np.ndarray, S: int, MB: int) -> np.ndarray:
  """int32 ``[S, MB]``: row s holds ``tables[s]`` (``nbs[s]`` entries), the rest ``PADDING_BLOCK``.

  ValueError naming the first sequence whose table uses the padding block."""
  flat_tables = np.fromiter(itertools.chain.from_iterable(tables), np.int32, count=int(nbs.sum()))
  table_ends = np.cumsum(nbs)
  if np.any(flat_tables == PADDING_BLOCK):
    bad = int(np.searchsorted(table_ends, int(np.argmax(flat_tables == PADDING_BLOCK)), side="right"))
    raise ValueError(f"sequence {bad}: block table uses the padding block {PADDING_BLOCK}")
  block_tables = np.full((S, MB), PADDING_BLOCK, np.int32)
  table_rows = np.repeat(np.arange(len(tables), dtype=np.int32), nbs)
  table_starts = table_ends - nbs
  block_tables[table_rows, np.arange(flat_tables.size, dtype=np.int32) - np.repeat(table_starts, nbs)] = flat_tables
  return block_tables
