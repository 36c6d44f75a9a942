"""Eager write-back (docs/paper.md §4.4): the write-back queue and the functions that fill and drain it.

``WriteBackQueue`` holds ``(req_id, logical block)`` keys of full, computed blocks of resident requests whose
host copy is missing or stale, oldest first (insertion order). Invariant (the *write-back queue invariant*): a
key is queued iff its block is full, computed and dirty; ``SeqBlocks.nwb`` counts a request's keys. This module
is the only writer of the queue and of ``nwb``.

``take_writebacks`` drains the queue into D2H pairs, taking host blocks from the host ``BlockPool``;
``drop_host_mirrors`` releases a resident request's host copies and queues its full blocks again. Both are
plain functions over the queue, the per-request columns (``kv/block_seq.py``) and the host pool; they return
how the number of host mirrors changed instead of keeping that count (the block manager does). They never
touch KV data, only return copy lists.
"""
from __future__ import annotations

from array import array

from superinfer_jax.kv.block_pool import BlockPool
from superinfer_jax.kv.block_seq import NO_BLOCK, ReqId, SeqBlocks, no_block_ids
from superinfer_jax.kv.pairs import HOST_IDS, PairList


class WriteBackQueue:
  """The eager write-back queue (see the module docstring). Iterates its keys oldest first.

  Attributes:
    entries: ``dict`` of ``(req_id, logical block) -> None``, insertion-ordered; read-only outside this module.
  """
  __slots__ = ("entries",)

  def __init__(self):
    self.entries: dict[tuple[ReqId, int], None] = {}

  def __len__(self) -> int:
    return len(self.entries)

  def __contains__(self, key: tuple[ReqId, int]) -> bool:
    return key in self.entries

  def __iter__(self):
    return iter(self.entries)

  def queue_filled(self, req_id: ReqId, s: SeqBlocks, first: int, end: int, block_size: int) -> None:
    """Logical blocks ``first..end-1`` of resident ``s`` just became full and computed: queues the dirty ones
    (host copy holding fewer than ``block_size`` tokens), in block order."""
    ht = s.host_tokens
    entries = self.entries
    for i in range(first, end):
      if ht[i] < block_size:
        entries[(req_id, i)] = None
        s.nwb += 1

  def remove(self, req_id: ReqId, s: SeqBlocks, i: int) -> None:
    """Unqueues block ``i`` of ``s`` (it is queued; its host copy is about to be made clean)."""
    del self.entries[(req_id, i)]
    s.nwb -= 1

  def drop(self, req_id: ReqId, s: SeqBlocks) -> None:
    """Unqueues every block of ``s`` (swap-out, free)."""
    if not s.nwb:
      return
    entries = self.entries
    for i in range(len(s.host) - 1, -1, -1):  # queued blocks are usually the most recently filled ones
      if entries.pop((req_id, i), 0) is None:
        s.nwb -= 1
        if not s.nwb:
          break


def take_writebacks(queue: WriteBackQueue, seqs: dict, host: BlockPool, block_size: int,
                    max_blocks: int | None, min_free_host: int) -> tuple[PairList, int]:
  """``BlockManager.take_writebacks``: D2H pairs for queued blocks, oldest first; marks them clean.

  Returns ``(pairs, taken)``: ``taken`` host blocks came off ``host``'s free queue (fresh host copies, now
  mirrors of resident requests). Stops at ``max_blocks`` pairs, or where taking another host block would
  leave fewer than ``min_free_host`` free; the rest stay queued.
  """
  srcs: list[int] = []
  dsts: list[int] = []
  out = PairList.from_columns(srcs, dsts)
  wb = queue.entries
  if not wb:
    return out, 0
  bs = block_size
  limit = len(wb) if max_blocks is None else max_blocks
  if limit <= 0:
    return out, 0
  # Host blocks are read from the free queue's head in order and consumed at the end (BlockPool's contract).
  hfree = host.ids
  head = host.head
  avail = len(hfree) - head - min_free_host  # host blocks this call may take
  taken = 0
  done = []
  for key in wb:  # oldest first; entries are deleted after the loop
    req_id, i = key
    s = seqs[req_id]
    h = s.host[i]
    if h == NO_BLOCK:
      if taken >= avail:
        break
      h = s.host[i] = hfree[head + taken]
      s.nhost += 1
      taken += 1
    done.append(key)
    s.nwb -= 1
    s.host_tokens[i] = bs
    srcs.append(s.dev[i])
    dsts.append(h)
    if len(done) >= limit:
      break
  for key in done:
    del wb[key]
  if taken:
    host.consume(taken)
  return out, taken


