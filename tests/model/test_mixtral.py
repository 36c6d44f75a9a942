"""Mixtral MoE: a tiny random transformers ``MixtralForCausalLM`` through load_model / score (reference and
Pallas attention), the grouped MoE formulations against the dense reference, and compiled-HLO FLOPs that
grow with top-k, not with the number of experts."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from superinfer_jax.model import load_model, score
from superinfer_jax.model import moe as moe_mod
from superinfer_jax.model.params import param_shapes
from support.tiny_models import save_tiny_hf_model, torch_logits

TOL = 1e-4
BS = 8


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("mixtral"))
  model = save_tiny_hf_model(path, "mixtral", num_local_experts=4, num_experts_per_tok=2)
  cfg, params = load_model(path)
  return model, cfg, params, path


def test_mixtral_loads_with_stacked_experts(tiny_mixtral):
  model, cfg, params, _ = tiny_mixtral
  assert (cfg.family, cfg.num_experts, cfg.num_experts_per_token) == ("mixtral", 4, 2)
  lp = params["layers"]
  assert lp["w_gate"].shape == (2, 4, 64, 96) and lp["w_down"].shape == (2, 4, 96, 64)
  assert lp["router"].shape == (2, 64, 4)
  assert jax.tree.map(lambda x: tuple(x.shape), params) == jax.tree.map(
      tuple, param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
  # Expert 3's up projection of layer 1 is transformers' w3 (transposed): the per-expert stacking is in order.
  sd = model.state_dict()
  up = sd["model.layers.1.mlp.experts.gate_up_proj"][3, 96:].numpy()           # [F, H]
  np.testing.assert_array_equal(np.asarray(lp["w_up"][1, 3]), up.T)


@pytest.mark.parametrize("attention", ["reference", "pallas"])
@pytest.mark.parametrize("length,chunk", [(13, 5), (37, 16)])
def test_mixtral_score_matches_transformers(tiny_mixtral, attention, length, chunk):
  model, cfg, params, _ = tiny_mixtral
  ids = np.random.RandomState(length).randint(0, cfg.vocab_size, size=length)
  got = score(params, cfg, ids, attention=attention, chunk_size=chunk, block_size=BS)
  ref = torch_logits(model, ids)
  assert np.abs(got - ref).max() < TOL


def test_mixtral_bfloat16_stays_close(tiny_mixtral):
  model, cfg, _, path = tiny_mixtral
  _, p16 = load_model(path, dtype="bfloat16")
  ids = np.random.RandomState(5).randint(0, cfg.vocab_size, size=19)
  ref = torch_logits(model, ids)
  got = score(p16, cfg, ids, attention="reference", chunk_size=8, block_size=BS)
  err = np.abs(got - ref).max()
  assert TOL < err < 0.05 * max(1.0, np.abs(ref).max())


def _layer(rng, E, H=32, F=48, dtype=jnp.float32):
  k = jax.random.split(jax.random.PRNGKey(rng), 4)
  return {"router": jax.random.normal(k[0], (H, E), dtype),
          "w_gate": 0.2 * jax.random.normal(k[1], (E, H, F), dtype),
          "w_up": 0.2 * jax.random.normal(k[2], (E, H, F), dtype),
          "w_down": 0.2 * jax.random.normal(k[3], (E, F, H), dtype)}


@pytest.mark.parametrize("T,E,k,tile", [(1, 4, 1, None), (8, 4, 2, None), (37, 8, 2, 8), (64, 8, 3, 16),
                                        (5, 16, 4, None)])
def test_grouped_moe_equals_dense(T, E, k, tile):
  lp = _layer(T + E, E)
  h = jax.random.normal(jax.random.PRNGKey(T), (T, 32), jnp.float32)
  weights, experts = moe_mod.route(h, lp["router"], k)
  np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, rtol=1e-6)
  want = moe_mod.moe_dense(h, lp, weights, experts)
  tiles = moe_mod.moe_tiles(h, lp, weights, experts, tile=tile)
  ragged = moe_mod.moe_ragged_dot(h, lp, weights, experts)
  kernel = moe_mod.moe_pallas(h, lp, weights, experts, tile=tile)
  for got in (tiles, ragged, kernel):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
  # A hand-rolled per-token loop (independent of both formulations).
  hn, wn, en = np.asarray(h), np.asarray(weights), np.asarray(experts)
  silu = lambda x: x / (1 + np.exp(-x))
  loop = np.zeros_like(hn)
  for t in range(T):
    for j in range(k):
      e = en[t, j]
      a = silu(hn[t] @ np.asarray(lp["w_gate"][e])) * (hn[t] @ np.asarray(lp["w_up"][e]))
      loop[t] += wn[t, j] * (a @ np.asarray(lp["w_down"][e]))
  np.testing.assert_allclose(np.asarray(want), loop, atol=1e-4, rtol=1e-4)


def test_model_step_with_each_moe_impl_matches_dense(tiny_mixtral):
  """A ragged step (prefill chunk + decodes) through forward(moe=...) for every formulation."""
  from superinfer_jax.model import build_batch, forward, init_kv_cache
  _, cfg, params, _ = tiny_mixtral
  rng = np.random.default_rng(4)
  seqs = [(rng.integers(0, 128, 11).tolist(), 3, [2, 5]), (rng.integers(0, 128, 1).tolist(), 9, [7, 1])]
  batch, rows = build_batch(seqs, BS, logits="all")
  batch = jax.tree.map(jnp.asarray, batch)
  cache = jax.random.normal(jax.random.PRNGKey(1), init_kv_cache(cfg, 9, BS).shape)
  want, _ = forward(params, cache, batch, cfg, "reference", moe="dense")
  for impl in moe_mod.MOE_IMPLS[1:] + ("auto",):
    got, _ = forward(params, cache, batch, cfg, "reference", moe=impl)
    np.testing.assert_allclose(np.asarray(got[:rows]), np.asarray(want[:rows]), atol=2e-5, rtol=2e-5)


def test_grouped_matmul_kernel_skips_inactive_tiles_and_compiles_for_sm90():
  from pallas_kernels import grouped_matmul as gm
  from pallas_kernels import triton_check
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((5 * 16, 64)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((3, 64, 96)), jnp.float32)
  te = jnp.array([0, 0, 2, 1, 2], jnp.int32)
  got = np.asarray(gm.grouped_matmul(x, w, te, 4, tile_m=16))
  xs = np.asarray(x).reshape(5, 16, 64)
  want = np.concatenate([xs[i] @ np.asarray(w)[int(te[i])] for i in range(4)] + [np.zeros((16, 96))])
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)
  with pytest.raises(ValueError, match="powers of two"):
    gm.grouped_matmul(x[:, :8], w[:, :8], te, 4, tile_m=16, interpret=False)   # block_k 8 < 16
  # Mixtral-8x7B's expert GEMMs in bf16 (H 4096, F 14336) through Triton's compiler for sm_90, on CPU.
  sds = jax.ShapeDtypeStruct
  for k, n in ((4096, 14336), (14336, 4096)):
    fn = functools.partial(gm.grouped_matmul, tile_m=64, interpret=False)
    modules = triton_check.capture_ttir(fn, sds((24 * 64, k), jnp.bfloat16), sds((8, k, n), jnp.bfloat16),
                                        sds((24,), jnp.int32), sds((), jnp.int32))
    assert len(modules) == 1
    compiled = triton_check.compile_ttir(modules[0], arch=90)
    assert compiled.shared_bytes <= triton_check.SM90_MAX_SMEM


def test_moe_mlp_rejects_unknown_impl():
  lp = _layer(0, 4)
  with pytest.raises(ValueError, match="unknown MoE implementation 'loop'"):
    moe_mod.moe_mlp(jnp.ones((2, 32)), lp, 2, impl="loop")


def _flops(impl: str, T: int, E: int, k: int, H: int = 64, F: int = 128) -> float:
  lp = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), _layer(0, E, H, F))
  h = jax.ShapeDtypeStruct((T, H), jnp.float32)
  fn = jax.jit(lambda h, lp: moe_mod.moe_mlp(h, lp, k, impl=impl))
  cost = fn.lower(h, lp).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost["flops"])


def test_grouped_moe_flops_grow_with_top_k_not_with_experts():
  """XLA's compiled cost analysis: ``tiles`` does ~T*k expert rows, ``dense`` T*E (and ragged_dot, on CPU
  in jax 0.10.2, is rewritten to the dense form, which is why it is not the default)."""
  T, H, F = 256, 64, 128
  active = lambda k: 3 * 2 * T * k * H * F          # the expert FLOPs one must do
  tiles = {(E, k): _flops("tiles", T, E, k) for E, k in [(4, 2), (16, 2), (64, 2), (16, 1), (16, 4)]}
  dense = {E: _flops("dense", T, E, 2) for E in (4, 16)}
  # Experts x16 at top-2: dense FLOPs x~4 per x4 experts; grouped FLOPs flat (padding <= m-1 rows/expert).
  assert dense[16] / dense[4] > 3.5
  assert tiles[(64, 2)] / tiles[(4, 2)] < 1.3 and tiles[(16, 2)] / tiles[(4, 2)] < 1.3
  # Top-k x4: grouped FLOPs x~4.
  assert 3.0 < tiles[(16, 4)] / tiles[(16, 1)] < 5.0
  # Never below the real work, and at most ~2x it (the padding bound).
  for (E, k), f in tiles.items():
    assert active(k) <= f <= 2.2 * active(k), (E, k, f / active(k))
  assert tiles[(16, 2)] < dense[16] / 3
  ragged = {E: _flops("ragged_dot", T, E, 2) for E in (4, 16)}
  print("flops/active:", {key: round(f / active(key[1]), 2) for key, f in tiles.items()},
        "dense E4/E16:", dense[4] / active(2), dense[16] / active(2),
        "ragged_dot E4/E16:", ragged[4] / active(2), ragged[16] / active(2))


@pytest.mark.parametrize("q8", [False, True], ids=["f32", "q8_0"])
def test_mixtral_gguf_with_merged_experts_matches_transformers(tiny_mixtral, tmp_path, q8):
  """llama.cpp's layout: architecture llama + expert_count, router ffn_gate_inp, merged ffn_*_exps."""
  from support.tiny_models import write_gguf_from_hf_model
  model, cfg, params, _ = tiny_mixtral
  path = str(tmp_path / "mixtral.gguf")
  write_gguf_from_hf_model(path, model, quantize_q8=q8)
  gcfg, gparams = load_model(path)
  assert (gcfg.family, gcfg.num_experts, gcfg.num_experts_per_token) == ("mixtral", 4, 2)
  if not q8:
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(gparams)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  ids = np.random.RandomState(2).randint(0, cfg.vocab_size, size=17)
  err = np.abs(score(gparams, gcfg, ids, block_size=BS) - torch_logits(model, ids)).max()
  assert err < (5e-2 if q8 else TOL)
