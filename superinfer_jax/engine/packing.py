"""One host->device transfer per step: the ragged batch and the sampling parameters packed in one buffer.

``pack(batch, samp)`` concatenates the seven int32 ``BatchInputs`` arrays and the five per-row sampling
arrays (float32 / uint32 bit-cast to int32) into ONE flat int32 numpy buffer, so a step costs one
``jax.device_put`` of one array instead of twelve (each ``device_put`` has a fixed host cost that dominated
the step's host time on CPU). ``unpack(buf, dims)`` runs inside the jitted step: static slices, reshapes and
bit-casts, no data-dependent shapes.

Layout for ``dims = (T, S, MB, R)`` (offsets in int32 words):
  token_ids[T] | positions[T] | slot_mapping[T] | block_tables[S*MB] | context_lens[S] |
  query_start_loc[S+1] | logits_indices[R] | temperature[R] (f32 bits) | top_k[R] | top_p[R] (f32 bits) |
  seed[R] (u32 bits) | step[R]
Total ``3T + S*MB + 2S + 1 + 6R`` words.
"""
from __future__ import annotations

import numpy as np


def dims_of(batch) -> tuple[int, int, int, int]:
  """(T, S, MB, R) of a numpy or device ``BatchInputs``."""
  S, MB = batch.block_tables.shape
  return (int(batch.token_ids.shape[0]), int(S), int(MB), int(batch.logits_indices.shape[0]))


def pack(batch, samp) -> tuple[np.ndarray, tuple[int, int, int, int]]:
  """Packs a numpy ``BatchInputs`` and ``SamplingArrays`` (rows = R) into one int32 buffer + its dims."""
  dims = dims_of(batch)
  R = dims[3]
  for name, a in zip(("temperature", "top_k", "top_p", "seed", "step"), samp.as_tuple()):
    if a.shape != (R,):
      raise ValueError(f"sampling array {name} has shape {a.shape}, batch has {R} logit rows")
  parts = [np.asarray(x, np.int32).ravel() for x in batch]
  parts += [np.asarray(samp.temperature, np.float32).view(np.int32),
            np.asarray(samp.top_k, np.int32),
            np.asarray(samp.top_p, np.float32).view(np.int32),
            np.asarray(samp.seed, np.uint32).view(np.int32),
            np.asarray(samp.step, np.int32)]
  return np.concatenate(parts), dims


def unpack(buf, dims):
  """Inverse of ``pack`` on device (inside jit): returns ``(BatchInputs, (temperature, top_k, top_p, seed,
  step))`` with the dtypes ``sampling.sample`` expects. ``dims`` must be static."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from superinfer_jax.model.batch import BatchInputs  # pylint: disable=import-outside-toplevel
  T, S, MB, R = dims
  sizes = [T, T, T, S * MB, S, S + 1, R, R, R, R, R, R]
  out, off = [], 0
  for n in sizes:
    out.append(jax.lax.slice_in_dim(buf, off, off + n))
    off += n
  batch = BatchInputs(out[0], out[1], out[2], out[3].reshape(S, MB), out[4], out[5], out[6])
  samp = (jax.lax.bitcast_convert_type(out[7], jnp.float32), out[8],
          jax.lax.bitcast_convert_type(out[9], jnp.float32),
          jax.lax.bitcast_convert_type(out[10], jnp.uint32), out[11])
  return batch, samp
