"""Dense projection ``x @ W`` on XLA:CPU as a C++ custom call (``cpu_dense.cc``, XLA FFI), for weights packed in
panels of 16 output columns.

Why: a decode step's dense layers stream every weight from memory once, for a few rows of activations. XLA's dots
(and torch's) reached ~12 GB/s doing so at 16 rows, against ~28 GB/s for one row; the kernel streams each panel
once, contiguously, and uses each 16-float row of it for every activation row (WORKSPACE_NOTES 2026-12-04: the
30 SmolLM2 layers' projections plus the head at 16 rows, 27 ms against XLA's 45).

Layout: ``pack(w)`` turns ``W [K, N]`` (N a multiple of 16) into ``[N // 16, K, 16]`` with
``packed[p, k, j] = W[k, 16 p + j]``; ``unpack`` inverts it. ``cpu_dense(x, packed)`` is ``x @ W`` for
``x [..., K]``, float32, each output summed over k in order with fused multiply-adds (so it matches XLA's dot
to float32 rounding, not bit for bit). ``dense_reference(x, packed)`` is the same product in jnp, the reference
the tests compare against.

Built with ``cpu_paged_attention.cc`` into one library (``pallas_kernels/cpu_paged_attention.py``: compiled on first
use, cached per source / compiler / jaxlib / CPU); ``available()`` / ``build_error()`` are that library's.
"""
from __future__ import annotations

import numpy as np

from pallas_kernels import cpu_paged_attention as _lib

LANES = 16


def available() -> bool:
  return _lib.available()


def build_error() -> str | None:
  return _lib.build_error()


def packable(w) -> bool:
  """Whether ``w`` can be packed: a float32 ``[K, N]`` matrix with N a positive multiple of 16."""
  return getattr(w, "ndim", 0) == 2 and w.shape[1] > 0 and w.shape[1] % LANES == 0 and w.dtype == np.float32


def pack(w):
  """``W [K, N]`` -> ``[N // 16, K, 16]`` panels (same array type as ``w``: numpy stays numpy)."""
  if not packable(w):
    raise ValueError(f"pack: expected a float32 [K, N] matrix with N a multiple of {LANES}, got "
                     f"{getattr(w, 'dtype', None)} {getattr(w, 'shape', None)}")
  k, n = w.shape
  return w.reshape(k, n // LANES, LANES).transpose(1, 0, 2)


def unpack(packed):
  """``[P, K, 16]`` panels -> ``W [K, 16 P]``."""
  p, k, lanes = packed.shape
  return packed.transpose(1, 0, 2).reshape(k, p * lanes)


def dense_reference(x, packed):
  """``x @ unpack(packed)`` in jnp (float32): ``x [..., K]`` -> ``[..., N]``."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  return jnp.matmul(x.astype(jnp.float32), unpack(packed).astype(jnp.float32))


def cpu_dense(x, packed, *, offset: int = 0, panels: int | None = None, k: int | None = None):
  """``x @ W`` by the C++ kernel: ``x [..., K]`` float32 -> ``[..., 16 * panels]`` float32.

  ``packed`` is ``pack(W)`` (``[P, K, 16]``; ``offset`` / ``panels`` / ``k`` then default to the whole of it), or
  any float32 array read as a flat buffer whose elements ``offset .. offset + 16 * panels * K - 1`` hold one
  ``pack``ed weight (``panels`` and ``k`` required): one buffer may hold every packed weight of a model.
  CPU only (the custom call is registered for XLA:CPU); raises ``RuntimeError`` where the library cannot be
  built or the default backend is not the CPU, ``ValueError`` on shapes, dtypes or ranges the kernel does not
  take.
  """
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  err = build_error()
  if err is not None:
    raise RuntimeError(f"the cpu_dense kernel is unavailable: {err}")
  if jax.default_backend() != "cpu":
    raise RuntimeError(f"the cpu_dense kernel runs on XLA:CPU only (default backend: {jax.default_backend()})")
  if packed.dtype != jnp.float32:
    raise ValueError(f"packed weights must be float32, got {packed.dtype}")
  if panels is None:
    if packed.ndim != 3 or packed.shape[2] != LANES or offset:
      raise ValueError(f"without panels=, packed must be one [P, K, {LANES}] weight, got {packed.shape}")
    panels, k = packed.shape[0], packed.shape[1]
  if k is None or k < 0 or panels < 0 or offset < 0 or offset + panels * k * LANES > packed.size:
    raise ValueError(f"range offset={offset} panels={panels} k={k} does not fit a buffer of {packed.size}")
  if x.shape[-1] != k or x.dtype != jnp.float32:
    raise ValueError(f"x must be float32 [..., {k}], got {x.dtype} {x.shape}")
  lead = x.shape[:-1]
  x2 = x.reshape(-1, k)
  n = panels * LANES
  call = jax.ffi.ffi_call(_lib.DENSE_TARGET, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32),
                          vmap_method="sequential")
  return call(x2, packed, offset=np.int64(offset), panels=np.int64(panels)).reshape(*lead, n)
