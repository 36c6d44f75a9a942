"""Random ragged paged-attention batches for tests and benchmarks (numpy, host side).

A batch follows the contract in ``pallas_kernels/reference.py``: q [T, Hq, D], kv_cache [NB, L, 2, BS, Hkv, D]
(block 0 is the padding block), block_tables [S, MB] (unused entries 0), context_lens [S], query_start_loc
[S+1]. Blocks are handed out from a shuffled permutation of 1..NB-1, so block tables are non-contiguous.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class RaggedBatch:
  q: jnp.ndarray
  kv_cache: jnp.ndarray
  block_tables: jnp.ndarray
  context_lens: jnp.ndarray
  query_start_loc: jnp.ndarray

  def args(self, layer=0):
    """Positional arguments of the attention contract."""
    return (self.q, self.kv_cache, layer, self.block_tables, self.context_lens, self.query_start_loc)


def blocks_needed(seqs: Sequence[tuple[int, int]], block_size: int) -> int:
  return sum(-(-ctx // block_size) for _, ctx in seqs)


def make_ragged_batch(rng: np.random.Generator, seqs: Sequence[tuple[int, int]], *, num_tokens: int,
                      num_seqs: int, max_blocks: int, block_size: int, num_q_heads: int, num_kv_heads: int,
                      head_dim: int, num_layers: int = 2, num_blocks: int | None = None, dtype=jnp.float32,
                      shuffle_blocks: bool = True) -> RaggedBatch:
  """Builds a batch from ``seqs`` = [(q_len, context_len), ...] (``(0, 0)`` = padding sequence).

  The list is padded with padding sequences up to ``num_seqs`` and the token axis with padding tokens up to
  ``num_tokens``. Requires q_len <= context_len <= max_blocks * block_size and sum(q_len) <= num_tokens.
  """
  seqs = list(seqs) + [(0, 0)] * (num_seqs - len(seqs))
  assert len(seqs) == num_seqs, (len(seqs), num_seqs)
  q_lens = np.array([s[0] for s in seqs], np.int32)
  ctx = np.array([s[1] for s in seqs], np.int32)
  assert np.all(q_lens <= ctx) and np.all(ctx <= max_blocks * block_size), seqs
  assert q_lens.sum() <= num_tokens, (q_lens.sum(), num_tokens)
  need = blocks_needed(seqs, block_size)
  if num_blocks is None:
    num_blocks = need + 1 + max(2, need // 4)  # a few never-referenced blocks
  assert num_blocks >= need + 1
  ids = np.arange(1, num_blocks, dtype=np.int32)
  if shuffle_blocks:
    ids = rng.permutation(ids)
  block_tables = np.zeros((num_seqs, max_blocks), np.int32)
  k = 0
  for s, (_, c) in enumerate(seqs):
    n = -(-c // block_size)
    block_tables[s, :n] = ids[k:k + n]
    k += n
  query_start_loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  q = rng.standard_normal((num_tokens, num_q_heads, head_dim), dtype=np.float32)
  kv = rng.standard_normal((num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), dtype=np.float32)
  return RaggedBatch(q=jnp.asarray(q, dtype), kv_cache=jnp.asarray(kv, dtype),
                     block_tables=jnp.asarray(block_tables), context_lens=jnp.asarray(ctx),
                     query_start_loc=jnp.asarray(query_start_loc))


def to_jax_paged_layout(kv_cache, layer: int):
  """Block-first cache -> (k_pages, v_pages) [Hkv, NB, BS, D] for jax.experimental.pallas.ops.gpu.paged_attention."""
  k = jnp.transpose(kv_cache[:, layer, 0], (2, 0, 1, 3))
  v = jnp.transpose(kv_cache[:, layer, 1], (2, 0, 1, 3))
  return k, v


# Unit roundoff of the operands a float32 dot multiplies at each matmul precision: full float32 (24-bit
# significand), TF32 (11-bit), bfloat16 (8-bit).
_F32_DOT_ROUNDOFF = {"highest": 2.0 ** -24, "float32": 2.0 ** -24, "tensorfloat32": 2.0 ** -11, "high": 2.0 ** -11,
                     "bfloat16": 2.0 ** -8, "default": 2.0 ** -8, "fastest": 2.0 ** -8}


def float32_dot_roundoff() -> float:
  """Unit roundoff of a float32 dot as this process runs it: full float32 on a CPU; on a GPU, what
  ``jax_default_matmul_precision`` asks for (unset: XLA:GPU's default, which may round float32 operands to
  TF32 on tensor cores, so it counts as ``tensorfloat32``)."""
  import jax  # pylint: disable=import-outside-toplevel
  if jax.default_backend() == "cpu":
    return 2.0 ** -24
  precision = jax.config.jax_default_matmul_precision
  return _F32_DOT_ROUNDOFF.get(str(precision).lower(), 2.0 ** -11) if precision else 2.0 ** -11


def tolerance(dtype) -> float:
  """Absolute and relative tolerance for an attention / model output in ``dtype`` against the float32 jnp
  reference: bfloat16 outputs carry their own rounding (2e-2); float32 ones 300 times the dot's roundoff
  (``float32_dot_roundoff``: the soft-max and its sums grow it), at least 2e-5: 2e-5 at full float32, ~1.5e-1 for
  bfloat16 dots, ~1.5e-3 for TF32 (a GPU at default precision)."""
  if jnp.dtype(dtype) == jnp.bfloat16:
    return 2e-2
  return max(2e-5, 300.0 * float32_dot_roundoff())
