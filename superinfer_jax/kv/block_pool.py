"""``BlockPool``: one tier's blocks (device or host) and its FIFO free queue.

What goes in: the tier's id range (``first_id .. first_id + num_blocks - 1``) and the id typecode. What comes out:
block ids, ``take(n)`` from the head of the free queue (all ``n`` or, when fewer are free, None and no change) and
``release(ids)`` to its tail, in order. The device pool is ``BlockPool(1, num_device_blocks, DEV_IDS)``
(``PADDING_BLOCK``, 0, is outside its range and so never handed out: ``kv/layout.py``); the host pool is
``BlockPool(0, num_host_blocks, HOST_IDS)``.

Ownership rule: a block off the free queue is owned by one or more slots: a (request, logical block) of the block
manager's per-request columns (``kv/block_seq.py``), or a shared run held for several requests (``kv/shared_run.py``:
one slot however many requests hold it). One owner is the common case and costs nothing: the count is implicit. A block
with more owners (prefix caching shares full blocks of equal content) has its extra owners in ``refs``. A block is never
free while any slot owns it, and its KV is never written while more than one slot owns it (only full blocks are shared,
and KV is append-only).

Cached blocks (prefix caching). A block may be *published* under a content hash (``publish``): ``index`` maps
the hash to the block and ``hash_of`` the block to its hash; ``lookup(hash)`` finds it. Publishing never
changes ownership. When its last owner releases a published block it goes to ``evictable`` (an LRU, oldest
first) instead of the free queue: it stays findable, and ``share`` re-adopts it with its KV intact.

Parked blocks (rotation). ``park(ids)`` puts blocks their one owner gave up (a rotated-out request's blocks
nobody else owns, in logical order) on the free queue's tail, last block first, and returns where the group
ends: the group is its absolute queue positions, ``(end, count)``, which the owner keeps (the pool keeps no
record of it). Parked blocks count as free and a ``take`` reuses them in queue order (so the group's tail first)
with no work of its own. ``untaken(end, count)`` is what the queue has not handed out yet (the positions past its
head), and ``unpark(end, count)`` takes it back (a leading part of ``ids``, in order, with its KV intact), leaving
a hole in the queue (``tombs``: absolute position ranges a take skips). A group the queue has passed needs
nothing done: its owner finds nothing left.

Unindexed chains. Keys are chained content hashes (``kv/prefix_hash.py``): a key names its whole prefix, so a
lookup always names a chain (its hashes from the root, ``hashes[0]``). ``publish_chain(blocks, hashes, start,
owner)`` publishes blocks ``start ..`` of a chain without index entries while ``owner`` is the only one publishing
under that root, in increasing positions, and no lookup has reached them: the publication is kept in ``pending``
(root -> ``_Chain``). ``lookup_chain`` / ``lookup_at`` / ``published_run`` index a chain (``index_chain``) before
they read a position it covers, and so does a publish under its root by another owner or at an earlier position;
the root is then in ``eager_roots`` and publishes under it go to the index. A chain's block keeps its entry while
``pubser[b]`` is that publication's serial and it was not unpublished since (``pubgen`` without the high bit): the
entry an index would hold, stale ones included. ``lazy_entries`` counts those entries, ``index_entries`` the
others. ``lookup`` / ``lookup_many`` / ``publish`` / ``publish_many`` name no chain: lookups scan the chains (tests
and debug), publishes index everything from then on (``index_all``). Every result equals the eager index's.

Validity (why parking costs no per-block Python). Parking and taking never touch ``index`` / ``hash_of``. A block is
published iff it was published in its current generation: ``pubgen[b] == gen[b]`` (``pubgen`` is moved out of reach,
``UNPUBLISHED`` away, when its entries go: eviction, or another block taking its key while it was hidden). Parking a
block advances its generation and unparking moves it back (a group's part its owner knows holds no published block
skips both: ``park_many``'s ``hidden``), so a parked block is never found, what its owner takes back is found
again, and a block the queue hands out while parked never is under its old key (its new owners may park and unpark
it, but its generation never returns to the one it was published in; ``publish`` starts anew).
Generations move in batches: ``park`` / ``unpark`` queue the ids, and the next read applies them with one numpy
operation (before anything can find a block or a take hands one out; a swap-in batch looks up before it unparks).
``num_published`` counts the published blocks (again, in one numpy pass, after generations moved).

Evictable blocks count as free (``num_free``). A ``take`` that the free queue cannot serve evicts the oldest
evictable blocks (unpublishing them) into the free queue: blocks that were never published are reused first.
``evictions`` counts evicted published blocks.

The free queue is FIFO: ``release`` appends to the tail, ``take`` pops the head, so the ids handed out depend
only on the sequence of takes and releases (the scheduler's plan hashes include every id). It is an
``array`` ``ids`` plus a head index ``head``: the live queue is ``ids[head:]``; a take slices it (one
``memcpy``) and advances ``head``; a release is one ``extend``. When the consumed prefix reaches half the array
it is deleted (amortized O(1) per block; the live queue's order never changes).

Public fields (part of the contract): ``ids`` and ``head``, for the rotation hot paths, which move blocks one
request at a time and would otherwise pay a call per request:

* Taking: a caller may read ``ids[head + k]`` for ``k < len(ids) - head`` itself and then remove the ``k`` ids
  it used with one ``consume(k)``; no ``take``, ``release`` or ``consume`` may come in between. Valid while the
  queue has no holes (``ntomb == 0``; a host pool never has any): past the queue's end only ``take`` can evict.
* Releasing: a caller may extend ``ids`` in place with an ``array`` of the pool's typecode (``ids += dev``),
  which is exactly ``release(dev)``, only while ``shared`` is False (nothing published or with extra owners, no
  holes): ``release`` must then sort blocks into the LRU or keep counts.

Nothing outside this module assigns either field or changes ``ids`` otherwise. Never touches KV data.
"""
from __future__ import annotations

