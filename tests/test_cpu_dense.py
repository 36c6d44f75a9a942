"""The cpu_dense kernel (pallas_kernels/cpu_dense.py) against float64 numpy and its jnp reference; the packed model
buffer (model/dense_pack.py) against the fused weights; the engine with --dense=cpu_kernel against --dense=xla."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_dense as cd

pytestmark = pytest.mark.skipif(not cd.available(), reason="no C++ compiler / FFI headers here")


def _rel_err(y, r):
  return float(np.max(np.abs(np.asarray(y, np.float64) - r)) / max(np.max(np.abs(r)), 1e-30))


@pytest.mark.parametrize("m,k,n", [(1, 64, 16), (3, 7, 32), (16, 576, 960), (17, 40, 48), (33, 96, 64),
                                   (64, 128, 16), (5, 1, 16), (28, 33, 80), (20, 50, 112)])
def test_kernel_matches_float64(m, k, n):
  rng = np.random.default_rng(m * 1000 + k + n)
  x = rng.standard_normal((m, k), dtype=np.float32)
  w = rng.standard_normal((k, n), dtype=np.float32)
  packed = cd.pack(w)
  assert packed.shape == (n // 16, k, 16) and np.array_equal(cd.unpack(packed), w)
  y = jax.jit(cd.cpu_dense)(jnp.asarray(x), jnp.asarray(packed))
  r = x.astype(np.float64) @ w.astype(np.float64)
  assert y.shape == (m, n) and y.dtype == jnp.float32
  assert _rel_err(y, r) < 2e-6
  # The jnp reference beside it computes the same product.
  assert _rel_err(cd.dense_reference(jnp.asarray(x), jnp.asarray(packed)), r) < 2e-6


def test_hand_worked_case():
  # W = [[1, 2, ..., 16], [0.5] * 16]; x = [[1, 2], [0, 0], [-1, 4]] -> rows: 1*W0 + 2*W1, 0, -W0 + 4*W1.
  w = np.stack([np.arange(1, 17, dtype=np.float32), np.full(16, 0.5, np.float32)])
  x = np.array([[1, 2], [0, 0], [-1, 4]], np.float32)
  y = np.asarray(cd.cpu_dense(jnp.asarray(x), jnp.asarray(cd.pack(w))))
  np.testing.assert_array_equal(y[0], np.arange(1, 17) + 1.0)
  np.testing.assert_array_equal(y[1], np.zeros(16))
  np.testing.assert_array_equal(y[2], -np.arange(1, 17) + 2.0)


def test_flat_buffer_offsets_and_leading_dims():
  rng = np.random.default_rng(1)
  wa = rng.standard_normal((24, 32), dtype=np.float32)
  wb = rng.standard_normal((8, 48), dtype=np.float32)
  flat = jnp.asarray(np.concatenate([np.zeros(5, np.float32), cd.pack(wa).reshape(-1), cd.pack(wb).reshape(-1)]))
  xa = rng.standard_normal((2, 3, 24), dtype=np.float32)
  xb = rng.standard_normal((4, 8), dtype=np.float32)

  @jax.jit
  def f(xa, xb, flat):
    return (cd.cpu_dense(xa, flat, offset=5, panels=2, k=24),
            cd.cpu_dense(xb, flat, offset=5 + wa.size, panels=3, k=8))
  ya, yb = f(jnp.asarray(xa), jnp.asarray(xb), flat)
  assert ya.shape == (2, 3, 32) and yb.shape == (4, 48)
  assert _rel_err(ya, xa.astype(np.float64) @ wa) < 2e-6
  assert _rel_err(yb, xb.astype(np.float64) @ wb) < 2e-6


def test_bad_inputs_raise():
  w = jnp.ones((3, 8, 16), jnp.float32)
  with pytest.raises(ValueError, match="float32"):
    cd.cpu_dense(jnp.ones((2, 8), jnp.bfloat16), w)
  with pytest.raises(ValueError, match=r"\[\.\.\., 8\]"):
    cd.cpu_dense(jnp.ones((2, 9), jnp.float32), w)
  with pytest.raises(ValueError, match="does not fit"):
    cd.cpu_dense(jnp.ones((2, 8), jnp.float32), w, offset=1, panels=3, k=8)
  with pytest.raises(ValueError, match="multiple of 16"):
    cd.pack(np.ones((4, 20), np.float32))
  with pytest.raises(ValueError, match="multiple of 16"):
    cd.pack(np.ones((4, 32), np.float64))


def _tiny_cfg_params():
  from test_engine_utils import random_params, tiny_config
  cfg = tiny_config()   # hidden 64, MLP 128, 4 / 2 heads of 16: every projection a multiple of 16 wide
  return cfg, random_params(cfg, seed=3)


def test_concurrent_calls_share_the_workers_safely():
  # Two Python threads calling the kernel at once: one call holds the library's workers (cpu_workers.h), the
  # other runs alone on its calling thread; every result must still be the full product.
  import threading
  rng = np.random.default_rng(11)
  w = rng.standard_normal((96, 160)).astype(np.float32)
  packed = jnp.asarray(cd.pack(w))
  f = jax.jit(cd.cpu_dense)
  xs = [rng.standard_normal((m, 96)).astype(np.float32) for m in (1, 5, 16, 31)]
  refs = [x.astype(np.float64) @ w.astype(np.float64) for x in xs]
  errors = []

  def worker(seed):
    order = np.random.default_rng(seed).permutation(40) % len(xs)
    for i in order:
      y = np.asarray(f(jnp.asarray(xs[i]), packed))
      if y.shape != refs[i].shape or _rel_err(y, refs[i]) > 1e-5:
        errors.append((seed, int(i)))

  threads = [threading.Thread(target=worker, args=(s,)) for s in range(3)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert errors == []


def test_packed_model_buffer_matches_fused_weights():
  from superinfer_jax.model import dense_pack, fused
  cfg, params = _tiny_cfg_params()
  assert dense_pack.packable(cfg) and not dense_pack.packable(cfg, "bfloat16")
  lay = dense_pack.layout(cfg)
  # Ranges are laid end to end in layer order, nothing between them.
  ranges = [(o, o + p * k * 16) for layer in lay for (o, p, k) in (layer[n] for n in dense_pack.NAMES)]
  assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
  stacked = fused.fuse_projections(params, cfg)
  unrolled = fused.unroll_layers(fused.transpose_mlp(stacked))
  buf = dense_pack.pack_params(unrolled, cfg)
  head_offset, head_panels, head_k = dense_pack.head_layout(cfg)
  # The output head follows the last layer's projections and ends the buffer.
  assert head_offset == ranges[-1][1] and buf.size == head_offset + head_panels * 16 * head_k
  assert buf.size * 4 == dense_pack.packed_bytes(cfg)
  assert np.array_equal(buf, dense_pack.pack_params(stacked, cfg))
  x = jax.random.normal(jax.random.PRNGKey(1), (5, cfg.hidden_size), jnp.float32)
  for i in range(cfg.num_layers):
    lp = fused.layer_params(unrolled, i)
    proj = dense_pack.projector(jnp.asarray(buf), cfg, i)
    np.testing.assert_allclose(proj("qkv", x), x @ lp["wqkv"], rtol=1e-5, atol=1e-5)
    xo = x[:, :cfg.q_size]
    np.testing.assert_allclose(proj("o", xo), xo @ lp["wo"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(proj("gate_up", x), x @ lp["w_gate_up_t"].T, rtol=1e-5, atol=1e-5)
    xf = jax.random.normal(jax.random.PRNGKey(2 + i), (5, cfg.intermediate_size), jnp.float32)
    np.testing.assert_allclose(proj("down", xf), xf @ lp["w_down_t"].T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied,vocab", [(False, 128), (True, 100), (False, 37)])
def test_packed_head_logits_match_the_output_weight(tied, vocab):
  # The head's vocabulary is padded to a multiple of 16 columns with zeros and sliced back off.
  import dataclasses
  from test_engine_utils import random_params, tiny_config
  from superinfer_jax.model import dense_pack, fused
  cfg = dataclasses.replace(tiny_config(vocab=vocab), tie_word_embeddings=tied)
  params = random_params(cfg, seed=5)
  if tied:
    params.pop("lm_head", None)
  assert dense_pack.head_panels(cfg) == -(-vocab // 16)
  buf = jnp.asarray(dense_pack.pack_params(fused.fuse_projections(params, cfg), cfg))
  x = jax.random.normal(jax.random.PRNGKey(7), (6, cfg.hidden_size), jnp.float32)
  w_out = np.asarray(params["embed"]).T if tied else np.asarray(params["lm_head"])
  assert w_out.shape == (cfg.hidden_size, vocab)
  logits = dense_pack.head_logits(buf, cfg, x)
  assert logits.shape == (6, vocab)
  np.testing.assert_allclose(logits, np.asarray(x, np.float64) @ w_out.astype(np.float64), rtol=1e-5, atol=1e-5)


def test_engine_dense_kernel_tokens_match_xla():
  from superinfer_jax.engine.config import EngineConfig, SamplingParams
  from superinfer_jax.engine.engine import LLMEngine
  cfg, params = _tiny_cfg_params()
  rng = np.random.default_rng(0)
  # Mixed prompt lengths: prefill steps above dense_max_rows run XLA's dots, decode steps the kernel.
  prompts = [rng.integers(3, cfg.vocab_size, size=n).tolist() for n in (5, 40, 17, 3)]
  sp = SamplingParams(max_tokens=12, ignore_eos=True)
  out = {}
  for dense in ("xla", "cpu_kernel", "auto"):
    eng = LLMEngine((cfg, params), EngineConfig.create(num_device_blocks=64, dense=dense, dense_max_rows=8))
    assert eng.dense_backend == ("xla" if dense == "xla" else "cpu_kernel")
    assert ("dense_packed" in eng.params) == (eng.dense_backend == "cpu_kernel")
    out[dense] = [o.token_ids for o in eng.generate(prompts, sp)]
  assert out["cpu_kernel"] == out["xla"] == out["auto"]
  assert all(len(t) == 12 for t in out["xla"])


def test_engine_dense_kernel_refused_where_it_cannot_apply():
  from superinfer_jax.engine.config import EngineConfig
  from superinfer_jax.engine.engine import LLMEngine
  cfg, params = _tiny_cfg_params()
  with pytest.raises(ValueError, match="scan"):
    LLMEngine((cfg, params), EngineConfig.create(num_device_blocks=64, dense="cpu_kernel", layer_loop="scan"))
  eng = LLMEngine((cfg, params), EngineConfig.create(num_device_blocks=64, layer_loop="scan"))   # auto: XLA
  assert eng.dense_backend == "xla" and "dense_packed" not in eng.params
  with pytest.raises(ValueError, match="dense_max_rows"):
    EngineConfig.create(dense_max_rows=0)
