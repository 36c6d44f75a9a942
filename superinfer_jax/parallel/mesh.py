"""The 1-D tensor-parallel mesh, its replicated sharding, and global array construction.

``make_mesh(tp)`` takes the first ``tp`` of ``jax.devices()`` (every process's devices, in process order,
once ``jax.distributed`` is initialized). In a multi-process run the mesh must span every process's devices
(``tp == jax.device_count()``): a process with no device in the mesh could not run the step.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

TP_AXIS = "tp"


def make_mesh(tp: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ``Mesh`` of shape ``(tp,)`` with axis ``"tp"`` over ``devices`` (default: the first ``tp`` devices).

  Raises ValueError for ``tp < 1``, more devices asked than exist, or (multi-process) a mesh that leaves
  some process without a device."""
  if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
    raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
  devs = list(jax.devices() if devices is None else devices)
  if tp > len(devs):
    raise ValueError(f"tensor_parallel_size={tp} but only {len(devs)} devices are visible "
                     f"({jax.default_backend()}; on CPU set JAX_NUM_CPU_DEVICES before JAX starts)")
  devs = devs[:tp]
  if jax.process_count() > 1:
    missing = sorted(set(range(jax.process_count())) - {d.process_index for d in devs})
    if missing:
      raise ValueError(f"tensor_parallel_size={tp} leaves processes {missing} without a device: in a "
                       f"multi-process run it must be the global device count {jax.device_count()}")
  return Mesh(np.array(devs), (TP_AXIS,))


def replicated(mesh: Mesh, memory_kind: str | None = None) -> NamedSharding:
  """Every device holds the whole array."""
  return NamedSharding(mesh, P(), memory_kind=memory_kind)


def local_mesh_devices(mesh: Mesh) -> list[jax.Device]:
  """The mesh's devices this process drives."""
  return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def put_global(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
  """``x`` (numpy, or a jax array this process can read) placed with ``sharding``, which may span other
  processes' devices: each process copies the slices of its own devices, so every process must pass the
  same global value (replicated scheduling guarantees that for batches; weights are loaded everywhere)."""
  if isinstance(x, jax.Array) and x.sharding == sharding:
    return x
  return jax.device_put(np.asarray(x), sharding)


def free_device_bytes(devices: Sequence[jax.Device]) -> int | None:
  """The least free memory (``bytes_limit - bytes_in_use``) over ``devices``, or None when the backend
  reports none (CPU)."""
  free = []
  for d in devices:
    try:
      stats = d.memory_stats()
    except Exception:  # pylint: disable=broad-except
      stats = None
    if not stats or "bytes_limit" not in stats:
      return None
    free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
  return min(free) if free else None
