"""One-buffer packing of the step inputs (superinfer_jax/engine/packing.py) round-trips exactly, and the
token feed substitutes the previous step's device tokens."""
import functools

import jax
import numpy as np
import pytest

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
  feed = np.full(batch.token_ids.shape[0], -1, np.int32)
  feed[3] = 2
  buf, dims = packing.pack(batch, samp, feed)
  assert buf.dtype == np.int32 and buf.ndim == 1
  T, S, MB, R = dims
  assert buf.size == 4 * T + S * MB + 2 * S + 1 + 6 * R == packing.offsets(dims)["feed"][1]
  fn = jax.jit(functools.partial(packing.unpack, dims=dims))
  b2, s2, f2 = jax.device_get(fn(jax.device_put(buf)))
  for a, b in zip(batch, b2):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(samp.as_tuple(), s2):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(f2, feed)
  np.testing.assert_array_equal(packing.pack(batch, samp)[0][-T:], -1)   # no feed: every token from the host


def test_feed_tokens_reads_previous_step_tokens():
  token_ids = np.array([5, 6, 7, 0], np.int32)
  feed = np.array([-1, 2, -1, 0], np.int32)
  prev = np.array([40, 41, 42, 43], np.int32)
  got = jax.jit(packing.feed_tokens)(token_ids, feed, prev)
  np.testing.assert_array_equal(got, [5, 42, 7, 40])


def test_pack_rejects_mismatched_shapes():
  batch, _ = build_batch([([5, 6], 0, [1])], 4, token_floor=4)
  with pytest.raises(ValueError, match="feed"):
    packing.pack(batch, SamplingArrays.empty(1), np.zeros(3, np.int32))
  with pytest.raises(ValueError, match="logit rows"):
    packing.pack(batch, SamplingArrays.empty(2))
