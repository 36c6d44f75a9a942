"""Rotation of whole requests between the device and host pools: swap-out and swap-in, as plain functions.

What goes in: the per-request columns (``seqs``: req_id -> ``SeqBlocks``), the device and host ``BlockPool``s,
the ``WriteBackQueue``, the block size, the requests to move (distinct ids, each in the state its move needs:
the block manager checks a batch before it calls) and the caller's ``PairList`` to append copy pairs to. What
comes out: how many requests moved, the pairs (appended to the ``PairList`` column-wise: D2H
``(device, host)`` for swap-out, H2D ``(host, device)`` for swap-in) and how the number of host mirrors (host
blocks held by resident requests) changed, which the block manager keeps. Every move is all-or-nothing per
request, in order, stopping at the first request the target pool cannot take (ordering contract 4 of
``kv/block_manager.py``). Never touches KV data.

Swap-out copies exactly the dirty blocks (the general path, ``swap_out_general``); ``swap_out_many`` takes a
shortcut for the three shapes a rotating request usually has, each giving the general path's result (see
``_fast_block``). Swap-in pairs every host block with a fresh device block and keeps the host blocks as clean
mirrors.
"""
from __future__ import annotations

import bisect
import itertools
from array import array

from superinfer_jax.kv import shared_run
from superinfer_jax.kv.block_pool import BlockPool
from superinfer_jax.kv.block_seq import (NO_BLOCK, ReqId, SeqBlocks, computed_in_block, dirty_blocks, extend_column,
                                         no_block_ids)
from superinfer_jax.kv.layout import blocks_for
from superinfer_jax.kv.pairs import DEV_IDS, HOST_IDS, PairList
from superinfer_jax.kv.writeback import WriteBackQueue


def swap_out_many(seqs: dict, device: BlockPool, host: BlockPool, queue: WriteBackQueue, block_size: int,
                  req_ids, out: PairList) -> tuple[int, int, int]:
  """``BlockManager.swap_out_many``: swaps resident requests out in order until the host pool cannot take one.

  Returns ``(k, pairs, mirrors)``: the first ``k`` requests are swapped out, their D2H pairs (``pairs`` in all)
  appended to ``out`` in order; ``req_ids[k]``, if any, is unchanged; the host mirror count changed by
  ``mirrors`` (<= 0: the swapped requests' host blocks are now their only copy, not mirrors).
  """
  bs = block_size
  srcs = out.srcs
  dsts = out.dsts
  start = len(srcs)  # every path appends its pairs to out's columns: pairs = len(srcs) - start
  hfree = host.ids
  hpos = host.head  # host ids read from hfree[host.head:hpos] are consumed later (BlockPool's contract)
  dfree = device.ids  # released to by extending in place (BlockPool's contract)
  done = mirrors = 0
  for req_id in req_ids:
    s = seqs[req_id]
    nhost = s.nhost  # its host blocks so far stop being mirrors of a resident request
    i = _fast_block(queue, req_id, s, bs)
    if i is None:
      host.consume(hpos - host.head)  # the general path takes host blocks through the pool: settle first
      moved = swap_out_general(queue, req_id, s, device, host, bs, out)
      hpos = host.head
      if moved is None:
        break
      mirrors += nhost
      done += 1
      continue
    if i >= 0:
      ids = s.host
      h = ids[i]
      if h == NO_BLOCK:
        if hpos == len(hfree):
          break
        h = ids[i] = hfree[hpos]
        hpos += 1
        s.nhost += 1
      if s.nwb:  # the block boundary case: its one queue entry is this block
        queue.remove(req_id, s, i)
      s.host_tokens[i] = s.num_computed - i * bs
      srcs.append(s.dev[i])
      dsts.append(h)
    mirrors += nhost
    dev = s.dev
    dfree += dev  # device.release(dev), in place
    del dev[:]  # in place: a swapped request keeps an empty device column
    s.num_tokens = s.num_computed
    s.on_host = True
    done += 1
  host.consume(hpos - host.head)
  return done, len(srcs) - start, -mirrors


