"""Fused projections: the step layout the engine runs on CPU, where every parameter leaf costs dispatch time.

``fuse_projections(params, cfg)`` returns the params with, per layer,
  * ``wq | wk | wv`` concatenated on the output axis into ``wqkv`` ``[..., H, Hq*D + 2*Hkv*D]`` (and
    ``bq | bk | bv`` into ``bqkv`` for ``qkv_bias`` models), and
  * for dense MLPs, ``w_gate | w_up`` into ``w_gate_up`` ``[..., H, 2F]`` (MoE experts keep theirs),
  * ``attn_norm`` and ``mlp_norm`` stacked into ``norms`` ``[..., 2, H]``,
removing the originals. Works on stacked (``[L, ...]``) and per-layer params alike (the concatenation is on
the last axis). ``forward`` reads either layout (``qkv`` / ``gate_up`` below split the fused products).

Why: a jitted call's host cost grows with its argument leaves (SmolLM2-135M unrolled has 272). Fusing drops
them to 152 and runs two wide matmuls instead of five narrow ones (measured on the 2-core CPU box: batch-16
dispatch 1.00 -> 0.85 ms wall, the bare step 1-3% faster). The split outputs are the same columns of the same products, so values match the unfused
layout up to float summation order inside the matmul.

``unroll_layers(params)`` is the layout the engine's unrolled CPU step runs on: ``layers`` becomes a list of
per-layer dicts (each matmul then reads its weight where it lies; XLA CPU copies a slice of a stacked weight
before a dot), except the RMSNorm weights (``norms`` / ``attn_norm``, ``mlp_norm``), which stay stacked
``[L, ...]`` under ``params["stacked_layers"]``: a static slice of a few ``H``-vectors costs nothing to copy,
and it saves one jit argument leaf per layer (SmolLM2-135M: 152 -> 123 leaves with the fused projections).
``forward`` reads it (``layer_params``).

Invariant: the fused arrays are new buffers; the caller's params are not modified (the engine keeps
both only when the caller still holds the originals — it fuses only the unrolled CPU layout, not a GPU
model under ``lax.scan``, whose few stacked leaves cost little to dispatch).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from superinfer_jax.model.config import ModelConfig
from superinfer_jax.model.moe import matmul


def fuse_projections(params, cfg: ModelConfig):
  """``params`` with fused ``wqkv`` / ``bqkv`` / ``w_gate_up`` (module docstring). Idempotent."""
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


def qkv(h: jax.Array, lp, cfg: ModelConfig, proj=None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """q ``[T, Hq*D]``, k, v ``[T, Hkv*D]`` of one layer from either layout (biases added). ``proj``: the layer's
  ``model/dense_pack.projector``, used instead of the weights when given."""
  if proj is not None or "wqkv" in lp:
    out = proj("qkv", h).astype(h.dtype) if proj is not None else matmul(h, lp["wqkv"])
    if cfg.qkv_bias:
      out = out + lp["bqkv"]
    Q, KV = cfg.q_size, cfg.kv_size
    return out[:, :Q], out[:, Q:Q + KV], out[:, Q + KV:]
  q, k, v = matmul(h, lp["wq"]), matmul(h, lp["wk"]), matmul(h, lp["wv"])
  if cfg.qkv_bias:
    q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
  return q, k, v


def matmul_t(x: jax.Array, w_t: jax.Array, out=None) -> jax.Array:
  """``x @ w_t.T`` (``w_t`` stored ``[out, in]``, as torch's ``linear``) accumulated in f32, in ``out`` dtype."""
  y = jax.lax.dot_general(x, w_t, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  return y.astype(out or x.dtype)


def transpose_mlp(params):
  """``params`` (fused, stacked or unrolled) with the dense MLP's ``w_gate_up`` / ``w_down`` stored transposed, as
  ``w_gate_up_t [..., 2F, H]`` / ``w_down_t [..., H, F]`` (new buffers; ``forward`` reads them through
  ``gate_up`` / ``down``). On XLA CPU a 16-row product runs faster against the ``[out, in]`` layout and a 1-row
  one slower; in the SmolLM2 engine, decode at batch 16 / 64 / 1 ran 0.95 / 0.98 / ~1.01x the time with it
  (WORKSPACE_NOTES, 2026-12-02 ninth pass), so the engine's unrolled CPU layout uses it. MoE experts keep theirs."""
  def tr(lp):
    lp = dict(lp)
    if "w_gate_up" in lp:
      lp["w_gate_up_t"] = jnp.swapaxes(lp.pop("w_gate_up"), -1, -2)
      lp["w_down_t"] = jnp.swapaxes(lp.pop("w_down"), -1, -2)
    return lp
  layers = params["layers"]
  layers = [tr(lp) for lp in layers] if isinstance(layers, (list, tuple)) else tr(layers)
  return dict(params, layers=layers)


def down(a: jax.Array, lp, proj=None) -> jax.Array:
  """The dense MLP's down projection of ``a [T, F]`` (in ``a``'s dtype) from any layout (``proj``: as ``qkv``)."""
  if proj is not None:
    return proj("down", a).astype(a.dtype)
  if "w_down_t" in lp:
    return matmul_t(a, lp["w_down_t"])
  return matmul(a, lp["w_down"])


def gate_up(h: jax.Array, lp, proj=None) -> tuple[jax.Array, jax.Array]:
  """The dense MLP's gate and up products ``[T, F]`` (float32) from any layout (``proj``: as ``qkv``)."""
  if proj is not None or "w_gate_up_t" in lp or "w_gate_up" in lp:
    out = (proj("gate_up", h) if proj is not None
           else matmul_t(h, lp["w_gate_up_t"], out=jnp.float32) if "w_gate_up_t" in lp
           else matmul(h, lp["w_gate_up"], out=jnp.float32))
    F = out.shape[-1] // 2
    return out[:, :F], out[:, F:]
  return matmul(h, lp["w_gate"], out=jnp.float32), matmul(h, lp["w_up"], out=jnp.float32)


STACKED_IN_UNROLLED = ("norms", "attn_norm", "mlp_norm")  # per-layer leaves ``unroll_layers`` keeps stacked


def unroll_layers(params):
  """``params`` (stacked, fused or not) in the unrolled layout (module docstring): ``layers`` a list of L
  per-layer dicts without the norm weights, which stay stacked in ``stacked_layers`` ``{name: [L, ...]}``."""
  layers = params["layers"]
  n = jax.tree.leaves(layers)[0].shape[0]
  stacked = {k: v for k, v in layers.items() if k in STACKED_IN_UNROLLED}
  rest = {k: v for k, v in layers.items() if k not in STACKED_IN_UNROLLED}
  return dict(params, layers=[jax.tree.map(lambda a, i=i: a[i], rest) for i in range(n)],
              stacked_layers=stacked)


def layer_params(params, layer: int):
  """Layer ``layer``'s dict of an unrolled ``params`` (``unroll_layers``), its stacked leaves sliced in."""
  lp = params["layers"][layer]
  stacked = params.get("stacked_layers")
  if not stacked:
    return lp
  return dict(lp, **{k: v[layer] for k, v in stacked.items()})
