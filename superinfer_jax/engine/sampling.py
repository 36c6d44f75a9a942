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

``mode`` (static; ``SAMPLING_MODES``) says how much of the sampler is compiled into a step: ``greedy`` (one
argmax; every row must be greedy), ``random`` (temperature sampling; no row may filter), ``filtered`` (top-k /
top-p too; serves any rows). The host picks the least general mode that serves a step's rows
(``sampling_mode``), so the compiled step holds no data-dependent conditional: on a GPU a conditional's
predicate is read on the host, which would make the step call wait for the device. For the same rows every
mode that serves them gives the same tokens.
"""
from __future__ import annotations

import dataclasses

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


GREEDY, RANDOM, FILTERED = "greedy", "random", "filtered"
SAMPLING_MODES = (GREEDY, RANDOM, FILTERED)


def sampling_mode(rows) -> str:
  """The least general mode serving ``rows``, an iterable of ``(temperature, top_k, top_p, ...)`` (top_k 0 or
  -1: off; top_p 1: off). No rows: ``greedy``."""
  mode = GREEDY
  for r in rows:
    temperature, top_k, top_p = r[0], r[1], r[2]
    if temperature > 0:
      if top_k > 0 or top_p < 1.0:
        return FILTERED
      mode = RANDOM
  return mode


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           seed: jax.Array, step: jax.Array, mode: str = FILTERED) -> jax.Array:
  """Samples one token per row. Shapes in the module docstring; ``mode`` static (module docstring), and a row
  it does not serve (a sampled row under ``greedy``, a filtering row under ``random``) is sampled as that mode
  does (greedy / unfiltered). Returns [R] int32 token ids."""
  if mode not in SAMPLING_MODES:
    raise ValueError(f"sampling mode must be one of {SAMPLING_MODES}, got {mode!r}")
  logits = logits.astype(jnp.float32)
  greedy_tokens = first_argmax(logits, axis=-1)
  is_greedy = temperature <= 0.0

  if mode == GREEDY:
    return greedy_tokens
  safe_t = jnp.where(is_greedy, 1.0, temperature)
  scaled = logits / safe_t[:, None]
  if mode == FILTERED:
    scaled = _filter_top_k_top_p(scaled, top_k, top_p)
  keys = _row_keys(seed.astype(jnp.uint32), step.astype(jnp.int32))
  gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(keys)
  sampled = first_argmax(scaled + gumbel, axis=-1)
  return jnp.where(is_greedy, greedy_tokens, sampled)


sample_jit = jax.jit(sample, static_argnames=("mode",))

