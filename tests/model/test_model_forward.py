"""Forward-step invariants: cache writes only at slot_mapping, padding is inert, CUDA lowering, donation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from superinfer_jax.model import build_batch, init_kv_cache, load_config, step
from superinfer_jax.model.params import init_random_params, param_shapes

BS = 16


@pytest.fixture(scope="module")
def tiny():
  cfg = load_config("tiny-llama")
  return cfg, init_random_params(cfg, jax.random.key(0), scale=0.2)


def test_init_random_params_shapes(tiny):
  cfg, params = tiny
  got = jax.tree.map(lambda x: tuple(x.shape), params)
  assert got == jax.tree.map(tuple, param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))


def test_step_writes_exactly_the_mapped_slots(tiny):
  cfg, params = tiny
  cache0 = jax.random.normal(jax.random.key(1), cfg.kv_spec(BS).shape(8), jnp.float32)
  before = np.asarray(cache0)
  seqs = [([5, 6, 7], 14, [3, 6]), ([9], 0, [2])]       # writes block 3 slots 14,15 + block 6 slot 0; block 2 slot 0
  batch, _ = build_batch(seqs, BS, token_floor=8)
  _, cache = step(params, cache0, batch, cfg, "reference")
  after = np.asarray(cache)
  changed = np.any(after != before, axis=(1, 2, 4, 5))    # [NB, BS]
  want = np.zeros_like(changed)
  want[3, [14, 15]] = want[6, 0] = want[2, 0] = True
  want[0] = changed[0]                                     # padding block: anything goes
  np.testing.assert_array_equal(changed, want)
  assert changed[3, 14] and changed[2, 0]


def test_padding_does_not_change_real_logits(tiny):
  cfg, params = tiny
  seqs = [(list(range(1, 12)), 0, [1]), ([40], 20, [2, 3])]
  out = []
  for floors in (dict(token_floor=8, seq_floor=1, blocks_floor=1, rows_floor=1),
                 dict(token_floor=32, seq_floor=8, blocks_floor=8, rows_floor=8)):
    cache = init_kv_cache(cfg, 5, BS)
    batch, rows = build_batch(seqs, BS, **floors)
    logits, _ = step(params, cache, batch, cfg, "reference")
    assert np.all(np.isfinite(np.asarray(logits)))
    out.append(np.asarray(logits[:rows]))
  np.testing.assert_allclose(out[0], out[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_step_lowers_for_cuda_with_donated_cache(dtype):
  cfg = load_config("tiny-qwen2")
  params = init_random_params(cfg, jax.random.key(0), dtype=dtype)
  cache = init_kv_cache(cfg, 9, BS, dtype)
  batch, _ = build_batch([([1, 2, 3], 5, [1, 2])], BS)
  text = step.trace(params, cache, batch, cfg, "reference").lower(lowering_platforms=("cuda",)).as_text()
  assert "tf.aliasing_output" in text or "jax.buffer_donor" in text   # kv_cache is donated


def test_tied_embeddings_give_the_logits_of_lm_head_equal_embed_transposed(tiny):
  """Tied embeddings (the output weight is ``embed [V, H]``) give the logits of the same model with a separate
  ``lm_head [H, V]`` = ``embed.T``."""
  import dataclasses
  cfg, params = tiny
  tied_cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
  tied = {k: v for k, v in params.items() if k != "lm_head"}
  untied = dict(tied, lm_head=params["embed"].T)
  seqs = [(list(range(1, 12)), 0, [1]), ([40, 41], 20, [2, 3]), ([7], 3, [4])]
  batch, rows = build_batch(seqs, BS, token_floor=16, rows_floor=8)
  want, _ = step(untied, init_kv_cache(cfg, 5, BS), batch, cfg, "reference")
  got, _ = step(tied, init_kv_cache(cfg, 5, BS), batch, tied_cfg, "reference")
  assert got.shape == (8, cfg.vocab_size) and rows == 3
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
  assert np.abs(np.asarray(want)).max() > 1e-3
