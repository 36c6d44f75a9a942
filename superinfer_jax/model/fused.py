"""The step layout of the weights: fused projections, and the per-layer list of the unrolled layer loop.

``fuse_projections(params, cfg)`` returns the params with, per layer,
  * ``wq | wk | wv`` concatenated on the output axis into ``wqkv`` ``[..., H, Hq*D + 2*Hkv*D]`` (and
    ``bq | bk | bv`` into ``bqkv`` for ``qkv_bias`` models),
  * for dense MLPs, ``w_gate | w_up`` into ``w_gate_up`` ``[..., H, 2F]`` (MoE experts keep theirs),
  * ``attn_norm`` and ``mlp_norm`` stacked into ``norms`` ``[..., 2, H]``,
removing the originals: two wide matmuls per layer instead of five narrow ones, and fewer jit argument
leaves. Works on stacked (``[L, ...]``) and per-layer params alike (the concatenation is on the last axis).
``forward`` reads either layout (``qkv`` / ``gate_up`` / ``down`` / ``norms`` below); the fused products'
columns are the unfused ones, so values match up to float summation order inside the matmul.

``unroll_layers(params)`` makes ``layers`` a list of L per-layer dicts: ``forward`` then runs an unrolled
layer loop in which every matmul reads its own weight buffer (no per-layer slice of a stacked weight, no
while loop in the compiled step).

Invariant: the fused and unrolled arrays are new buffers; the caller's params are not modified.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from superinfer_jax.model.config import ModelConfig
from superinfer_jax.model.moe import matmul


def fuse_projections(params, cfg: ModelConfig):
  """``params`` with fused ``wqkv`` / ``bqkv`` / ``w_gate_up`` / ``norms`` (module docstring). Idempotent."""
  def fuse_layer(lp):
    lp = dict(lp)
    if "wqkv" not in lp:
      lp["wqkv"] = jnp.concatenate([lp.pop("wq"), lp.pop("wk"), lp.pop("wv")], axis=-1)
      if cfg.qkv_bias:
        lp["bqkv"] = jnp.concatenate([lp.pop("bq"), lp.pop("bk"), lp.pop("bv")], axis=-1)
    if not cfg.is_moe and "w_gate_up" not in lp:
      lp["w_gate_up"] = jnp.concatenate([lp.pop("w_gate"), lp.pop("w_up")], axis=-1)
    if "norms" not in lp:
      lp["norms"] = jnp.stack([lp.pop("attn_norm"), lp.pop("mlp_norm")], axis=-2)
    return lp

  layers = params["layers"]
  if isinstance(layers, (list, tuple)):
    layers = [fuse_layer(lp) for lp in layers]
  else:
    layers = fuse_layer(layers)
  return dict(params, layers=layers)


def norms(lp) -> tuple[jax.Array, jax.Array]:
  """The layer's (attention, MLP) RMSNorm weights ``[H]`` from either layout."""
  if "norms" in lp:
    return lp["norms"][0], lp["norms"][1]
  return lp["attn_norm"], lp["mlp_norm"]


def qkv(h: jax.Array, lp, cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
  """q ``[T, Hq*D]``, k, v ``[T, Hkv*D]`` of one layer from either layout (biases added)."""
  if "wqkv" in lp:
    out = matmul(h, lp["wqkv"])
    if cfg.qkv_bias:
      out = out + lp["bqkv"]
    Q, KV = cfg.q_size, cfg.kv_size
    return out[:, :Q], out[:, Q:Q + KV], out[:, Q + KV:]
  q, k, v = matmul(h, lp["wq"]), matmul(h, lp["wk"]), matmul(h, lp["wv"])
  if cfg.qkv_bias:
    q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
  return q, k, v


def gate_up(h: jax.Array, lp) -> tuple[jax.Array, jax.Array]:
  """The dense MLP's gate and up products ``[T, F]`` (float32) from either layout."""
  if "w_gate_up" in lp:
    out = matmul(h, lp["w_gate_up"], out=jnp.float32)
    F = out.shape[-1] // 2
    return out[:, :F], out[:, F:]
  return matmul(h, lp["w_gate"], out=jnp.float32), matmul(h, lp["w_up"], out=jnp.float32)


def down(a: jax.Array, lp) -> jax.Array:
  """The dense MLP's down projection of ``a [T, F]``, in ``a``'s dtype."""
  return matmul(a, lp["w_down"])


def unroll_layers(params):
  """``params`` (stacked, fused or not) with ``layers`` as a list of L per-layer dicts. Idempotent."""
  layers = params["layers"]
  if isinstance(layers, (list, tuple)):
    return params
  n = jax.tree.leaves(layers)[0].shape[0]
  return dict(params, layers=[jax.tree.map(lambda a, i=i: a[i], layers) for i in range(n)])