def _fast_block(queue: WriteBackQueue, req_id: ReqId, s: SeqBlocks, block_size: int) -> int | None:
  """The one block a fast-path swap-out of resident ``s`` copies: its logical index, -1 when it copies
  nothing, None when only the general path (``swap_out_general``) applies. Never changes anything.

  The fast paths rely on the write-back queue invariant (a full computed block is queued iff dirty) and
  give the general path's result: (a) no queue entry and a partial, dirty tail block that is the last
  block: copy the tail; (b) the computed tokens end on a block boundary and the last block is the one
  queued: copy it; (c) block boundary, nothing queued: copy nothing.
  """
  nc = s.num_computed
  nfull = nc // block_size
  tail = nc - nfull * block_size
  n = len(s.host)
  if not s.nwb and tail and s.host_tokens[nfull] < tail and n == nfull + 1:
    return nfull
  if s.nwb == 1 and not tail and n == nfull and nfull and (req_id, nfull - 1) in queue.entries:
    return nfull - 1
  if not s.nwb and not tail and n == nfull:
    return -1
  return None


def swap_out_general(queue: WriteBackQueue, req_id: ReqId, s: SeqBlocks, device: BlockPool, host: BlockPool,
                     block_size: int, out: PairList) -> int | None:
  """Swaps resident ``s`` out by the general rule: a host copy and a D2H pair (appended to ``out``) for every
  dirty block, its device blocks released, its logical blocks past the computed tokens dropped (their KV does
  not exist). Returns the number of pairs, or None (the host pool lacks blocks; nothing changed)."""
  moved = _copy_dirty(queue, req_id, s, host, block_size, out)
  if moved is None:
    return None
  # The per-request columns are updated in place: replacing them would hand the allocator thousands of fresh
  # buffers per step under heavy rotation.
  dev = s.dev
  device.release(dev)
  del dev[:]
  _mark_swapped(s, host, block_size)
  return moved


def _mark_swapped(s: SeqBlocks, host: BlockPool, block_size: int) -> None:
  """The end of a swap-out whose device blocks are gone: its logical blocks past the computed tokens are
  dropped (their host copies released: their KV does not exist), and it is swapped out."""
  ids = s.host
  n = blocks_for(s.num_computed, block_size)
  if n < len(ids):
    dropped = [h for h in ids[n:] if h != NO_BLOCK]
    if dropped:
      host.release(array(HOST_IDS, dropped))
      s.nhost -= len(dropped)
    del ids[n:]
    del s.host_tokens[n:]
  s.num_tokens = s.num_computed
  s.on_host = True


def _copy_dirty(queue: WriteBackQueue, req_id: ReqId, s: SeqBlocks, host: BlockPool, block_size: int,
                out: PairList, dirty: list | None = None) -> int | None:
  """``swap_out_general``'s copy step: host copies for every dirty block (``dirty``: ``dirty_blocks(s)`` when
  the caller has it already), D2H pairs appended to ``out``, the request's write-back entries dropped. Returns
  the number of pairs, or None (host pool too small; nothing changed). Leaves the device blocks to the
  caller."""
  if dirty is None:
    dirty = dirty_blocks(s, block_size)
  ids = s.host
  need_host = 0
  if dirty:
    a, b = dirty[0], dirty[-1] + 1
    if b - a == len(dirty):  # one run of blocks (the usual case): count in C
      need_host = ids[a:b].count(NO_BLOCK)
    else:
      for i in dirty:
        if ids[i] == NO_BLOCK:
          need_host += 1
    new_ids = host.take(need_host) if need_host else []
    if new_ids is None:
      return None
  if s.nwb:
    queue.drop(req_id, s)
  if dirty:
    s.nhost += need_host
    dev = s.dev
    host_tokens = s.host_tokens
    if need_host == len(dirty) == b - a:
      # Bulk path: the dirty blocks are one run without host copies (a request whose mirrors were dropped, or
      # one rotated out before any write-back): assign and pair them with slices.
      ids[a:b] = new_ids
      host_tokens[a:b] = [block_size] * (b - a)
      host_tokens[b - 1] = computed_in_block(s, b - 1, block_size)  # the tail block may be partial
      out.srcs += dev[a:b]
      out.dsts += new_ids
    else:
      srcs = out.srcs
      dsts = out.dsts
      new_host = iter(new_ids)
      for i in dirty:
        h = ids[i]
        if h == NO_BLOCK:
          h = ids[i] = next(new_host)
        host_tokens[i] = computed_in_block(s, i, block_size)
        srcs.append(dev[i])
        dsts.append(h)
  return len(dirty)


