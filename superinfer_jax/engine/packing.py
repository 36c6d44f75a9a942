"""One host->device transfer per step: the ragged batch, the sampling parameters and the token feed in one
buffer.

``pack(batch, samp, feed)`` concatenates the seven int32 ``BatchInputs`` arrays, the five per-row sampling
arrays (float32 / uint32 bit-cast to int32) and the token feed into ONE flat int32 numpy buffer, so a step
costs one ``jax.device_put`` of one array instead of thirteen (each ``device_put`` has a fixed host cost
that dominated the step's host time on CPU). ``unpack(buf, dims)`` runs inside the jitted step: static
slices, reshapes and bit-casts, no data-dependent shapes.

Token feed (on-device token feedback, ``EngineConfig.zero_bubble``): ``feed[t] >= 0`` says token ``t``'s
id is not in ``token_ids`` but is entry ``feed[t]`` of the previous step's sampled tokens, still on the
device; ``feed_tokens`` substitutes it inside the jitted step. ``-1`` (the default) keeps ``token_ids[t]``.

Layout for ``dims = (T, S, MB, R)`` (offsets in int32 words):
  token_ids[T] | positions[T] | slot_mapping[T] | block_tables[S*MB] | context_lens[S] |
  query_start_loc[S+1] | logits_indices[R] | temperature[R] (f32 bits) | top_k[R] | top_p[R] (f32 bits) |
  seed[R] (u32 bits) | step[R] | feed[T]
Total ``4T + S*MB + 2S + 1 + 6R`` words. ``offsets(dims)`` names each field's ``(start, stop)``.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np

class StepHandle(NamedTuple):
  """What ``ModelRunner.dispatch`` returns (``engine/model_runner.py``): the step's sampled ids ``[out_rows]`` and,
  when asked, its logprobs ``(values, ids)``, as device arrays (numpy for a fake runner), not read yet."""
  tokens: Any
  logprobs: Any = None


FIELDS = ("token_ids", "positions", "slot_mapping", "block_tables", "context_lens", "query_start_loc",
          "logits_indices", "temperature", "top_k", "top_p", "seed", "step", "feed")


def dims_of(batch) -> tuple[int, int, int, int]:
  """(T, S, MB, R) of a numpy or device ``BatchInputs``."""
  S, MB = batch.block_tables.shape
  return (int(batch.token_ids.shape[0]), int(S), int(MB), int(batch.logits_indices.shape[0]))


def offsets(dims) -> dict[str, tuple[int, int]]:
  """``field -> (start, stop)`` word offsets of every field in a buffer of ``dims`` (layout above)."""
  T, S, MB, R = dims
  sizes = (T, T, T, S * MB, S, S + 1, R, R, R, R, R, R, T)
  out, off = {}, 0
  for name, n in zip(FIELDS, sizes):
    out[name] = (off, off + n)
    off += n
  return out


def pack(batch, samp, feed: Optional[np.ndarray] = None) -> tuple[np.ndarray, tuple[int, int, int, int]]:
  """Packs a numpy ``BatchInputs``, ``SamplingArrays`` (rows = R) and token feed ``[T]`` (None: all -1)
  into one int32 buffer + its dims."""
  dims = dims_of(batch)
  T, R = dims[0], dims[3]
  for name, a in zip(("temperature", "top_k", "top_p", "seed", "step"), samp.as_tuple()):
    if a.shape != (R,):
      raise ValueError(f"sampling array {name} has shape {a.shape}, batch has {R} logit rows")
  if feed is None:
    feed = np.full(T, -1, np.int32)
  elif feed.shape != (T,):
    raise ValueError(f"feed has shape {feed.shape}, batch has {T} tokens")
  parts = [np.asarray(x, np.int32).ravel() for x in batch]
  parts += [np.asarray(samp.temperature, np.float32).view(np.int32),
            np.asarray(samp.top_k, np.int32),
            np.asarray(samp.top_p, np.float32).view(np.int32),
            np.asarray(samp.seed, np.uint32).view(np.int32),
            np.asarray(samp.step, np.int32),
            np.asarray(feed, np.int32)]
  return np.concatenate(parts), dims


def unpack(buf, dims):
  """Inverse of ``pack`` on device (inside jit): returns ``(BatchInputs, (temperature, top_k, top_p, seed,
  step), feed)`` with the dtypes ``sampling.sample`` expects. ``dims`` must be static."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from superinfer_jax.model.batch import BatchInputs  # pylint: disable=import-outside-toplevel
  S, MB = dims[1], dims[2]
  out = [jax.lax.slice_in_dim(buf, a, b) for a, b in offsets(dims).values()]
  batch = BatchInputs(out[0], out[1], out[2], out[3].reshape(S, MB), out[4], out[5], out[6])
  samp = (jax.lax.bitcast_convert_type(out[7], jnp.float32), out[8],
          jax.lax.bitcast_convert_type(out[9], jnp.float32),
          jax.lax.bitcast_convert_type(out[10], jnp.uint32), out[11])
  return batch, samp, out[12]


def feed_tokens(token_ids, feed, prev_tokens):
  """``token_ids`` [T] with every fed position (``feed >= 0``) replaced by ``prev_tokens[feed]`` (inside
  jit; ``prev_tokens`` is the previous step's sampled ids, on device)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  fed = prev_tokens[jnp.clip(feed, 0, prev_tokens.shape[0] - 1)]
  return jnp.where(feed >= 0, fed, token_ids)
