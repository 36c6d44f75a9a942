"""bf16 end to end: with bf16 params and KV cache the step's residual stream and cache stay bf16 and every
matmul that reads a bf16 operand accumulates in f32 (checked on the traced jaxpr, layer scan included),
for a dense windowed model and a Mixtral MoE."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from superinfer_jax.model import build_batch, forward, init_kv_cache
from superinfer_jax.model.config import ModelConfig
from superinfer_jax.model.params import init_random_params

pytestmark = pytest.mark.gpu   # numerics / kernels / transfers that depend on the accelerator


def _cfg(family):
  kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=8, max_position_embeddings=64)
  if family == "mixtral":
    return ModelConfig(family="mixtral", num_experts=4, num_experts_per_token=2, **kw)
  return ModelConfig(family="qwen2", qkv_bias=True, sliding_window=5, sliding_window_layers=(1,),
                     rope_type="llama3", rope_factor=4.0, rope_original_max_positions=16, **kw)


def _eqns(jaxpr):
  for e in jaxpr.eqns:
    yield e
    for p in e.params.values():
      for sub in (p if isinstance(p, (list, tuple)) else [p]):
        if hasattr(sub, "eqns"):                       # a Jaxpr
          yield from _eqns(sub)
        elif hasattr(getattr(sub, "jaxpr", None), "eqns"):   # a ClosedJaxpr
          yield from _eqns(sub.jaxpr)


@pytest.mark.parametrize("family", ["qwen2", "mixtral"])
def test_bf16_step_keeps_bf16_activations_with_f32_accumulation(family):
  cfg = _cfg(family)
  params = init_random_params(cfg, jax.random.PRNGKey(0), dtype="bfloat16", scale=0.3)
  cache = init_kv_cache(cfg, 8, 4, "bfloat16")
  batch, rows = build_batch([(list(range(1, 12)), 0, [1, 2, 3]), ([5], 6, [4, 5])], 4, logits="all")
  batch = jax.tree.map(jnp.asarray, batch)
  closed = jax.make_jaxpr(lambda p, c, b: forward(p, c, b, cfg, "reference"))(params, cache, batch)
  dots = [e for e in _eqns(closed.jaxpr) if e.primitive.name in ("dot_general", "ragged_dot_general")]
  bf16_dots = [e for e in dots if any(v.aval.dtype == jnp.bfloat16 for v in e.invars)]
  assert len(bf16_dots) >= 8
  for e in bf16_dots:
    assert e.params["preferred_element_type"] == jnp.float32, e
  scans = [e for e in _eqns(closed.jaxpr) if e.primitive.name == "scan"]
  carry = scans[0].outvars[:2]                         # (residual stream, KV cache)
  assert [v.aval.dtype for v in carry] == [jnp.bfloat16, jnp.bfloat16]
  logits, new_cache = forward(params, cache, batch, cfg, "reference")
  assert logits.dtype == jnp.float32 and new_cache.dtype == jnp.bfloat16
  assert np.all(np.isfinite(np.asarray(logits[:rows])))
  # bf16 close to the f32 run of the same (bf16-representable) weights.
  p32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  want, _ = forward(p32, init_kv_cache(cfg, 8, 4, "float32"), batch, cfg, "reference")
  err = np.abs(np.asarray(logits[:rows]) - np.asarray(want[:rows])).max()
  assert 0 < err < 0.05 * np.abs(np.asarray(want[:rows])).max()
