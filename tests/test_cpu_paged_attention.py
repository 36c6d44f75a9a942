"""The C++ CPU attention kernel (``pallas_kernels/cpu_paged_attention.{py,cc}``) against the pure-JAX reference.

Random ragged batches (prefill chunks, decode tokens, padding sequences and padding tokens, non-contiguous block
tables), MHA and GQA, sliding windows (a Python int and a traced scalar), the layer as an int and as a traced scalar
under ``lax.scan``, float32 and bfloat16 caches and queries, and the build/fallback path.
"""
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_paged_attention as cpa
from pallas_kernels.reference import ragged_paged_attention_reference as reference

# Without a C++ compiler the kernel cannot exist here: its tests skip, and only the fallback test below runs.
needs_kernel = pytest.mark.skipif(not cpa.available(), reason=f"cpu_kernel unavailable: {cpa.build_error()}")


def _batch(rng, num_seqs, num_blocks, bs, max_blocks, total_tokens):
  """A ragged batch: per sequence a query length (0 = padding sequence) and a context that covers it."""
  q_lens, ctx = [], []
  for _ in range(num_seqs):
    kind = rng.integers(4)
    if kind == 0:  # padding sequence
      q_lens.append(0)
      ctx.append(0)
      continue
    c = int(rng.integers(1, max_blocks * bs + 1))
    q = 1 if kind == 1 else int(rng.integers(1, min(c, 8) + 1))  # decode, or a prefill chunk ending at c
    q_lens.append(q)
    ctx.append(c)
  qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  assert qsl[-1] <= total_tokens
  tables = np.zeros((num_seqs, max_blocks), np.int32)
  ids = rng.permutation(np.arange(1, num_blocks))
  used = 0
  for s in range(num_seqs):
    n = -(-ctx[s] // bs)
    tables[s, :n] = ids[used:used + n]
    used += n
  return tables, np.asarray(ctx, np.int32), qsl


@needs_kernel
def test_kernel_builds_where_a_compiler_is_found():
  assert cpa.build_error() is None
  assert cpa.available()
  assert cpa.library_path().exists()


@needs_kernel
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("heads", [(4, 4), (9, 3)])
def test_kernel_matches_reference_on_random_ragged_batches(seed, heads):
  hq, hkv = heads
  rng = np.random.default_rng(seed)
  nb, layers, bs, d, mb, num_seqs = 48, 3, 4, 16, 6, 5
  tables, ctx, qsl = _batch(rng, num_seqs, nb, bs, mb, total_tokens=40)
  t = int(qsl[-1]) + int(rng.integers(0, 4))  # padding tokens past the last sequence
  cache = jnp.asarray(rng.standard_normal((nb, layers, 2, bs, hkv, d)), jnp.float32)
  q = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.float32)
  args = (jnp.asarray(tables), jnp.asarray(ctx), jnp.asarray(qsl))
  for layer in range(layers):
    for window in (None, 3, 0):
      want = reference(q, cache, layer, *args, scale=d ** -0.5, window=window)
      got = jax.jit(lambda q, c, l, w=window: cpa.cpu_paged_attention(q, c, l, *args, scale=d ** -0.5, window=w))(
          q, cache, layer)
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)
      # Padding tokens (past query_start_loc[S]) are exactly 0, as in the reference.
      assert not np.asarray(got)[int(qsl[-1]):].any()


