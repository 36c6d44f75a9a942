"""The jnp attention reference (``pallas_kernels/reference.py``) against a plain numpy loop over tokens.

The Pallas kernel and the model are checked against the reference elsewhere; this pins the reference itself to
the contract written in its docstring (positions, causal mask, GQA grouping, padding tokens), with the layer
given as a Python int and as a traced scalar, and with non-contiguous block tables.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.reference import ragged_paged_attention_reference
from pallas_kernels.testing import make_ragged_batch

from pallas_kernels.testing import tolerance  # noqa: E402

F32_TOL = tolerance("float32")
pytestmark = pytest.mark.gpu   # numerics / kernels / transfers that depend on the accelerator


def _numpy_attention(batch, layer, scale, window=None):
  """One query at a time: its sequence's keys at positions 0..p (p - W < k when a window W > 0 is set)."""
  q = np.asarray(batch.q, np.float64)
  kv = np.asarray(batch.kv_cache, np.float64)
  bt = np.asarray(batch.block_tables)
  ctx = np.asarray(batch.context_lens)
  qsl = np.asarray(batch.query_start_loc)
  T, Hq, D = q.shape
  BS, Hkv = kv.shape[3], kv.shape[4]
  group = Hq // Hkv
  out = np.zeros_like(q)
  for s in range(len(ctx)):
    q_len = qsl[s + 1] - qsl[s]
    if q_len == 0:
      continue
    keys = np.concatenate([kv[b, layer, 0] for b in bt[s, :-(-ctx[s] // BS)]])[:ctx[s]]   # [ctx, Hkv, D]
    vals = np.concatenate([kv[b, layer, 1] for b in bt[s, :-(-ctx[s] // BS)]])[:ctx[s]]
    for j in range(q_len):
      t = qsl[s] + j
      p = ctx[s] - q_len + j
      lo = p - window + 1 if window else 0
      for h in range(Hq):
        k = keys[max(lo, 0):p + 1, h // group]
        v = vals[max(lo, 0):p + 1, h // group]
        logits = (k @ q[t, h]) * scale
        w = np.exp(logits - logits.max())
        out[t, h] = (w / w.sum()) @ v
  return out


# (q_len, context_len); (0, 0) = a padding sequence between real ones.
SEQS = [(1, 1), (5, 21), (0, 0), (1, 33), (17, 17), (1, 16), (9, 48)]


@pytest.mark.parametrize("hq,hkv,window", [(4, 4, None), (6, 2, None), (8, 2, 7)])
def test_reference_matches_numpy_loop(hq, hkv, window):
  rng = np.random.default_rng(hq * 10 + hkv)
  batch = make_ragged_batch(rng, SEQS, num_tokens=40, num_seqs=8, max_blocks=4, block_size=16,
                            num_q_heads=hq, num_kv_heads=hkv, head_dim=32, num_layers=3)
  scale = 32 ** -0.5
  kw = {} if window is None else {"window": window}
  for layer in (0, 2):
    got = np.asarray(ragged_paged_attention_reference(*batch.args(layer), scale=scale, **kw))
    want = _numpy_attention(batch, layer, scale, window)
    np.testing.assert_allclose(got, want, atol=F32_TOL, rtol=F32_TOL)
  end = int(batch.query_start_loc[-1])
  assert not np.any(got[end:]), "padding tokens must be exactly zero"


def test_reference_traced_layer_matches_numpy_loop():
  """``layer`` as a traced int32 scalar (the scanned model) reads the same rows as a Python int."""
  rng = np.random.default_rng(7)
  batch = make_ragged_batch(rng, [(3, 20), (1, 5), (2, 40)], num_tokens=8, num_seqs=4, max_blocks=3, block_size=16,
                            num_q_heads=4, num_kv_heads=2, head_dim=16, num_layers=3)

  @jax.jit
  def run(q, kv, bt, ctx, qsl):
    def body(carry, layer):
      return carry, ragged_paged_attention_reference(q, kv, layer, bt, ctx, qsl, scale=0.25)
    return jax.lax.scan(body, 0, jnp.arange(3, dtype=jnp.int32))[1]

  got = np.asarray(run(batch.q, batch.kv_cache, batch.block_tables, batch.context_lens, batch.query_start_loc))
  for layer in range(3):
    np.testing.assert_allclose(got[layer], _numpy_attention(batch, layer, 0.25), atol=F32_TOL, rtol=F32_TOL)
