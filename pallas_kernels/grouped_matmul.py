"""Grouped matmul over expert-homogeneous row tiles (the MoE expert GEMMs) as a Pallas kernel.

  grouped_matmul(x[NT*m, K], w[E, K, N], tile_expert[NT], num_active, *, tile_m, ...) -> [NT*m, N]

Rows ``i*m .. (i+1)*m - 1`` of ``x`` form tile ``i`` and are multiplied by ``w[tile_expert[i]]``; tiles
``i >= num_active`` are inactive (no weights read, output rows 0). The caller (``superinfer_jax.model.moe``)
sorts the (token, expert) pairs by expert and pads each expert's run to whole tiles, so only the routed
experts' weights are read, each by the tiles that use it, straight from the stacked ``[E, K, N]`` array (no
per-tile copy of the weights as the jnp formulation makes).

Grid ``(NT, N // block_n)``: program ``(i, j)`` keeps an f32 ``[m, block_n]`` accumulator and walks K in
``block_k`` steps, loading ``x[tile i, k-step]`` and ``w[e, k-step, j-block]``. Triton backend on GPU,
interpret mode elsewhere (as ``ragged_paged_attention``).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.ragged_paged_attention import _full_spec, _is_pow2, _plgpu, default_interpret

MIN_DOT = 16   # Triton's tl.dot needs every dimension >= 16


def _largest_pow2_divisor(n: int, cap: int) -> int:
  b = 1
  while b * 2 <= cap and n % (b * 2) == 0:
    b *= 2
  return b


def _gmm_kernel(tile_expert_ref, num_active_ref, x_ref, w_ref, o_ref, *, tile_m: int, block_k: int,
                block_n: int, num_k: int, precision):
  i = pl.program_id(0)
  j = pl.program_id(1)
  e = tile_expert_ref[i]
  steps = jnp.where(i < num_active_ref[0], jnp.int32(num_k), jnp.int32(0))

  def body(kk, acc):
    x = x_ref[pl.ds(i * tile_m, tile_m), pl.ds(kk * block_k, block_k)]
    w = w_ref[e, pl.ds(kk * block_k, block_k), pl.ds(j * block_n, block_n)]
    if w.dtype != x.dtype:
      w = w.astype(x.dtype)
    return acc + lax.dot_general(x, w, (((1,), (0,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32)

  acc = lax.fori_loop(jnp.int32(0), steps, body, jnp.zeros((tile_m, block_n), jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


def grouped_matmul(x, w, tile_expert, num_active, *, tile_m: int, out_dtype=None,
                   interpret: Optional[bool] = None, block_k: Optional[int] = None,
                   block_n: Optional[int] = None, num_warps: int = 4, num_stages: int = 2):
  """``out[i*m + r] = x[i*m + r] @ w[tile_expert[i]]`` for active tiles (f32 accumulation), 0 elsewhere.

  Args:
    x: [NT * tile_m, K] rows grouped in tiles of ``tile_m``.
    w: [E, K, N] stacked expert weights.
    tile_expert: [NT] int32 expert of each tile (in [0, E)).
    num_active: int32 scalar: tiles ``>= num_active`` are skipped.
    tile_m: rows per tile (compiled: a power of two >= 16).
    out_dtype: default x's dtype. interpret: None -> interpret mode unless on GPU.
    block_k / block_n: K / N step (default: the largest power of two <= 64 / 128 dividing K / N).
  """
  rows, k = x.shape
  num_experts, k_w, n = w.shape
  if k_w != k or rows % tile_m or tile_expert.shape != (rows // tile_m,):
    raise ValueError(f"grouped_matmul: x {x.shape}, w {w.shape}, tile_expert {tile_expert.shape}, "
                     f"tile_m {tile_m}")
  if interpret is None:
    interpret = default_interpret()
  block_k = block_k or _largest_pow2_divisor(k, 64)
  block_n = block_n or _largest_pow2_divisor(n, 128)
  if k % block_k or n % block_n:
    raise ValueError(f"grouped_matmul: block_k {block_k} / block_n {block_n} must divide K {k} / N {n}")
  if not interpret:
    bad = [f"{name}={v}" for name, v in (("tile_m", tile_m), ("block_k", block_k), ("block_n", block_n))
           if not (_is_pow2(v) and v >= MIN_DOT)]
    if bad:
      raise ValueError("compiled grouped_matmul needs powers of two >= 16: " + ", ".join(bad))
  return _grouped_matmul_impl(x, w, tile_expert.astype(jnp.int32),
                              jnp.asarray(num_active, jnp.int32).reshape(1), tile_m=tile_m,
                              block_k=block_k, block_n=block_n, out_dtype=jnp.dtype(out_dtype or x.dtype),
                              interpret=bool(interpret), num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=("tile_m", "block_k", "block_n", "out_dtype", "interpret",
                                             "num_warps", "num_stages"))
def _grouped_matmul_impl(x, w, tile_expert, num_active, *, tile_m, block_k, block_n, out_dtype, interpret,
                         num_warps, num_stages):
  rows, k = x.shape
  n = w.shape[2]
  num_tiles = rows // tile_m
  precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  kernel = functools.partial(_gmm_kernel, tile_m=tile_m, block_k=block_k, block_n=block_n,
                             num_k=k // block_k, precision=precision)
  kwargs = {}
  if not interpret and _plgpu is not None:
    kwargs["compiler_params"] = _plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  inputs = (tile_expert, num_active, x, w)
  return pl.pallas_call(
      kernel, grid=(num_tiles, n // block_n), in_specs=[_full_spec(a.shape) for a in inputs],
      out_specs=pl.BlockSpec((tile_m, block_n), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((rows, n), out_dtype), interpret=interpret,
      name=f"grouped_matmul_m{tile_m}_k{block_k}_n{block_n}", **kwargs)(*inputs)
