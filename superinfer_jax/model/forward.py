"""Functional Llama-family forward over the paged, block-first KV cache.

``forward(params, kv_cache, batch, cfg, attention)`` runs one ragged step (prefill chunks and decode tokens
mixed): embed -> L x [RMSNorm, q/k/v (+bias), RoPE (scaled per ``cfg.rope_type``), write K/V into the cache
at ``slot_mapping``, paged attention (sliding window on the layers ``cfg`` names), o-proj, residual,
RMSNorm, SwiGLU MLP or top-k mixture of SwiGLU experts (``superinfer_jax.model.moe``), residual] -> final
RMSNorm -> logits of the rows ``logits_indices``. Stacked layers run as a ``lax.scan`` (one compiled layer body,
whatever L is); a list of per-layer dicts (``model/fused.py:unroll_layers``) runs as an unrolled loop, which
compiles to straight-line code (no while loop). MoE expert weights are stacked inside each layer.

Numerics: activations and the residual stream are in the params' dtype (bf16 or f32); every matmul
accumulates in f32 (``preferred_element_type``) and RMSNorm, RoPE, soft-max and routing run in f32.

``step`` is the jitted forward: ``kv_cache`` donated, ``cfg``, ``attention`` and ``moe`` static.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.reference import token_metadata
from superinfer_jax.model.attention import resolve_attention
from superinfer_jax.model.batch import BatchInputs
from superinfer_jax.model.config import ModelConfig
from superinfer_jax.model.moe import matmul, moe_mlp
from superinfer_jax.model import fused
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


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """``[head_dim // 2]`` float32 inverse frequencies (transformers' ``ROPE_INIT_FUNCTIONS``), static.

  "default" / "dynamic": ``theta ** (-2i / D)`` (dynamic rescales per sequence, see ``rope_cos_sin``);
  "linear": divided by ``factor``; "llama3": Llama-3.1's band-wise scaling."""
  d = cfg.head_dim
  inv = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))))
  inv = inv.astype(np.float32)
  if cfg.rope_type == "linear":
    inv = inv / np.float32(cfg.rope_factor)
  elif cfg.rope_type == "llama3":
    factor, old = np.float32(cfg.rope_factor), np.float32(cfg.rope_original_max_positions)
    low, high = np.float32(cfg.rope_low_freq_factor), np.float32(cfg.rope_high_freq_factor)
    wavelen = np.float32(2 * np.pi) / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    inv = np.where(medium, smoothed, scaled)
  return inv.astype(np.float32)


def rope_cos_sin(cfg: ModelConfig, batch: BatchInputs) -> tuple[jax.Array, jax.Array]:
  """cos, sin ``[T, head_dim // 2]`` float32 for the half-split (HF ``rotate_half``) RoPE convention.

  "dynamic" (NTK) scaling uses, for each token, the base of its sequence's length after this step
  (``context_lens``), as transformers does for the tokens of one forward call: a prompt scored in one
  chunk matches transformers exactly; later chunks / decode tokens get the base of their own step (keys
  already cached keep theirs, again as in transformers' cached generation)."""
  pos = batch.positions.astype(jnp.float32)
  inv = jnp.asarray(rope_inv_freq(cfg))[None, :]                       # [1, D/2]
  if cfg.rope_type == "dynamic":
    d = cfg.head_dim
    seq_idx, _, _ = token_metadata(batch.query_start_loc, batch.context_lens, pos.shape[0])
    orig = float(cfg.rope_original_max_positions)
    seq_len = jnp.maximum(batch.context_lens[seq_idx].astype(jnp.float32), orig)
    base = cfg.rope_theta * ((cfg.rope_factor * seq_len / orig) - (cfg.rope_factor - 1)) ** (d / (d - 2))
    inv = 1.0 / (base[:, None] ** (jnp.arange(0, d, 2, dtype=jnp.float32)[None, :] / d))   # [T, D/2]
  freqs = pos[:, None] * inv
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


