"""Fused projections (model/fused.py): the engine's step layout gives the unfused model's logits and cache, for
Llama, Qwen2 (qkv biases) and Mixtral (experts stay unfused), stacked and per-layer."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from superinfer_jax.model import build_batch, init_kv_cache, load_config
from superinfer_jax.model.forward import forward
from superinfer_jax.model.fused import fuse_projections, unroll_layers
from superinfer_jax.model.params import init_random_params

BS = 8


def _cfg(name):
  if name == "tiny-mixtral":
    return load_config("tiny-llama").replace(family="mixtral", num_experts=4, num_experts_per_token=2)
  return load_config(name)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mixtral"])
@pytest.mark.parametrize("unrolled", [False, True])
def test_fused_forward_matches_unfused(name, unrolled):
  cfg = _cfg(name)
  params = init_random_params(cfg, jax.random.key(1), scale=0.2)
  fused = fuse_projections(params, cfg)
  if unrolled:
    params, fused = unroll_layers(params), unroll_layers(fused)
  seqs = [(list(range(3, 14)), 0, [1, 2]), ([40], 12, [3, 4]), ([7, 8], 5, [5])]   # prefill + decodes
  batch, rows = build_batch(seqs, BS, token_floor=16)
  cache = jax.random.normal(jax.random.key(2), cfg.kv_spec(BS).shape(6), jnp.float32)
  run = jax.jit(forward, static_argnames=("cfg", "attention"))
  want, want_cache = run(params, cache, batch, cfg=cfg, attention="reference")
  got, got_cache = run(fused, cache, batch, cfg=cfg, attention="reference")
  np.testing.assert_allclose(np.asarray(got[:rows]), np.asarray(want[:rows]), atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(got_cache), np.asarray(want_cache), atol=2e-5, rtol=1e-5)
  assert np.abs(np.asarray(want[:rows])).max() > 1e-3          # the comparison is not between zeros


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mixtral"])
def test_fused_layout_keys_columns_and_leaf_count(name):
  cfg = _cfg(name)
  params = init_random_params(cfg, jax.random.key(0))
  before = {k: np.asarray(v) for k, v in params["layers"].items()}
  fused = fuse_projections(params, cfg)
  lp = fused["layers"]
  assert set(params["layers"]) == set(before)                  # the input is not modified
  Q, KV = cfg.q_size, cfg.kv_size
  np.testing.assert_array_equal(np.asarray(lp["wqkv"][..., :Q]), before["wq"])
  np.testing.assert_array_equal(np.asarray(lp["wqkv"][..., Q:Q + KV]), before["wk"])
  np.testing.assert_array_equal(np.asarray(lp["wqkv"][..., Q + KV:]), before["wv"])
  np.testing.assert_array_equal(np.asarray(lp["norms"][:, 1]), before["mlp_norm"])
  gone = {"wq", "wk", "wv", "attn_norm", "mlp_norm", "bq", "bk", "bv"}
  assert not gone & set(lp)
  if cfg.is_moe:
    assert "w_gate" in lp and "w_gate_up" not in lp             # experts keep their own layout
  else:
    np.testing.assert_array_equal(np.asarray(lp["w_gate_up"][..., cfg.intermediate_size:]), before["w_up"])
    assert "w_gate" not in lp and "w_up" not in lp
  per_layer = len(jax.tree.leaves(unroll_layers(params))) - len(jax.tree.leaves(unroll_layers(fused)))
  saved = 2 + (2 if cfg.qkv_bias else 0) + (0 if cfg.is_moe else 1)   # q,k,v -> 1; b q,k,v -> 1; gate,up -> 1
  assert per_layer == (saved + 1) * cfg.num_layers             # and norms: 2 leaves -> 1 per layer
  again = fuse_projections(fused, cfg)                            # idempotent
  assert jax.tree.structure(again) == jax.tree.structure(fused)


def test_unrolled_layout_is_one_dict_per_layer():
  """``unroll_layers``: one dict per layer holding that layer's slice of every stacked leaf (fused: wqkv, wo,
  w_gate_up, w_down, norms); idempotent."""
  cfg = _cfg("tiny-llama")
  fused = fuse_projections(init_random_params(cfg, jax.random.key(0)), cfg)
  un = unroll_layers(fused)
  assert len(un["layers"]) == cfg.num_layers
  assert set(un["layers"][0]) == {"wqkv", "wo", "w_gate_up", "w_down", "norms"}
  for i in range(cfg.num_layers):
    for name in ("norms", "wo", "wqkv"):
      np.testing.assert_array_equal(np.asarray(un["layers"][i][name]), np.asarray(fused["layers"][name][i]))
  assert unroll_layers(un) is un
