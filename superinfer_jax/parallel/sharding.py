"""Megatron partition specs for the stacked params pytree, and KV-head replication for TP.

Layout of the params: ``superinfer_jax/model/params.py`` (matrices ``[in, out]``, layers stacked on axis 0).
With mesh axis ``"tp"`` of size ``tp``:

  embed   [V, H]       P("tp", None)        by vocab (XLA masks the lookup per shard and all-reduces)
  lm_head [H, V]       P(None, "tp")        by vocab: logits come out vocab-sharded, gathered for sampling
  wq      [L, H, Q]    P(None, None, "tp")  column-parallel by query heads (bq [L, Q]: P(None, "tp"))
  wk, wv  [L, H, KV']  P(None, None, "tp")  by KV heads (after replication, below)
  wo      [L, Q, H]    P(None, "tp", None)  row-parallel: one all-reduce after attention
  w_gate, w_up [L,H,F] P(None, None, "tp")  MLP columns ...
  w_down  [L, F, H]    P(None, "tp", None)  ... then rows: one all-reduce after the MLP
  MoE experts: w_gate, w_up [L, E, H, F] and w_down [L, E, F, H] are split the same way inside every
  expert (F columns, then F rows); the router [L, H, E] is replicated (axes are counted from the end)
  norms, anything else replicated           (a leaf this table does not name, e.g. a new family's, stays
                                             replicated: always correct, never sharded by accident)

A dimension the table shards but ``tp`` does not divide (vocab 49155, F not a multiple) falls back to
replicated for that leaf (correct, more memory); ``sharding_report`` lists such leaves. Query heads must
divide: attention runs per shard.

KV-head replication: the KV cache is sharded by KV heads, so each shard needs whole KV heads for its query
heads. With ``Hkv`` KV heads, ``Hq`` query heads (group ``G = Hq / Hkv``) and TP degree ``tp``, the model runs
with ``Hkv' = lcm(Hkv, tp)`` stored KV heads: head ``j`` of the original is stored ``r = Hkv' / Hkv`` times
(``j, j, ..., j`` consecutively), so stored head ``j'`` is original ``j' // r``. Query head ``i`` reads stored
head ``i // (G / r)`` = original ``i // G``: the same attention. Needs ``Hq % Hkv' == 0`` (else ValueError).
``Hkv % tp == 0`` gives ``r = 1`` (no copy). The KV cache then holds ``Hkv'`` heads: each device stores
``Hkv' / tp`` of them, ``r`` times the bytes of an unreplicated head share (vLLM does the same).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from superinfer_jax.parallel.mesh import TP_AXIS

# Leaf name -> the axis sharded by "tp", counted from the end (so a dense MLP [L, H, F] and a MoE layer's
# stacked experts [L, E, H, F] shard the same F axis); see the module docstring.
_SHARDED_AXIS = {
    "embed": -2, "lm_head": -1,
    "wq": -1, "wk": -1, "wv": -1, "bq": -1, "bk": -1, "bv": -1,
    "wo": -2, "w_gate": -1, "w_up": -1, "w_down": -2,
}
_KV_LEAVES = {"wk": 2, "wv": 2, "bk": 1, "bv": 1}   # leaves whose last axis is KV heads x head_dim


def stored_kv_heads(num_heads: int, num_kv_heads: int, tp: int) -> int:
  """``Hkv' = lcm(Hkv, tp)``: the KV heads the TP model stores (see the module docstring)."""
  if num_heads % tp:
    raise ValueError(f"tensor_parallel_size={tp} must divide the {num_heads} query heads")
  hkv = math.lcm(num_kv_heads, tp)
  if num_heads % hkv:
    raise ValueError(f"cannot split {num_heads} query heads / {num_kv_heads} KV heads over {tp} devices: "
                     f"each shard needs whole KV heads, so {hkv} stored KV heads must divide {num_heads}")
  return hkv


def tp_model_config(cfg, tp: int):
  """``cfg`` with ``num_kv_heads`` = the stored KV heads at TP degree ``tp`` (a static jit argument)."""
  hkv = stored_kv_heads(cfg.num_heads, cfg.num_kv_heads, tp)
  return cfg if hkv == cfg.num_kv_heads else dataclasses.replace(cfg, num_kv_heads=hkv)


def replicate_kv_heads(params: Any, cfg, tp: int) -> Any:
  """Host (numpy) params with each KV head's columns of wk / wv (bk / bv) repeated ``Hkv' / Hkv`` times.

  ``params`` leaves may be numpy or jax arrays; the result's leaves are numpy (untouched leaves are
  ``np.asarray`` views)."""
  r = stored_kv_heads(cfg.num_heads, cfg.num_kv_heads, tp) // cfg.num_kv_heads

  def expand(name, leaf):
    a = np.asarray(leaf)
    if r == 1 or name not in _KV_LEAVES:
      return a
    D = cfg.head_dim
    shape = a.shape[:-1] + (cfg.num_kv_heads, D)
    return np.repeat(a.reshape(shape), r, axis=-2).reshape(a.shape[:-1] + (cfg.num_kv_heads * r * D,))
  return jax.tree_util.tree_map_with_path(lambda path, v: expand(_leaf_name(path), v), params)


def _leaf_name(path) -> str:
  """The last dict key of a pytree path (``("layers", "wk")`` -> ``"wk"``)."""
  key = path[-1]
  return str(getattr(key, "key", getattr(key, "name", key)))


def _paths(params: Any) -> dict[str, Any]:
  """``"layers/wk" -> leaf`` for every leaf of ``params``."""
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  return {"/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path): v for path, v in flat}


def leaf_spec(name: str, shape: tuple[int, ...], tp: int) -> P:
  """The ``PartitionSpec`` of param leaf ``name`` with ``shape`` at TP degree ``tp`` (module docstring)."""
  axis = _SHARDED_AXIS.get(name)
  if axis is None or tp == 1 or len(shape) < -axis or shape[axis] % tp:
    return P()
  axis += len(shape)
  return P(*[TP_AXIS if i == axis else None for i in range(len(shape))])


def param_partition_specs(params: Any, tp: int) -> Any:
  """A pytree like ``params`` of ``PartitionSpec``s (leaves named by their last dict key)."""
  return jax.tree_util.tree_map_with_path(lambda path, v: leaf_spec(_leaf_name(path), tuple(v.shape), tp),
                                          params)


def sharding_report(params: Any, tp: int) -> dict[str, list[str]]:
  """``{"sharded": [...], "replicated_fallback": [...], "replicated": [...]}`` leaf names: which leaves the
  Megatron table shards, which it would shard but ``tp`` does not divide, which it keeps whole."""
  out = {"sharded": [], "replicated_fallback": [], "replicated": []}
  for path, v in _paths(params).items():
    name = path.rsplit("/", 1)[-1]
    if leaf_spec(name, tuple(v.shape), tp) != P():
      out["sharded"].append(path)
    elif name in _SHARDED_AXIS and tp > 1:
      out["replicated_fallback"].append(path)
    else:
      out["replicated"].append(path)
  return out


# Partition specs of the block-first KV cache [NB, L, 2, BS, Hkv', D] and of one block [L, 2, BS, Hkv', D].
KV_CACHE_SPEC = P(None, None, None, None, TP_AXIS, None)
KV_BLOCK_SPEC = P(None, None, None, TP_AXIS, None)
