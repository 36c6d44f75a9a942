"""Content hashes of full KV blocks, chained: equal hashes mean equal KV (same model, same tokens, same prefix).

``block_hashes(token_ids, block_size, extra_key)`` returns one hash per FULL block of ``token_ids`` (a partial
last block gets none): block ``i``'s hash digests the parent block's hash (the root for block 0), the block's
token ids and, through the root, ``extra_key``. So two prompts share block ``i``'s hash exactly when their
tokens ``[0, (i + 1) * block_size)`` and their extra keys are equal. ``extra_key`` carries what else decides the
KV: the model's identity and a request's optional ``cache_salt`` (``extra_key_of``), so requests of different
salts never share a block. ``chain_hashes(contents, extra_key)`` is the same chain over given per-block contents
(a trace's recorded block ids, ``workload/reuse.py``).

Hashes are 128-bit BLAKE2b digests as Python ints: collisions are out of reach even for a client who picks
prompts to collide (a 64-bit or Python ``hash`` chain would not be: two salted users must never share KV).
Deterministic across processes. Pure Python, no JAX.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Iterable, Sequence

_DIGEST_BYTES = 16


def extra_key_of(model_id: str, cache_salt: str | None = None) -> bytes:
  """The extra key of a request: the model's identity and its cache salt (None: no salt), as bytes."""
  salt = b"" if cache_salt is None else b"salt:" + cache_salt.encode()
  return b"model:" + model_id.encode() + b"\0" + salt


def _root(extra_key: bytes) -> bytes:
  return hashlib.blake2b(b"root\0" + extra_key, digest_size=_DIGEST_BYTES).digest()


def chain_hashes(contents: Iterable[bytes], extra_key: bytes = b"") -> tuple[int, ...]:
  """One hash per item of ``contents`` (each a block's content as bytes), chained from ``extra_key``'s root."""
  parent = _root(extra_key)
  out = []
  for c in contents:
    parent = hashlib.blake2b(parent + c, digest_size=_DIGEST_BYTES).digest()
    out.append(int.from_bytes(parent, "little"))
  return tuple(out)


def block_hashes(token_ids: Sequence[int], block_size: int, extra_key: bytes = b"") -> tuple[int, ...]:
  """Chained hashes of the ``len(token_ids) // block_size`` full blocks of ``token_ids`` (module docstring)."""
  if block_size < 1:
    raise ValueError(f"block_size must be >= 1, got {block_size}")
  ids = array("q", token_ids)
  n = len(ids) // block_size
  step = block_size * ids.itemsize
  raw = ids.tobytes()
  return chain_hashes((raw[i * step:(i + 1) * step] for i in range(n)), extra_key)


def id_block_hashes(block_ids: Iterable[int], extra_key: bytes = b"") -> tuple[int, ...]:
  """Chained hashes over recorded per-block ids (unsigned 64-bit), one per id."""
  return chain_hashes((int(b).to_bytes(8, "little", signed=False) for b in block_ids), extra_key)