def swap_in_many(seqs: dict, device: BlockPool, block_size: int, req_ids, num_new_tokens: int,
                 out: PairList) -> tuple[list[array], int]:
  """``BlockManager.swap_in_many``: swaps requests in and grows each by ``num_new_tokens`` slots, in order,
  until the device pool cannot take one.

  Returns ``(tables, mirrors)``: the new device block tables (fresh arrays) of the requests swapped in, a prefix
  of ``req_ids``; their H2D pairs (one per host block, in logical order) are appended to ``out``; ``mirrors``
  host blocks became clean mirrors (all of theirs). The device blocks are the free queue's head, in the order
  one request at a time would take them (its swap-in's, then its growth's).
  """
  bs = block_size
  srcs = out.srcs
  start = len(srcs)
  free = device.ids
  first = head = device.head  # device ids read from free[first:head], consumed at the end (BlockPool's contract)
  nfree = len(free)
  tables = []
  # The pairs' columns are extended once at the end, from the pieces collected here: appending each request's
  # ids in turn would grow the columns (thousands of ids per step under rotation) by repeated reallocation.
  src_pieces = []
  dst_pieces = []
  for req_id in req_ids:
    s = seqs[req_id]
    ids = s.host
    tokens = s.num_tokens + num_new_tokens
    end = head + (tokens + bs - 1) // bs  # blocks_for (kv/layout.py), inline: once per request swapped in
    if end > nfree:
      break
    devs = free[head:end]
    s.dev += devs  # in place (see swap_out_general; it was empty)
    if end - head == len(ids):  # (never fewer: a swapped request's blocks cover its tokens)
      src_pieces.append(ids)
      dst_pieces.append(devs)
    else:  # the new tokens start new blocks: they have no host copy (and no H2D pair)
      n = len(ids)
      src_pieces.append(ids[:n])
      dst_pieces.append(devs[:n])
      ids += no_block_ids(end - head - n)
      s.host_tokens += [0] * (end - head - n)
    head = end
    s.on_host = False
    s.num_tokens = tokens
    tables.append(devs)
  extend_column(srcs, src_pieces, HOST_IDS)
  extend_column(out.dsts, dst_pieces, DEV_IDS)
  device.consume(head - first)
  return tables, len(srcs) - start


# ------------------------------------------------------------------------------------ with shared blocks
# The paths below run when a pool has published or shared blocks (``BlockPool.shared``): every take and release
# goes through the pools, one request at a time, so reference counts and the cached-block LRU stay exact.

