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

Cached blocks (prefix caching). A block may be *published* under a content hash (``publish``): ``index`` maps
the hash to the block and ``hash_of`` the block to its hash; ``lookup(hash)`` finds it. Publishing never
changes ownership. When its last owner releases a published block it goes to ``evictable`` (an LRU, oldest
first) instead of the free queue: it stays findable, and ``share`` re-adopts it with its KV intact.

Parked blocks (rotation). ``park(key, ids)`` sets aside blocks their one owner gave up (a rotated-out
request's own, never-published blocks) as one group under ``key``; ``unpark(key)`` hands back what is left of
the group, in the order parked, with its KV intact. Groups are oldest first in ``parked``.

Evictable and parked blocks count as free (``num_free``). A ``take`` that the free queue cannot serve evicts
first parked blocks (the oldest group first, from its tail), then the oldest evictable blocks (unpublishing
them), into the free queue: blocks that were never published or parked are reused first. ``evictions``
counts evicted published blocks, ``parked_evictions`` parked ones.

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
    parked: key -> its group of parked blocks (an ``array``), oldest group first (``OrderedDict``).
    num_parked: blocks in ``parked``; parked_evictions: parked blocks evicted so far.
  """
  __slots__ = ("first_id", "num_blocks", "ids", "head", "index", "hash_of", "evictable", "refs", "evictions",
               "parked", "num_parked", "parked_evictions")

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
    self.parked: collections.OrderedDict[Hashable, array] = collections.OrderedDict()
    self.num_parked = 0
    self.parked_evictions = 0

  @property
  def num_free(self) -> int:
    """Blocks a ``take`` can hand out: the free queue plus the evictable and parked blocks."""
    return len(self.ids) - self.head + len(self.evictable) + self.num_parked

  @property
  def shared(self) -> bool:
    """Some block is published, parked or has more than one owner (the direct ``ids`` paths are off)."""
    return bool(self.hash_of) or bool(self.refs) or bool(self.num_parked)

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
      if n < 0 or end > len(ids) + len(self.evictable) + self.num_parked:
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
    self.share_many((block,))

  def share_many(self, blocks) -> None:
    """``share`` for each of ``blocks`` (published, distinct)."""
    evictable = self.evictable
    refs = self.refs
    for b in blocks:
      if b in evictable:
        del evictable[b]
      else:
        refs[b] = refs.get(b, 0) + 1

  def is_evictable(self, block: int) -> bool:
    return block in self.evictable

  def park(self, key: Hashable, ids: array) -> None:
    """Sets aside ``ids`` (an ``array`` of the pool's typecode, taken over), blocks their one owner gave up and
    nobody else owns or finds, as the group ``key`` (module docstring). ``key`` must not be parked already."""
    if key in self.parked:
      raise ValueError(f"park: {key!r} is parked already")
    if ids:
      self.parked[key] = ids
      self.num_parked += len(ids)

  def parked_count(self, key: Hashable) -> int:
    """Blocks of group ``key`` still parked (0 if none)."""
    g = self.parked.get(key)
    return 0 if g is None else len(g)

  def unpark(self, key: Hashable) -> array:
    """What is left of group ``key`` (a prefix of the ids parked, in order; evictions take its tail), now
    owned by the caller again; an empty array if nothing is left."""
    g = self.parked.pop(key, None)
    if g is None:
      return array(self.ids.typecode)
    self.num_parked -= len(g)
    return g

  def drop_parked(self, key: Hashable) -> None:
    """Frees what is left of group ``key`` (to the free queue's tail)."""
    self.ids += self.unpark(key)

  def owners(self, block: int) -> int:
    """Owners of a block known to be owned (1 + ``refs``)."""
    return 1 + self.refs.get(block, 0)

  def _evict(self, n: int) -> None:
    """Moves ``n`` blocks to the free queue's tail: parked ones first (oldest group, from its tail), then the
    oldest evictable ones, unpublished."""
    free = self.ids
    parked = self.parked
    while n and parked:
      key, g = next(iter(parked.items()))
      k = n if n < len(g) else len(g)
      free += g[len(g) - k:][::-1]
      del g[len(g) - k:]
      if not g:
        del parked[key]
      self.num_parked -= k
      self.parked_evictions += k
      n -= k
    if not n:
      return
    evictable = self.evictable
    hash_of = self.hash_of
    index = self.index
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
    evictable block unpublished or on the free queue, extra owners of a free block, a parked block also
    free, evictable, published or shared, ``num_parked`` off). O(num_blocks); for tests and debug."""
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
    parked = [b for g in self.parked.values() for b in g]
    assert len(parked) == self.num_parked, f"num_parked {self.num_parked} != {len(parked)}"
    assert len(set(parked)) == len(parked), "a block parked twice"
    for b in parked:
      assert b not in fset and b not in self.evictable, f"parked block {b} is also free or evictable"
      assert b not in self.hash_of and b not in self.refs, f"parked block {b} is published or shared"
    lo, hi = self.first_id, self.first_id + self.num_blocks
    bad = [b for b in free if not lo <= b < hi]
    assert not bad, f"free queue holds ids {bad[:8]} outside [{lo}, {hi})"
