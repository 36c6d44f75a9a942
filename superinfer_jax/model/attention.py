"""Attention-backend registry: name -> function with the ``pallas_kernels.reference`` contract.

Every backend has the signature
``attn(q[T,Hq,D], kv_cache[NB,L,2,BS,Hkv,D], layer, block_tables[S,MB], context_lens[S],
query_start_loc[S+1], *, scale) -> [T,Hq,D]`` and reads K/V that the model has already written.
Backends are looked up by name so the name (a string) can be a static jit argument: ``reference`` (pure JAX,
``pallas_kernels/reference.py``), and ``pallas`` (``pallas_kernels/ragged_paged_attention.py``; on CPU only in
interpret mode, correct but slow). ``"auto"`` is the default everywhere: ``pallas`` on a GPU, ``reference``
elsewhere.
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


AUTO = "auto"


def attention_backend_names() -> tuple[str, ...]:
  return (AUTO,) + tuple(_BACKENDS)


def default_backend_name() -> str:
  """What ``"auto"`` means on this process's default JAX backend: ``pallas`` on a GPU, else ``reference``."""
  import jax  # pylint: disable=import-outside-toplevel
  return "pallas" if jax.default_backend() in ("gpu", "cuda", "rocm") else "reference"


def resolved_attention_name(name: str) -> str:
  """The registered backend ``name`` stands for here (``"auto"`` resolved; other names unchanged)."""
  return default_backend_name() if name == AUTO else name


@functools.cache
def get_attention_backend(name: str) -> AttentionFn:
  """The attention function registered as ``name`` ("auto", "reference", "pallas"). Unknown ->
  ValueError."""
  name = resolved_attention_name(name)
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
