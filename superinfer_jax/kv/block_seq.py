"""Per-request block columns (``SeqBlocks``) and the reads over them that the block manager's modules share.

A request's logical block ``i`` holds tokens ``[i * block_size, (i + 1) * block_size)``; ``SeqBlocks`` keeps its
logical blocks as parallel columns (device id, host id, tokens the host copy holds) plus its token counts. The
meaning of every field, and the resident / swapped and clean / dirty rules, are stated in
``kv/block_manager.py``'s docstring. Who writes what: ``nwb`` only ``kv/writeback.py`` (the write-back queue's
per-request count); the other fields the block manager's mutations (``block_manager.py``, ``swap.py``,
``writeback.py``), each keeping the invariants ``kv/invariants.py`` checks. The functions here only read.
``NO_BLOCK`` marks a logical block without a host copy. Pure Python, no JAX.
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
  __slots__ = ("dev", "host", "host_tokens", "num_tokens", "num_computed", "on_host", "nwb", "nhost", "hashes",
               "nhashes", "park_start", "park_end", "pub_end", "run")

  def __init__(self):
    self.dev = array(DEV_IDS)  # device block ids
    self.host = array(HOST_IDS)  # host block ids (NO_BLOCK where none)
    self.host_tokens: list[int] = []
    self.num_tokens = 0
    self.num_computed = 0
    self.on_host = False
    self.nwb = 0  # entries of this request in the write-back queue
    self.nhost = 0  # host ids in ``host`` (not NO_BLOCK); avoids scanning ``host`` on the hot paths
    # Content hashes of its full prompt blocks (``kv/prefix_hash.py``), or None: the request takes no part in
    # prefix caching (nothing of it is published, looked up or re-adopted). Chained: equal hashes at index i mean
    # equal blocks 0..i (shared runs are found by their last block's hash alone, ``kv/shared_run.py``).
    self.hashes: tuple | None = None
    self.nhashes = -1  # len(hashes), -1 when None: the hot paths test it without reading the (cold) tuple
    # Swapped out with prefix caching (kv/swap.py): its first logical block parked, and where its parked group
    # (``park_count`` blocks) ends on the device free queue (``BlockPool.park``); stale while resident.
    self.park_start = 0
    self.park_end = 0
    # Prefix caching: a bound on its published device blocks. Resident: no device block it owns at a logical index
    # >= pub_end is published. Swapped out: its parked group's blocks before pub_end were parked hidden (a new
    # generation: ``BlockPool.park_many``'s ``hidden``), those from there on were not and are unpublished. Raised
    # when its blocks are published or it takes published ones; lowered by a swap-in to what it re-adopts.
    self.pub_end = 0
    # Prefix caching: the ``SharedRun`` (kv/shared_run.py) whose blocks are its first logical blocks, held for it
    # and the run's other members (it does not own them itself), or None. Always None while swapped out.
    self.run = None

  @property
  def park_count(self) -> int:
    """Blocks of its parked group: its logical blocks from ``park_start`` on (a swapped-out request has one per
    computed block, and each of them from ``park_start`` on was parked). Stale while resident."""
    return len(self.host) - self.park_start


def computed_in_block(s: SeqBlocks, i: int, block_size: int) -> int:
  """Computed tokens that logical block ``i`` of ``s`` holds (0..block_size)."""
  c = s.num_computed - i * block_size
  return 0 if c <= 0 else (block_size if c >= block_size else c)


def dirty_blocks(s: SeqBlocks, block_size: int) -> list[int]:
  """Logical blocks of ``s`` holding computed tokens that their host copy lacks, in order (KV is append-only,
  so a full block is dirty iff its host copy holds fewer than block_size tokens)."""
  bs = block_size
  nfull = s.num_computed // bs
  ht = s.host_tokens
  nclean = ht[:nfull].count(bs)
  if nclean == nfull:
    out = []
  elif nclean == 0:  # e.g. after drop_host_mirrors: every full block is dirty
    out = list(range(nfull))
  else:
    out = [i for i in range(nfull) if ht[i] < bs]
  tail = s.num_computed - nfull * bs
  if tail and ht[nfull] < tail:
    out.append(nfull)
  return out

