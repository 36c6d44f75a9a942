"""On-device token sampling, batched with per-row parameters (runs inside the jitted engine step).

One call samples one token for each of R logit rows. Every row carries its own parameters:

  logits       [R, V] float32   one row per sequence whose next token is wanted.
  temperature  [R] float32      0 -> greedy (argmax of the raw logits); > 0 -> sample from softmax(l / T).
  top_k        [R] int32        keep the k most likely tokens; 0 (or >= V) disables it.
  top_p        [R] float32      keep the smallest most-likely set with mass >= p (after top-k); 1 disables it.
  seed         [R] uint32       the request's seed.
  step         [R] int32        index of the output token being sampled (0 for the first generated token).

Reproducibility: the random key of a row is ``fold_in(key(seed), step)``, so a request's sampled tokens
depend only on its own logits, seed and output index, never on which other requests share the batch, the
row it lands in, or the bucket size. Greedy rows (temperature 0) ignore the key entirely.

The sort needed by top-k / top-p is skipped (``lax.cond``) when no row of the batch uses either, and the
whole random path is skipped when every row is greedy, so a greedy batch costs one argmax.
"""
from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class SamplingArrays:
  """Host-side (numpy) per-row sampling parameters, padded to the logits bucket ``R``.

  Padding rows are greedy (temperature 0), so they cost nothing and their tokens are ignored.
  """
  temperature: np.ndarray  # [R] float32
  top_k: np.ndarray        # [R] int32
  top_p: np.ndarray        # [R] float32
  seed: np.ndarray         # [R] uint32
  step: np.ndarray         # [R] int32

  @classmethod
  def empty(cls, num_rows: int) -> "SamplingArrays":
    return cls(temperature=np.zeros(num_rows, np.float32), top_k=np.zeros(num_rows, np.int32),
               top_p=np.ones(num_rows, np.float32), seed=np.zeros(num_rows, np.uint32),
               step=np.zeros(num_rows, np.int32))

  def as_tuple(self) -> tuple[np.ndarray, ...]:
    return (self.temperature, self.top_k, self.top_p, self.seed, self.step)


def _row_keys(seed: jax.Array, step: jax.Array) -> jax.Array:
  """[R] typed PRNG keys: fold_in(key(seed_r), step_r)."""
  return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seed, step)


def _filter_top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Masks (to -inf) the tokens outside each row's top-k, then outside its top-p nucleus.

  scaled: [R, V] temperature-scaled logits. Returns [R, V]. Ties at a threshold are all kept.
  The most likely token is always kept, so top_p -> 0 degenerates to greedy.
  """
  R, V = scaled.shape
  sorted_desc = -jnp.sort(-scaled, axis=-1)                       # [R, V]
  k = jnp.where((top_k <= 0) | (top_k > V), V, top_k)             # [R]
  ranks = jnp.arange(V, dtype=jnp.int32)[None, :]
  sorted_desc = jnp.where(ranks < k[:, None], sorted_desc, -jnp.inf)
  probs = jax.nn.softmax(sorted_desc, axis=-1)
  exclusive_cum = jnp.cumsum(probs, axis=-1) - probs              # mass strictly before each rank
  keep = (exclusive_cum < top_p[:, None]) | (ranks == 0)
  kept = jnp.where(keep, sorted_desc, jnp.inf)
  threshold = jnp.min(kept, axis=-1, keepdims=True)               # smallest kept logit per row
  return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def first_argmax(x: jax.Array, axis: int) -> jax.Array:
  """``jnp.argmax(x, axis)`` as int32, computed as a max then the smallest index holding it (NaN counts as
  the maximum, and ties go to the first index, as in ``jnp.argmax``).

  Two plain reductions instead of argmax's (value, index) pair reduction, which XLA CPU runs 2-3x slower
  (logits ``[16, 49152]``: 1.9 -> 0.8 ms; ``[64, 49152]``: 7.4 -> 3.1 ms; docs/platform.md)."""
  m = jnp.max(x, axis=axis, keepdims=True)
  n = x.shape[axis]
  idx = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis % x.ndim)
  return jnp.min(jnp.where((x == m) | jnp.isnan(x), idx, n), axis=axis)


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           seed: jax.Array, step: jax.Array, vocab_major: bool = False) -> jax.Array:
  """Samples one token per row. Shapes in the module docstring. Returns [R] int32 token ids.

  ``vocab_major=True``: ``logits`` is ``[V, R]`` (``forward(..., logits_layout="vocab")``); the greedy argmax
  runs over axis 0 in place and only the random path transposes it. The tokens are the same."""
  logits = logits.astype(jnp.float32)
  greedy_tokens = first_argmax(logits, axis=0 if vocab_major else -1)
  is_greedy = temperature <= 0.0

  def random_path(logits):
    if vocab_major:
      logits = logits.T  # [R, V], inside the branch: an all-greedy batch never transposes
    safe_t = jnp.where(is_greedy, 1.0, temperature)
    scaled = logits / safe_t[:, None]
    needs_filter = jnp.any(~is_greedy & (((top_k > 0) & (top_k < logits.shape[-1])) | (top_p < 1.0)))
    scaled = jax.lax.cond(needs_filter, lambda x: _filter_top_k_top_p(x, top_k, top_p), lambda x: x,
                          scaled)
    keys = _row_keys(seed.astype(jnp.uint32), step.astype(jnp.int32))
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(keys)
    sampled = first_argmax(scaled + gumbel, axis=-1)
    return jnp.where(is_greedy, greedy_tokens, sampled)

  return jax.lax.cond(jnp.all(is_greedy), lambda _: greedy_tokens, random_path, logits)


sample_jit = jax.jit(sample, static_argnames=("vocab_major",))


def derive_seed(engine_seed: int, request_id: str) -> int:
  """A 32-bit seed for a request that gave none: a stable hash of (engine seed, request id)."""
  return zlib.crc32(f"{engine_seed}:{request_id}".encode()) & 0xFFFFFFFF
