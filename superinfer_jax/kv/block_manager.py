"""KV block manager: device and host block pools, per-request block tables, clean/dirty host copies.

Host-side bookkeeping only (pure Python; no JAX, no numpy arrays on the hot path). It decides *which* blocks
hold a request's KV and returns the copy lists the rotation engine (DuplexKV, ``superinfer_jax/rotation``)
must execute; it never touches KV data itself. Copy lists are ``PairList``s (``kv/pairs.py``): sequences of
``(src, dst)`` block-id pairs that read like a list of 2-tuples but are stored as two int columns (``srcs``,
``dsts``), so moving thousands of blocks per step allocates no per-pair tuple.

Pools
-----
* Device pool: block ids ``1..num_device_blocks``. ``PADDING_BLOCK`` (0) is never allocated (the device
  cache array therefore has ``num_device_blocks + 1`` blocks; see ``kv/layout.py``).
* Host pool (pinned host memory): block ids ``0..num_host_blocks-1``.
* Free lists are FIFO: a freed block goes to the tail, allocation pops the head. Each is an ``array`` plus a
  head index, so a request's blocks are taken as one slice and released with one ``extend`` (C speed; no
  per-block Python work on the rotation path, which moves up to B_xfer blocks per step each way).
* Every allocated block has exactly one owner, a (request, logical block) slot; the reference count is
  therefore implicit (1 off the free list, 0 on it), which keeps bulk allocation and release free of
  per-block bookkeeping. Prefix sharing would add an explicit count for shared blocks only.

Block ids are stored as ``array('i')``: host ids (``HOST_IDS``) in each request's ``host`` column and the host
free list, device ids (``DEV_IDS``) in each request's ``dev`` column, the device free list and every block table
handed out. Under rotation a step moves ~2,400 host ids into the swap-in copy list and ~2,400 device ids out
of the free list; with arrays each move is a ``memcpy`` (into ``StepPlan.swap_in``'s columns, both arrays:
``kv/pairs.h2d_pairs``) instead of an incref of one cold int object per id, and ``block_table``'s per-step
copy of every scheduled request's table is a ``memcpy`` too (2026-12-02: device ids as arrays took 8% off
rotasched's ``schedule()`` and 5.5% off fcfs's; last-level cache misses -37% / -27%, callgrind).

Per-request state
-----------------
A request owns a list of *logical blocks* ``0..n-1``; logical block ``i`` holds tokens
``[i*block_size, (i+1)*block_size)``. Each logical block has a device id and/or a host id:

* ``num_tokens``: tokens with a slot (covered by the block table). ``n == ceil(num_tokens / block_size)``.
* ``num_computed``: leading tokens whose KV is written by a model step that has already been *dispatched*
  (``mark_computed``); ``0 <= num_computed <= num_tokens``; never decreases while the request lives.
* ``host_tokens[i]``: how many leading tokens of logical block ``i`` the host copy holds (0 if no host copy).
  KV is append-only, so a host copy holding ``k`` tokens stays valid for those ``k`` tokens forever.
  The host copy is **clean** iff it holds every computed token of the block
  (``host_tokens[i] >= computed_in_block(i)``); otherwise the block is **dirty**.
* A request is either **resident** (every logical block has a device id; host ids are optional clean or
  stale mirrors) or **swapped** / rotary (no device ids; every logical block has a host id and is clean,
  and ``num_tokens == num_computed``).

Public API
----------
``BlockManager(num_device_blocks, num_host_blocks, block_size)``

Capacity queries (all O(1) unless noted):
  * ``num_free_device_blocks``, ``num_free_host_blocks`` (properties), ``host_usage()`` and
    ``device_usage()`` (used fraction in [0, 1]).
  * ``blocks_to_grow(req_id, total_tokens) -> int``: device blocks ``append_slots`` would allocate to cover
    ``total_tokens`` tokens (an unknown request counts from 0 tokens). Resident or new requests only.
  * ``blocks_to_swap_in(req_id) -> int``: device blocks ``swap_in`` allocates (the request's block count).
  * ``blocks_to_swap_out(req_id) -> int``: host blocks ``swap_out`` must allocate (dirty blocks without a
    host copy). O(blocks of the request).
  * ``reclaimable_host_blocks()``: host blocks held as mirrors by resident requests; ``num_host_mirrors(id)``.
  * ``num_blocks(req_id)``, ``num_tokens(req_id)``, ``num_computed(req_id)``, ``is_swapped(req_id)``,
    ``has_request(req_id)`` / ``req_id in manager``, ``num_requests``.

Mutations:
  * ``append_slots(req_id, num_new_tokens) -> bool``: grow a resident (or new: the first call creates the
    request) request by ``num_new_tokens`` token slots, allocating device blocks as needed. All-or-nothing:
    returns False and changes nothing if the device pool lacks blocks. Raises on a swapped request.
  * ``mark_computed(req_id, num_computed_tokens)``: absolute count of tokens whose KV is written by a step
    already dispatched. Monotone, ``<= num_tokens``. Blocks that become full are queued for write-back.
  * ``mark_computed_next(req_ids)``: ``mark_computed(req_id, num_computed + 1)`` for each id, in order (the
    scheduler marks a swap-in batch's pending tokens with one call).
  * ``take_writebacks(max_blocks=None, min_free_host=0) -> PairList[(device, host)]``: eager write-back
    (docs/paper.md §4.4): D2H pairs for full, computed, dirty blocks of resident requests, oldest first. A block
    without a host copy gets a fresh host block; one with a stale copy (a tail block that filled up after a
    swap-in) reuses it. Marks them clean. Stops at ``max_blocks`` pairs or when taking another host block
    would leave fewer than ``min_free_host`` free; the rest stay queued for a later call.
  * ``swap_out(req_id) -> PairList[(device, host)] | None``: rotate a resident request to host. D2H pairs only
    for blocks whose host copy is missing or stale (normally just the dirty tail block when write-back keeps
    up). Returns None and changes nothing if the host pool lacks blocks (caller falls back to recompute
    preemption via ``free``). Uncomputed slots (``num_tokens > num_computed``) are dropped, because their KV
    does not exist. Frees all the request's device blocks.
  * ``swap_in(req_id) -> PairList[(host, device)] | None``: bring a swapped request back. Allocates one device
    block per logical block and returns H2D pairs for all of them; host blocks are kept as clean mirrors
    so a later ``swap_out`` copies only what changed. Returns None and changes nothing if the device pool
    lacks blocks.
  * ``swap_out_to(req_id, out: PairList) -> int | None``, ``swap_in_to(req_id, out) -> int | None``: as
    ``swap_out`` / ``swap_in``, but the pairs are appended to ``out`` column-wise (no intermediate list) and
    their count is returned; None leaves ``out`` unchanged. The scheduler fills its ``StepPlan`` with these.
  * ``swap_in_grow(req_id, num_new_tokens, out) -> array | None``: ``swap_in_to`` then
    ``append_slots(req_id, num_new_tokens)`` in one all-or-nothing call (same block ids); returns the new
    block table (a fresh ``array('i')``) or None. ``swap_in_many(req_ids, num_new_tokens, out) -> tables`` and
    ``swap_out_many(req_ids, out) -> (k, pairs)``: the same for each id in order, until one does not fit.
    The scheduler rotates a step's requests in and out with these.
  * ``free(req_id)``: finish / abort / recompute preemption. Releases device and host blocks. Unknown id:
    no-op.
  * ``block_table(req_id) -> array``: device ids of a resident request's logical blocks (a fresh
    ``array('i')``, typecode ``DEV_IDS``; it compares equal to another array, not to a list: use ``tolist()``;
    pad with ``PADDING_BLOCK``). Token ``t`` lives at slot ``table[t // block_size] * block_size +
    t % block_size``.
  * ``host_block_table(req_id) -> list[int]``: host ids (-1 where none).
  * ``drop_host_mirrors(req_id) -> int``: release a resident request's host copies (redundant: the device
    holds the data); its full blocks are queued for write-back again. For reclaiming host space.
  * ``check_invariants()``: raises ``AssertionError`` describing the first violation: no block owned twice,
    free lists disjoint from used blocks and complete, padding block never used,
    every request's table covers its tokens, resident/swapped and clean/dirty consistency, write-back queue
    consistent. O(total blocks); for tests and debug.

Ordering contract (the rotation engine relies on it; see WORKSPACE_NOTES "Rotation")
------------------------------------------------------------------------------------
1. Within one step, the engine gathers *all* D2H sources (swap-out + write-back pairs) from the cache returned
   by the last dispatched model step *before* it scatters any H2D data into the cache, and dispatches the
   next model step after the scatter. Hence a device block freed by ``swap_out`` may be handed out again in
   the same step (as a ``swap_in`` target or for ``append_slots``): its old content has already been
   gathered.
2. "Computed" means written by a step already dispatched. D2H gathers are data-dependent on the last
   dispatched step, so every copied token's KV exists. The scheduler marks a plan's tokens computed *after*
   it has taken that plan's swap-outs and write-backs, and the engine dispatches a plan's step before asking
   for the next plan.
3. Within one step no host block is both an H2D source and a D2H target, or a D2H target twice, provided the
   caller (the scheduler) (a) does not ``free`` a request it swapped in or out in the same step, (b) does
   not ``drop_host_mirrors`` of a request swapped in during the step, and (c) calls ``take_writebacks``
   last. Across steps the engine must apply step k's copies to a host block before step k+1's (e.g. wait for
   step k's transfers before issuing step k+1's, as the reference does). Device blocks need no such wait:
   step k's gather is enqueued before any later scatter into (or model step on) the donated cache.
4. Nothing is lost silently: ``swap_out``/``swap_in``/``append_slots`` either do everything or return
   None/False with no change.
"""
from __future__ import annotations

