"""Mixture-of-experts MLP (Mixtral): top-k routing and three formulations of the expert SwiGLUs.

Routing (Mixtral / transformers ``MixtralTopKRouter``): router logits ``h @ router`` in f32, the
``k`` largest per token, and weights = soft-max over those ``k`` logits (equal to transformers' soft-max
over all experts renormalised over the selected ones). A token's output is
``sum_j weight_j * down_e(silu(gate_e(h)) * up_e(h))`` over its selected experts ``e = experts_j``.

Formulations (``MOE_IMPLS``), all exact (no capacity, no dropped tokens):

* ``dense``: every expert on every token, combined with a ``[T, E]`` weight matrix that is zero off the
  selected experts. FLOPs ``~ T * E``. The test reference.
* ``tiles`` (default off GPU): the ``T * k`` (token, expert) pairs are sorted by expert; each expert's run is padded
  to a multiple of the tile size ``m`` and cut into tiles of ``m`` rows that belong to one expert; each tile
  multiplies by its own expert's weights (a batched matmul over tiles). The static tile count is
  ``(T*k + min(E, T*k) * (m - 1)) // m``, so FLOPs ``~ T * k`` plus at most ``m - 1`` padding rows per
  expert -- not ``T * E``. The expert weights are gathered per tile (``[tiles, H, F]``), which costs
  memory traffic of about ``tiles / E`` times the experts' weights.
* ``pallas`` (default on a GPU): the same tiles through ``pallas_kernels.grouped_matmul``, which reads
  each tile's expert weights in place from the stacked array and skips the padding tiles.
* ``ragged_dot``: the same sorted rows through ``jax.lax.ragged_dot`` (a grouped GEMM). Only worth it where
  XLA lowers ragged dot natively; the CPU and CUDA backends may rewrite it to a dense masked matmul over
  all experts (FLOPs ``~ T * E``), hence not the default.

Shapes: ``h [T, H]``; per layer ``router [H, E]``, ``w_gate`` / ``w_up`` ``[E, H, F]``, ``w_down [E, F, H]``.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

MOE_IMPLS = ("dense", "tiles", "pallas", "ragged_dot")
AUTO = "auto"
MIN_TILE, MAX_TILE = 8, 128
PALLAS_MIN_TILE = 16   # Triton dot rows


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


class TileLayout(NamedTuple):
  """Expert-homogeneous tiles of the sorted (token, expert) pairs.

  order [N]: flat pair (token * k + j) of each sorted row; prow [N]: the padded row of sorted row r (tile
  ``prow // m``); tile_expert [NT]: expert of each tile (the last expert for inactive tiles); num_active:
  tiles in use (the rest are padding); tile: m; num_tiles: NT (static)."""
  order: jax.Array
  prow: jax.Array
  tile_expert: jax.Array
  num_active: jax.Array
  tile: int
  num_tiles: int


def tile_layout(experts: jax.Array, num_experts: int, tile: int) -> TileLayout:
  """Sorts the pairs by expert and pads each expert's run to whole tiles of ``tile`` rows."""
  N = experts.size
  nt = num_tiles(N, num_experts, tile)
  order, sizes = sort_by_expert(experts, num_experts)
  tiles_per = (sizes + tile - 1) // tile
  tile_end = jnp.cumsum(tiles_per)
  tile_start = tile_end - tiles_per
  group_start = jnp.cumsum(sizes) - sizes
  sorted_expert = experts.reshape(-1)[order]                                   # [N]
  r = jnp.arange(N, dtype=jnp.int32)
  prow = tile_start[sorted_expert] * tile + (r - group_start[sorted_expert])
  i = jnp.arange(nt, dtype=jnp.int32)
  tile_expert = jnp.minimum(jnp.sum(tile_end[None, :] <= i[:, None], axis=1), num_experts - 1)
  return TileLayout(order, prow.astype(jnp.int32), tile_expert.astype(jnp.int32),
                    tile_end[-1].astype(jnp.int32), tile, nt)


def _tiled_rows(h, layout: TileLayout, k: int):
  """The sorted rows of h scattered into the padded tile layout: [NT * m, H] (padding rows 0)."""
  return jnp.zeros((layout.num_tiles * layout.tile, h.shape[1]), h.dtype).at[layout.prow].set(
      h[layout.order // k])


def moe_tiles(h, lp, weights, experts, tile: int | None = None):
  """Grouped formulation on expert-homogeneous tiles, jnp (see module docstring). Returns [T, H]."""
  T, H = h.shape
  k = experts.shape[1]
  E = lp["router"].shape[-1]
  lay = tile_layout(experts, E, tile or tile_size(T * k, E))
  nt, m, te = lay.num_tiles, lay.tile, lay.tile_expert
  x = _tiled_rows(h, lay, k).reshape(nt, m, H)
  a = _swiglu(x, lp["w_gate"][te], lp["w_up"][te], "nmh,nhf->nmf")
  y = jnp.einsum("nmf,nfh->nmh", a, lp["w_down"][te], preferred_element_type=jnp.float32)
  return _combine(T, lay.order, k, weights, y.reshape(nt * m, H)[lay.prow], h.dtype)


def moe_pallas(h, lp, weights, experts, tile: int | None = None, interpret: bool | None = None):
  """The same tile layout through the Pallas grouped-matmul kernel (``pallas_kernels.grouped_matmul``):
  each tile reads its expert's weights in place and inactive tiles are skipped. Returns [T, H]."""
  from pallas_kernels.grouped_matmul import grouped_matmul  # pylint: disable=import-outside-toplevel
  T = h.shape[0]
  k = experts.shape[1]
  E = lp["router"].shape[-1]
  lay = tile_layout(experts, E, tile or max(PALLAS_MIN_TILE, tile_size(T * k, E)))
  gmm = functools.partial(grouped_matmul, tile_expert=lay.tile_expert, num_active=lay.num_active,
                          tile_m=lay.tile, out_dtype=jnp.float32, interpret=interpret)
  x = _tiled_rows(h, lay, k)
  a = (jax.nn.silu(gmm(x, lp["w_gate"])) * gmm(x, lp["w_up"])).astype(h.dtype)
  y = gmm(a, lp["w_down"])
  return _combine(T, lay.order, k, weights, y[lay.prow], h.dtype)


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


_IMPLS = {"dense": moe_dense, "tiles": moe_tiles, "pallas": moe_pallas, "ragged_dot": moe_ragged_dot}


def default_impl() -> str:
  """What ``auto`` means: the Pallas kernel on a GPU (as the attention backend), ``tiles`` elsewhere (the
  kernel runs there only in interpret mode)."""
  return "pallas" if jax.default_backend() in ("gpu", "cuda", "rocm") else "tiles"


def moe_mlp(h: jax.Array, lp, k: int, impl: str = AUTO) -> jax.Array:
  """Routed SwiGLU experts of one layer (``lp``: that layer's params). ``impl``: one of MOE_IMPLS or auto
  (``default_impl()``). Returns [T, H] in h's dtype."""
  name = default_impl() if impl == AUTO else impl
  if name not in _IMPLS:
    raise ValueError(f"unknown MoE implementation {impl!r}; known: {(AUTO,) + MOE_IMPLS}")
  weights, experts = route(h, lp["router"], k)
  return _IMPLS[name](h, lp, weights, experts)