def swap_out_shared(seqs: dict, device: BlockPool, host: BlockPool, queue: WriteBackQueue, block_size: int,
                    req_ids, out: PairList, host_published: list, runs: dict) -> tuple[int, int, int]:
  """``swap_out_many`` with shared blocks: the same moves and copies (the same shortcuts, ``_fast_block``; fresh host
  blocks off the free queue's head, then through ``host.take``, which may evict). Device blocks: a request taking no
  part in prefix caching (``SeqBlocks.hashes`` None) releases its blocks, tail first (nobody else owns or finds them).
  One that takes part leaves its ``SharedRun`` (``runs``: the registry, ``kv/shared_run.py``; the run keeps its blocks
  for the other members, with no per-block work, or the last member inherits them), releases the leading run of its own
  blocks that others share (they keep them) and parks the rest, its alone, as one group (``BlockPool.park_many``, one
  call for the batch; its published blocks there are not findable while parked; only the group's part before
  ``SeqBlocks.pub_end``, which holds every published block of the group, moves to a new generation), so that
  ``swap_in_shared`` re-adopts what is still parked: ``SeqBlocks.park_start`` is the group's first logical block (the
  group: every logical block from there on), ``park_end`` / ``park_count`` its queue positions. Should a block others
  share come after its first own block (a hash published first by a third request), its hashed blocks are released one
  by one (published ones stay findable by content) and only the blocks after them parked. Host copies made clean by the
  swap-out whose block has a content hash are recorded in ``host_published`` as ``(req_id, hashes, first logical
  block, host ids)``, one entry per run of consecutive blocks (the block manager publishes them a step later:
  ordering). Returns ``(k, pairs, mirrors)`` as ``swap_out_many``."""
  srcs = out.srcs
  dsts = out.dsts
  start = len(srcs)
  done = mirrors = 0
  bs = block_size
  refs = device.refs
  park_seqs = []  # groups parked at the end, in order (BlockPool.park_many): their requests and blocks
  park_groups = []
  hidden = []  # their leading parts that may hold published blocks (before SeqBlocks.pub_end): generations move
  # Fresh host blocks for the shortcuts are read off the free queue's head and consumed before anything else
  # takes (BlockPool's contract; a host pool never parks, so its queue has no holes); once the queue runs dry,
  # ``take`` evicts.
  hfree = host.ids
  hpos = host.head
  for req_id in req_ids:
    s = seqs[req_id]
    nhost = s.nhost
    nhashes = s.nhashes  # (-1: no part in prefix caching; the hashes tuple is read only when needed: it is cold)
    i = _fast_block(queue, req_id, s, bs)
    if i is None:
      host.consume(hpos - host.head)  # the general path takes host blocks through the pool: settle first
      dirty = dirty_blocks(s, bs)
      moved = _copy_dirty(queue, req_id, s, host, bs, out, dirty)
      hpos = host.head
      if moved is None:
        break
      n = blocks_for(s.num_computed, bs)
      dev = s.dev
      if len(dev) > n:
        device.release(dev[n:])  # slots without KV: never published or shared
        del dev[n:]
      _mark_swapped(s, host, bs)
      if nhashes > 0:
        full = [j for j in dirty if j < nhashes and (j + 1) * bs <= s.num_computed]
        if full:
          host_published += _host_runs(req_id, s.hashes, s.host, full)
    else:
      if i >= 0:
        ids = s.host
        h = ids[i]
        if h == NO_BLOCK:
          if hpos == len(hfree):
            host.consume(hpos - host.head)
            got = host.take(1)  # evicts
            hpos = host.head
            if got is None:
              break
            h = got[0]
          else:
            h = hfree[hpos]
            hpos += 1
          ids[i] = h
          s.nhost += 1
        if s.nwb:  # the block boundary case: its one queue entry is this block
          queue.remove(req_id, s, i)
        c = s.host_tokens[i] = s.num_computed - i * bs
        srcs.append(s.dev[i])
        dsts.append(h)
        if c == bs and i < nhashes:
          host_published.append((req_id, s.hashes, i, array(HOST_IDS, (h,))))
      s.num_tokens = s.num_computed
      s.on_host = True
    dev = s.dev
    if nhashes < 0:
      device.release(dev[::-1])
      del dev[:]
    else:
      run = s.run
      k = 0
      if run is not None:  # the run keeps its blocks for its other members, or passes them to the last one
        s.run = None
        k = shared_run.leave(runs, run)
      if refs:  # (a block others share is published: only its blocks before pub_end can be)
        pub_end = s.pub_end
        if k < pub_end and dev[k] in refs:
          k = device.release_shared_run(dev, k)  # others keep them
        if k < pub_end and not refs.keys().isdisjoint(dev[k:pub_end]):
          nh = min(nhashes, s.num_computed // bs)  # its full, computed hashed blocks: released one by one
          if nh > k:
            device.release(dev[nh - 1:k - 1 if k else None:-1])  # (tail first)
            k = nh
      park_seqs.append(s)
      if k:
        group = dev[k:]
        del dev[:]
      else:  # (the column itself is handed over)
        group = dev
        s.dev = dev[:0]
      park_groups.append(group)
      if s.pub_end > k:  # (else the group holds no published block: no generation moves)
        hidden.append(group[:s.pub_end - k])
      s.park_start = k  # (its group: the rest, SeqBlocks.park_count)
    mirrors += nhost
    done += 1
  host.consume(hpos - host.head)
  if park_seqs:
    for s, end in zip(park_seqs, device.park_many(park_groups, hidden)):
      s.park_end = end
  return done, len(srcs) - start, -mirrors


def _host_runs(req_id: ReqId, hashes: tuple, host: array, blocks: list) -> list:
  """``(req_id, hashes, first, host ids)`` for each run of consecutive logical blocks of ``blocks`` (ascending)."""
  runs = []
  start = prev = blocks[0]
  for j in blocks[1:]:
    if j != prev + 1:
      runs.append((req_id, hashes, start, host[start:prev + 1]))
      start = j
    prev = j
  runs.append((req_id, hashes, start, host[start:prev + 1]))
  return runs


_NOTHING_LEFT = array(DEV_IDS)  # what is left of a group the queue has handed out (read only)


def swap_in_shared(seqs: dict, device: BlockPool, block_size: int, req_ids, num_new_tokens: int,
                   out: PairList, runs: dict) -> tuple[list[array], int, int]:
  """``swap_in_many`` with shared blocks. A logical block whose KV is still on device (before ``SeqBlocks.park_start``:
  published under its hash, found by ``lookup_chain``; from there: in its parked group, not yet handed out by the free
  queue) is re-adopted with no copy; the others get a fresh block and an H2D pair. A request that finds every block
  before its group joins the live ``SharedRun`` of exactly those blocks (``runs``, ``kv/shared_run.py``: found with no
  lookup and no per-block count) or, if there is none, the batch registers one for the requests that found them.
  All-or-nothing per request, in order, stopping at the first the device pool cannot take (each counted against what the
  requests before it take). The batch then moves its blocks at once: re-adopted shared runs, every group unparked, and
  one take for every fresh block (so no request's fresh blocks come out of a later one's group), handed out in request
  order. A batch with nothing to re-adopt, on a free queue without holes or evictable blocks, takes ``swap_in_many``'s
  path (the same moves). Returns ``(tables, mirrors, readopted)``: as ``swap_in_many``, plus the blocks re-adopted."""
  bs = block_size
  # Phase 1: which requests fit, in order (nothing moves yet). Most have nothing left on device (their group was
  # handed out, nothing before it): they need their total; the others (``readopt``) are counted one by one.
  head = device.head_position
  batch = [seqs[req_id] for req_id in req_ids]
  readopt = [j for j, s in enumerate(batch) if s.park_start or s.park_end > head]
  if not readopt and not device.ntomb and not device.evictable:
    # Nothing to re-adopt, and the free queue alone (no holes) is what a take hands out: swap_in_many's moves.
    tables, mirrors = swap_in_many(seqs, device, bs, req_ids, num_new_tokens, out)
    for s in batch[:len(tables)]:
      s.pub_end = 0  # fresh blocks only
    return tables, mirrors, 0
  up = num_new_tokens + bs - 1
  totals = [(s.num_tokens + up) // bs for s in batch]  # blocks_for (kv/layout.py), inline
  if readopt:
    fits, moves, shared = _fit_readopting(batch, totals, readopt, device, runs)
  else:
    fits = bisect.bisect_right(list(itertools.accumulate(totals)), device.num_free)
    moves = []
  # Phase 2: the batch's blocks move: re-adopted shared runs, its groups unparked, one take for the fresh ones.
  fresh_counts = totals[:fits]
  if moves:
    if shared:
      device.share_many(shared)
    groups = []
    hidden = []
    left = []  # the moves whose group the queue has not handed out entirely
    for move in moves:
      s = batch[move[0]]
      if s.park_end > head:
        groups.append((s.park_end, s.park_count))
        hidden.append(max(0, s.pub_end - s.park_start))
        left.append(move)
      else:
        move.append(_NOTHING_LEFT)
        fresh_counts[move[0]] -= move[2]
    if left:
      for move, back in zip(left, device.unpark_many(groups, hidden)):
        move.append(back)
        fresh_counts[move[0]] -= move[2] + len(back)
  fresh_all = device.take(sum(fresh_counts))
  # Phase 3: each request's table, in order. The pairs' columns are extended once at the end, from the pieces
  # collected here (as swap_in_many).
  src_pieces = []
  dst_pieces = []
  tables = []
  mirrors = readopted = pos = 0
  moves.append((fits,))  # (a sentinel)
  special = iter(moves)
  move = next(special)
  for j in range(fits):
    s = batch[j]
    total = totals[j]
    ids = s.host
    n = len(ids)
    end = pos + fresh_counts[j]
    if j == move[0]:
      _, found, hits, role, back = move
      move = next(special)
      fresh = fresh_all[pos:end]
      if found is None:
        devs = back[:]
      elif hits == len(found):  # every block before its group found
        devs = array(DEV_IDS, found)
        devs += back
        if role is not None:  # a run's blocks: a live run, or the one the batch registers (shared above)
          run = role if type(role) is shared_run.SharedRun else (runs.get(role) or
                                                                 shared_run.register(runs, role, found, 0))
          run.members += 1
          s.run = run
      else:
        devs = _partly_found_table(found, back, ids, fresh, src_pieces, dst_pieces)
        fresh = fresh[len(found) - hits:]
      m = n - len(devs)  # the rest of its blocks: copied into fresh ones
      if m > 0:
        src_pieces.append(ids[len(devs):n])
        dst_pieces.append(fresh[:m])
      devs += fresh  # (then the growth's blocks: no host copy)
      readopted += total - end + pos
      # Published now: what it found by content (before park_start) and its group's part parked hidden that it took
      # back (the queue hands a group out tail first).
      start = s.park_start
      pub_end = s.pub_end
      if pub_end > start + len(back):
        pub_end = start + len(back)
      s.pub_end = start if hits and start > pub_end else pub_end
    else:  # every block copied (as swap_in_many)
      s.pub_end = 0  # fresh blocks only
      devs = fresh_all[pos:end]
      if total > n:
        src_pieces.append(ids[:n])
        dst_pieces.append(devs[:n])
      else:
        src_pieces.append(ids)
        dst_pieces.append(devs)
    pos = end
    if total > n:  # the new tokens start new blocks: no host copy (and no H2D pair)
      ids += no_block_ids(total - n)
      s.host_tokens += [0] * (total - n)
    s.dev += devs  # in place (it was empty)
    s.on_host = False
    s.num_tokens += num_new_tokens
    mirrors += s.nhost
    tables.append(devs)
  extend_column(out.srcs, src_pieces, HOST_IDS)
  extend_column(out.dsts, dst_pieces, DEV_IDS)
  return tables, mirrors, readopted


def _fit_readopting(batch: list, totals: list, readopt: list, device: BlockPool, runs: dict) -> tuple:
  """``swap_in_shared``'s phase 1 when some requests (indices ``readopt`` of ``batch``, ascending) may re-adopt
  blocks: the leading blocks they find by content (a live ``SharedRun`` of exactly those blocks, else
  ``lookup_chain``; an evictable one needs a free block, once per batch) and their parked groups (parked blocks count
  as free already). Returns ``(fits, moves, shared)``: how many requests fit in order, ``[j, found, hits, role]``
  for each re-adopting one among them, in order (``j``: its index; ``found``: the blocks found, a block or None per
  leading block, read only and shared by the requests of one prefix, None when nothing was looked up; ``role``: the
  live run it joins, or the key of the run the batch registers for the requests that found every block, or None),
  and the found blocks to share, in order (a run the batch registers shares its blocks once). Changes nothing."""
  lookup_chain = device.lookup_chain
  evictable = device.evictable
  free_left = device.num_free
  revived = set()  # evictable blocks an earlier request of the batch re-adopts (one free block each, once)
  memo = {}  # a prefix's last hash -> (its blocks found, hits, role): requests of one prefix look up once a batch
  moves = []
  shared = []
  special = iter(readopt)
  nxt = next(special)
  for j, total in enumerate(totals):
    if j != nxt:
      if total > free_left:
        return j, moves, shared
      free_left -= total
      continue
    nxt = next(special, -1)
    s = batch[j]
    nh = s.park_start if s.nhashes >= 0 else 0  # its blocks before its parked group: found by content
    if not nh:
      if total > free_left:
        return j, moves, shared
      free_left -= total
      moves.append([j, None, 0, None])
      continue
    key = s.hashes[nh - 1]  # (a chained hash names its whole prefix)
    looked_up = memo.get(key)
    first = looked_up is None
    if first:
      run = runs.get(key)
      if run is not None:  # owned by the run: published, not evictable, nothing to share
        looked_up = (run.blocks, nh, run)
      else:
        found = lookup_chain(s.hashes[:nh])
        hits = nh - found.count(None)
        looked_up = (found, hits, key if hits == nh else None)
      memo[key] = looked_up
    found, hits, role = looked_up
    newly = None
    if hits and type(role) is not shared_run.SharedRun and evictable and not evictable.keys().isdisjoint(found):
      newly = (evictable.keys() & found) - revived
    need = total - hits + (len(newly) if newly else 0)  # (a parked block counts as free already: it needs one too)
    if need > free_left:
      return j, moves, shared
    free_left -= need
    if hits:
      if newly:
        revived |= newly
      if role is None:  # some not found: it owns those found itself
        shared += [b for b in found if b is not None]
      elif first and type(role) is not shared_run.SharedRun:  # the run the batch registers: shared once
        shared += found
    moves.append([j, found, hits, role])
  return len(totals), moves, shared


def _partly_found_table(found: list, unparked: array, ids: array, fresh: array, src_pieces: list,
                        dst_pieces: list) -> array:
  """``swap_in_shared``'s table for one request that found some of its leading blocks by content (``found``: a
  block or None per leading block): those found, a fresh block with an H2D pair (from its host id in ``ids``,
  appended to the piece lists) for each not found (taken from the head of ``fresh``, in order), then what is left of
  its parked group (``unparked``). Returns that table (the caller appends the rest)."""
  devs = array(DEV_IDS, [0]) * len(found)
  srcs = array(HOST_IDS)
  dsts = array(DEV_IDS)
  k = 0
  for i, b in enumerate(found):
    if b is None:
      b = fresh[k]
      k += 1
      srcs.append(ids[i])
      dsts.append(b)
    devs[i] = b
  src_pieces.append(srcs)
  dst_pieces.append(dsts)
  devs += unparked
  return devs


