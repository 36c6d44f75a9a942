"""KV block manager: device and host block pools, per-request block tables, clean/dirty host copies.

Host-side bookkeeping only (pure Python; no JAX; numpy only inside the block pools, for batched work: a rotation
batch's generation update and queue copy, a bulk release). It decides *which* blocks hold a request's KV and returns
the copy lists the rotation engine (DuplexKV, ``superinfer_jax/rotation``) must execute; it never touches KV data
itself. Copy lists are ``PairList``s (``kv/pairs.py``): sequences of ``(src, dst)`` block-id pairs that read like a
list of 2-tuples but are stored as two int columns (``srcs``, ``dsts``), so moving thousands of blocks per step
allocates no per-pair tuple.

Pools
-----
Each tier is a ``BlockPool`` (``kv/block_pool.py``), ``manager.device`` and ``manager.host``:

* Device pool: block ids ``1..num_device_blocks``. ``PADDING_BLOCK`` (0) is never allocated (the device
  cache array therefore has ``num_device_blocks + 1`` blocks; see ``kv/layout.py``).
* Host pool (pinned host memory): block ids ``0..num_host_blocks-1``.
* Free queues are FIFO: a freed block goes to the tail, allocation pops the head, so the ids handed out
  depend only on the order of allocations and releases. A request's blocks are taken as one slice and
  released with one ``extend`` (C speed; no per-block Python work on the rotation path, which moves up to
  B_xfer blocks per step each way).
* Ownership rule: a block off the free queue is owned by one or more slots, each a (request, logical block) or
  a shared run held for several requests (``kv/shared_run.py``: one slot however many hold it); one owner is
  implicit, extra owners are counted in ``BlockPool.refs``. A block any live request references is never
  free and never written while shared (only full blocks are shared; KV is append-only). Prefix caching
  (docs/prefix_caching.md) shares blocks: a published block whose last owner lets go waits in its pool's
  LRU (``evictable``), counted as free and still findable, until a take evicts it.

Block ids are stored as ``array('i')``: host ids (``HOST_IDS``) in each request's ``host`` column and the host
free queue, device ids (``DEV_IDS``) in each request's ``dev`` column, the device free queue and every block table
handed out. Under rotation a step moves thousands of host ids into the swap-in copy list and device ids out of
the free queue; with arrays each move is a ``memcpy`` (into ``StepPlan.swap_in``'s columns, both arrays:
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
No mixins: ``BlockManager`` (this module) composes the parts below and holds the capacity queries,
``append_slots``, ``mark_computed`` / ``mark_computed_next``, ``free``, the block tables and the count of host
mirrors; its other mutations call the plain functions of ``swap.py`` and ``writeback.py`` and apply the mirror
count change they return.

* ``kv/block_pool.py``: ``BlockPool``, one tier's ids and FIFO free queue (take, release); the ownership rule.
* ``kv/block_seq.py``: ``SeqBlocks``, one request's block columns and token counts; ``NO_BLOCK``; reads over
  the columns (``computed_in_block``, ``dirty_blocks``).
* ``kv/shared_run.py``: ``SharedRun``, leading device blocks several requests found by content, owned once on
  behalf of them all (prefix caching; the registry is ``runs``).
* ``kv/writeback.py``: ``WriteBackQueue`` (the eager write-back queue and its invariant), ``take_writebacks``,
  ``drop_host_mirrors``.
* ``kv/swap.py``: ``swap_out_many`` (with its shortcuts and ``swap_out_general``), ``swap_in_many``.
* ``kv/invariants.py``: ``check_invariants``, through the pools', queue's and columns' public fields.
* ``kv/layout.py``: ``blocks_for(num_tokens, block_size)``, the one block-count definition
  (``BlockManager.blocks_for_tokens`` is its method form), ``PADDING_BLOCK``, ``KVCacheSpec``.
* ``kv/pairs.py``: ``PairList``, the copy lists.

Public fields, read-only outside ``kv/``: ``device`` and ``host`` (the ``BlockPool``s), ``seqs`` (req_id ->
``SeqBlocks``), ``writebacks`` (the ``WriteBackQueue``), ``runs`` (live ``SharedRun``s by their last block's hash),
``num_device_blocks``, ``num_host_blocks``, ``block_size``. Tests and debug read them; the scheduler, engine and
simulator use the methods below.

Public API
----------
``BlockManager(num_device_blocks, num_host_blocks, block_size, host_prefix_cache=True)``

Capacity queries (all O(1) unless noted):
  * ``num_free_device_blocks``, ``num_free_host_blocks`` (properties), ``host_usage()`` and
    ``device_usage()`` (used fraction in [0, 1]).
  * ``blocks_to_grow(req_id, total_tokens) -> int``: device blocks ``append_slots`` would allocate to cover
    ``total_tokens`` tokens (an unknown request counts from 0 tokens). Resident or new requests only.
  * ``blocks_to_swap_in(req_id) -> int``: device blocks ``swap_in`` allocates (the request's block count).
  * ``blocks_for_tokens(num_tokens) -> int``: ``blocks_for(num_tokens, block_size)``.
  * ``blocks_to_swap_out(req_id) -> int``: host blocks ``swap_out`` must allocate (dirty blocks without a
    host copy). O(blocks of the request).
  * ``swap_out_copies(req_id) -> int``: D2H pairs ``swap_out`` would return (blocks whose host copy is missing
    or stale).
  * ``reclaimable_host_blocks()``: host blocks held as mirrors by resident requests; ``num_host_mirrors(id)``.
  * ``num_blocks(req_id)``, ``num_tokens(req_id)``, ``num_computed(req_id)``, ``is_swapped(req_id)``,
    ``has_request(req_id)`` / ``req_id in manager``, ``num_requests``, ``pending_writebacks()`` (queued
    write-back blocks), ``stats()`` (a dict of free blocks, requests and pending write-backs).

Prefix caching (requests created by ``allocate_prefix`` take part; docs/prefix_caching.md):
  * ``lookup_prefix(hashes, max_blocks) -> (device, host)``: leading blocks published on device, then on host.
  * ``allocate_prefix(req_id, hashes, device_hits, host_loads, total_tokens, out) -> bool``: create a request
    on its cached prefix (device hits shared, host hits loaded by H2D pairs appended to ``out``).
  * ``begin_step()``: publishes the last step's host copies (the scheduler calls it first in each step).
  * ``num_cached_requests``, ``prefix_cache_stats()``, ``readopted_blocks``, ``device_references(block)`` (requests
    holding a device block, each member of a shared run counted; for tests).
  * While any block is published or shared (``BlockPool.shared``) or a cached request lives, rotation and
    write-back take the per-request ``*_shared`` paths of ``swap.py`` / ``writeback.py``: a rotated-out cached
    request releases the leading run of its blocks others share and parks the rest, hashed ones included, on
    the device free queue's tail as one group whose queue positions it keeps (``BlockPool.park``: nothing finds
    them while parked); a swap-in re-adopts, with no copy, what the queue has not handed out yet and its
    shared run still published; write-back shares a published host copy.

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
    free queues disjoint from used blocks and complete, padding block never used,
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

from superinfer_jax.kv import shared_run, swap, writeback
from superinfer_jax.kv.block_pool import BlockPool
from superinfer_jax.kv.block_seq import NO_BLOCK, ReqId, SeqBlocks, no_block_ids
from superinfer_jax.kv.invariants import check_invariants as _check_invariants
from superinfer_jax.kv.layout import blocks_for
from superinfer_jax.kv.pairs import DEV_IDS, HOST_IDS, PairList
from superinfer_jax.kv.writeback import WriteBackQueue

__all__ = ["BlockManager", "NO_BLOCK"]


class BlockManager:
  """Device + host block pools and per-request block tables. See the module docstring for the API."""

  def __init__(self, num_device_blocks: int, num_host_blocks: int, block_size: int, host_prefix_cache: bool = True):
    if num_device_blocks < 1:
      raise ValueError(f"num_device_blocks must be >= 1, got {num_device_blocks}")
    if num_host_blocks < 0:
      raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
    if block_size < 1:
      raise ValueError(f"block_size must be >= 1, got {block_size}")
    self.num_device_blocks = num_device_blocks
    self.num_host_blocks = num_host_blocks
    self.block_size = block_size
    self.device = BlockPool(1, num_device_blocks, DEV_IDS)  # PADDING_BLOCK (0) is outside the pool
    self.host = BlockPool(0, num_host_blocks, HOST_IDS)
    self.seqs: dict[ReqId, SeqBlocks] = {}
    self.writebacks = WriteBackQueue()
    self._mirrors = 0  # host blocks held by resident requests (clean or stale mirrors)
    self.host_prefix_cache = host_prefix_cache
    self._ncached = 0  # live requests taking part in prefix caching (SeqBlocks.hashes not None)
    # Host copies of content-hashed blocks made in the current step, (req_id, hashes, first logical block, host ids)
    # per run of consecutive blocks:
    # published by the next begin_step, once their D2H copies are ordered before any H2D copy that reads them.
    self._host_published: list = []
    self.readopted_blocks = 0  # device blocks a swap-in re-adopted with no copy (a request's own re-hits)
    self.runs: dict[int, shared_run.SharedRun] = {}  # live shared runs by their last block's hash (kv/shared_run.py)

  # ---------------------------------------------------------------- capacity queries
  @property
  def _sharing(self) -> bool:
    """The per-request paths that keep reference counts and publish blocks are in force (``kv/swap.py``)."""
    return bool(self._ncached) or self.device.shared or self.host.shared

  @property
  def num_free_device_blocks(self) -> int:
    return self.device.num_free

  @property
  def num_free_host_blocks(self) -> int:
    return self.host.num_free

  @property
  def num_requests(self) -> int:
    return len(self.seqs)

  def device_usage(self) -> float:
    return self.device.usage()

  def host_usage(self) -> float:
    return self.host.usage()

  def reclaimable_host_blocks(self) -> int:
    """Host blocks held as mirrors by resident requests (``drop_host_mirrors`` can release them)."""
    return self._mirrors

  def num_host_mirrors(self, req_id: ReqId) -> int:
    s = self.seqs[req_id]
    return 0 if s.on_host else s.nhost

  def blocks_for_tokens(self, num_tokens: int) -> int:
    return blocks_for(num_tokens, self.block_size)

  def __contains__(self, req_id: ReqId) -> bool:
    return req_id in self.seqs

  def has_request(self, req_id: ReqId) -> bool:
    return req_id in self.seqs

  def is_swapped(self, req_id: ReqId) -> bool:
    return self.seqs[req_id].on_host

  def num_blocks(self, req_id: ReqId) -> int:
    s = self.seqs.get(req_id)
    return 0 if s is None else len(s.host)

  def num_tokens(self, req_id: ReqId) -> int:
    s = self.seqs.get(req_id)
    return 0 if s is None else s.num_tokens

  def num_computed(self, req_id: ReqId) -> int:
    s = self.seqs.get(req_id)
    return 0 if s is None else s.num_computed

  def blocks_to_grow(self, req_id: ReqId, total_tokens: int) -> int:
    """Device blocks ``append_slots`` needs so that the request covers ``total_tokens`` tokens."""
    s = self.seqs.get(req_id)
    have = 0 if s is None else len(s.dev)
    if s is not None and s.on_host:
      raise ValueError(f"request {req_id!r} is swapped out; use blocks_to_swap_in")
    need = blocks_for(total_tokens, self.block_size) - have
    return need if need > 0 else 0

  def blocks_to_swap_in(self, req_id: ReqId) -> int:
    s = self.seqs[req_id]
    return len(s.host) if s.on_host else 0

  def blocks_to_swap_out(self, req_id: ReqId) -> int:
    """Host blocks ``swap_out`` would allocate (computed blocks without any host copy)."""
    s = self.seqs[req_id]
    if s.on_host:
      return 0
    return s.host[:blocks_for(s.num_computed, self.block_size)].count(NO_BLOCK)

  def swap_out_copies(self, req_id: ReqId) -> int:
    """D2H block copies ``swap_out`` would issue (computed blocks whose host copy is missing or stale)."""
    s = self.seqs[req_id]
    if s.on_host:
      return 0
    # Full blocks are dirty exactly when queued for write-back (write-back queue invariant): s.nwb of them;
    # plus the partial tail block if its host copy lacks some of its computed tokens.
    nc = s.num_computed
    tail = nc % self.block_size
    if tail and s.host_tokens[nc // self.block_size] < tail:
      return s.nwb + 1
    return s.nwb

  def pending_writebacks(self) -> int:
    return len(self.writebacks)

  def block_table(self, req_id: ReqId) -> array:
    s = self.seqs[req_id]
    if s.on_host:
      raise ValueError(f"request {req_id!r} is swapped out; it has no device block table")
    return s.dev[:]  # a fresh array (one memcpy; called for every scheduled seq)

  def host_block_table(self, req_id: ReqId) -> list[int]:
    return self.seqs[req_id].host.tolist()

  # ---------------------------------------------------------------- growth and computed marks
  def append_slots(self, req_id: ReqId, num_new_tokens: int) -> bool:
    """Covers ``num_new_tokens`` more tokens on device. All-or-nothing. Creates unknown requests."""
    s = self.seqs.get(req_id)
    if s is not None and not s.on_host and num_new_tokens >= 0:
      # Fast path (a running request's next token usually fits its last block).
      total = s.num_tokens + num_new_tokens
      if total <= len(s.dev) * self.block_size:
        s.num_tokens = total
        return True
    if num_new_tokens < 0:
      raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
    if s is None:
      devs = self.device.take(blocks_for(num_new_tokens, self.block_size))
      if devs is None:
        return False
      s = self.seqs[req_id] = SeqBlocks()
    else:
      if s.on_host:
        raise ValueError(f"append_slots on swapped-out request {req_id!r}; swap_in first")
      devs = self.device.take(blocks_for(s.num_tokens + num_new_tokens, self.block_size) - len(s.dev))
      if devs is None:
        return False
    need = len(devs)
    if need:
      s.dev += devs
      s.host += no_block_ids(need)
      s.host_tokens += [0] * need
    s.num_tokens += num_new_tokens
    return True

  def mark_computed(self, req_id: ReqId, num_computed_tokens: int) -> None:
    """Records that the first ``num_computed_tokens`` tokens' KV is written by a dispatched step; blocks that
    become full are queued for write-back if dirty."""
    s = self.seqs[req_id]
    old = s.num_computed
    if s.on_host:
      raise ValueError(f"mark_computed on swapped-out request {req_id!r}")
    if num_computed_tokens < old or num_computed_tokens > s.num_tokens:
      raise ValueError(f"mark_computed({req_id!r}, {num_computed_tokens}): must be in "
                       f"[{s.num_computed}, {s.num_tokens}]")
    s.num_computed = num_computed_tokens
    bs = self.block_size
    first = old // bs  # first block that was not full before
    end = num_computed_tokens // bs
    if end > first:
      self.writebacks.queue_filled(req_id, s, first, end, bs)
      if first < s.nhashes:
        self._publish_device(s, first, end)

  def _publish_device(self, s: SeqBlocks, first: int, end: int) -> None:
    """Publishes logical blocks ``first..end-1`` of ``s`` (just full and computed; ``first < s.nhashes``) under
    their content hashes (those that have one; a hash published already by another block of the same content stays
    with it)."""
    hashes = s.hashes
    if self.device.publish_chain(s.dev[first:end], hashes, first, s):
      end = min(end, len(hashes))
      if end > s.pub_end:
        s.pub_end = end

  def mark_computed_next(self, req_ids) -> None:
    """``mark_computed(req_id, num_computed + 1)`` for each id in order (resident requests with an uncomputed
    slot): the scheduler marks each swapped-in request's pending token with one call per batch."""
    seqs = self.seqs
    bs = self.block_size
    for req_id in req_ids:
      s = seqs[req_id]
      c = s.num_computed + 1
      if s.on_host or c > s.num_tokens:
        raise ValueError(f"mark_computed_next({req_id!r}): swapped out, or no uncomputed slot "
                         f"(computed {s.num_computed} of {s.num_tokens})")
      s.num_computed = c
      if not c % bs:  # block c // bs - 1 just filled
        self.writebacks.queue_filled(req_id, s, c // bs - 1, c // bs, bs)
        if c // bs <= s.nhashes:
          self._publish_device(s, c // bs - 1, c // bs)

  # ---------------------------------------------------------------- write-back (kv/writeback.py)
  def take_writebacks(self, max_blocks: int | None = None, min_free_host: int = 0) -> PairList:
    """Eager write-back: D2H pairs for full, computed, dirty blocks (oldest first); marks them clean."""
    if self._sharing:
      published = []
      pairs, taken = writeback.take_writebacks_shared(self.writebacks, self.seqs, self.host, self.block_size,
                                                      max_blocks, min_free_host, published)
      self._queue_host_published(published)
    else:
      pairs, taken = writeback.take_writebacks(self.writebacks, self.seqs, self.host, self.block_size, max_blocks,
                                               min_free_host)
    self._mirrors += taken
    return pairs

  def drop_host_mirrors(self, req_id: ReqId) -> int:
    """Releases the host copies of a *resident* request (they are redundant); returns blocks released.

    Lets a caller reclaim host space held by clean mirrors of running requests. The next ``swap_out`` of the
    request then copies every computed block again. Must not be called for a request swapped in during the
    current step (its host blocks are this step's H2D sources; ordering contract 3).
    """
    s = self.seqs[req_id]
    if s.on_host:
      raise ValueError(f"request {req_id!r} is swapped out; its host blocks are its only copy")
    released = writeback.drop_host_mirrors(self.writebacks, req_id, s, self.host, self.block_size)
    self._mirrors -= released
    return released

  # ---------------------------------------------------------------- rotation (kv/swap.py)
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
    scheduler rotates a step's victims out with one call. Raises ValueError, changing nothing, if an id repeats
    or is swapped out already.
    """
    req_ids = self._batch(req_ids, False)
    if self._sharing:
      published = []
      done, moved, mirrors = swap.swap_out_shared(self.seqs, self.device, self.host, self.writebacks,
                                                  self.block_size, req_ids, out, published, self.runs)
      self._queue_host_published(published)
    else:
      done, moved, mirrors = swap.swap_out_many(self.seqs, self.device, self.host, self.writebacks,
                                                self.block_size, req_ids, out)
    self._mirrors += mirrors
    return done, moved

  def _batch(self, req_ids, on_host: bool) -> list:
    """``req_ids`` as a list, each a request swapped out (``on_host``) or resident (not): a rotation batch's
    ids, checked before anything moves. Raises ValueError if one is in the other state or an id repeats."""
    ids = list(req_ids)
    seqs = self.seqs
    for req_id in ids:
      if seqs[req_id].on_host != on_host:
        raise ValueError(f"request {req_id!r} is " + ("not swapped out" if on_host else "already swapped out"))
    if len(set(ids)) != len(ids):
      raise ValueError(f"request ids repeat in one batch: {ids}")
    return ids

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
    free queue's head in the order the two calls would take them (the swap-in's, then the growth's). None:
    the device pool lacks blocks for both; nothing changed.
    """
    tables = self.swap_in_many((req_id,), num_new_tokens, out)
    return tables[0] if tables else None

  def swap_in_many(self, req_ids, num_new_tokens: int, out: PairList) -> list[array]:
    """``swap_in_grow(req_id, num_new_tokens, out)`` for each (distinct) id in order, stopping at the first
    the device pool cannot take. Returns the new block tables of those swapped in (a prefix of ``req_ids``;
    fresh arrays); their H2D pairs are appended to ``out`` in order. The device blocks are exactly those the
    calls one by one would take. The scheduler rotates a step's requests in with one call. Raises ValueError,
    changing nothing, if an id repeats or is not swapped out, or ``num_new_tokens`` < 0.
    """
    if num_new_tokens < 0:
      raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
    req_ids = self._batch(req_ids, True)
    if self._sharing:
      tables, mirrors, readopted = swap.swap_in_shared(self.seqs, self.device, self.block_size, req_ids,
                                                       num_new_tokens, out, self.runs)
      self.readopted_blocks += readopted
    else:
      tables, mirrors = swap.swap_in_many(self.seqs, self.device, self.block_size, req_ids, num_new_tokens, out)
    self._mirrors += mirrors
    return tables

  # ---------------------------------------------------------------- release
  def free(self, req_id: ReqId) -> None:
    """Releases every device and host block of the request (finish, abort, recompute preemption)."""
    s = self.seqs.pop(req_id, None)
    if s is None:
      return
    if s.nwb:
      self.writebacks.drop(req_id, s)
    if self._sharing:
      self._free_shared(req_id, s)
      return
    ids = s.host
    if not s.on_host:
      self._mirrors -= s.nhost
      self.device.release(s.dev)
    if s.nhost == len(ids):
      self.host.release(ids)
    elif s.nhost:
      self.host.release(array(HOST_IDS, [h for h in ids if h != NO_BLOCK]))

  def _free_shared(self, req_id: ReqId, s: SeqBlocks) -> None:
    """``free`` with shared blocks: a swapped-out request's parked group needs nothing (its blocks are on the free
    queue already, never found again), a resident one's device blocks and either's host blocks released tail
    first (published ones stay findable, in the LRU)."""
    if s.hashes is not None:
      self._ncached -= 1
    if not s.on_host:
      self._mirrors -= s.nhost
      dev = s.dev
      if s.run is not None:  # the run keeps its blocks for its other members, or passes them to this last one
        dev = dev[shared_run.leave(self.runs, s.run):]
        s.run = None
      self.device.release(dev[::-1])
    if s.nhost == len(s.host):
      self.host.release(s.host[::-1])
    elif s.nhost:
      self.host.release(array(HOST_IDS, [h for h in reversed(s.host) if h != NO_BLOCK]))

  # ---------------------------------------------------------------- prefix caching
  def begin_step(self) -> None:
    """Starts a scheduling step: the host copies of content-hashed blocks made in the last step are published
    (host tier on), those whose request still holds them clean. Their D2H copies were issued in that step, so
    every H2D copy that can read them now comes later (ordering contract 3)."""
    pending = self._host_published  # empty with the host tier off (_queue_host_published)
    if not pending:
      return
    self._host_published = []
    seqs = self.seqs
    bs = self.block_size
    publish = self.host.publish_chain
    for req_id, hashes, start, hosts in pending:
      s = seqs.get(req_id)
      if s is None:
        continue
      end = start + len(hosts)
      if end <= len(s.host) and s.host[start:end] == hosts and s.host_tokens[start:end].count(bs) == len(hosts):
        publish(hosts, hashes, start, s)
        continue
      for j, h in enumerate(hosts, start):  # some copies dropped or replaced since: those still held
        if j < len(s.host) and s.host[j] == h and s.host_tokens[j] == bs:
          publish(hosts[j - start:j - start + 1], hashes, j, s)

  def _queue_host_published(self, published: list) -> None:
    """Queues ``(req_id, hashes, first logical block, host ids)`` entries for ``begin_step`` (host tier on)."""
    if published and self.host_prefix_cache:
      self._host_published += published

  @property
  def num_cached_requests(self) -> int:
    """Live requests taking part in prefix caching."""
    return self._ncached

  def lookup_prefix(self, hashes, max_blocks: int) -> tuple[int, int]:
    """``(device, host)``: the longest run of ``hashes``' leading blocks (at most ``max_blocks``) published on
    device, then how many of the blocks after it are published on host (0 with the host tier off). ``hashes``:
    int content hashes (``kv/prefix_hash.py``; the pools index ints). Never changes anything."""
    n = min(max_blocks, len(hashes))
    d = self.device.published_run(hashes, 0, n)
    h = self.host.published_run(hashes, d, n) if self.host_prefix_cache else d
    return d, h - d

  def allocate_prefix(self, req_id: ReqId, hashes: tuple, device_hits: int, host_loads: int, total_tokens: int,
                      out: PairList) -> bool:
    """Creates request ``req_id`` (unknown to the manager) covering ``total_tokens`` slots, its first
    ``device_hits`` logical blocks the published device blocks of ``hashes`` (shared, no copy), the next
    ``host_loads`` fresh device blocks loaded from the published host copies (H2D pairs appended to ``out``;
    the host copies become its clean mirrors), the rest fresh. Its computed tokens are those hit blocks',
    ``(device_hits + host_loads) * block_size``, which must be < ``total_tokens``. The request takes part in
    prefix caching from now on (its blocks are published as they fill). All-or-nothing: False (nothing
    changed) if the device pool lacks blocks. ``lookup_prefix`` gives hits that are valid until the next
    mutation. ``hashes`` must be chained (``kv/prefix_hash.py``: an equal hash at index i means equal blocks 0..i):
    a live shared run of the hit blocks is found by the last hit's hash alone (``kv/shared_run.py``)."""
    if req_id in self.seqs:
      raise ValueError(f"allocate_prefix: request {req_id!r} exists")
    bs = self.block_size
    hit = device_hits + host_loads
    if hit * bs >= total_tokens or hit > len(hashes):
      raise ValueError(f"allocate_prefix({req_id!r}): {hit} hit blocks for {total_tokens} tokens "
                       f"({len(hashes)} hashes)")
    dev_pool = self.device
    total = blocks_for(total_tokens, bs)
    run = None
    if device_hits:
      key = hashes[device_hits - 1]
      run = self.runs.get(key)  # a live run of exactly these blocks: join it (kv/shared_run.py)
      if run is not None:
        if total - device_hits > dev_pool.num_free:
          return False
        run.members += 1
        hit_dev = run.blocks
      else:
        hit_dev = dev_pool.lookup_chain(hashes[:device_hits])
        if None in hit_dev:
          raise ValueError(f"allocate_prefix({req_id!r}): a device hit is not published (stale lookup_prefix)")
        revive = len(dev_pool.evictable.keys() & hit_dev)  # re-adopting an evictable block takes a free one
        if total - device_hits + revive > dev_pool.num_free:
          return False
        dev_pool.share_many(hit_dev)
        run = shared_run.register(self.runs, key, hit_dev, 1)
      fresh = dev_pool.take(total - device_hits)
    else:
      fresh = dev_pool.take(total)
      if fresh is None:
        return False
    s = self.seqs[req_id] = SeqBlocks()
    s.hashes = hashes
    s.nhashes = len(hashes)
    s.run = run
    s.pub_end = device_hits  # (its hits are published)
    self._ncached += 1
    if device_hits:
      s.dev += run.blocks
    s.dev += fresh
    s.host += no_block_ids(total)
    s.host_tokens += [0] * total
    for i in range(device_hits, hit):
      h = self.host.lookup_at(hashes, i)
      self.host.share(h)
      s.host[i] = h
      s.host_tokens[i] = bs
      out.srcs.append(h)
      out.dsts.append(s.dev[i])
    s.nhost = host_loads
    self._mirrors += host_loads
    s.num_tokens = total_tokens
    s.num_computed = hit * bs
    if device_hits:  # full, computed and without a host copy: dirty (write-back shares a published one)
      self.writebacks.queue_filled(req_id, s, 0, device_hits, bs)
    if host_loads:  # their KV is on device before the step that reads it runs (ordering contract 1)
      self._publish_device(s, device_hits, hit)
    return True

  def prefix_cache_stats(self) -> dict:
    """Cached blocks per tier (published), evictable ones, evictions so far, re-adopted blocks."""
    d, h = self.device, self.host
    return {"device_cached_blocks": d.num_published, "device_evictable_blocks": len(d.evictable),
            "device_evictions": d.evictions, "host_cached_blocks": h.num_published,
            "host_evictable_blocks": len(h.evictable), "host_evictions": h.evictions,
            "readopted_blocks": self.readopted_blocks}

  def device_references(self, block: int) -> int:
    """Requests holding owned device ``block``, each member of a shared run holding it counted (the pool counts the
    run once). O(live runs); for tests and debug."""
    return shared_run.references(self.runs, self.device, block)

  # ---------------------------------------------------------------- invariants
  def check_invariants(self) -> None:
    """Raises AssertionError on the first violated invariant (see the module docstring)."""
    _check_invariants(self)

  def stats(self) -> dict:
    return {"free_device_blocks": self.device.num_free, "free_host_blocks": self.host.num_free,
            "requests": len(self.seqs), "pending_writebacks": len(self.writebacks)}
