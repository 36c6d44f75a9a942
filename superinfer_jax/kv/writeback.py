"""Eager write-back (docs/paper.md §4.4): the one home of the block manager's write-back queue logic.

The queue ``BlockManager._wb`` holds ``(req_id, logical block)`` keys of full, computed blocks of resident
requests whose host copy is missing or stale, oldest first. Invariant: a key is queued iff its block is full,
computed and dirty; ``SeqBlocks.nwb`` counts a request's keys. ``WriteBackMixin`` is mixed into
``BlockManager`` and reads its pools and ``_seqs``; it never touches KV data, it only returns copy lists.
"""
from __future__ import annotations

from array import array

from superinfer_jax.kv.block_seq import NO_BLOCK, ReqId, SeqBlocks, no_block_ids
from superinfer_jax.kv.pairs import HOST_IDS, PairList


class WriteBackMixin:
  """Write-back queue maintenance and draining for ``BlockManager`` (see the module docstring)."""

  def _computed_in_block(self, s: SeqBlocks, i: int) -> int:
    c = s.num_computed - i * self.block_size
    return 0 if c <= 0 else (self.block_size if c >= self.block_size else c)

  def _dirty_indices(self, s: SeqBlocks) -> list[int]:
    """Logical blocks holding computed tokens that their host copy lacks (KV is append-only, so a full block
    is dirty iff its host copy holds fewer than block_size tokens)."""
    bs = self.block_size
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

  def _drop_wb(self, req_id: ReqId, s: SeqBlocks) -> None:
    if not s.nwb:
      return
    wb = self._wb
    for i in range(len(s.host) - 1, -1, -1):  # queued blocks are usually the most recently filled ones
      if wb.pop((req_id, i), 0) is None:
        s.nwb -= 1
        if not s.nwb:
          break

  def mark_computed(self, req_id: ReqId, num_computed_tokens: int) -> None:
    """Records that the first ``num_computed_tokens`` tokens' KV is written by a dispatched step."""
    s = self._seqs[req_id]
    old = s.num_computed
    if s.on_host:
      raise ValueError(f"mark_computed on swapped-out request {req_id!r}")
    if num_computed_tokens < old or num_computed_tokens > s.num_tokens:
      raise ValueError(f"mark_computed({req_id!r}, {num_computed_tokens}): must be in "
                       f"[{s.num_computed}, {s.num_tokens}]")
    s.num_computed = num_computed_tokens
    bs = self.block_size
    first_full = old // bs  # first block that was not full before
    end = num_computed_tokens // bs
    if end > first_full:
      ht = s.host_tokens
      wb = self._wb
      for i in range(first_full, end):
        if ht[i] < bs:
          wb[(req_id, i)] = None
          s.nwb += 1

  def mark_computed_next(self, req_ids) -> None:
    """``mark_computed(req_id, num_computed + 1)`` for each id in order (resident requests with an uncomputed
    slot): the scheduler marks each swapped-in request's pending token with one call per batch."""
    seqs = self._seqs
    bs = self.block_size
    wb = self._wb
    for req_id in req_ids:
      s = seqs[req_id]
      c = s.num_computed + 1
      if s.on_host or c > s.num_tokens:
        raise ValueError(f"mark_computed_next({req_id!r}): swapped out, or no uncomputed slot "
                         f"(computed {s.num_computed} of {s.num_tokens})")
      s.num_computed = c
      if not c % bs and s.host_tokens[c // bs - 1] < bs:  # the block c // bs - 1 just filled and is dirty
        wb[(req_id, c // bs - 1)] = None
        s.nwb += 1

  def pending_writebacks(self) -> int:
    return len(self._wb)

  def take_writebacks(self, max_blocks: int | None = None, min_free_host: int = 0) -> PairList:
    """Eager write-back: D2H pairs for full, computed, dirty blocks (oldest first); marks them clean."""
    srcs: list[int] = []
    dsts: list[int] = []
    out = PairList.from_columns(srcs, dsts)
    if not self._wb:
      return out
    bs = self.block_size
    wb = self._wb
    seqs = self._seqs
    limit = len(wb) if max_blocks is None else max_blocks
    if limit <= 0:
      return out
    # Host blocks are taken from the free list's head in order (one slice at the end).
    hfree = self._host_free
    head = self._host_head
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
      self._take_host(taken)
      self._mirror_blocks += taken
    return out

  def drop_host_mirrors(self, req_id: ReqId) -> int:
    """Releases the host copies of a *resident* request (they are redundant); returns blocks released.

    Lets a caller reclaim host space held by clean mirrors of running requests. The next ``swap_out`` of the
    request then copies every computed block again. Must not be called for a request swapped in during the
    current step (its host blocks are this step's H2D sources; ordering contract 3).
    """
    s = self._seqs[req_id]
    if s.on_host:
      raise ValueError(f"request {req_id!r} is swapped out; its host blocks are its only copy")
    if not s.nhost:
      return 0
    host = s.host
    n = len(host)
    released = s.nhost
    # Release in logical-block order (as a per-block loop would), in bulk.
    self._host_free += host if released == n else array(HOST_IDS, [h for h in host if h != NO_BLOCK])
    host[:] = no_block_ids(n)
    s.host_tokens[:] = [0] * n
    # Every full computed block is now dirty, so it must be queued for write-back. Blocks already queued keep
    # their place (dict.update does not move existing keys); new ones are appended in block order.
    wb = self._wb
    queued = len(wb)
    wb.update(dict.fromkeys([(req_id, i) for i in range(s.num_computed // self.block_size)]))
    s.nwb += len(wb) - queued
    s.nhost = 0
    self._mirror_blocks -= released
    return released