import collections
from array import array
from typing import Hashable

from superinfer_jax.kv.layout import PADDING_BLOCK
from superinfer_jax.kv.pairs import DEV_IDS, HOST_IDS, PairList

NO_BLOCK = -1
_NO_BLOCKS = array(HOST_IDS, [NO_BLOCK]) * 4096  # slices of it fill host tables (no host copy) in bulk


def _no_blocks(n: int) -> array:
  """``n`` NO_BLOCK host ids as a host-id array."""
  return _NO_BLOCKS[:n] if n <= len(_NO_BLOCKS) else array(HOST_IDS, [NO_BLOCK]) * n

ReqId = Hashable


def _extend_column(col, pieces: list, typecode: str) -> None:
  """Appends the id arrays ``pieces`` (of ``typecode``) to ``col`` in order: one copy into an ``array`` column of
  the same typecode, else one ``+=`` per piece (a list column; another array type raises as ``+=`` does)."""
  if type(col) is array and col.typecode == typecode:
    if pieces:
      col.frombytes(b"".join(pieces))
  else:
    for p in pieces:
      col += p


class _Seq:
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


class BlockManager:
  """Device + host block pools and per-request block tables. See the module docstring for the API."""

  def __init__(self, num_device_blocks: int, num_host_blocks: int, block_size: int):
    if num_device_blocks < 1:
      raise ValueError(f"num_device_blocks must be >= 1, got {num_device_blocks}")
    if num_host_blocks < 0:
      raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
    if block_size < 1:
      raise ValueError(f"block_size must be >= 1, got {block_size}")
    self.num_device_blocks = num_device_blocks
    self.num_host_blocks = num_host_blocks
    self.block_size = block_size
    # FIFO free lists: the live part is ``_dev_free[_dev_head:]`` (see ``_take_dev``).
    self._dev_free = array(DEV_IDS, range(1, num_device_blocks + 1))
    self._dev_head = 0
    self._host_free = array(HOST_IDS, range(num_host_blocks))
    self._host_head = 0
    self._seqs: dict[ReqId, _Seq] = {}
    # Eager write-back queue: (req_id, logical block) of full, computed blocks of resident requests whose
    # host copy is missing or stale. Insertion-ordered (oldest first); entries are removed on swap-out/free.
    self._wb: dict[tuple[ReqId, int], None] = {}
    self._mirror_blocks = 0  # host blocks held by resident requests (clean or stale mirrors)

  # ---------------------------------------------------------------- capacity queries
  @property
  def num_free_device_blocks(self) -> int:
    return len(self._dev_free) - self._dev_head

  @property
  def num_free_host_blocks(self) -> int:
    return len(self._host_free) - self._host_head

  @property
  def num_requests(self) -> int:
    return len(self._seqs)

  def device_usage(self) -> float:
    return 1.0 - (len(self._dev_free) - self._dev_head) / self.num_device_blocks

  def reclaimable_host_blocks(self) -> int:
    """Host blocks held as mirrors by resident requests (``drop_host_mirrors`` can release them)."""
    return self._mirror_blocks

  def num_host_mirrors(self, req_id: ReqId) -> int:
    s = self._seqs[req_id]
    return 0 if s.on_host else s.nhost

  def host_usage(self) -> float:
    if self.num_host_blocks == 0:
      return 1.0
    return 1.0 - (len(self._host_free) - self._host_head) / self.num_host_blocks

  def blocks_for_tokens(self, num_tokens: int) -> int:
    return -(-num_tokens // self.block_size)

  def __contains__(self, req_id: ReqId) -> bool:
    return req_id in self._seqs

  def has_request(self, req_id: ReqId) -> bool:
    return req_id in self._seqs

  def is_swapped(self, req_id: ReqId) -> bool:
    return self._seqs[req_id].on_host

  def num_blocks(self, req_id: ReqId) -> int:
    s = self._seqs.get(req_id)
    return 0 if s is None else len(s.host)

  def num_tokens(self, req_id: ReqId) -> int:
    s = self._seqs.get(req_id)
    return 0 if s is None else s.num_tokens

  def num_computed(self, req_id: ReqId) -> int:
    s = self._seqs.get(req_id)
    return 0 if s is None else s.num_computed

  def blocks_to_grow(self, req_id: ReqId, total_tokens: int) -> int:
    """Device blocks ``append_slots`` needs so that the request covers ``total_tokens`` tokens."""
    s = self._seqs.get(req_id)
    have = 0 if s is None else len(s.dev)
    if s is not None and s.on_host:
      raise ValueError(f"request {req_id!r} is swapped out; use blocks_to_swap_in")
    need = -(-total_tokens // self.block_size) - have
    return need if need > 0 else 0

  def blocks_to_swap_in(self, req_id: ReqId) -> int:
    s = self._seqs[req_id]
    return len(s.host) if s.on_host else 0

  def blocks_to_swap_out(self, req_id: ReqId) -> int:
    """Host blocks ``swap_out`` would allocate (computed blocks without any host copy)."""
    s = self._seqs[req_id]
    if s.on_host:
      return 0
    n = -(-s.num_computed // self.block_size)
    return s.host[:n].count(NO_BLOCK)

  def swap_out_copies(self, req_id: ReqId) -> int:
    """D2H block copies ``swap_out`` would issue (computed blocks whose host copy is missing or stale)."""
    s = self._seqs[req_id]
    if s.on_host:
      return 0
    # Full blocks are dirty exactly when queued for write-back (write-back queue invariant): s.nwb of them;
    # plus the partial tail block if its host copy lacks some of its computed tokens.
    nc = s.num_computed
    tail = nc % self.block_size
    if tail and s.host_tokens[nc // self.block_size] < tail:
      return s.nwb + 1
    return s.nwb

  def block_table(self, req_id: ReqId) -> array:
    s = self._seqs[req_id]
    if s.on_host:
      raise ValueError(f"request {req_id!r} is swapped out; it has no device block table")
    return s.dev[:]  # a fresh array (one memcpy; called for every scheduled seq)

  def host_block_table(self, req_id: ReqId) -> list[int]:
    return self._seqs[req_id].host.tolist()

  # ---------------------------------------------------------------- helpers
  def _computed_in_block(self, s: _Seq, i: int) -> int:
    c = s.num_computed - i * self.block_size
    return 0 if c <= 0 else (self.block_size if c >= self.block_size else c)

  def _dirty_indices(self, s: _Seq) -> list[int]:
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

  def _take_dev(self, n: int) -> array:
    """Pops the ``n`` head blocks of the device free list (caller checked there are enough)."""
    free = self._dev_free
    end = self._dev_head + n
    out = free[self._dev_head:end]
    if end + end >= len(free):  # the consumed prefix is at least half: compact (amortized O(1) per block)
      del free[:end]
      end = 0
    self._dev_head = end
    return out

  def _take_host(self, n: int) -> array:
    """Pops the ``n`` head blocks of the host free list (caller checked there are enough)."""
    free = self._host_free
    end = self._host_head + n
    out = free[self._host_head:end]
    if end + end >= len(free):
      del free[:end]
      end = 0
    self._host_head = end
    return out

  def _free_device_ids(self) -> list[int]:
    """The device free list, head first (a copy; for tests and debug)."""
    return self._dev_free[self._dev_head:].tolist()

  def _free_host_ids(self) -> list[int]:
    """The host free list, head first (a copy; for tests and debug)."""
    return self._host_free[self._host_head:].tolist()

  def _drop_wb(self, req_id: ReqId, s: _Seq) -> None:
    if not s.nwb:
      return
    wb = self._wb
    for i in range(len(s.host) - 1, -1, -1):  # queued blocks are usually the most recently filled ones
      if wb.pop((req_id, i), 0) is None:
        s.nwb -= 1
        if not s.nwb:
          break

  # ---------------------------------------------------------------- mutations
  def append_slots(self, req_id: ReqId, num_new_tokens: int) -> bool:
    """Covers ``num_new_tokens`` more tokens on device. All-or-nothing. Creates unknown requests."""
    s = self._seqs.get(req_id)
    if s is not None and not s.on_host and num_new_tokens >= 0:
      # Fast path (a running request's next token usually fits its last block).
      total = s.num_tokens + num_new_tokens
      if total <= len(s.dev) * self.block_size:
        s.num_tokens = total
        return True
    if num_new_tokens < 0:
      raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
    s = self._seqs.get(req_id)
    if s is None:
      need = -(-num_new_tokens // self.block_size)
      if need > len(self._dev_free) - self._dev_head:
        return False
      s = self._seqs[req_id] = _Seq()
    else:
      if s.on_host:
        raise ValueError(f"append_slots on swapped-out request {req_id!r}; swap_in first")
      need = -(-(s.num_tokens + num_new_tokens) // self.block_size) - len(s.dev)
      if need > len(self._dev_free) - self._dev_head:
        return False
    if need > 0:
      s.dev += self._take_dev(need)
      s.host += _no_blocks(need)
      s.host_tokens += [0] * need
    s.num_tokens += num_new_tokens
    return True

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
      host = s.host
      nc = s.num_computed
      nfull = nc // bs
      tail = nc - nfull * bs
      ht = s.host_tokens
      if not s.nwb and tail and ht[nfull] < tail and len(host) == nfull + 1:
        # Fast path (the usual rotation under eager write-back): no full block is queued for write-back, i.e.
        # (write-back queue invariant) every full computed block has a clean host copy, so the partial tail
        # block (the last one: no uncomputed slots beyond it) is the only dirty one. Same result as the
        # general path.
        h = host[nfull]
        mirrors += s.nhost  # its host blocks so far stop being mirrors of a resident request
        if h == NO_BLOCK:
          if hhead == len(hfree):
            mirrors -= s.nhost
            break
          h = host[nfull] = hfree[hhead]
          hhead += 1
          s.nhost += 1
        ht[nfull] = tail
        dev = s.dev
        srcs.append(dev[nfull])
        dsts.append(h)
        dev_free += dev
        del dev[:]
        s.num_tokens = nc
        s.on_host = True
      elif (s.nwb == 1 and not tail and len(host) == nfull and nfull
            and (req_id, nfull - 1) in self._wb):
        # The computed tokens end on a block boundary and the last block filled after the last write-back:
        # it is the one dirty block (write-back queue invariant). Copy it and drop its queue entry.
        i = nfull - 1
        h = host[i]
        mirrors += s.nhost  # its host blocks so far stop being mirrors of a resident request
        if h == NO_BLOCK:
          if hhead == len(hfree):
            mirrors -= s.nhost
            break
          h = host[i] = hfree[hhead]
          hhead += 1
          s.nhost += 1
        del self._wb[(req_id, i)]
        s.nwb = 0
        ht[i] = bs
        dev = s.dev
        srcs.append(dev[i])
        dsts.append(h)
        dev_free += dev
        del dev[:]
        s.on_host = True
      elif not s.nwb and not tail and len(host) == nfull:
        # The computed tokens end on a block boundary and every full block has a clean host copy (no
        # write-back queued): nothing to copy; the device blocks are released (the general path's result).
        mirrors += s.nhost
        dev = s.dev
        dev_free += dev
        del dev[:]
        s.on_host = True
      else:
        self._host_head = hhead  # the general path takes host blocks through _take_host
        moved = self._swap_out_general(req_id, s, out)
        hhead = self._host_head
        if moved is None:
          break
      done += 1
    if hhead + hhead >= len(hfree):  # compact as _take_host does (the consumed prefix is at least half)
      del hfree[:hhead]
      hhead = 0
    self._host_head = hhead
    self._mirror_blocks -= mirrors
    return done, len(srcs) - start

  def _swap_out_general(self, req_id: ReqId, s: _Seq, out: PairList) -> int | None:
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

  def _swap_out_dirty(self, req_id: ReqId, s: _Seq, out: PairList) -> int | None:
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
        host += _no_blocks(end - head - n)
        s.host_tokens += [0] * (end - head - n)
      head = end
      s.on_host = False
      s.num_tokens = tokens
      tables.append(devs)
    _extend_column(srcs, src_pieces, HOST_IDS)
    _extend_column(dsts, dst_pieces, DEV_IDS)
    if head + head >= nfree:  # compact as _take_dev does (the consumed prefix is at least half)
      del free[:head]
      head = 0
    self._dev_head = head
    self._mirror_blocks += len(srcs) - start  # every host block of a swapped request is now a clean mirror
    return tables

  def free(self, req_id: ReqId) -> None:
    """Releases every device and host block of the request (finish, abort, recompute preemption)."""
    s = self._seqs.pop(req_id, None)
    if s is None:
      return
    if s.nwb:
      self._drop_wb(req_id, s)
    host = s.host
    if not s.on_host:
      self._mirror_blocks -= s.nhost
      self._dev_free += s.dev
    if s.nhost == len(host):
      self._host_free += host
    elif s.nhost:
      self._host_free += array(HOST_IDS, [h for h in host if h != NO_BLOCK])

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
    host[:] = _no_blocks(n)
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

  # ---------------------------------------------------------------- invariants
  def check_invariants(self) -> None:
    """Raises AssertionError on the first violated invariant (see the module docstring)."""
    bs = self.block_size
    dev_owners = [0] * (self.num_device_blocks + 1)
    host_owners = [0] * self.num_host_blocks
    for rid, s in self._seqs.items():
      n = len(s.host)
      assert len(s.host_tokens) == n, f"{rid!r}: parallel lists differ in length"
      if s.on_host:
        assert not s.dev, f"{rid!r}: swapped request holds device blocks {s.dev}"
      else:
        assert len(s.dev) == n, f"{rid!r}: {len(s.dev)} device ids for {n} logical blocks"
      assert 0 <= s.num_computed <= s.num_tokens, f"{rid!r}: computed {s.num_computed} > {s.num_tokens}"
      assert n == -(-s.num_tokens // bs), f"{rid!r}: {n} blocks do not cover exactly {s.num_tokens} tokens"
      for i in range(n):
        d, h, ht = NO_BLOCK if s.on_host else s.dev[i], s.host[i], s.host_tokens[i]
        assert 0 <= ht <= bs, f"{rid!r}[{i}]: host_tokens {ht}"
        if h == NO_BLOCK:
          assert ht == 0, f"{rid!r}[{i}]: host_tokens {ht} without a host block"
        else:
          assert 0 <= h < self.num_host_blocks, f"{rid!r}[{i}]: bad host id {h}"
          host_owners[h] += 1
        if s.on_host:
          assert h != NO_BLOCK, f"{rid!r}[{i}]: swapped request lacks a host block"
          assert ht >= self._computed_in_block(s, i), f"{rid!r}[{i}]: swapped block is dirty"
        else:
          assert d != PADDING_BLOCK, f"{rid!r}[{i}]: padding block allocated"
          assert 1 <= d <= self.num_device_blocks, f"{rid!r}[{i}]: bad device id {d}"
          dev_owners[d] += 1
          full_dirty = (i + 1) * bs <= s.num_computed and ht < bs
          assert full_dirty == ((rid, i) in self._wb), (
              f"{rid!r}[{i}]: full&dirty={full_dirty} but write-back queued={(rid, i) in self._wb}")
      nhost = n - s.host.count(NO_BLOCK)
      assert s.nhost == nhost, f"{rid!r}: host block count {s.nhost} != {nhost}"
      if s.on_host:
        assert s.num_tokens == s.num_computed, f"{rid!r}: swapped with uncomputed slots"
    mirrors = sum(len(s.host) - s.host.count(NO_BLOCK) for s in self._seqs.values() if not s.on_host)
    assert mirrors == self._mirror_blocks, f"mirror count {self._mirror_blocks} != {mirrors}"
    nwb = collections.Counter()
    for key in self._wb:
      assert key[0] in self._seqs and not self._seqs[key[0]].on_host, f"stale write-back entry {key!r}"
      nwb[key[0]] += 1
    for rid, s in self._seqs.items():
      assert s.nwb == nwb[rid], f"{rid!r}: write-back count {s.nwb} != queued {nwb[rid]}"
    assert dev_owners[PADDING_BLOCK] == 0, "padding block in use"
    assert 0 <= self._dev_head <= len(self._dev_free), f"device free-list head {self._dev_head}"
    assert 0 <= self._host_head <= len(self._host_free), f"host free-list head {self._host_head}"
    dev_free_list = self._free_device_ids()
    dev_free = set(dev_free_list)
    assert len(dev_free) == len(dev_free_list), "device free list has duplicates"
    assert PADDING_BLOCK not in dev_free, "padding block on the free list"
    for b in range(1, self.num_device_blocks + 1):
      assert dev_owners[b] <= 1, f"device block {b} owned {dev_owners[b]} times"
      assert (b in dev_free) == (dev_owners[b] == 0), f"device block {b}: free={b in dev_free}, owners={dev_owners[b]}"
    host_free_list = self._free_host_ids()
    host_free = set(host_free_list)
    assert len(host_free) == len(host_free_list), "host free list has duplicates"
    for b in range(self.num_host_blocks):
      assert host_owners[b] <= 1, f"host block {b} owned {host_owners[b]} times"
      assert (b in host_free) == (host_owners[b] == 0), (
          f"host block {b}: free={b in host_free}, owners={host_owners[b]}")

  def stats(self) -> dict:
    return {"free_device_blocks": self.num_free_device_blocks, "free_host_blocks": self.num_free_host_blocks,
            "requests": len(self._seqs), "pending_writebacks": len(self._wb)}