import collections
import itertools
from array import array
from typing import Iterable

import numpy as np


# ``release`` of at least this many blocks without extra owners runs in numpy, and ``share_many`` of this many counts
# them first (below it a loop is cheaper).
_BULK = 16

# The key -> block map is split by the key's low bits (keys are ints: content hashes, ``kv/prefix_hash.py``) into
# dicts of about this many entries at most (a power of two of them: ``_num_shards``). Keys churn (a block published
# again drops its old key, an eviction drops one), and CPython rebuilds a dict whenever its deleted slots use up its
# table: one dict of a whole pool's keys would stall one publish O(pool) (into a fresh table the kernel faults in
# page by page); small tables are rebuilt often, each in O(_SHARD_ENTRIES), from memory the allocator reuses.
_SHARD_ENTRIES = 1024


def _num_shards(num_blocks: int) -> int:
  """Index shards for a pool of ``num_blocks`` (a pool has at most one live key per block): a power of two."""
  n = 1
  while n * _SHARD_ENTRIES < num_blocks:
    n += n
  return n


# ``pubgen[b]`` of a block not published: ``gen[b] ^ UNPUBLISHED`` (a generation moves by one per parking or
# unparking, so it never reaches that value).
UNPUBLISHED = 0x80000000


def _untaken(end: int, m: int, head_pos: int) -> int:
  """Of ``m`` blocks parked at the absolute queue positions ``end - m .. end - 1``, those the free queue (its head
  at absolute position ``head_pos``) has not handed out yet: the positions from ``head_pos`` on."""
  left = end - head_pos
  return m if left > m else (left if left > 0 else 0)


class _Chain:
  """An unindexed chain (module docstring): its one publisher (``owner``), the position after the last block it
  published (``end``) and its publications, ``(blocks, hashes, start, serial)`` each (``blocks`` published under
  ``hashes[start:start + len(blocks)]``), in order."""
  __slots__ = ("owner", "end", "records")

  def __init__(self, owner):
    self.owner = owner
    self.end = 0
    self.records: list = []


