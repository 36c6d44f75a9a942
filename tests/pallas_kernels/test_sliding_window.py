"""Sliding-window attention: the jnp reference against a hand-written numpy mask, the Pallas kernel against
the reference on ragged batches (hypothesis), blocks wholly outside the window never read, and tiny
transformers Qwen2 (``use_sliding_window``) / Mistral checkpoints scored past their window."""
import functools

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import paged_decode_attention, ragged_paged_attention
from pallas_kernels.reference import ragged_paged_attention_reference
from pallas_kernels.testing import make_ragged_batch
from superinfer_jax.model import load_model, score
from support.tiny_models import save_tiny_hf_model, torch_logits
from test_pallas_ragged_attention import H_BS, H_MB, H_S, H_T, _compositions

from pallas_kernels.testing import tolerance  # noqa: E402

F32_TOL = tolerance("float32")
pytestmark = pytest.mark.gpu   # numerics / kernels / transfers that depend on the accelerator

TOL = {jnp.float32: tolerance(jnp.float32), jnp.bfloat16: tolerance(jnp.bfloat16)}   # from the matmul precision


def _numpy_attention(batch, layer, scale, window):
  """Per query: soft-max over its sequence's keys at positions (p - W, p] (all of 0..p for W <= 0)."""
  q = np.asarray(batch.q, np.float32)
  kv = np.asarray(batch.kv_cache, np.float32)
  qsl, ctx, bt = (np.asarray(x) for x in (batch.query_start_loc, batch.context_lens, batch.block_tables))
  bs, hkv = kv.shape[3], kv.shape[4]
  out = np.zeros_like(q)
  g = q.shape[1] // hkv
  for s in range(len(ctx)):
    n = qsl[s + 1] - qsl[s]
    if n == 0:
      continue
    keys = np.concatenate([kv[b, layer] for b in bt[s, :-(-ctx[s] // bs)]], axis=1)   # [2, K, Hkv, D]
    for j in range(n):
      p = ctx[s] - n + j
      lo = max(0, p - window + 1) if window > 0 else 0
      k, v = keys[0, lo:p + 1], keys[1, lo:p + 1]
      for h in range(q.shape[1]):
        logits = k[:, h // g] @ q[qsl[s] + j, h] * scale
        w = np.exp(logits - logits.max())
        out[qsl[s] + j, h] = (w / w.sum()) @ v[:, h // g]
  return out


@pytest.mark.parametrize("window", [1, 5, 16, 33, 0])
def test_reference_window_matches_numpy(window):
  rng = np.random.default_rng(window)
  batch = make_ragged_batch(rng, [(1, 40), (9, 30), (0, 0), (17, 17)], num_tokens=32, num_seqs=4, max_blocks=3,
                            block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=16)
  got = ragged_paged_attention_reference(*batch.args(1), scale=0.25, window=window)
  np.testing.assert_allclose(np.asarray(got), _numpy_attention(batch, 1, 0.25, window), atol=F32_TOL, rtol=F32_TOL)


@hypothesis.settings(max_examples=14, deadline=None, derandomize=True)
@hypothesis.given(seqs=_compositions(), seed=st.integers(0, 2**16), window=st.integers(-1, H_MB * H_BS),
                  splits=st.sampled_from([1, 2]), bpi=st.sampled_from([1, 2]),
                  dtype=st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_pallas_window_matches_reference_hypothesis(seqs, seed, window, splits, bpi, dtype):
  rng = np.random.default_rng(seed)
  batch = make_ragged_batch(rng, seqs, num_tokens=H_T, num_seqs=H_S, max_blocks=H_MB, block_size=H_BS,
                            num_q_heads=4, num_kv_heads=2, head_dim=64, num_blocks=H_S * H_MB + 3, dtype=dtype)
  want = ragged_paged_attention_reference(*batch.args(1), scale=0.125, window=window)
  got = ragged_paged_attention(*batch.args(1), scale=0.125, window=window, num_splits=splits, tile_q=8,
                               blocks_per_iter=bpi)
  got32, want32 = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert np.all(np.isfinite(got32))
  np.testing.assert_allclose(got32, want32, atol=TOL[dtype], rtol=TOL[dtype])
  assert not np.any(got32[int(batch.query_start_loc[-1]):])


@pytest.mark.parametrize("entry", ["ragged", "decode"])
def test_blocks_wholly_outside_the_window_are_not_read(entry):
  """NaN in every block below each sequence's window: the kernel never loads them (a loaded NaN would
  reach the output through p @ v), and the result equals the reference on the clean cache."""
  rng = np.random.default_rng(0)
  bs, window = 8, 10
  ctx = [50, 9, 33, 64]
  batch = make_ragged_batch(rng, [(1, c) for c in ctx], num_tokens=4, num_seqs=4, max_blocks=8, block_size=bs,
                            num_q_heads=4, num_kv_heads=2, head_dim=16)
  want = ragged_paged_attention_reference(*batch.args(1), scale=0.25, window=window)
  kv = np.asarray(batch.kv_cache).copy()
  poisoned = 0
  for s, c in enumerate(ctx):
    first_key = max(0, c - 1 - window + 1)
    for b in range(first_key // bs):                   # blocks whose keys are all below the window
      kv[int(batch.block_tables[s, b]), 1] = np.nan
      poisoned += 1
  assert poisoned >= 8
  kv = jnp.asarray(kv)
  if entry == "ragged":
    got = ragged_paged_attention(batch.q, kv, 1, batch.block_tables, batch.context_lens, batch.query_start_loc,
                                 scale=0.25, window=window, blocks_per_iter=1, num_splits=2)
  else:
    got = paged_decode_attention(batch.q, kv, 1, batch.block_tables, batch.context_lens, scale=0.25,
                                 window=window, blocks_per_iter=1)
  assert np.all(np.isfinite(np.asarray(got)))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=F32_TOL, rtol=F32_TOL)
  # Without the window the poisoned blocks are read.
  full = ragged_paged_attention(batch.q, kv, 1, batch.block_tables, batch.context_lens, batch.query_start_loc,
                                scale=0.25, blocks_per_iter=1)
  assert np.isnan(np.asarray(full)).any()


def test_traced_per_layer_window_under_scan():
  """As the model calls it: the window is a scanned int32 (0 = full attention on that layer)."""
  rng = np.random.default_rng(2)
  batch = make_ragged_batch(rng, [(5, 37), (1, 20), (12, 12)], num_tokens=24, num_seqs=4, max_blocks=3,
                            block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=16)
  windows = jnp.array([0, 7], jnp.int32)

  def run(fn):
    def body(_, xs):
      layer, w = xs
      return None, fn(batch.q, batch.kv_cache, layer, batch.block_tables, batch.context_lens,
                      batch.query_start_loc, scale=0.25, window=w)
    return jax.lax.scan(body, None, (jnp.arange(2, dtype=jnp.int32), windows))[1]

  got, want = jax.jit(lambda: run(ragged_paged_attention))(), run(ragged_paged_attention_reference)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=F32_TOL, rtol=F32_TOL)
  np.testing.assert_allclose(np.asarray(want[0]), np.asarray(ragged_paged_attention_reference(
      *batch.args(0), scale=0.25)), atol=1e-6)


def test_windowed_kernel_lowers_and_compiles_for_cuda_on_cpu():
  sds = jax.ShapeDtypeStruct
  args = (sds((32, 8, 128), jnp.bfloat16), sds((40, 2, 2, 16, 2, 128), jnp.bfloat16), sds((), jnp.int32),
          sds((8, 8), jnp.int32), sds((8,), jnp.int32), sds((9,), jnp.int32), sds((), jnp.int32))
  f = functools.partial(ragged_paged_attention, scale=128 ** -0.5, interpret=False)
  windowed = lambda *a: f(*a[:6], window=a[6])
  text = jax.jit(windowed).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "triton" in text
  # ... and Triton's own compiler accepts it for sm_90 (H100/H200), still without a GPU.
  from pallas_kernels import triton_check
  modules = triton_check.capture_ttir(lambda *a: f(*a[:6], window=a[6]), *args)   # fresh fn: no lowering cache
  assert len(modules) == 1
  assert triton_check.compile_ttir(modules[0], arch=90).shared_bytes <= triton_check.SM90_MAX_SMEM


@pytest.fixture(scope="module", params=["qwen2", "mistral"])
def windowed_model(request, tmp_path_factory):
  path = str(tmp_path_factory.mktemp(request.param))
  if request.param == "qwen2":   # layer 0 full, layer 1 windowed (max_window_layers=1)
    model = save_tiny_hf_model(path, "qwen2", use_sliding_window=True, sliding_window=12, max_window_layers=1)
  else:
    model = save_tiny_hf_model(path, "mistral", sliding_window=12)
  cfg, params = load_model(path)
  return request.param, model, cfg, params


@pytest.mark.parametrize("attention", ["reference", "pallas"])
def test_windowed_models_score_matches_transformers(windowed_model, attention):
  family, model, cfg, params = windowed_model
  assert cfg.layer_windows() == ((0, 12) if family == "qwen2" else (12, 12))
  ids = np.random.RandomState(6).randint(0, cfg.vocab_size, size=61)     # 5x the window
  got = score(params, cfg, ids, attention=attention, chunk_size=13, block_size=8)
  want = torch_logits(model, ids)
  assert np.abs(got - want).max() < 1e-4
  # The window mattered: the same weights without it give other logits past position 12.
  full = score(params, cfg.replace(sliding_window=0, sliding_window_layers=()), ids, block_size=8)
  assert np.abs(full[:12] - want[:12]).max() < 1e-4 and np.abs(full[12:] - want[12:]).max() > 1e-3
