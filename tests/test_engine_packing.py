"""One-buffer packing of the step inputs (superinfer_jax/engine/packing.py) round-trips exactly."""
import functools

import jax
import numpy as np

from superinfer_jax.engine import packing
from superinfer_jax.engine.sampling import SamplingArrays
from superinfer_jax.model.batch import build_batch


def test_pack_unpack_roundtrip():
  batch, _ = build_batch([([5, 6, 7], 0, [1]), ([9], 12, [2, 3, 4, 5])], 4, token_floor=8, seq_floor=4)
  R = batch.logits_indices.shape[0]
  samp = SamplingArrays.empty(R)
  samp.temperature[:] = np.linspace(0, 1.5, R)
  samp.top_k[:] = np.arange(R)
  samp.top_p[:] = 0.25
  samp.seed[:] = np.uint32(2**32 - 5)
  samp.step[:] = 7
  buf, dims = packing.pack(batch, samp)
  assert buf.dtype == np.int32 and buf.ndim == 1
  fn = jax.jit(functools.partial(packing.unpack, dims=dims))
  b2, s2 = jax.device_get(fn(jax.device_put(buf)))
  for a, b in zip(batch, b2):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(samp.as_tuple(), s2):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
