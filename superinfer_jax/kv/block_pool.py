"""``BlockPool``: one tier's blocks (device or host) and its FIFO free queue.

What goes in: the tier's id range (``first_id .. first_id + num_blocks - 1``) and the id typecode. What comes out:
block ids, ``take(n)`` from the head of the free queue (all ``n`` or, when fewer are free, None and no change)
and ``release(ids)`` to its tail, in order. The device
pool is ``BlockPool(1, num_device_blocks, DEV_IDS)`` (``PADDING_BLOCK``, 0, is outside its range and so never
handed out: ``kv/layout.py``); the host pool is ``BlockPool(0, num_host_blocks, HOST_IDS)``.

Ownership rule in force: every block off the free queue has exactly one owner, a (request, logical block) slot
of the block manager's per-request columns (``kv/block_seq.py``). The reference count is therefore implicit, 1
off the free queue and 0 on it, and bulk take and release need no per-block bookkeeping. This class is where
explicit reference counts and the cached-block LRU will live once prefix caching shares blocks between
requests; no other per-block allocation state exists.

The free queue is FIFO: ``release`` appends to the tail, ``take`` pops the head, so the ids handed out depend
only on the sequence of takes and releases (the scheduler's plan hashes include every id). It is an
``array`` ``ids`` plus a head index ``head``: the live queue is ``ids[head:]``; a take slices it (one
``memcpy``) and advances ``head``; a release is one ``extend``. When the consumed prefix reaches half the array
it is deleted (amortized O(1) per block; the live queue's order never changes).

Public fields (part of the contract): ``ids`` and ``head``, for the rotation hot paths, which move blocks one
request at a time and would otherwise pay a call per request:

* Taking: a caller may read ``ids[head + k]`` for ``k < num_free`` itself and then remove the ``k`` ids it used
  with one ``consume(k)``; no ``take``, ``release`` or ``consume`` may come in between.
* Releasing: a caller may extend ``ids`` in place with an ``array`` of the pool's typecode (``ids += dev``),
  which is exactly ``release(dev)``.

Nothing outside this module assigns either field or changes ``ids`` otherwise. Never touches KV data.
"""
from __future__ import annotations

from array import array
from typing import Iterable


class BlockPool:
  """One tier's blocks and their FIFO free queue (see the module docstring).

  Attributes:
    first_id: the pool's lowest id.
    num_blocks: the pool's size (every id ``first_id .. first_id + num_blocks - 1``).
    ids: ``array`` of the typecode given; the free queue is ``ids[head:]``, head first.
    head: index of the free queue's head in ``ids``.
  """
  __slots__ = ("first_id", "num_blocks", "ids", "head")

  def __init__(self, first_id: int, num_blocks: int, typecode: str):
    if num_blocks < 0:
      raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
    self.first_id = first_id
    self.num_blocks = num_blocks
    self.ids = array(typecode, range(first_id, first_id + num_blocks))
    self.head = 0

  @property
  def num_free(self) -> int:
    return len(self.ids) - self.head

  def usage(self) -> float:
    """Used fraction in [0, 1]; an empty pool counts as full (1.0)."""
    if not self.num_blocks:
      return 1.0
    return 1.0 - (len(self.ids) - self.head) / self.num_blocks

  def take(self, n: int) -> array | None:
    """Pops the ``n`` head ids of the free queue (a fresh array, head first); None, changing nothing, if
    fewer than ``n`` are free (so a caller checks and takes with one call)."""
    ids = self.ids
    head = self.head
    end = head + n
    if end > len(ids) or n < 0:
      return None
    out = ids[head:end]
    if end + end >= len(ids):  # the consumed prefix is at least half: compact
      del ids[:end]
      end = 0
    self.head = end
    return out

  def consume(self, n: int) -> None:
    """Removes the ``n`` head ids of the free queue, which the caller has read from ``ids[head:head + n]``
    itself: ``take`` with its result discarded (one definition of taking). Raises ValueError, changing nothing,
    if fewer than ``n`` are free."""
    if self.take(n) is None:
      raise ValueError(f"consume {n} blocks: {len(self.ids) - self.head} free")

  def release(self, ids: Iterable[int]) -> None:
    """Appends ``ids`` to the free queue's tail, in order (an ``array`` of the pool's typecode: one copy).
    The caller gives up ownership; it must not release an id twice or one it does not own."""
    self.ids += ids if type(ids) is array else array(self.ids.typecode, ids)

  def free_ids(self) -> list[int]:
    """The free queue, head first (a copy; for tests and debug)."""
    return self.ids[self.head:].tolist()

  def check(self) -> None:
    """Raises AssertionError if the free queue is malformed: head out of range, an id outside the pool's
    range, or an id queued twice. O(num_blocks); for tests and debug."""
    assert 0 <= self.head <= len(self.ids), f"free-queue head {self.head} of {len(self.ids)}"
    free = self.free_ids()
    assert len(set(free)) == len(free), "free queue has duplicates"
    lo, hi = self.first_id, self.first_id + self.num_blocks
    bad = [b for b in free if not lo <= b < hi]
    assert not bad, f"free queue holds ids {bad[:8]} outside [{lo}, {hi})"