@needs_kernel
def test_traced_layer_and_window_under_scan():
  rng = np.random.default_rng(7)
  nb, layers, bs, hq, hkv, d = 32, 4, 8, 6, 2, 32
  tables, ctx, qsl = _batch(rng, 4, nb, bs, 3, total_tokens=32)
  t = int(qsl[-1])
  cache = jnp.asarray(rng.standard_normal((nb, layers, 2, bs, hkv, d)), jnp.float32)
  q = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.float32)
  args = (jnp.asarray(tables), jnp.asarray(ctx), jnp.asarray(qsl))
  windows = jnp.asarray([0, 5, 2, 0], jnp.int32)

  def run(fn):
    def body(carry, xs):
      layer, w = xs
      return carry, fn(q, cache, layer, *args, scale=0.3, window=w)
    return jax.jit(lambda: jax.lax.scan(body, 0, (jnp.arange(layers, dtype=jnp.int32), windows))[1])()

  np.testing.assert_allclose(np.asarray(run(cpa.cpu_paged_attention)), np.asarray(run(reference)),
                             rtol=2e-5, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("q_dtype,cache_dtype", [(jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.bfloat16),
                                                 (jnp.bfloat16, jnp.float32)])
def test_bfloat16_inputs_match_the_reference_to_bfloat16_rounding(q_dtype, cache_dtype):
  rng = np.random.default_rng(3)
  nb, bs, hq, hkv, d = 24, 4, 8, 2, 16
  tables, ctx, qsl = _batch(rng, 4, nb, bs, 5, total_tokens=24)
  t = int(qsl[-1]) + 2
  cache = jnp.asarray(rng.standard_normal((nb, 2, 2, bs, hkv, d)), cache_dtype)
  q = jnp.asarray(rng.standard_normal((t, hq, d)), q_dtype)
  args = (jnp.asarray(tables), jnp.asarray(ctx), jnp.asarray(qsl))
  got = cpa.cpu_paged_attention(q, cache, 1, *args, scale=0.25)
  want = reference(q, cache, 1, *args, scale=0.25)
  assert got.dtype == q_dtype and got.shape == q.shape
  # Both compute in float32 from the same inputs; the outputs differ by at most the final rounding to q's dtype.
  tol = 1e-2 if q_dtype == jnp.bfloat16 else 1e-5
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


@needs_kernel
def test_a_decode_token_sees_exactly_its_sequences_keys():
  """Hand-worked: one sequence, values chosen so the output is the mean of V over the visible keys."""
  nb, bs, d = 4, 2, 4
  cache = np.zeros((nb, 1, 2, bs, 1, d), np.float32)
  # Sequence keys 0..2 live in blocks 3 (keys 0, 1) and 1 (key 2); K = 0 gives equal scores (uniform soft-max).
  values = {(3, 0): 1.0, (3, 1): 2.0, (1, 0): 6.0}
  for (blk, off), v in values.items():
    cache[blk, 0, 1, off, 0, :] = v
  cache[2, 0, 1, :, 0, :] = 100.0  # another sequence's block: must not be read
  q = jnp.ones((1, 1, d), jnp.float32)
  tables = jnp.asarray([[3, 1]], jnp.int32)
  out = cpa.cpu_paged_attention(q, jnp.asarray(cache), 0, tables, jnp.asarray([3], jnp.int32),
                                jnp.asarray([0, 1], jnp.int32), scale=1.0)
  np.testing.assert_allclose(np.asarray(out)[0, 0], np.full(d, 3.0), rtol=1e-6)  # (1 + 2 + 6) / 3
  out = cpa.cpu_paged_attention(q, jnp.asarray(cache), 0, tables, jnp.asarray([3], jnp.int32),
                                jnp.asarray([0, 1], jnp.int32), scale=1.0, window=2)
  np.testing.assert_allclose(np.asarray(out)[0, 0], np.full(d, 4.0), rtol=1e-6)  # keys 1, 2 only


@needs_kernel
def test_edge_cases_match_the_reference():
  """Contexts past the table (keys clipped to MB * BS), a chunk longer than its context (negative positions:
  no key, output 0), negative and zero windows (no window), and a head_dim that is not a multiple of 16 (the
  dot product's scalar tail)."""
  rng = np.random.default_rng(11)
  nb, bs, hq, hkv, d, mb = 16, 4, 4, 2, 20, 2
  tables = jnp.asarray([[3, 5], [7, 2], [9, 11]], jnp.int32)
  ctx = jnp.asarray([8 + 3, 2, 6], jnp.int32)        # sequence 0: 11 tokens, but its table holds 8 keys
  qsl = jnp.asarray([0, 2, 6, 7], jnp.int32)          # sequence 1: 4 queries for a 2-token context
  cache = jnp.asarray(rng.standard_normal((nb, 1, 2, bs, hkv, d)), jnp.float32)
  q = jnp.asarray(rng.standard_normal((8, hq, d)), jnp.float32)
  for window in (None, -2, 0, 1, 3):
    want = reference(q, cache, 0, tables, ctx, qsl, scale=0.2, window=window)
    got = cpa.cpu_paged_attention(q, cache, 0, tables, ctx, qsl, scale=0.2, window=window)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)
  assert not np.asarray(got)[2:4].any()   # sequence 1's first two queries sit at positions -2, -1