def forward(params, kv_cache: jax.Array, batch: BatchInputs, cfg: ModelConfig, attention="reference",
            moe: str = "auto") -> tuple[jax.Array, jax.Array]:
  """One ragged model step.

  Args:
    params: stacked params (see ``superinfer_jax.model.params``), or their fused layout
      (``model/fused.py``); ``layers`` may also be a list of per-layer dicts (``fused.unroll_layers``: the
      layer loop is then unrolled).
    kv_cache: ``[NB, L, 2, BS, Hkv, D]`` block-first cache (block 0 = padding).
    batch: ``BatchInputs`` (T tokens, S sequences, R logit rows).
    cfg: model config (static).
    attention: backend name or function with the ``pallas_kernels.reference`` contract (static). Called
      with ``window=`` (a per-layer int32 scalar, <= 0 meaning full attention) only when ``cfg`` has
      sliding-window layers, so backends without that keyword serve every other model.
    moe: MoE formulation (static; ignored for dense models): see ``superinfer_jax.model.moe.MOE_IMPLS``.
  Returns:
    ``(logits [R, vocab] float32, kv_cache with this step's K/V written)``.
  """
  cfg.check_supported()
  attn = resolve_attention(attention)
  T = batch.token_ids.shape[0]
  Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  scale = D ** -0.5
  x = params["embed"][batch.token_ids]                                  # [T, H]
  cos, sin = rope_cos_sin(cfg, batch)
  windows = cfg.layer_windows()

  def layer_body(carry, xs):
    x, kv = carry
    lp, layer, window = xs
    attn_norm, mlp_norm = fused.norms(lp)
    h = rms_norm(x, attn_norm, cfg.rms_norm_eps)
    q, k, v = fused.qkv(h, lp, cfg)
    q = apply_rope(q.reshape(T, Hq, D), cos, sin)
    k = apply_rope(k.reshape(T, Hkv, D), cos, sin)
    kv = write_kv(kv, layer, k, v.reshape(T, Hkv, D), batch.slot_mapping)
    kw = {} if windows is None else {"window": window}
    o = attn(q, kv, layer, batch.block_tables, batch.context_lens, batch.query_start_loc, scale=scale, **kw)
    o = o.reshape(T, Hq * D).astype(x.dtype)
    x = x + matmul(o, lp["wo"])
    x = x + _mlp(rms_norm(x, mlp_norm, cfg.rms_norm_eps), lp, cfg, moe)
    return (x, kv), None

  layer_windows = jnp.asarray(windows or (0,) * cfg.num_layers, jnp.int32)
  if isinstance(params["layers"], (list, tuple)):
    for layer, lp in enumerate(params["layers"]):
      (x, kv_cache), _ = layer_body((x, kv_cache), (lp, layer, layer_windows[layer]))
  else:
    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (x, kv_cache), _ = jax.lax.scan(layer_body, (x, kv_cache), (params["layers"], layer_ids, layer_windows))
  return _logits(x[batch.logits_indices], params, cfg), kv_cache


def _mlp(h: jax.Array, lp, cfg: ModelConfig, moe: str) -> jax.Array:
  """The MLP block's output ``[T, H]`` (dtype of ``h``) for normed input ``h [T, H]``: SwiGLU, or the
  routed expert mixture for an MoE config (``moe`` picks its formulation)."""
  if cfg.is_moe:
    return moe_mlp(h, lp, cfg.num_experts_per_token, impl=moe)
  gate, up = fused.gate_up(h, lp)
  return fused.down((jax.nn.silu(gate) * up).astype(h.dtype), lp)


def _logits(x: jax.Array, params, cfg: ModelConfig) -> jax.Array:
  """float32 logits ``[R, V]`` of the hidden states ``x [R, H]`` of the wanted rows (final norm, then the
  output projection, accumulated in float32)."""
  x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
  # Output weight: embed [V, H] (tied) or lm_head [H, V]; h_axis is its hidden axis, contracted with x's.
  w_out, h_axis = (params["embed"], 1) if cfg.tie_word_embeddings else (params["lm_head"], 0)
  dims = (((1,), (h_axis,)), ((), ()))
  logits = jax.lax.dot_general(x, w_out, dims, preferred_element_type=jnp.float32)
  return logits.astype(jnp.float32)


# Jitted ``forward``: ``kv_cache`` donated, ``cfg``, ``attention`` and ``moe`` static.
step = jax.jit(forward, static_argnames=("cfg", "attention", "moe"), donate_argnames=("kv_cache",))
