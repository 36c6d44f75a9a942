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
handed out. Under rotation a step moves thousands of host ids into the swap-in copy list and device ids out of
the free list; with arrays each move is a ``memcpy`` (into ``StepPlan.swap_in``'s columns, both arrays:
``kv/pairs.h2d_pairs``) instead of an incref of one cold int object per id, and ``block_table``'s per-step
copy of every scheduled request's table is a ``memcpy`` too.

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

Modules
-------
``kv/block_seq.py`` (per-request columns), ``kv/writeback.py`` (eager write-back queue), ``kv/swap.py``
(swap-out / swap-in), ``kv/invariants.py`` (``check_invariants``); this module holds the pools, capacity
queries, ``append_slots`` and ``free``.

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

Ordering contract (the rotation engine relies on it)
----------------------------------------------------
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

from array import array

from superinfer_jax.kv.block_seq import NO_BLOCK, ReqId, SeqBlocks, no_block_ids
from superinfer_jax.kv.invariants import check_invariants as _check_invariants
from superinfer_jax.kv.pairs import DEV_IDS, HOST_IDS, PairList
from superinfer_jax.kv.swap import SwapMixin
from superinfer_jax.kv.writeback import WriteBackMixin


class BlockManager(SwapMixin, WriteBackMixin):
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
    self._seqs: dict[ReqId, SeqBlocks] = {}
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
      s = self._seqs[req_id] = SeqBlocks()
    else:
      if s.on_host:
        raise ValueError(f"append_slots on swapped-out request {req_id!r}; swap_in first")
      need = -(-(s.num_tokens + num_new_tokens) // self.block_size) - len(s.dev)
      if need > len(self._dev_free) - self._dev_head:
        return False
    if need > 0:
      s.dev += self._take_dev(need)
      s.host += no_block_ids(need)
      s.host_tokens += [0] * need
    s.num_tokens += num_new_tokens
    return True

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

  # ---------------------------------------------------------------- invariants
  def check_invariants(self) -> None:
    """Raises AssertionError on the first violated invariant (see the module docstring)."""
    _check_invariants(self)


  def stats(self) -> dict:
    return {"free_device_blocks": self.num_free_device_blocks, "free_host_blocks": self.num_free_host_blocks,
            "requests": len(self._seqs), "pending_writebacks": len(self._wb)}
