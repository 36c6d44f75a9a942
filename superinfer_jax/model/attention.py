"""Attention-backend registry: name -> function with the ``pallas_kernels.reference`` contract.

Every backend has the signature
``attn(q[T,Hq,D], kv_cache[NB,L,2,BS,Hkv,D], layer, block_tables[S,MB], context_lens[S],
query_start_loc[S+1], *, scale) -> [T,Hq,D]`` and reads K/V that the model has already written.
Backends are looked up by name so the name (a string) can be a static jit argument.
"""
from __future__ import annotations

import functools
from typing import Callable

AttentionFn = Callable[..., "jax.Array"]  # noqa: F821


def _reference() -> AttentionFn:
  from pallas_kernels.reference import ragged_paged_attention_reference
  return ragged_paged_attention_reference


def _pallas() -> AttentionFn:
  # Imported lazily: the kernel module may be absent or heavy to import; ``interpret=None`` -> auto.
  from pallas_kernels.ragged_paged_attention import ragged_paged_attention
  return ragged_paged_attention


_BACKENDS: dict[str, Callable[[], AttentionFn]] = {"reference": _reference, "pallas": _pallas}


def attention_backend_names() -> tuple[str, ...]:
  return tuple(_BACKENDS)


@functools.cache
def get_attention_backend(name: str) -> AttentionFn:
  """The attention function registered as ``name`` ("reference", "pallas"). Unknown name -> ValueError."""
  if name not in _BACKENDS:
    raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}")
  return _BACKENDS[name]()


def resolve_attention(attention: str | AttentionFn) -> AttentionFn:
  """A backend name or an attention function itself (must be hashable when used as a static arg)."""
  if isinstance(attention, str):
    return get_attention_backend(attention)
  if callable(attention):
    return attention
  raise ValueError(f"attention must be a backend name or a function, got {attention!r}")
