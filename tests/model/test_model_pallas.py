"""The model with attention="pallas" (interpret mode on CPU) gives the reference backend's logits."""
import jax
import numpy as np
import pytest

import superinfer_jax.model as model  # noqa: E402
from superinfer_jax.model.config import ModelConfig  # noqa: E402
from superinfer_jax.model.params import init_random_params  # noqa: E402

from pallas_kernels.testing import tolerance  # noqa: E402

F32_TOL = tolerance("float32")
pytestmark = pytest.mark.gpu   # numerics / kernels / transfers that depend on the accelerator


def _tiny(num_heads=4, num_kv_heads=2, head_dim=32):
  cfg = ModelConfig(family="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                    num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    max_position_embeddings=256, rope_theta=10000.0)
  params = init_random_params(cfg, jax.random.PRNGKey(0), dtype="float32", scale=0.2)
  return cfg, params


@pytest.mark.parametrize("heads", [(4, 2), (6, 2)])   # GQA 2 and a non-power-of-two group (3)
def test_pallas_score_matches_reference(heads):
  cfg, params = _tiny(*heads)
  rng = np.random.default_rng(0)
  ids = rng.integers(0, cfg.vocab_size, size=37).tolist()
  # chunk 12 with block 16: chunks start mid-block and attend to earlier cached chunks.
  want = model.score(params, cfg, ids, attention="reference", chunk_size=12, block_size=16)
  got = model.score(params, cfg, ids, attention="pallas", chunk_size=12, block_size=16)
  assert got.shape == (37, cfg.vocab_size)
  np.testing.assert_allclose(got, want, atol=max(1e-4, F32_TOL), rtol=max(1e-4, F32_TOL))


def test_pallas_mixed_step_matches_reference():
  """One ragged step mixing decode tokens and a prefill chunk, through the jitted model step."""
  cfg, params = _tiny()
  bs = 16
  rng = np.random.default_rng(1)
  seqs = [(rng.integers(0, 97, 1).tolist(), 20, [3, 7]),           # decode at position 20
          (rng.integers(0, 97, 9).tolist(), 5, [9]),                # chunk starting mid-block
          (rng.integers(0, 97, 1).tolist(), 0, [2])]                # length-1 sequence
  batch, rows = model.build_batch(seqs, bs, logits="all")
  cache = model.init_kv_cache(cfg, 12, bs)
  # Fill the "earlier" cache content with random K/V so attention to cached tokens matters.
  cache = jax.random.normal(jax.random.PRNGKey(2), cache.shape, cache.dtype)
  batch = jax.tree.map(jax.numpy.asarray, batch)
  want, _ = model.forward(params, cache, batch, cfg, "reference")
  got, _ = model.forward(params, cache, batch, cfg, "pallas")
  np.testing.assert_allclose(np.asarray(got[:rows]), np.asarray(want[:rows]), atol=max(1e-4, F32_TOL), rtol=max(1e-4, F32_TOL))


def test_auto_backend_is_pallas_on_gpu_reference_elsewhere_and_names_are_checked():
  from pallas_kernels.ragged_paged_attention import ragged_paged_attention
  from pallas_kernels.reference import ragged_paged_attention_reference
  from superinfer_jax.model.attention import attention_backend_names, get_attention_backend
  on_gpu = jax.default_backend() in ("gpu", "cuda")
  expected = ragged_paged_attention if on_gpu else ragged_paged_attention_reference
  assert get_attention_backend("auto") is expected
  assert set(attention_backend_names()) == {"auto", "reference", "pallas"}
  with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
    get_attention_backend("flash")
