"""Mixture-of-experts MLP (Mixtral): top-k routing and three formulations of the expert SwiGLUs.

Routing (Mixtral / transformers ``MixtralTopKRouter``): router logits ``h @ router`` in f32, the
``k`` largest per token, and weights = soft-max over those ``k`` logits (equal to transformers' soft-max
over all experts renormalised over the selected ones). A token's output is
``sum_j weight_j * down_e(silu(gate_e(h)) * up_e(h))`` over its selected experts ``e = experts_j``.

Formulations (``MOE_IMPLS``), all exact (no capacity, no dropped tokens):

* ``dense``: every expert on every token, combined with a ``[T, E]`` weight matrix that is zero off the
  selected experts. FLOPs ``~ T * E``. The test reference.
* ``tiles`` (default): the ``T * k`` (token, expert) pairs are sorted by expert; each expert's run is padded
  to a multiple of the tile size ``m`` and cut into tiles of ``m`` rows that belong to one expert; each tile
  multiplies by its own expert's weights (a batched matmul over tiles). The static tile count is
  ``(T*k + min(E, T*k) * (m - 1)) // m``, so FLOPs ``~ T * k`` plus at most ``m - 1`` padding rows per
  expert -- not ``T * E``. The expert weights are gathered per tile (``[tiles, H, F]``), which costs
  memory traffic of about ``tiles / E`` times the experts' weights.
* ``ragged_dot``: the same sorted rows through ``jax.lax.ragged_dot`` (a grouped GEMM). Only worth it where
  XLA lowers ragged dot natively: in jax 0.10.2 the CPU and CUDA backends rewrite it to a dense masked
  matmul over all experts (FLOPs ``~ T * E``; measured in tests/test_mixtral.py), hence not the default.

Shapes: ``h [T, H]``; per layer ``router [H, E]``, ``w_gate`` / ``w_up`` ``[E, H, F]``, ``w_down [E, F, H]``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

MOE_IMPLS = ("dense", "tiles", "ragged_dot")
AUTO = "auto"
MIN_TILE, MAX_TILE = 8, 128


def matmul(x: jax.Array, w: jax.Array, out=None) -> jax.Array:
  """``x @ w`` accumulated in f32, returned in ``out`` dtype (default: x's dtype)."""
  y = jnp.dot(x, w, preferred_element_type=jnp.float32)
  return y.astype(out or x.dtype)


def route(h: jax.Array, router: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """(weights [T, k] f32 summing to 1, experts [T, k] int32), experts in decreasing logit order."""
  logits = jnp.dot(h, router, preferred_element_type=jnp.float32)     # [T, E]
  top, experts = jax.lax.top_k(logits, k)
  return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)


def _swiglu(x, w_gate, w_up, einsum: str):
  g = jnp.einsum(einsum, x, w_gate, preferred_element_type=jnp.float32)
  u = jnp.einsum(einsum, x, w_up, preferred_element_type=jnp.float32)
  return (jax.nn.silu(g) * u).astype(x.dtype)


def moe_dense(h, lp, weights, experts):
  """Reference: all experts on all tokens. Returns [T, H] in h's dtype."""
  T, E = h.shape[0], lp["router"].shape[-1]
  a = _swiglu(h, lp["w_gate"], lp["w_up"], "th,ehf->tef")                # [T, E, F]
  y = jnp.einsum("tef,efh->teh", a, lp["w_down"], preferred_element_type=jnp.float32)
  combine = jnp.zeros((T, E), jnp.float32).at[jnp.arange(T)[:, None], experts].add(weights)
  return jnp.einsum("te,teh->th", combine, y).astype(h.dtype)


def tile_size(num_rows: int, num_experts: int) -> int:
  """Rows per tile: about the mean rows per expert, a power of two in [MIN_TILE, MAX_TILE]."""
  mean = -(-num_rows // num_experts)
  m = 1 << max(0, (mean - 1).bit_length())
  return max(MIN_TILE, min(MAX_TILE, m))


def num_tiles(num_rows: int, num_experts: int, tile: int) -> int:
  """Static bound on sum_e ceil(rows_e / tile) over the non-empty experts (sum_e rows_e = num_rows)."""
  return max(1, (num_rows + min(num_experts, num_rows) * (tile - 1)) // tile)


def sort_by_expert(experts: jax.Array, num_experts: int):
  """(order [N], sizes [E]): ``order`` lists the flat (token * k + j) pairs grouped by expert (stable), and
  ``sizes[e]`` is the number of pairs routed to expert e (N = T * k)."""
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  return order, sizes


def _combine(T: int, order, k: int, weights, rows, dtype):
  """Sum of the sorted expert outputs ``rows [N, H]`` back onto their tokens, weighted; [T, H] in dtype."""
  w = weights.reshape(-1)[order][:, None]
  out = jnp.zeros((T, rows.shape[-1]), jnp.float32).at[order // k].add(rows.astype(jnp.float32) * w)
  return out.astype(dtype)


def moe_tiles(h, lp, weights, experts, tile: int | None = None):
  """Grouped formulation on expert-homogeneous tiles (see module docstring). Returns [T, H]."""
  T, H = h.shape
  k = experts.shape[1]
  E = lp["router"].shape[-1]
  N = T * k
  m = tile or tile_size(N, E)
  nt = num_tiles(N, E, m)
  order, sizes = sort_by_expert(experts, E)
  tiles_per = (sizes + m - 1) // m
  tile_end = jnp.cumsum(tiles_per)
  tile_start = tile_end - tiles_per
  group_start = jnp.cumsum(sizes) - sizes
  sorted_expert = experts.reshape(-1)[order]                                   # [N]
  r = jnp.arange(N, dtype=jnp.int32)
  prow = tile_start[sorted_expert] * m + (r - group_start[sorted_expert])      # padded row of sorted row r
  i = jnp.arange(nt, dtype=jnp.int32)
  tile_expert = jnp.minimum(jnp.sum(tile_end[None, :] <= i[:, None], axis=1), E - 1)   # [NT]
  x = jnp.zeros((nt * m, H), h.dtype).at[prow].set(h[order // k]).reshape(nt, m, H)
  a = _swiglu(x, lp["w_gate"][tile_expert], lp["w_up"][tile_expert], "nmh,nhf->nmf")
  y = jnp.einsum("nmf,nfh->nmh", a, lp["w_down"][tile_expert], preferred_element_type=jnp.float32)
  return _combine(T, order, k, weights, y.reshape(nt * m, H)[prow], h.dtype)


def moe_ragged_dot(h, lp, weights, experts):
  """Grouped formulation through ``jax.lax.ragged_dot`` on the expert-sorted rows. Returns [T, H]."""
  T = h.shape[0]
  k = experts.shape[1]
  order, sizes = sort_by_expert(experts, lp["router"].shape[-1])
  xs = h[order // k]
  g = jax.lax.ragged_dot(xs, lp["w_gate"], sizes, preferred_element_type=jnp.float32)
  u = jax.lax.ragged_dot(xs, lp["w_up"], sizes, preferred_element_type=jnp.float32)
  a = (jax.nn.silu(g) * u).astype(h.dtype)
  y = jax.lax.ragged_dot(a, lp["w_down"], sizes, preferred_element_type=jnp.float32)
  return _combine(T, order, k, weights, y, h.dtype)


_IMPLS = {"dense": moe_dense, "tiles": moe_tiles, "ragged_dot": moe_ragged_dot}


def moe_mlp(h: jax.Array, lp, k: int, impl: str = AUTO) -> jax.Array:
  """Routed SwiGLU experts of one layer (``lp``: that layer's params). ``impl``: one of MOE_IMPLS or auto
  (= tiles). Returns [T, H] in h's dtype."""
  name = "tiles" if impl == AUTO else impl
  if name not in _IMPLS:
    raise ValueError(f"unknown MoE implementation {impl!r}; known: {(AUTO,) + MOE_IMPLS}")
  weights, experts = route(h, lp["router"], k)
  return _IMPLS[name](h, lp, weights, experts)
