"""Rotation of whole requests between the device and host pools (swap-out, swap-in) for ``BlockManager``.

``SwapMixin`` is mixed into ``BlockManager``. Every call is all-or-nothing per request (the ordering contract
of ``kv/block_manager.py``): it appends copy pairs to a caller's ``PairList`` and never touches KV data.
"""
from __future__ import annotations

from array import array

from superinfer_jax.kv.block_seq import NO_BLOCK, ReqId, SeqBlocks, extend_column, no_block_ids
from superinfer_jax.kv.pairs import DEV_IDS, HOST_IDS, PairList


class SwapMixin:
  """Swap-out / swap-in of requests for ``BlockManager`` (see the module docstring)."""

  def swap_out(self, req_id: ReqId) -> PairList | None:
    """Rotates a resident request to host; D2H pairs for dirty blocks, or None (host pool too small)."""
    out = PairList.from_columns([], [])
    return None if self.swap_out_to(req_id, out) is None else out

  def swap_out_to(self, req_id: ReqId, out: PairList) -> int | None:
    """``swap_out`` that appends its D2H pairs to ``out`` (column-wise); returns how many, or None.

    None means the host pool lacks blocks; then neither the manager nor ``out`` changed.
    """
    done, moved = self.swap_out_many((req_id,), out)
    return moved if done else None

  def swap_out_many(self, req_ids, out: PairList) -> tuple[int, int]:
    """``swap_out_to`` for each id in order, stopping at the first the host pool cannot take.

    Returns ``(k, pairs)``: the first ``k`` requests are swapped out (their D2H pairs, ``pairs`` in all, are
    appended to ``out`` in order); ``req_ids[k]``, if any, is unchanged (host pool too small). The
    scheduler rotates a step's victims out with one call.
    """
    seqs = self._seqs
    bs = self.block_size
    srcs = out.srcs
    dsts = out.dsts
    start = len(srcs)  # every path appends its pairs to out's columns: pairs = len(srcs) - start
    dev_free = self._dev_free
    hfree = self._host_free
    hhead = self._host_head  # _take_host(1), inline: the live host free list is hfree[hhead:]
    done = mirrors = 0
    for req_id in req_ids:
      s = seqs[req_id]
      if s.on_host:
        raise ValueError(f"request {req_id!r} is already swapped out")
      i = self._fast_swap_out_block(req_id, s)
      if i is None:
        self._host_head = hhead  # the general path takes host blocks through _take_host
        moved = self._swap_out_general(req_id, s, out)
        hhead = self._host_head
        if moved is None:
          break
        done += 1
        continue
      nhost = s.nhost  # its host blocks so far stop being mirrors of a resident request
      if i >= 0:
        host = s.host
        h = host[i]
        if h == NO_BLOCK:
          if hhead == len(hfree):
            break
          h = host[i] = hfree[hhead]
          hhead += 1
          s.nhost += 1
        if s.nwb:  # the block boundary case: its one queue entry is this block
          del self._wb[(req_id, i)]
          s.nwb = 0
        s.host_tokens[i] = s.num_computed - i * bs
        srcs.append(s.dev[i])
        dsts.append(h)
      mirrors += nhost
      dev = s.dev
      dev_free += dev
      del dev[:]
      s.num_tokens = s.num_computed
      s.on_host = True
      done += 1
    if hhead + hhead >= len(hfree):  # compact as _take_host does (the consumed prefix is at least half)
      del hfree[:hhead]
      hhead = 0
    self._host_head = hhead
    self._mirror_blocks -= mirrors
    return done, len(srcs) - start

  def _fast_swap_out_block(self, req_id: ReqId, s: SeqBlocks) -> int | None:
    """The one block a fast-path swap-out of resident ``s`` copies: its logical index, -1 when it copies
    nothing, None when only the general path (``_swap_out_general``) applies. Never changes anything.

    The fast paths rely on the write-back queue invariant (a full computed block is queued iff dirty) and
    give the general path's result: (a) no queue entry and a partial, dirty tail block that is the last
    block: copy the tail; (b) the computed tokens end on a block boundary and the last block is the one
    queued: copy it; (c) block boundary, nothing queued: copy nothing.
    """
    bs = self.block_size
    nc = s.num_computed
    nfull = nc // bs
    tail = nc - nfull * bs
    n = len(s.host)
    if not s.nwb and tail and s.host_tokens[nfull] < tail and n == nfull + 1:
      return nfull
    if s.nwb == 1 and not tail and n == nfull and nfull and (req_id, nfull - 1) in self._wb:
      return nfull - 1
    if not s.nwb and not tail and n == nfull:
      return -1
    return None

  def _swap_out_general(self, req_id: ReqId, s: SeqBlocks, out: PairList) -> int | None:
    """One swap-out by the general path: every dirty block copied, uncomputed slots dropped (None: the host
    pool lacks blocks; nothing changed)."""
    moved = self._swap_out_dirty(req_id, s, out)
    if moved is None:
      return None
    # Release the device blocks (one bulk extend; a swapped request keeps an empty device list) and drop logical
    # blocks past the computed tokens (their KV does not exist). The per-request lists are updated in place:
    # replacing them would hand the allocator thousands of fresh buffers per step under heavy rotation.
    bs = self.block_size
    nc = s.num_computed
    host = s.host
    dev = s.dev
    self._dev_free += dev
    del dev[:]
    n = (nc + bs - 1) // bs
    if n < len(host):
      dropped = [h for h in host[n:] if h != NO_BLOCK]
      if dropped:
        self._host_free += array(HOST_IDS, dropped)
        s.nhost -= len(dropped)
      del host[n:]
      del s.host_tokens[n:]
    s.num_tokens = nc
    s.on_host = True
    return moved

  def _swap_out_dirty(self, req_id: ReqId, s: SeqBlocks, out: PairList) -> int | None:
    """``swap_out_to``'s general copy step: host copies for every dirty block, D2H pairs appended to ``out``.

    Returns the number of pairs, or None (host pool too small; nothing changed). Leaves the device blocks to
    the caller.
    """
    dirty = self._dirty_indices(s)
    host = s.host
    need_host = 0
    if dirty:
      a, b = dirty[0], dirty[-1] + 1
      if b - a == len(dirty):  # one run of blocks (the usual case): count in C
        need_host = host[a:b].count(NO_BLOCK)
      else:
        for i in dirty:
          if host[i] == NO_BLOCK:
            need_host += 1
      if need_host > len(self._host_free) - self._host_head:
        return None
    if s.nwb:
      self._drop_wb(req_id, s)
    self._mirror_blocks -= s.nhost
    if dirty:
      new_ids = self._take_host(need_host) if need_host else []
      s.nhost += need_host
      dev = s.dev
      host_tokens = s.host_tokens
      if need_host == len(dirty) == b - a:
        # Bulk path: the dirty blocks are one run without host copies (a request whose mirrors were
        # dropped, or one rotated out before any write-back): assign and pair them with slices.
        host[a:b] = new_ids
        bs = self.block_size
        host_tokens[a:b] = [bs] * (b - a)
        host_tokens[b - 1] = self._computed_in_block(s, b - 1)  # the tail block may be partial
        out.srcs += dev[a:b]
        out.dsts += new_ids
      else:
        srcs = out.srcs
        dsts = out.dsts
        new_host = iter(new_ids)
        for i in dirty:
          h = host[i]
          if h == NO_BLOCK:
            h = host[i] = next(new_host)
          host_tokens[i] = self._computed_in_block(s, i)
          srcs.append(dev[i])
          dsts.append(h)
    return len(dirty)

  def swap_in(self, req_id: ReqId) -> PairList | None:
    """Brings a swapped request back; H2D pairs for every block, or None (device pool too small)."""
    out = PairList.from_columns([], [])
    return None if self.swap_in_to(req_id, out) is None else out

  def swap_in_to(self, req_id: ReqId, out: PairList) -> int | None:
    """``swap_in`` that appends its H2D pairs to ``out`` (column-wise); returns how many, or None.

    None means the device pool lacks blocks; then neither the manager nor ``out`` changed.
    """
    table = self.swap_in_grow(req_id, 0, out)
    return None if table is None else len(table)

  def swap_in_grow(self, req_id: ReqId, num_new_tokens: int, out: PairList) -> array | None:
    """``swap_in_to`` followed by ``append_slots(req_id, num_new_tokens)``, as one all-or-nothing step.

    Appends the H2D pairs (one per host block, in logical order) to ``out`` and returns the request's new
    device block table (a fresh array, as ``block_table`` would return). The device blocks come off the
    free list's head in the order the two calls would take them (the swap-in's, then the growth's). None:
    the device pool lacks blocks for both; nothing changed.
    """
    tables = self.swap_in_many((req_id,), num_new_tokens, out)
    return tables[0] if tables else None

  def swap_in_many(self, req_ids, num_new_tokens: int, out: PairList) -> list[array]:
    """``swap_in_grow(req_id, num_new_tokens, out)`` for each (distinct) id in order, stopping at the first
    the device pool cannot take. Returns the new block tables of those swapped in (a prefix of ``req_ids``;
    fresh arrays); their H2D pairs are appended to ``out`` in order. The device blocks are exactly those the
    calls one by one would take. The scheduler rotates a step's requests in with one call.
    """
    if num_new_tokens < 0:
      raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
    seqs = self._seqs
    bs = self.block_size
    srcs = out.srcs
    dsts = out.dsts
    start = len(srcs)
    free = self._dev_free
    head = self._dev_head
    nfree = len(free)
    tables = []
    # The pairs' columns are extended once at the end, from the pieces collected here: appending each request's
    # ids in turn would grow the columns (thousands of ids per step under rotation) by repeated reallocation.
    src_pieces = []
    dst_pieces = []
    for req_id in req_ids:
      s = seqs[req_id]
      if not s.on_host:
        raise ValueError(f"request {req_id!r} is not swapped out")
      host = s.host
      tokens = s.num_tokens + num_new_tokens
      end = head + (tokens + bs - 1) // bs  # blocks >= len(host): a swapped request's blocks cover its tokens
      if end > nfree:
        break
      devs = free[head:end]  # _take_dev(need), inline (the free list's head, in order)
      s.dev += devs  # in place (see swap_out; it was empty)
      if end - head == len(host):
        src_pieces.append(host)
        dst_pieces.append(devs)
      else:  # the new tokens start new blocks: they have no host copy (and no H2D pair)
        n = len(host)
        src_pieces.append(host[:n])
        dst_pieces.append(devs[:n])
        host += no_block_ids(end - head - n)
        s.host_tokens += [0] * (end - head - n)
      head = end
      s.on_host = False
      s.num_tokens = tokens
      tables.append(devs)
    extend_column(srcs, src_pieces, HOST_IDS)
    extend_column(dsts, dst_pieces, DEV_IDS)
    if head + head >= nfree:  # compact as _take_dev does (the consumed prefix is at least half)
      del free[:head]
      head = 0
    self._dev_head = head
    self._mirror_blocks += len(srcs) - start  # every host block of a swapped request is now a clean mirror
    return tables