def drop_host_mirrors(queue: WriteBackQueue, req_id: ReqId, s: SeqBlocks, host: BlockPool,
                      block_size: int) -> int:
  """``BlockManager.drop_host_mirrors`` for resident ``s``: releases its host copies to ``host`` (in logical
  block order) and queues every full computed block, now dirty; returns the host blocks released."""
  if not s.nhost:
    return 0
  ids = s.host
  n = len(ids)
  released = s.nhost
  host.release(ids if released == n else array(HOST_IDS, [h for h in ids if h != NO_BLOCK]))
  ids[:] = no_block_ids(n)
  s.host_tokens[:] = [0] * n
  s.nhost = 0
  # Blocks already queued keep their place (dict.update does not move existing keys); new ones are appended in
  # block order.
  wb = queue.entries
  queued = len(wb)
  wb.update(dict.fromkeys([(req_id, i) for i in range(s.num_computed // block_size)]))
  s.nwb += len(wb) - queued
  return released


def take_writebacks_shared(queue: WriteBackQueue, seqs: dict, host: BlockPool, block_size: int,
                           max_blocks: int | None, min_free_host: int, host_published: list) -> tuple[PairList, int]:
  """``take_writebacks`` when the host pool has published or shared blocks: the same order and limits, with
  two differences. A queued block whose content hash is published on host already (another request's copy,
  or an evictable one) shares that copy: it is clean at once, with no pair. And each host copy made for a
  block with a content hash is recorded in ``host_published``, runs of consecutive blocks of one request as one
  entry ``(req_id, hashes, first logical block, host ids)`` (published a step later: ordering). Fresh host blocks
  come off the free queue's head, then through ``host.take`` (evicting the oldest evictable copies) once it runs
  dry. Returns ``(pairs, mirrors)``: the host
  blocks that became mirrors."""
  srcs: list[int] = []
  dsts: list[int] = []
  out = PairList.from_columns(srcs, dsts)
  wb = queue.entries
  limit = len(wb) if max_blocks is None else max_blocks
  if not wb or limit <= 0:
    return out, 0
  bs = block_size
  avail = host.num_free - min_free_host
  lookup_at = host.lookup_at
  look_s = None  # the request whose chain's lookups miss from miss_from on (-1: look each up)
  miss_from = -1
  run_s = None  # the request of the run of host copies host_published's last entry records
  run_hosts = None
  run_end = 0
  mirrors = 0
  done = []
  # Fresh host blocks are read off the free queue's head and consumed at the end (BlockPool's contract; a host
  # pool never parks, so its queue has no holes); only when the queue runs dry does ``take`` evict.
  hfree = host.ids
  hpos = host.head
  for key in wb:
    req_id, i = key
    s = seqs[req_id]
    h = s.host[i]
    hashed = i < s.nhashes  # (the hashes tuple itself is read only when needed: it is cold)
    shared = None
    if hashed and h == NO_BLOCK:
      hashes = s.hashes
      if s is not look_s:
        look_s = s
        miss_from = host.unindexed_end(hashes)
      if miss_from < 0 or i < miss_from:
        shared = lookup_at(hashes, i)
        miss_from = -1  # (it may have indexed the chain: look up from now on)
    if shared is not None:
      if host.is_evictable(shared):
        if avail <= 0:
          break
        avail -= 1
      host.share(shared)
      s.host[i] = shared
      s.nhost += 1
      mirrors += 1
    else:
      if h == NO_BLOCK:
        if avail <= 0:
          break
        avail -= 1
        if hpos < len(hfree):
          h = hfree[hpos]
          hpos += 1
        else:
          host.consume(hpos - host.head)
          h = host.take(1)[0]  # evicts
          hpos = host.head
        s.host[i] = h
        s.nhost += 1
        mirrors += 1
      srcs.append(s.dev[i])
      dsts.append(h)
      if hashed:
        if s is run_s and i == run_end:
          run_hosts.append(h)
        else:
          run_s = s
          run_hosts = array(HOST_IDS, (h,))
          host_published.append((req_id, s.hashes, i, run_hosts))
        run_end = i + 1
    done.append(key)
    s.nwb -= 1
    s.host_tokens[i] = bs
    if len(srcs) >= limit:
      break
  host.consume(hpos - host.head)
  for key in done:
    del wb[key]
  return out, mirrors
