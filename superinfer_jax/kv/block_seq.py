"""Per-request block columns shared by the block manager's modules.

``SeqBlocks`` holds one request's logical blocks as parallel columns; ``NO_BLOCK`` marks a logical block without
a host copy. Pure Python, no JAX.
"""
from __future__ import annotations

from array import array
from typing import Hashable

from superinfer_jax.kv.pairs import DEV_IDS, HOST_IDS

NO_BLOCK = -1
_NO_BLOCKS = array(HOST_IDS, [NO_BLOCK]) * 4096  # slices of it fill host tables (no host copy) in bulk


def no_block_ids(n: int) -> array:
  """``n`` NO_BLOCK host ids as a host-id array."""
  return _NO_BLOCKS[:n] if n <= len(_NO_BLOCKS) else array(HOST_IDS, [NO_BLOCK]) * n

ReqId = Hashable


def extend_column(col, pieces: list, typecode: str) -> None:
  """Appends the id arrays ``pieces`` (of ``typecode``) to ``col`` in order: one copy into an ``array`` column of
  the same typecode, else one ``+=`` per piece (a list column; another array type raises as ``+=`` does)."""
  if type(col) is array and col.typecode == typecode:
    if pieces:
      col.frombytes(b"".join(pieces))
  else:
    for p in pieces:
      col += p


class SeqBlocks:
  """One request's logical blocks (parallel columns, indexed by logical block; ``dev`` is empty while the
  request is swapped out, so ``len(host)`` is the block count in both states)."""
  __slots__ = ("dev", "host", "host_tokens", "num_tokens", "num_computed", "on_host", "nwb", "nhost")

  def __init__(self):
    self.dev = array(DEV_IDS)  # device block ids
    self.host = array(HOST_IDS)  # host block ids (NO_BLOCK where none)
    self.host_tokens: list[int] = []
    self.num_tokens = 0
    self.num_computed = 0
    self.on_host = False
    self.nwb = 0  # entries of this request in the write-back queue
    self.nhost = 0  # host ids in ``host`` (not NO_BLOCK); avoids scanning ``host`` on the hot paths