@needs_kernel
def test_many_tokens_split_across_threads_match_the_reference():
  """A batch large enough that XLA's pool threads take tokens too (the work-stealing path)."""
  rng = np.random.default_rng(5)
  nb, bs, hq, hkv, d, num_seqs = 400, 16, 9, 3, 64, 96
  tables, ctx, qsl = _batch(rng, num_seqs, nb, bs, 4, total_tokens=800)
  cache = jnp.asarray(rng.standard_normal((nb, 2, 2, bs, hkv, d)), jnp.float32)
  q = jnp.asarray(rng.standard_normal((int(qsl[-1]), hq, d)), jnp.float32)
  args = (jnp.asarray(tables), jnp.asarray(ctx), jnp.asarray(qsl))
  fn = jax.jit(lambda q, c: cpa.cpu_paged_attention(q, c, 1, *args, scale=0.125))
  want = reference(q, cache, 1, *args, scale=0.125)
  for _ in range(3):   # the same result every call, whichever thread took which token
    np.testing.assert_allclose(np.asarray(fn(q, cache)), np.asarray(want), rtol=2e-5, atol=2e-6)


@needs_kernel
def test_bad_shapes_raise_clear_errors():
  q = jnp.zeros((2, 3, 8), jnp.float32)
  cache = jnp.zeros((4, 1, 2, 2, 2, 8), jnp.float32)
  args = (jnp.zeros((1, 2), jnp.int32), jnp.asarray([1], jnp.int32), jnp.asarray([0, 1], jnp.int32))
  with pytest.raises(ValueError, match="not a multiple of kv heads"):
    cpa.cpu_paged_attention(q, cache, 0, *args, scale=1.0)
  with pytest.raises(ValueError, match=r"expected q \[T,Hq,D\]"):
    cpa.cpu_paged_attention(q[0], cache, 0, *args, scale=1.0)
  with pytest.raises(ValueError, match="kv_cache must be float32 or bfloat16"):
    cpa.cpu_paged_attention(q[:, :2], cache.astype(jnp.float16), 0, *args, scale=1.0)


def test_without_a_compiler_auto_falls_back_to_the_reference(monkeypatch, tmp_path):
  from superinfer_jax.model import attention
  monkeypatch.setenv("SUPERINFER_KERNEL_CACHE", str(tmp_path))  # nothing cached there
  monkeypatch.setenv("CXX", "")
  monkeypatch.setattr(shutil, "which", lambda name: None)
  assert cpa._compiler() is None  # pylint: disable=protected-access
  with pytest.raises(RuntimeError, match="no C\\+\\+ compiler found"):
    cpa.build()
  cpa.build_error.cache_clear()
  cpa._register.cache_clear()  # pylint: disable=protected-access
  try:
    assert "no C++ compiler found" in cpa.build_error()
    assert not cpa.available()
    assert attention.default_backend_name() == "reference"
    with pytest.raises(RuntimeError, match="cpu_kernel attention backend is unavailable"):
      cpa.cpu_paged_attention(jnp.zeros((1, 1, 4)), jnp.zeros((2, 1, 2, 2, 1, 4)), 0, jnp.zeros((1, 1), jnp.int32),
                              jnp.ones((1,), jnp.int32), jnp.asarray([0, 1], jnp.int32), scale=1.0)
  finally:
    cpa.build_error.cache_clear()
    cpa._register.cache_clear()  # pylint: disable=protected-access
