"""``BlockPool``: one tier's blocks (device or host) and its FIFO free queue.

What goes in: the tier's id range (``first_id .. first_id + num_blocks - 1``) and the id typecode. What comes out:
block ids, ``take(n)`` from the head of the free queue (all ``n`` or, when fewer are free, None and no change)
and ``release(ids)`` to its tail, in order. The device
pool is ``BlockPool(1, num_device_blocks, DEV_IDS)`` (``PADDING_BLOCK``, 0, is outside its range and so never
handed out: ``kv/layout.py``); the host pool is ``BlockPool(0, num_host_blocks, HOST_IDS)``.

Ownership rule: a block off the free queue is owned by one or more (request, logical block) slots of the block
manager's per-request columns (``kv/block_seq.py``). One owner is the common case and costs nothing: the count
is implicit. A block with more owners (prefix caching shares full blocks of equal content) has its extra owners
in ``refs``. A block is never free while any slot owns it, and its KV is never written while more than one slot
owns it (only full blocks are shared, and KV is append-only).

Cached blocks (prefix caching). A block may be *published* under a key (``publish``): ``index`` maps the key to
the block and ``hash_of`` the block to its key; ``lookup(key)`` finds it. Publishing never changes ownership.
When its last owner releases a published block it goes to ``evictable`` (an LRU, oldest first) instead of the
free queue: it stays findable, and ``share`` re-adopts it with its KV intact. It counts as free
(``num_free``): a ``take`` that the free queue cannot serve evicts the oldest evictable blocks (unpublishing
them, counted in ``evictions``) into the free queue, so blocks that were never published are reused first.
``forget(key)`` unpublishes one block (an evictable one goes to the free queue). Keys are hashable values
chosen by the block manager (content hashes of full blocks, or a request's private rotation keys).

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

These direct paths are valid only while ``shared`` is False (nothing published, no extra owners): ``release``
must then run per block and ``take`` may have to evict. Nothing outside this module assigns either field or
changes ``ids`` otherwise. Never touches KV data.
"""
from __future__ import annotations

import collections
from array import array
from typing import Hashable, Iterable


