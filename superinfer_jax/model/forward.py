"""Functional Llama-family forward over the paged, block-first KV cache.

``forward(params, kv_cache, batch, cfg, attention)`` runs one ragged step (prefill chunks and decode tokens
mixed): embed -> L x [RMSNorm, q/k/v (+bias), RoPE, write K/V into the cache at ``slot_mapping``,
paged attention, o-proj, residual, RMSNorm, SwiGLU MLP, residual] -> final RMSNorm -> logits of the rows
``logits_indices``. Layers are stacked and run with ``lax.scan`` (one compiled layer body, whatever L is).

``step`` is the jitted forward: ``kv_cache`` donated, ``cfg`` and ``attention`` static.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from superinfer_jax.model.attention import resolve_attention
from superinfer_jax.model.batch import BatchInputs
from superinfer_jax.model.config import ModelConfig
from superinfer_jax.model.params import DTYPES


def init_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: str = "float32") -> jax.Array:
  """Zeroed block-first cache ``[num_blocks, L, 2, BS, Hkv, D]``; ``num_blocks`` includes padding block 0.

  Committed to the default device: jitted steps and the rotation kernels return committed arrays, and jit
  treats a committed and an uncommitted argument as two signatures (each shape would compile twice)."""
  if num_blocks < 2:
    raise ValueError(f"num_blocks must be >= 2 (block 0 is padding), got {num_blocks}")
  spec = cfg.kv_spec(block_size, dtype)
  return jax.device_put(jnp.zeros(spec.shape(num_blocks), DTYPES[dtype]), jax.local_devices()[0])


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm computed in float32, cast back to x's dtype, then scaled (HF Llama order)."""
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return weight * y.astype(x.dtype)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """cos, sin ``[T, head_dim // 2]`` float32 for the half-split (HF ``rotate_half``) RoPE convention."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
  return jnp.cos(freqs), jnp.sin(freqs)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x ``[T, H, D]`` rotated by position: ``x * cos + rotate_half(x) * sin`` (float32 math)."""
  half = x.shape[-1] // 2
  xf = x.astype(jnp.float32)
  x1, x2 = xf[..., :half], xf[..., half:]
  c, s = cos[:, None, :], sin[:, None, :]
  return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def write_kv(kv_cache: jax.Array, layer: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array) -> jax.Array:
  """Scatters k, v ``[T, Hkv, D]`` of one layer into the cache at ``slot_mapping`` (block*BS + offset)."""
  block_size = kv_cache.shape[3]
  blocks = slot_mapping // block_size
  offsets = slot_mapping % block_size
  kv = jnp.stack([k, v], axis=1).astype(kv_cache.dtype)                # [T, 2, Hkv, D]
  return kv_cache.at[blocks, layer, :, offsets].set(kv)


def forward(params, kv_cache: jax.Array, batch: BatchInputs, cfg: ModelConfig, attention="reference"
            ) -> tuple[jax.Array, jax.Array]:
  """One ragged model step.

  Args:
    params: stacked params (see ``superinfer_jax.model.params``); ``layers`` may also be a list of
      per-layer dicts (the layer loop is then unrolled).
    kv_cache: ``[NB, L, 2, BS, Hkv, D]`` block-first cache (block 0 = padding).
    batch: ``BatchInputs`` (T tokens, S sequences, R logit rows).
    cfg: model config (static).
    attention: backend name or function with the ``pallas_kernels.reference`` contract (static).
  Returns:
    ``(logits [R, vocab] float32, kv_cache with this step's K/V written)``.
  """
  cfg.check_supported()
  attn = resolve_attention(attention)
  T = batch.token_ids.shape[0]
  Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  scale = D ** -0.5
  x = params["embed"][batch.token_ids]                                  # [T, H]
  cos, sin = rope_cos_sin(batch.positions, D, cfg.rope_theta)

  def layer_body(carry, xs):
    x, kv = carry
    lp, layer = xs
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q, k, v = h @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
    if cfg.qkv_bias:
      q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = apply_rope(q.reshape(T, Hq, D), cos, sin)
    k = apply_rope(k.reshape(T, Hkv, D), cos, sin)
    kv = write_kv(kv, layer, k, v.reshape(T, Hkv, D), batch.slot_mapping)
    o = attn(q, kv, layer, batch.block_tables, batch.context_lens, batch.query_start_loc, scale=scale)
    x = x + o.reshape(T, Hq * D).astype(x.dtype) @ lp["wo"]
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    x = x + (jax.nn.silu(h @ lp["w_gate"]) * (h @ lp["w_up"])) @ lp["w_down"]
    return (x, kv), None

  if isinstance(params["layers"], (list, tuple)):
    # Per-layer dicts: an unrolled loop, each matmul reads its weight in place (the scan's dynamic-slice
    # copies every layer's weights first: XLA CPU does not fuse it into the dot).
    for layer, lp in enumerate(params["layers"]):
      (x, kv_cache), _ = layer_body((x, kv_cache), (lp, layer))
  else:
    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (x, kv_cache), _ = jax.lax.scan(layer_body, (x, kv_cache), (params["layers"], layer_ids))
  x = rms_norm(x[batch.logits_indices], params["final_norm"], cfg.rms_norm_eps)   # [R, H]
  if cfg.tie_word_embeddings:
    logits = jnp.einsum("rh,vh->rv", x, params["embed"], preferred_element_type=jnp.float32)
  else:
    logits = jnp.dot(x, params["lm_head"], preferred_element_type=jnp.float32)
  return logits.astype(jnp.float32), kv_cache


# Jitted ``forward``: ``kv_cache`` donated, ``cfg`` and ``attention`` static.
step = jax.jit(forward, static_argnames=("cfg", "attention"), donate_argnames=("kv_cache",))
