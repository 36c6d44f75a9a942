"""``TensorParallel``: the one object the engine and ``model.api`` use to run the model on a TP mesh.

It turns ``(cfg, params)`` into the TP model (``prepare``: stored KV heads, Megatron-sharded params), makes
the head-sharded KV cache, the per-shard attention backend, the replicated placement of a step's host
inputs, and the per-device sizes the memory sizing needs. The jitted step is the ordinary one: jit reads
the shardings of the committed params and cache, XLA SPMD partitions the matmuls (one all-reduce after
attention's o-proj, one after the MLP, the vocab-sharded embedding lookup and logits), and
``ShardedAttention`` runs attention per shard.

``tensor_parallel_size == 1`` never builds one (``make_tensor_parallel`` returns None): the single-device
path then runs with no mesh and no sharding annotations.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from superinfer_jax.parallel import kv as kv_lib
from superinfer_jax.parallel import sharding as sharding_lib
from superinfer_jax.parallel.attention import ShardedAttention
from superinfer_jax.parallel.mesh import (free_device_bytes, local_mesh_devices, make_mesh, put_global,
                                          replicated)


@dataclasses.dataclass(frozen=True)
class TensorParallel:
  """Tensor parallelism over ``mesh`` (1-D, axis ``"tp"``). Hashable."""
  mesh: Mesh

  @property
  def size(self) -> int:
    return self.mesh.size

  # ------------------------------------------------------------------------------------------- model
  def model_config(self, cfg):
    """The config the sharded model runs with (``num_kv_heads`` = stored KV heads)."""
    return sharding_lib.tp_model_config(cfg, self.size)

  def prepare(self, cfg, params) -> tuple[Any, Any]:
    """``(cfg_tp, params_tp)``: KV heads replicated as needed and every leaf placed with its Megatron
    sharding. ``params`` is the single-device model's (numpy or jax leaves); already-prepared params (same
    mesh and shapes) come back unchanged."""
    cfg_tp = self.model_config(cfg)
    wk = params["layers"]["wk"]
    if wk.shape[-1] == cfg_tp.kv_size and self._is_sharded(wk):
      return cfg_tp, params
    if wk.shape[-1] != cfg.kv_size:
      raise ValueError(f"params have wk of shape {tuple(wk.shape)}; config {cfg.name or cfg.family} expects "
                       f"{cfg.kv_size} output columns")
    host = sharding_lib.replicate_kv_heads(params, cfg, self.size)
    specs = sharding_lib.param_partition_specs(host, self.size)
    placed = jax.tree.map(lambda a, s: put_global(a, NamedSharding(self.mesh, s)), host, specs)
    return cfg_tp, placed

  def _is_sharded(self, a) -> bool:
    return isinstance(a, jax.Array) and isinstance(a.sharding, NamedSharding) and a.sharding.mesh == self.mesh

  def load_model(self, path_or_name: str, dtype: str) -> tuple[Any, Any]:
    """``(cfg, params)`` of a checkpoint in host memory (the CPU backend, where JAX has one), so no
    accelerator ever holds the whole model; ``prepare`` then shards it."""
    from superinfer_jax.model import load_model  # pylint: disable=import-outside-toplevel
    try:
      host = jax.local_devices(backend="cpu")[0]
    except RuntimeError:     # JAX_PLATFORMS names no cpu: load on the default device
      return load_model(path_or_name, dtype=dtype)
    with jax.default_device(host):
      return load_model(path_or_name, dtype=dtype)

  def attention(self, backend) -> ShardedAttention:
    """``backend`` (a registry name or a backend function) run per shard through ``shard_map``."""
    return ShardedAttention(self.mesh, backend)

  # ---------------------------------------------------------------------------------------- KV cache
  def init_kv_cache(self, cfg_tp, num_blocks: int, block_size: int, dtype: str = "float32") -> jax.Array:
    return kv_lib.init_sharded_kv_cache(cfg_tp, num_blocks, block_size, dtype, self.mesh)

  @property
  def block_sharding(self) -> NamedSharding:
    """Device sharding of one rotated block ``[L, 2, BS, Hkv', D]``."""
    return kv_lib.kv_block_sharding(self.mesh)

  def device_block_bytes(self, spec) -> int:
    """Bytes of one KV block on each device (``spec``: the TP model's, stored KV heads)."""
    return spec.block_bytes // self.size

  def host_block_bytes(self, spec) -> int:
    """Bytes of one KV block in this process's host memory (its devices' slices)."""
    return spec.block_bytes * len(local_mesh_devices(self.mesh)) // self.size

  def free_device_bytes(self) -> int | None:
    """The least free memory over the mesh's devices (every process's: the pool size must be the same
    everywhere, so a multi-process run agrees on the minimum), or None if the backend reports none."""
    free = free_device_bytes(local_mesh_devices(self.mesh))
    if jax.process_count() == 1:
      return free
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    mib = np.asarray(multihost_utils.process_allgather(np.array([-1 if free is None else free >> 20], np.int32)))
    return None if (mib < 0).any() else int(mib.min()) << 20

  # ------------------------------------------------------------------------------------------- steps
  @property
  def replicated(self) -> NamedSharding:
    """Sharding of a step's host inputs (one plan drives every shard) and of gathered logits."""
    return replicated(self.mesh)

  def put(self, x) -> jax.Array:
    """One explicit transfer of a host array (numpy) to every device of the mesh."""
    return put_global(x, self.replicated)

  def put_tree(self, tree):
    return jax.tree.map(self.put, tree)


def make_tensor_parallel(tp: int) -> TensorParallel | None:
  """A ``TensorParallel`` over the first ``tp`` devices, or None for ``tp == 1``."""
  mesh = make_mesh(tp)
  return None if tp == 1 else TensorParallel(mesh)