class BlockPool:
  """One tier's blocks and their FIFO free queue (see the module docstring).

  Attributes:
    first_id: the pool's lowest id.
    num_blocks: the pool's size (every id ``first_id .. first_id + num_blocks - 1``).
    ids: ``array`` of the typecode given; the free queue is ``ids[head:]``, head first, minus the holes
      ``tombs`` (zeros).
    head: index of the free queue's head in ``ids``; base: the absolute position of ``ids[0]`` (positions count
      every id ever released, so a parked group's place survives compaction).
    index: key (an int) -> block, in shards (a list of ``_num_shards(num_blocks)`` dicts: a key's is
      ``index[key & index_mask]``); ``index_entries``: their total size; ``hash_of``: a list by block id, the key of
      its index entry (None iff it has none: an unindexed chain's blocks have none). A block is published (under ``hash_of[b]``, and ``index`` maps that key back to it)
      iff ``pubgen[b] == gen[b]`` (``published``); other entries are stale.
    num_published: blocks published (a property: counted again, one numpy pass, after generations moved).
    pending: root -> ``_Chain``, the unindexed chains, oldest first; lazy_entries: their entries; eager_roots: the
      roots whose chains are indexed; pubser: ``array('Q')`` by block id, the serial of its last publication;
      root_of: by block id, the root of its index entry (to forget roots: ``index_chain``).
    evictable: published blocks nobody owns, oldest first (``OrderedDict`` block -> None).
    refs: block -> owners beyond the first (only blocks with more than one owner).
    evictions: published blocks evicted so far (a ``take`` reused them).
    gen, pubgen: ``array('I')`` by block id: a block's generation, and the one it was last published in.
    tombs: sorted ``[start, end)`` absolute position ranges of unparked blocks still in ``ids`` (zeros);
      ntomb: their total length.
  """
  __slots__ = ("first_id", "num_blocks", "ids", "head", "base", "index", "index_mask", "index_entries", "hash_of",
               "evictable", "refs",
               "evictions", "gen", "pubgen", "tombs", "ntomb", "_num_published",
               "_count_stale",
               "_gen_np", "_pubgen_np",
               "_pending_park", "_pending_unpark",
               "pending", "lazy_entries", "eager_roots", "pubser", "root_of", "_serial", "_untracked")

  def __init__(self, first_id: int, num_blocks: int, typecode: str):
    if num_blocks < 0:
      raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
    self.first_id = first_id
    self.num_blocks = num_blocks
    self.ids = array(typecode, range(first_id, first_id + num_blocks))
    self.head = 0
    self.base = 0
    shards = _num_shards(num_blocks)
    self.index: list[dict[int, int]] = [{} for _ in range(shards)]
    self.index_mask = shards - 1
    self.index_entries = 0
    self.hash_of: list = [None] * (first_id + num_blocks)  # a list, not a dict: churn never resizes it
    self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
    self.refs: dict[int, int] = {}
    self.evictions = 0
    size = first_id + num_blocks
    self.gen = array("I", bytes(4 * size))
    self.pubgen = array("I", [UNPUBLISHED]) * size
    self._gen_np = np.frombuffer(self.gen, np.uint32)  # views: batched updates of the same memory
    self._pubgen_np = np.frombuffer(self.pubgen, np.uint32)
    self._num_published = 0  # exact unless _count_stale (generations moved since it was counted)
    self._count_stale = False
    # Ids (bytes-like, the pool's typecode) parked, their generations not advanced yet, and unparked, their
    # generations not moved back yet.
    self._pending_park: list = []
    self._pending_unpark: list = []
    self.tombs: list[list[int]] = []
    self.ntomb = 0
    self.pending: collections.OrderedDict[int, _Chain] = collections.OrderedDict()
    self.lazy_entries = 0
    self.eager_roots: set[int] = set()
    self.pubser = array("Q", bytes(8 * size))
    self.root_of: list = [None] * size
    self._serial = 0
    self._untracked = False

  @property
  def num_free(self) -> int:
    """Blocks a ``take`` can hand out: the free queue (parked blocks included) plus the evictable blocks."""
    return len(self.ids) - self.head - self.ntomb + len(self.evictable)

  @property
  def shared(self) -> bool:
    """Some block is published or has more than one owner, or the queue has holes (the direct ``ids`` paths are
    off)."""
    return bool(self.index_entries or self.lazy_entries) or bool(self.refs) or bool(self.ntomb)

  def usage(self) -> float:
    """Used fraction in [0, 1]; an empty pool counts as full (1.0)."""
    if not self.num_blocks:
      return 1.0
    return 1.0 - self.num_free / self.num_blocks

  def take(self, n: int) -> array | None:
    """Pops the ``n`` head ids of the free queue (a fresh array, head first), skipping holes; None, changing
    nothing, if fewer than ``n`` are free (so a caller checks and takes with one call)."""
    ids = self.ids
    head = self.head
    if n < 0 or n > len(ids) - head - self.ntomb + len(self.evictable):
      return None
    if self._pending_park:  # parked blocks change generation before they can change hands (and park again)
      self._apply_generations()
    short = n - (len(ids) - head - self.ntomb)
    if short > 0:
      self._evict(short)
    if self.ntomb:
      out = self._take_around_holes(n)
    else:
      end = head + n
      out = ids[head:end]
      self.head = end
    end = self.head
    if end + end >= len(ids):  # the consumed prefix is at least half: compact
      del ids[:end]
      self.base += end
      self.head = 0
    return out

  def _take_around_holes(self, n: int) -> array:
    """``take``'s gather when the queue has holes: the next ``n`` ids past ``head`` that are not in ``tombs``
    (the holes it passes, and one right after its last id, are dropped from ``tombs``)."""
    ids = self.ids
    tombs = self.tombs
    base = self.base
    out = array(ids.typecode)
    head = self.head
    j = 0
    nt = len(tombs)
    skipped = 0
    while True:
      if j < nt and tombs[j][0] <= base + head:  # a hole at the head: skip it
        t0, t1 = tombs[j]
        skipped += t1 - t0
        head = t1 - base
        j += 1
        continue
      if not n:
        break
      stop = head + n if j == nt else min(head + n, tombs[j][0] - base)
      out += ids[head:stop]
      n -= stop - head
      head = stop
    del tombs[:j]
    self.ntomb -= skipped
    self.head = head
    return out

  def consume(self, n: int) -> None:
    """Removes the ``n`` head ids of the free queue, which the caller has read from ``ids[head:head + n]``
    itself: ``take`` with its result discarded (one definition of taking). Raises ValueError, changing nothing,
    if fewer than ``n`` are free."""
    if self.take(n) is None:
      raise ValueError(f"consume {n} blocks: {self.num_free} free")

  def release(self, ids: Iterable[int]) -> None:
    """Gives up one owner of each of ``ids``, in order. A block left without owners goes to the free queue's
    tail, or, when published, to the tail of ``evictable`` (so a caller releasing a request's blocks tail
    first has its tail evicted first). One copy when nothing is shared (an ``array`` of the pool's typecode).
    The caller must own each id (once per occurrence)."""
    if not (self.index_entries or self.lazy_entries or self.refs):
      self.ids += ids if type(ids) is array else array(self.ids.typecode, ids)
      return
    refs = self.refs
    if type(ids) is array and len(ids) >= _BULK and refs.keys().isdisjoint(ids):
      self._release_sole_owned(ids)
      return
    evictable = self.evictable
    free = self.ids
    gen = self.gen
    pubgen = self.pubgen
    queued = self._pending_park or self._pending_unpark
    for b in ids:
      r = refs.get(b)
      if r is not None:
        if r == 1:
          del refs[b]
        else:
          refs[b] = r - 1
        continue
      if queued:  # (applied only once a block without extra owners needs its published state)
        self._apply_generations()
        queued = False
      if pubgen[b] == gen[b]:  # published
        evictable[b] = None
      else:
        free.append(b)

  def _release_sole_owned(self, ids: array) -> None:
    """``release`` of blocks (an ``array`` of the pool's typecode) none of which has extra owners, in bulk: the
    published ones go to the tail of ``evictable`` and the others to the free queue's tail, each in order."""
    if self._pending_park or self._pending_unpark:
      self._apply_generations()
    idx = np.frombuffer(ids, ids.typecode)
    published = self._pubgen_np[idx] == self._gen_np[idx]
    if not published.any():
      self.ids += ids
      return
    self.ids.frombytes(idx[~published].tobytes())
    self.evictable.update(dict.fromkeys(idx[published].tolist()))

  def release_shared_run(self, ids: array, start: int = 0) -> int:
    """Gives up one owner of each block of ``ids`` from ``start`` on that has more than one (a rotated-out request's
    run of blocks others share: they keep them), stopping at the first block with one owner; returns its index
    (``len(ids)`` if none)."""
    refs = self.refs
    k = start
    for b in ids[start:] if start else ids:
      r = refs.get(b)
      if r is None:
        break
      if r == 1:
        del refs[b]
      else:
        refs[b] = r - 1
      k += 1
    return k

  # ------------------------------------------------------------------------------------------ cached blocks
  def lookup(self, key: int) -> int | None:
    """The block published under ``key``, or None. A key of an unindexed chain is found by a scan of the chains
    (tests and debug; the scheduler's paths name the chain: ``lookup_chain``, ``lookup_at``, ``published_run``)."""
    index, mask, gen, pubgen = self._read_state()
    b = index[key & mask].get(key)
    if b is None and self.pending:
      b = self._scan_pending(key)
    if b is None or pubgen[b] != gen[b]:
      return None
    return b

  def lookup_many(self, keys) -> list:
    """``lookup`` of each of ``keys``, in order (a list of blocks or None)."""
    if self.pending:
      return [self.lookup(key) for key in keys]
    return self._lookup_indexed(keys)

  def lookup_chain(self, keys) -> list:
    """``lookup_many`` of a chain's leading keys (``keys[0]`` its root, ``kv/prefix_hash.py``): the chain is indexed
    first if it is not (``index_chain``)."""
    if keys and self.pending and not self._index_covering(keys[0], 0):
      return [None] * len(keys)
    return self._lookup_indexed(keys)

  def _lookup_indexed(self, keys) -> list:
    """``lookup_many`` through the index alone."""
    index, mask, gen, pubgen = self._read_state()
    return [b if (b := index[key & mask].get(key)) is not None and pubgen[b] == gen[b] else None
            for key in keys]

  def _index_covering(self, root, pos: int) -> bool:
    """Readies a lookup of chain ``root``'s position ``pos``: False when it misses with no work (the root's unindexed
    chain ends at or before ``pos``, and an unindexed root has no index entries); else True, the root's unindexed
    chain, if any, indexed first."""
    chain = self.pending.get(root)
    if chain is None:
      return True
    if pos >= chain.end:
      return False
    self.index_chain(root)
    return True

  def lookup_at(self, hashes, i: int) -> int | None:
    """``lookup(hashes[i])`` for a chain ``hashes`` (``hashes[0]`` its root): an unindexed chain of that root that
    covers position ``i`` is indexed first."""
    if self.pending and not self._index_covering(hashes[0], i):
      return None
    key = hashes[i]
    index, mask, gen, pubgen = self._read_state()
    b = index[key & mask].get(key)
    if b is None or pubgen[b] != gen[b]:
      return None
    return b

  def unindexed_end(self, hashes) -> int:
    """Where lookups of chain ``hashes`` (``hashes[0]`` its root) miss with no work until this pool publishes or
    indexes again: from its unindexed chain's end, from 0 if nothing under its root was ever published, else -1
    (only ``lookup_at`` knows)."""
    root = hashes[0]
    chain = self.pending.get(root)
    if chain is not None:
      return chain.end
    return -1 if self._untracked or root in self.eager_roots else 0

  def published_run(self, keys, start: int, stop: int) -> int:
    """The end of the run of published keys of chain ``keys`` (``keys[0]`` its root) from ``start``: the first ``i``
    in ``start .. stop - 1`` such that ``keys[i]`` is not published, else ``max(start, stop)``. An unindexed chain
    of that root that covers ``start`` is indexed first."""
    if start < stop and self.pending and not self._index_covering(keys[0], start):
      return start
    index, mask, gen, pubgen = self._read_state()
    i = start
    while i < stop:
      key = keys[i]
      b = index[key & mask].get(key)
      if b is None or pubgen[b] != gen[b]:
        break
      i += 1
    return i

  def _read_state(self) -> tuple:
    """``(index, index_mask, gen, pubgen)`` for a batch of index reads or writes, the queued generation moves applied
    first (a block is published iff ``pubgen[b] == gen[b]``)."""
    if self._pending_park or self._pending_unpark:
      self._apply_generations()
    return self.index, self.index_mask, self.gen, self.pubgen

  def published(self, block: int) -> bool:
    """``block`` is published (under ``hash_of[block]``, or in an unindexed chain; module docstring)."""
    if self._pending_park or self._pending_unpark:
      self._apply_generations()
    return self.pubgen[block] == self.gen[block]

  @property
  def num_published(self) -> int:
    """Blocks published."""
    if self._pending_park or self._pending_unpark:
      self._apply_generations()
    if self._count_stale:
      self._num_published = int(np.count_nonzero(self._pubgen_np == self._gen_np))
      self._count_stale = False
    return self._num_published

  def published_items(self) -> dict:
    """Every published key -> block, indexed or not (a fresh dict; O(entries): for stats, tests and debug)."""
    out = {k: b for shard in self.index for k, b in shard.items() if self.published(b)}
    for chain in self.pending.values():
      for key, b in self._chain_entries(chain):
        if self.published(b):
          out[key] = b
    return out

  def publish(self, block: int, key: int) -> bool:
    """Makes owned ``block`` findable under ``key``. False (no change) if ``key`` is published already
    (another block has that content) or ``block`` is published under another key. ``key``'s chain is not
    named: it is indexed at once, and so is every chain from then on (tests; the scheduler uses
    ``publish_chain``)."""
    return self.publish_many((block,), (key,)) == 1

  def publish_many(self, blocks, keys) -> int:
    """``publish(block, key)`` for each ``block`` of ``blocks`` and ``key`` of ``keys``, in order; returns how many
    were published. Indexes every chain, now and from then on (as ``publish``)."""
    self.index_all()
    return self._publish_indexed(blocks, keys, None)

  def index_all(self) -> None:
    """Indexes every unindexed chain, and every chain published from then on (the eager index: same results)."""
    if not self._untracked:
      self._untracked = True
      for root in list(self.pending):
        self.index_chain(root)

  def publish_chain(self, blocks, hashes, start: int, owner) -> int:
    """``publish_many(blocks, hashes[start:start + len(blocks)])`` for blocks ``start ..`` of one chain (``hashes``:
    its content hashes from its root, ``hashes[0]``; ``kv/prefix_hash.py``), published by ``owner`` (an object
    compared by identity: the request's columns), in order; returns how many were published. Without an index
    entry while only ``owner`` publishes under that root, in increasing positions, and no lookup has named the
    root (module docstring, "Unindexed chains"); the pool keeps ``blocks`` and ``hashes`` (neither may change).
    Same result either way."""
    n = len(hashes) - start
    if n <= 0:
      return 0
    if n < len(blocks):
      blocks = blocks[:n]
    else:
      n = len(blocks)
    root = hashes[0]
    if self._untracked or root in self.eager_roots:
      return self._publish_indexed(blocks, hashes[start:start + n], root)
    pending = self.pending
    chain = pending.get(root)
    if chain is not None and (chain.owner is not owner or start < chain.end):
      self.index_chain(root)
      return self._publish_indexed(blocks, hashes[start:start + n], root)
    _, _, gen, pubgen = self._read_state()
    hash_of = self.hash_of
    pubser = self.pubser
    serial = self._next_serial()
    skipped = stale = 0  # (the rare cases are counted: most blocks are fresh, published and a new entry each)
    indexed = self.index_entries  # (none: no block has an index entry, hash_of is all None)
    for b in blocks:
      g = gen[b]
      p = pubgen[b]
      if p == g:
        skipped += 1  # published under another key (publish_many's rule)
        continue
      if indexed and hash_of[b] is not None:
        self._drop_entry(b)  # its stale entry of an earlier generation
      elif p < UNPUBLISHED:
        stale += 1  # its stale entry in an unindexed chain, replaced by this one
      pubgen[b] = g
      pubser[b] = serial
    published = n - skipped
    entries = published - stale
    self.lazy_entries += entries
    if published:
      if chain is None:
        if len(pending) > self.num_blocks:
          self._prune_chains()
        chain = pending[root] = _Chain(owner)
      chain.records.append((blocks, hashes, start, serial))
      self._num_published += published
    if chain is not None:
      chain.end = start + n
    return published

  def _publish_indexed(self, blocks, keys, root) -> int:
    """``publish_many``'s rule with index entries (``root``: the keys' chain root, None if unknown)."""
    index, mask, gen, pubgen = self._read_state()
    hash_of = self.hash_of
    root_of = self.root_of
    pubser = self.pubser
    serial = self._next_serial()
    n = 0
    entries = self.index_entries
    for block, key in zip(blocks, keys):
      if pubgen[block] == gen[block]:
        continue  # published under another key
      shard = index[key & mask]
      other = shard.get(key)
      if other is None:
        entries += 1
      elif pubgen[other] == gen[other]:
        continue  # another block has that content
      elif other != block:
        pubgen[other] = gen[other] ^ UNPUBLISHED  # hidden (parked) and superseded: never found under key again
        hash_of[other] = None  # (its entry is the new block's now)
      old = hash_of[block]
      if old is not None and old != key:  # (its own stale entry under key is overwritten below)
        old_shard = index[old & mask]
        if old_shard.get(old) == block:  # a stale entry of an earlier generation
          del old_shard[old]
          entries -= 1
      elif old is None and pubgen[block] < UNPUBLISHED:  # a stale entry in an unindexed chain: gone
        self.lazy_entries -= 1
      shard[key] = block
      hash_of[block] = key
      root_of[block] = root
      pubgen[block] = gen[block]
      pubser[block] = serial
      n += 1
    self.index_entries = entries
    self._num_published += n
    if root is not None:
      self.eager_roots.add(root)
    return n

  def _next_serial(self) -> int:
    """A publication serial no block holds yet (``pubser`` is 64-bit: they never run out)."""
    self._serial += 1
    return self._serial

  def _drop_entry(self, block: int) -> None:
    """Removes ``block``'s index entry (``hash_of[block]``, not None), if the index maps that key to it."""
    key = self.hash_of[block]
    shard = self.index[key & self.index_mask]
    if shard.get(key) == block:
      del shard[key]
      self.index_entries -= 1
    self.hash_of[block] = None

  def index_chain(self, root: int) -> None:
    """Gives the unindexed chain of ``root`` (if any) its index entries: those of its blocks still published, or
    parked hidden, in the publication that put them there; the root is indexed from then on."""
    chain = self.pending.pop(root, None)
    self.eager_roots.add(root)
    if chain is None:
      return
    index, mask, _, _ = self._read_state()
    hash_of = self.hash_of
    root_of = self.root_of
    n = 0
    for key, b in self._chain_entries(chain):
      index[key & mask][key] = b
      hash_of[b] = key
      root_of[b] = root
      n += 1
    self.index_entries += n
    self.lazy_entries -= n
    if len(self.eager_roots) > 2 * self.num_blocks + 64:  # roots whose entries all went: forgotten
      self.eager_roots = {root_of[b] for shard in index for b in shard.values()}
      self.eager_roots.add(root)

  def _chain_entries(self, chain: "_Chain"):
    """``(key, block)`` of each block an unindexed chain still holds: its publication is the one that put it there
    and it was not unpublished since (it may be parked hidden, or handed out while hidden: a stale entry)."""
    pubgen = self.pubgen  # (unpublished: the high bit set; generation moves never change pubgen)
    pubser = self.pubser
    for blocks, hashes, start, serial in chain.records:
      for b, key in zip(blocks, hashes[start:start + len(blocks)]):
        if pubser[b] == serial and pubgen[b] < UNPUBLISHED:
          yield key, b

  def _scan_pending(self, key: int) -> int | None:
    """The block an unindexed chain holds under ``key``, or None (O(unindexed entries))."""
    for chain in self.pending.values():
      for k, b in self._chain_entries(chain):
        if k == key:
          return b
    return None

  def _prune_chains(self) -> None:
    """Drops the unindexed chains among the two oldest that hold nothing any more (``_chain_entries`` empty),
    moving the others to the back. Called once per new chain while there are more than ``num_blocks``, so that at
    most about ``2 * num_blocks`` stay (a live one holds a block: there are at most ``num_blocks`` of those)."""
    pending = self.pending
    for _ in range(2):
      if not pending:
        return
      root, chain = pending.popitem(last=False)
      if next(self._chain_entries(chain), None) is not None:
        pending[root] = chain  # (live: to the back)

  def _apply_generations(self) -> None:
    """Applies the queued generation moves (at most one kind is queued: ``park`` and ``unpark`` apply the other
    first): parked ids advance, unparked ids move back (``np.add.at``: an id queued twice moves twice)."""
    gen = self._gen_np
    for pending, advance in ((self._pending_park, True), (self._pending_unpark, False)):
      if pending:
        idx = np.frombuffer(b"".join(pending), self.ids.typecode)
        pending.clear()
        (np.add if advance else np.subtract).at(gen, idx, np.uint32(1))
        self._count_stale = True

  def share(self, block: int) -> None:
    """Adds an owner to published ``block``: re-adopts it from ``evictable`` (KV intact), or counts one more
    owner of a block in use."""
    self.share_many((block,))

  def share_many(self, blocks) -> None:
    """``share`` for each of ``blocks`` (a sequence of published blocks), in order: a block listed ``m`` times gains
    ``m`` owners (a rotation batch lists a shared prefix's blocks once per request: many are counted first, in C)."""
    evictable = self.evictable
    refs = self.refs
    if len(blocks) < _BULK:
      for b in blocks:
        if b in evictable:
          del evictable[b]
        else:
          refs[b] = refs.get(b, 0) + 1
      return
    for b, m in collections.Counter(blocks).items():
      if b in evictable:
        del evictable[b]
        m -= 1
        if not m:
          continue
      refs[b] = refs.get(b, 0) + m

  def is_evictable(self, block: int) -> bool:
    return block in self.evictable

  @property
  def head_position(self) -> int:
    """The absolute queue position of the free queue's head (positions count every id ever released)."""
    return self.base + self.head

  def park(self, ids: array) -> int:
    """Puts ``ids`` (an ``array`` of the pool's typecode, in logical order), blocks their one owner gave up and
    nobody else owns, on the free queue's tail as one group, last block first (module docstring); they move to
    a new generation (those published are not found while parked). Returns the group's end position: the group
    is ``(end, len(ids))``, which its owner keeps to unpark it."""
    return self.park_many((ids,))[0]

  def park_many(self, groups, hidden=None) -> list[int]:
    """``park`` of each of ``groups``, in order, with one copy onto the queue and one generation update for the
    batch. ``hidden``: leading parts of groups (arrays), each holding every published block of its group; only
    their blocks move to a new generation (None: every group's). A group's blocks outside them must be unpublished
    (nobody can find them then, with no update), and it is unparked with ``hidden`` its part's length. Returns
    their end positions, in order."""
    if self._pending_unpark:
      self._apply_generations()
    free = self.ids
    ends = list(itertools.accumulate(map(len, groups), initial=self.base + len(free)))
    del ends[0]
    joined = b"".join(groups[::-1])
    if joined:
      # Each group last block first, the groups in order: the batch reversed (in numpy: one pass).
      free.frombytes(np.frombuffer(joined, free.typecode)[::-1].tobytes())
      if hidden is None:
        self._pending_park.append(joined)
      elif hidden:
        self._pending_park.append(b"".join(hidden))
    return ends

  def untaken(self, end: int, count: int) -> int:
    """Blocks of the parked group ``(end, count)`` the free queue has not handed out yet (its leading logical
    blocks; 0 once the queue has passed its end)."""
    return _untaken(end, count, self.base + self.head)

  def unpark(self, end: int, count: int) -> array:
    """What is left of the parked group ``(end, count)`` (a leading part of the ids parked, in logical order: the
    queue hands out its tail first), now owned by the caller again (found again if published before parking);
    an empty array if nothing is left. A group is unparked at most once."""
    return self.unpark_many(((end, count),))[0]

  def unpark_many(self, groups, hidden=None) -> list[array]:
    """``unpark(end, count)`` of each of ``groups`` (distinct), in order. Each group's untaken blocks leave a hole
    in the queue (``tombs``; merged with the ones already there in one sort). ``hidden``: per group, how many of its
    leading blocks were parked hidden (``park_many``; None: every one): those of them still untaken move back a
    generation."""
    ids = self.ids
    base = self.base
    pos = base + self.head
    typecode = ids.typecode
    if self._pending_park:  # (parked ids change generation before any moves back)
      self._apply_generations()
    pending = self._pending_unpark
    out = []
    holes = []
    for i, (end, m) in enumerate(groups):
      k = _untaken(end, m, pos)
      if not k:
        out.append(array(typecode))
        continue
      lo = end - k - base
      hi = end - base
      got = ids[lo:hi]
      got.reverse()
      out.append(got)
      ids[lo:hi] = array(typecode, bytes(ids.itemsize * k))  # a hole (zeros): take skips it
      holes.append([lo + base, hi + base])
      if hidden is None:
        pending.append(got[:])  # (a copy: the caller owns got)
      elif hidden[i]:
        pending.append(got[:hidden[i]])
    if holes:
      tombs = self.tombs
      tombs += holes
      tombs.sort()
      self.ntomb += sum([t1 - t0 for t0, t1 in holes])
    return out

  def parked_blocks(self, end: int, count: int) -> array:
    """What ``unpark(end, count)`` would hand back, changing nothing (for checks, tests and debug)."""
    k = _untaken(end, count, self.base + self.head)
    return self.ids[end - k - self.base:end - self.base][::-1]

  def owners(self, block: int) -> int:
    """Owners of a block known to be owned (1 + ``refs``)."""
    return 1 + self.refs.get(block, 0)

  def _evict(self, n: int) -> None:
    """Moves the ``n`` oldest evictable blocks to the free queue's tail, unpublished."""
    evictable = self.evictable
    hash_of = self.hash_of
    index = self.index
    mask = self.index_mask
    free = self.ids
    pubgen = self.pubgen
    gen = self.gen
    entries = 0
    for _ in range(n):
      b = evictable.popitem(last=False)[0]
      key = hash_of[b]
      if key is not None:  # (None: published in an unindexed chain)
        del index[key & mask][key]
        hash_of[b] = None
        entries += 1
      else:
        self.lazy_entries -= 1
      pubgen[b] = gen[b] ^ UNPUBLISHED
      free.append(b)
    self.evictions += n
    self.index_entries -= entries
    self._num_published -= n

  def free_ids(self) -> list[int]:
    """The free queue, head first, without its holes (a copy; for tests and debug)."""
    out = []
    pos = self.head
    for t0, t1 in self.tombs:
      out += self.ids[pos:t0 - self.base].tolist()
      pos = t1 - self.base
    return out + self.ids[pos:].tolist()

  def check(self) -> None:
    """Raises AssertionError if the free queue is malformed (head out of range, an id outside the pool's
    range, an id queued twice, holes that are not zeros past the head) or the cache's maps disagree (an
    ``index`` entry ``hash_of`` does not confirm, a published block whose entries disagree, ``num_published``
    off, an evictable block unpublished or on the free queue, extra
    owners of a free block, a published free block). Parked groups are checked by whoever holds them
    (``kv/invariants.py``). O(num_blocks); for tests and debug."""
    self._apply_generations()
    ids, head, base = self.ids, self.head, self.base
    assert 0 <= head <= len(ids), f"free-queue head {head} of {len(ids)}"
    free = self.free_ids()
    assert len(set(free)) == len(free), "free queue has duplicates"
    lo, hi = self.first_id, self.first_id + self.num_blocks
    bad = [b for b in free if not lo <= b < hi]
    assert not bad, f"free queue holds ids {bad[:8]} outside [{lo}, {hi})"
    mask = self.index_mask
    for i, shard in enumerate(self.index):
      for key, b in shard.items():
        assert key & mask == i, f"key {key!r} in index shard {i}"
        assert self.hash_of[b] == key, f"block {b} indexed under {key!r} but hash_of says {self.hash_of[b]!r}"
    assert self.index_entries == sum(map(len, self.index)), "index_entries differs from the index"
    for b, key in enumerate(self.hash_of):
      assert key is None or self.index[key & mask].get(key) == b, f"block {b}: hash_of {key!r} not its entry"
    if not self._untracked:
      for shard in self.index:
        for b in shard.values():
          assert self.root_of[b] in self.eager_roots, f"block {b} indexed under a root not marked indexed"
    unindexed = {}  # block -> key, held by an unindexed chain
    for root, chain in self.pending.items():
      assert root not in self.eager_roots and not self._untracked, "an unindexed chain of an indexed root"
      for key, b in self._chain_entries(chain):
        assert b not in unindexed, f"block {b} held by two unindexed chains"
        assert self.hash_of[b] is None, f"block {b} of an unindexed chain has an index entry"
        unindexed[b] = key
    lazy = {b for b in range(lo, hi) if self.hash_of[b] is None and self.pubgen[b] < UNPUBLISHED}
    assert lazy == set(unindexed), f"blocks with unindexed entries {sorted(lazy)} != held {sorted(unindexed)}"
    assert self.lazy_entries == len(unindexed), f"lazy_entries {self.lazy_entries} != {len(unindexed)}"
    published = [b for b in range(lo, hi) if self.published(b)]
    assert len(published) == self.num_published, f"num_published {self.num_published} != {len(published)}"
    for b in published:
      key = self.hash_of[b]
      assert b in unindexed or (key is not None and self.index[key & mask].get(key) == b), (
          f"published block {b}: its entries disagree")
    keys = [self.hash_of[b] for b in published if b not in unindexed] + [unindexed[b] for b in published
                                                                        if b in unindexed]
    assert len(set(keys)) == len(keys), "a key published by two blocks"
    end = base + head
    for t0, t1 in self.tombs:
      assert end <= t0 < t1 <= base + len(ids), f"hole [{t0}, {t1}) outside the queue or overlapping"
      assert not any(ids[t0 - base:t1 - base]), f"hole [{t0}, {t1}) holds ids"
      end = t1
    assert self.ntomb == sum(t1 - t0 for t0, t1 in self.tombs), "ntomb differs from the holes"
    fset = set(free)
    for b in self.evictable:
      assert self.published(b), f"evictable block {b} is not published"
      assert b not in fset, f"evictable block {b} is on the free queue"
      assert b not in self.refs, f"evictable block {b} has extra owners"
    for b in fset:
      assert not self.published(b), f"free block {b} is still published"
      assert b not in self.refs, f"free block {b} has extra owners"
    assert all(r >= 1 for r in self.refs.values()), "a refs entry below 1"