class BlockPool:
  """One tier's blocks and their FIFO free queue (see the module docstring).

  Attributes:
    first_id: the pool's lowest id.
    num_blocks: the pool's size (every id ``first_id .. first_id + num_blocks - 1``).
    ids: ``array`` of the typecode given; the free queue is ``ids[head:]``, head first.
    head: index of the free queue's head in ``ids``.
    index: published key -> block; ``hash_of``: block -> its published key (the inverse).
    evictable: published blocks nobody owns, oldest first (``OrderedDict`` block -> None).
    refs: block -> owners beyond the first (only blocks with more than one owner).
    evictions: published blocks evicted so far (a ``take`` reused them).
  """
  __slots__ = ("first_id", "num_blocks", "ids", "head", "index", "hash_of", "evictable", "refs", "evictions")

  def __init__(self, first_id: int, num_blocks: int, typecode: str):
    if num_blocks < 0:
      raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
    self.first_id = first_id
    self.num_blocks = num_blocks
    self.ids = array(typecode, range(first_id, first_id + num_blocks))
    self.head = 0
    self.index: dict[Hashable, int] = {}
    self.hash_of: dict[int, Hashable] = {}
    self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
    self.refs: dict[int, int] = {}
    self.evictions = 0

  @property
  def num_free(self) -> int:
    """Blocks a ``take`` can hand out: the free queue plus the evictable cached blocks."""
    return len(self.ids) - self.head + len(self.evictable)

  @property
  def shared(self) -> bool:
    """Some block is published or has more than one owner (the direct ``ids`` paths are off)."""
    return bool(self.hash_of) or bool(self.refs)

  def usage(self) -> float:
    """Used fraction in [0, 1]; an empty pool counts as full (1.0)."""
    if not self.num_blocks:
      return 1.0
    return 1.0 - self.num_free / self.num_blocks

  def take(self, n: int) -> array | None:
    """Pops the ``n`` head ids of the free queue (a fresh array, head first); None, changing nothing, if
    fewer than ``n`` are free (so a caller checks and takes with one call)."""
    ids = self.ids
    head = self.head
    end = head + n
    if end > len(ids) or n < 0:
      if n < 0 or end > len(ids) + len(self.evictable):
        return None
      self._evict(end - len(ids))
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
    """Gives up one owner of each of ``ids``, in order. A block left without owners goes to the free queue's
    tail, or, when published, to the tail of ``evictable`` (so a caller releasing a request's blocks tail
    first has its tail evicted first). One copy when nothing is shared (an ``array`` of the pool's typecode).
    The caller must own each id (once per occurrence)."""
    if not (self.hash_of or self.refs):
      self.ids += ids if type(ids) is array else array(self.ids.typecode, ids)
      return
    refs = self.refs
    hash_of = self.hash_of
    evictable = self.evictable
    free = self.ids
    for b in ids:
      r = refs.get(b)
      if r is not None:
        if r == 1:
          del refs[b]
        else:
          refs[b] = r - 1
      elif b in hash_of:
        evictable[b] = None
      else:
        free.append(b)

  # ------------------------------------------------------------------------------------------ cached blocks
  def lookup(self, key: Hashable) -> int | None:
    """The block published under ``key``, or None."""
    return self.index.get(key)

  def publish(self, block: int, key: Hashable) -> bool:
    """Makes owned ``block`` findable under ``key``. False (no change) if ``key`` is published already
    (another block has that content) or ``block`` is published under another key."""
    if key in self.index or block in self.hash_of:
      return False
    self.index[key] = block
    self.hash_of[block] = key
    return True

  def share(self, block: int) -> None:
    """Adds an owner to published ``block``: re-adopts it from ``evictable`` (KV intact), or counts one more
    owner of a block in use."""
    evictable = self.evictable
    if block in evictable:
      del evictable[block]
    else:
      self.refs[block] = self.refs.get(block, 0) + 1

  def is_evictable(self, block: int) -> bool:
    return block in self.evictable

  def forget(self, key: Hashable) -> None:
    """Unpublishes the block under ``key`` (no-op if none); an evictable one goes to the free queue's tail."""
    b = self.index.pop(key, None)
    if b is None:
      return
    del self.hash_of[b]
    if b in self.evictable:
      del self.evictable[b]
      self.ids.append(b)

  def owners(self, block: int) -> int:
    """Owners of a block known to be owned (1 + ``refs``)."""
    return 1 + self.refs.get(block, 0)

  def _evict(self, n: int) -> None:
    """Moves the ``n`` oldest evictable blocks to the free queue's tail, unpublished."""
    evictable = self.evictable
    hash_of = self.hash_of
    index = self.index
    free = self.ids
    for _ in range(n):
      b = evictable.popitem(last=False)[0]
      del index[hash_of.pop(b)]
      free.append(b)
    self.evictions += n

  def free_ids(self) -> list[int]:
    """The free queue, head first (a copy; for tests and debug)."""
    return self.ids[self.head:].tolist()

  def check(self) -> None:
    """Raises AssertionError if the free queue is malformed (head out of range, an id outside the pool's
    range, an id queued twice) or the cache's maps disagree (``index`` / ``hash_of`` not inverse, an
    evictable block unpublished or on the free queue, extra owners of a free block). O(num_blocks); for
    tests and debug."""
    assert 0 <= self.head <= len(self.ids), f"free-queue head {self.head} of {len(self.ids)}"
    free = self.free_ids()
    assert len(set(free)) == len(free), "free queue has duplicates"
    assert len(self.index) == len(self.hash_of), "index and hash_of differ in size"
    for key, b in self.index.items():
      assert self.hash_of.get(b) == key, f"block {b} indexed under {key!r} but hash_of says {self.hash_of.get(b)!r}"
    fset = set(free)
    for b in self.evictable:
      assert b in self.hash_of, f"evictable block {b} is not published"
      assert b not in fset, f"evictable block {b} is on the free queue"
      assert b not in self.refs, f"evictable block {b} has extra owners"
    for b in fset:
      assert b not in self.hash_of, f"free block {b} is still published"
      assert b not in self.refs, f"free block {b} has extra owners"
    assert all(r >= 1 for r in self.refs.values()), "a refs entry below 1"
    lo, hi = self.first_id, self.first_id + self.num_blocks
    bad = [b for b in free if not lo <= b < hi]
    assert not bad, f"free queue holds ids {bad[:8]} outside [{lo}, {hi})"
