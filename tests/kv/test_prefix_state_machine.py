"""Hypothesis stateful test of the block manager with prefix caching (shared, published, evictable blocks).

The machine drives ``BlockManager`` the way the scheduler does, one scheduling step at a time: a step opens
with ``begin_step()``; any number of step operations follow (admit a cached request through
``lookup_prefix`` / ``allocate_prefix`` with device hits and host loads, admit a plain no-cache request with
``append_slots`` (pressure that evicts cached blocks), grow a running request by a prefill chunk or a decode
token, rotate requests out (``swap_out_many``) and in (``swap_in_many``, round trips included), finish,
recompute-preempt (free, re-admitted later with the same hashes), drop host mirrors); the ``step`` operation
closes it: ``take_writebacks`` last, then the step's copies and model step, then ``mark_computed`` /
``mark_computed_next`` of every scheduled chunk in plan order; requests may finish between that and the next
step's ``begin_step`` (``on_step_done``). Operations on a request moved, admitted or
grown in the open step are not issued (ordering contract 3 of ``kv/block_manager.py``; the scheduler's
``touched_step``), except a swap-in straight after a swap-out (a round trip).

A shadow KV model holds one value per token slot of every device and host block. A token's value is the tuple
of its request's tokens up to and including it (equal prefixes have equal KV, which is what makes sharing
sound). A step's copies are applied as the engine orders them: every D2H gather (swap-out, then write-back
pairs) reads the device blocks as the last model step left them (the step's start); H2D scatters come after;
the model step then writes the scheduled tokens. Blocks handed out fresh are poisoned at once, free-queue
blocks at the end of every step except parked ones (their owner's swap-in re-adopts them; evictable ones keep
their KV too: they are findable).

Checked after every operation, besides ``check_invariants()`` (with the step's pending copies applied to a
virtual view where a check reads data the engine will have by the next model step):
  * no referenced block freed: no block of a live request is on a free queue (parked blocks sit there),
    evictable or parked;
  * reference counts: owners counted from ``seqs`` equal ``pool.owners(b)``, and every block is exactly one
    of owned / free / evictable;
  * no hash findable before its KV is written: a device block published under a content hash holds that
    hash's tokens (pending H2D included: a host load's block is published at admission and read after the
    step's scatter), a block parked for a rotated-out request holds that request's computed tokens of the
    logical block it stands for (its swap-in re-adopts it with no copy); a host block published
    under a hash holds them already (no pending copy counts: host entries are published a step after their
    D2H copy, and the check runs again between ``take_writebacks`` and the copies);
  * no lost KV: every computed token of every live request is in its device block (resident) or host block
    (swapped), and every host copy holds the tokens ``host_tokens`` says;
  * the copy lists keep ordering contract 3 (no host block both a D2H target and an H2D source except in a
    round-trip step, no block a copy target twice), and the model step never writes a shared or published
    block;
  * the shadow request counts (tokens, computed, swapped) agree with the manager's; failed operations
    change nothing.
"""
import collections

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from superinfer_jax.kv.block_manager import NO_BLOCK, BlockManager
from superinfer_jax.kv.block_seq import computed_in_block
from superinfer_jax.kv.layout import blocks_for
from superinfer_jax.kv.pairs import PairList, h2d_pairs
from superinfer_jax.kv.prefix_hash import block_hashes

POISON = None
MAX_LIVE = 6  # live requests at most (the scheduler's max_num_seqs): admissions wait for finishes
VOCAB = (0, 1, 2)  # suffix and decode tokens: a small vocabulary so equal prompts (and hits) are common
_BASE = (30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41)
_OTHER = (50, 51, 52, 53, 54, 55, 56, 57)


def system_prefixes(bs: int) -> list[tuple]:
  """Fixed prompt heads: two blocks, three blocks extending the first, another two blocks, none."""
  return [_BASE[:2 * bs], _BASE[:3 * bs], _OTHER[:2 * bs], ()]


def _parked_groups(bm) -> dict:
  """Swapped-out cached request -> what is left of its parked group on the device free queue (its swap-in
  re-adopts it; empty once the queue handed it out)."""
  return {rid: bm.device.parked_blocks(s.park_end, s.park_count)
          for rid, s in bm.seqs.items() if s.on_host and s.hashes is not None}


class Req:
  """Shadow of one request: its known tokens (prompt, then sampled ones) and their KV values."""
  __slots__ = ("tokens", "prompt_len", "hashes", "cap", "vals", "sampled")

  def __init__(self, tokens, hashes, cap):
    self.tokens = list(tokens)
    self.prompt_len = len(tokens)
    self.hashes = hashes
    self.cap = cap  # no more sampled tokens once it knows this many
    self.vals = []
    self.sampled = False  # sampled a token since it last entered running (the scheduler's rotatable)

  def value(self, t: int) -> tuple:
    vals = self.vals
    while len(vals) <= t:
      vals.append(tuple(self.tokens[:len(vals) + 1]))
    return vals[t]

  def values(self, start: int, end: int) -> list:
    return [self.value(t) for t in range(start, end)]


class PrefixCacheMachine(RuleBasedStateMachine):
  ROTATE_ANY = False  # rotate out only what the scheduler would (see _rotatable)

  def __init__(self):
    super().__init__()
    self.bm = None

  @initialize(bs=st.integers(2, 4), ndev=st.integers(8, 24), nhost=st.integers(8, 24),
              host_cache=st.sampled_from([True, True, True, False]))
  def setup(self, bs, ndev, nhost, host_cache):
    self.bs = bs
    self.bm = BlockManager(ndev, nhost, bs, host_prefix_cache=host_cache)
    self.prefixes = system_prefixes(bs)
    self.dev = {b: [POISON] * bs for b in range(ndev + 1)}  # lists are replaced, never mutated in place
    self.host = {h: [POISON] * bs for h in range(nhost)}
    self.hash_tokens = {}  # content hash -> the tokens it stands for (the prefix through its block)
    self.reqs = {}  # live requests (known to the manager)
    self.expect = {}  # rid -> [num_tokens, num_computed, on_host]
    self.waiting = {}  # recompute-preempted requests, re-admitted later with their hashes
    self.prompts = []  # prompts admitted so far
    self.prompt_hashes = {}  # prompt -> block_hashes(prompt, bs)
    self.next_id = 0
    self.done_ids = []  # ids of finished requests: a new request may reuse one (ids are only unique while live)
    self.stats = collections.Counter()
    self._open_step()
    self.bm.begin_step()

  def _open_step(self):
    self.dev_start = dict(self.dev)  # the device cache as the last model step left it (D2H gathers read it)
    self.touched = set()
    self.swapped_out_now = set()
    self.round_trip = False
    self.d2h = PairList.from_columns([], [])  # swap-out pairs of the open step
    self.h2d = h2d_pairs()  # swap-in and host-load pairs of the open step
    self.plan = []  # ("chunk", rid) or ("next", [rids]) in plan order: marked computed when the step closes

  # ------------------------------------------------------------------------------------------ helpers
  def _expected_block(self, key) -> list:
    prefix = self.hash_tokens[key]
    end = len(prefix)
    return [prefix[:t + 1] for t in range(end - self.bs, end)]

  def _poison_dev(self, blocks):
    for b in blocks:
      self.dev[b] = [POISON] * self.bs

  def _fingerprint(self):
    bm = self.bm
    seqs = tuple(sorted((repr(r), tuple(s.dev), tuple(s.host), tuple(s.host_tokens), s.num_tokens,
                         s.num_computed, s.on_host, s.nwb) for r, s in bm.seqs.items()))
    pools = tuple((tuple(p.free_ids()), tuple(p.evictable), tuple(sorted(p.refs.items())),
                   tuple(sorted(p.published_items().items(), key=repr)),
)
                  for p in (bm.device, bm.host))
    parked = tuple(sorted(((repr(r), tuple(g)) for r, g in _parked_groups(bm).items())))
    return seqs, pools, parked, tuple(bm.writebacks), len(self.d2h), len(self.h2d), bm.reclaimable_host_blocks()

  def _resident(self):
    """Resident requests not touched in the open step (so every token of theirs is computed)."""
    return [r for r, e in self.expect.items() if not e[2] and r not in self.touched]

  def _swapped(self):
    return [r for r, e in self.expect.items()
            if e[2] and (r not in self.touched or r in self.swapped_out_now)]

  def _new_id(self, data):
    ready = [r for r in self.done_ids if r not in self.touched]
    if ready and data.draw(st.integers(0, 3)) == 0:
      rid = data.draw(st.sampled_from(ready))
      self.done_ids.remove(rid)
      self.stats["reused_ids"] += 1
      return rid
    self.next_id += 1
    return self.next_id - 1

  def _pick(self, data, cands, max_n=1):
    cands = sorted(cands)
    if max_n == 1:
      return [data.draw(st.sampled_from(cands))]
    return data.draw(st.lists(st.sampled_from(cands), min_size=1, max_size=max_n, unique=True))

  def _overlays(self):
    """(host overlay, device overlay): the open step's pending copies applied to views of the pools."""
    vhost = {}
    for d, h in zip(self.d2h.srcs, self.d2h.dsts):
      vhost[h] = self.dev_start[d]
    vdev = {}
    for h, d in zip(self.h2d.srcs, self.h2d.dsts):
      vdev[d] = vhost[h] if h in vhost else self.host[h]
    return vhost, vdev

  def _check_copy_lists(self, d2h, h2d):
    """Ordering contract 3 over the step's copy lists (pairs)."""
    d2h_dst = [h for _, h in d2h]
    assert len(set(d2h_dst)) == len(d2h_dst), f"a host block is a D2H target twice: {d2h}"
    h2d_dst = [d for _, d in h2d]
    assert len(set(h2d_dst)) == len(h2d_dst), f"a device block is an H2D target twice: {h2d}"
    if not self.round_trip:
      both = set(d2h_dst) & {h for h, _ in h2d}
      assert not both, f"host blocks {sorted(both)} are D2H targets and H2D sources in one step (no round trip)"

  def _check_host_index(self):
    """Host entries are findable only after their copy: the host pool itself (no pending copy) holds them."""
    for key, h in self.bm.host.published_items().items():
      assert isinstance(key, int), f"host index key {key!r}"
      assert self.host[h] == self._expected_block(key), (
          f"host block {h} findable under a hash without its KV (copy not landed, or freed): holds {self.host[h]}")

  # ------------------------------------------------------------------------------------------ operations
  def admit(self, data):
    bm, bs = self.bm, self.bs
    if len(self.reqs) >= MAX_LIVE:
      return
    ready = sorted(r for r in self.waiting if r not in self.touched)
    if ready and data.draw(st.booleans()):
      rid = data.draw(st.sampled_from(ready))
      req = self.waiting[rid]
      readmit = True
    else:
      # A prompt seen before (its blocks may be cached anywhere), preferably one with host hits now.
      on_host = [p for p in self.prompts if bm.lookup_prefix(self.prompt_hashes[p], (len(p) - 1) // bs)[1]]
      if on_host and data.draw(st.booleans()):
        prompt = data.draw(st.sampled_from(on_host))
      elif self.prompts and data.draw(st.booleans()):
        prompt = data.draw(st.sampled_from(self.prompts))
      else:
        head = data.draw(st.sampled_from(self.prefixes))
        suffix = data.draw(st.lists(st.sampled_from(VOCAB), min_size=0 if head else 1, max_size=2 * bs + 1))
        prompt = tuple(head) + tuple(suffix)
        if prompt not in self.prompt_hashes:
          self.prompts.append(prompt)
          self.prompt_hashes[prompt] = block_hashes(prompt, bs)
      hashes = self.prompt_hashes[prompt]
      for i, key in enumerate(hashes):
        self.hash_tokens.setdefault(key, prompt[:(i + 1) * bs])
        assert self.hash_tokens[key] == prompt[:(i + 1) * bs], "hash collision"
      rid = self._new_id(data)
      req = Req(prompt, hashes, len(prompt) + 4 * bs)
      readmit = False
    hashes = req.hashes
    planned = len(req.tokens)
    maxb = (planned - 1) // bs
    d, h = bm.lookup_prefix(hashes, maxb)
    n = min(maxb, len(hashes))
    assert d + h <= n and all(bm.device.lookup(hashes[i]) is not None for i in range(d))
    assert d == n or bm.device.lookup(hashes[d]) is None
    if bm.host_prefix_cache:
      assert all(bm.host.lookup(hashes[i]) is not None for i in range(d, d + h))
      assert d + h == n or bm.host.lookup(hashes[d + h]) is None
    else:
      assert h == 0
    if h and data.draw(st.integers(0, 3)) == 0:
      h = 0  # the scheduler's load-or-recompute rule said recompute
    # What the hits stand for must be there already: device hits in the device blocks (a host load's block
    # published earlier in this step included, its H2D scatter runs before any model step reads it), host
    # hits in the host blocks (their D2H copies landed in an earlier step).
    _, vdev = self._overlays()
    hit_dev = [bm.device.lookup(hashes[i]) for i in range(d)]
    for i, b in enumerate(hit_dev):
      got = vdev.get(b, self.dev[b])
      assert got == req.values(i * bs, (i + 1) * bs), f"device hit block {b} (logical {i}) holds {got}"
    for i in range(d, d + h):
      hb = bm.host.lookup(hashes[i])
      assert self.host[hb] == req.values(i * bs, (i + 1) * bs), f"host hit block {hb} holds {self.host[hb]}"
    c = (d + h) * bs
    chunk = data.draw(st.one_of(st.just(planned - c), st.integers(1, planned - c)))
    total = c + chunk
    revive = sum(bm.device.is_evictable(b) for b in hit_dev)
    fits = blocks_for(total, bs) - d + revive <= bm.device.num_free
    before = self._fingerprint()
    npairs = len(self.h2d)
    ok = bm.allocate_prefix(rid, hashes, d, h, total, self.h2d)
    assert ok == fits, f"allocate_prefix returned {ok}, capacity says {fits}"
    if not ok:
      assert self._fingerprint() == before, "a failed allocate_prefix changed something"
      self.stats["admit_failed"] += 1
      return
    s = bm.seqs[rid]
    assert s.dev[:d].tolist() == hit_dev, "device hits are not the published blocks"
    assert len(self.h2d) - npairs == h
    self._poison_dev(s.dev[d:])  # fresh (host-loaded ones get their H2D scatter)
    if readmit:
      del self.waiting[rid]
    req.sampled = False
    self.reqs[rid] = req
    self.expect[rid] = [total, c, False]
    self.touched.add(rid)
    self.plan.append(("chunk", rid))
    self.stats["device_hits"] += d
    self.stats["host_loads"] += h

  def admit_plain(self, data, evict=False):
    """A no-cache request (no hashes), up to most of the device pool; with ``evict``, one that needs more
    blocks than the free queue holds, so that its allocation evicts cached (evictable) blocks, usually freed
    at once (its blocks are poisoned: whatever still read them would see it)."""
    bm, bs = self.bm, self.bs
    if evict:
      nfree, nevict = len(bm.device.free_ids()), len(bm.device.evictable)
      if not nevict:
        return
      n = data.draw(st.one_of(st.just((nfree + nevict) * bs), st.integers(nfree * bs + 1, (nfree + nevict) * bs)))
      self.stats["evict_pressure"] += 1
    else:
      n = data.draw(st.integers(1, max(1, bm.num_device_blocks * bs * 3 // 4)))
    rid = self._new_id(data)
    fits = blocks_for(n, bs) <= bm.device.num_free
    before = self._fingerprint()
    ok = bm.append_slots(rid, n)
    assert ok == fits
    if not ok:
      assert self._fingerprint() == before, "a failed append_slots changed something"
      return
    self._poison_dev(bm.seqs[rid].dev)
    if evict and data.draw(st.integers(0, 3)):  # gone at once (aborted): the evicted blocks' KV is gone too
      bm.free(rid)
      self.done_ids.append(rid)
      self.touched.add(rid)
      return
    self.reqs[rid] = Req([-1 - rid] * n, None, n + bs)
    self.expect[rid] = [n, 0, False]
    self.touched.add(rid)
    self.plan.append(("chunk", rid))

  def grow(self, data, rid=None):
    """A running request's next prefill chunk, or its decode token."""
    if rid is None:
      cands = [r for r in self._resident() if len(self.reqs[r].tokens) > self.expect[r][0]]
      if not cands:
        return
      rid = self._pick(data, cands)[0]
    e = self.expect[rid]
    rem = len(self.reqs[rid].tokens) - e[0]
    k = data.draw(st.one_of(st.just(rem), st.integers(1, rem)))
    s = self.bm.seqs[rid]
    old = len(s.dev)
    fits = self.bm.blocks_to_grow(rid, e[0] + k) <= self.bm.device.num_free
    before = self._fingerprint()
    ok = self.bm.append_slots(rid, k)
    assert ok == fits
    if not ok:
      assert self._fingerprint() == before, "a failed append_slots changed something"
      return
    self._poison_dev(s.dev[old:])
    e[0] += k
    self.touched.add(rid)
    self.plan.append(("chunk", rid))

  def _rotatable(self, rid) -> bool:
    """May be rotated out: with ``ROTATE_ANY``, every resident request not touched in the step (they are all
    fully computed); else only as the scheduler rotates (``Request.rotatable``): in the decode phase, exactly
    its one sampled token without KV, sampled since it last entered running."""
    if self.ROTATE_ANY:
      return True
    req = self.reqs[rid]
    return req.sampled and len(req.tokens) - self.expect[rid][1] == 1

  def rotate_out(self, data, everyone=False):
    """Rotates out up to three rotatable requests, or (``everyone``: host pressure) all of them at once."""
    cands = [r for r in self._resident() if self._rotatable(r)]
    if not cands:
      return
    if self.ROTATE_ANY and not everyone:  # often one stopped inside a hashed prompt block (mid-prefill)
      mid = [r for r in cands if self.expect[r][1] < len(self.reqs[r].hashes or ()) * self.bs
             and self.expect[r][1] % self.bs]
      if mid and data.draw(st.booleans()):
        cands = mid
    rids = sorted(cands) if everyone else self._pick(data, cands, 3)
    bm = self.bm
    start = len(self.d2h)
    k, moved = bm.swap_out_many(rids, self.d2h)
    assert 0 <= k <= len(rids) and moved == len(self.d2h) - start
    for rid in rids[:k]:
      e = self.expect[rid]
      assert e[0] == e[1], "rotated a request with uncomputed slots"
      e[2] = True
      self.touched.add(rid)
      self.swapped_out_now.add(rid)
      self.stats["rotated_out"] += 1
    for rid in rids[k:]:
      assert not bm.seqs[rid].on_host
    if k < len(rids):
      self.stats["rotate_out_refused"] += 1

  def rotate_in(self, data):
    cands = self._swapped()
    if not cands:
      return
    rids = self._pick(data, cands, 2)
    grow = 1 if all(len(self.reqs[r].tokens) > self.expect[r][0] for r in rids) and data.draw(st.booleans()) else 0
    bm = self.bm
    old_len = {r: len(bm.seqs[r].host) for r in rids}
    start = len(self.h2d)
    tables = bm.swap_in_many(rids, grow, self.h2d)
    new_pairs = list(zip(self.h2d.srcs[start:], self.h2d.dsts[start:]))
    loaded = {d for _, d in new_pairs}
    for rid, table in zip(rids, tables):
      s = bm.seqs[rid]
      assert not s.on_host and table.tolist() == s.dev.tolist()
      # Blocks without an H2D pair were re-adopted (their KV is on device); the growth's blocks are fresh.
      self._poison_dev(s.dev[old_len[rid]:])
      self.stats["readopted"] += sum(1 for b in s.dev[:old_len[rid]] if b not in loaded)
      e = self.expect[rid]
      e[0] += grow
      e[2] = False
      if rid in self.swapped_out_now:
        self.round_trip = True
        self.stats["round_trips"] += 1
      self.touched.add(rid)
      self.stats["rotated_in"] += 1
    for rid in rids[len(tables):]:
      assert bm.seqs[rid].on_host
    if grow and tables:
      self.plan.append(("next", list(rids[:len(tables)])))

  def finish(self, data):
    cands = [r for r in self.expect if r not in self.touched]
    if not cands:
      return
    rid = self._pick(data, cands)[0]
    self.bm.free(rid)
    del self.reqs[rid]
    del self.expect[rid]
    self.done_ids.append(rid)
    self.touched.add(rid)
    self.stats["finished"] += 1

  def preempt(self, data):
    """Recompute preemption: free; the request waits to be re-admitted with the same hashes."""
    cands = [r for r in self.expect if r not in self.touched and self.reqs[r].hashes is not None]
    if not cands:
      return
    rid = self._pick(data, cands)[0]
    self.bm.free(rid)
    self.waiting[rid] = self.reqs.pop(rid)
    del self.expect[rid]
    self.touched.add(rid)
    self.stats["preempted"] += 1

  def drop_mirrors(self, data):
    cands = self._resident()
    if not cands:
      return
    rid = self._pick(data, cands)[0]
    if self.bm.drop_host_mirrors(rid):
      self.stats["mirrors_dropped"] += 1

  def step(self, data):
    """Closes the open step (write-backs last, copies, model step, computed marks) and opens the next."""
    bm, bs = self.bm, self.bs
    if data.draw(st.booleans()):  # as a scheduler does: every running request gets its next chunk
      for rid in self._resident():
        if len(self.reqs[rid].tokens) > self.expect[rid][0]:
          self.grow(data, rid)
    max_blocks = data.draw(st.one_of(st.none(), st.integers(0, 4)))
    min_free = data.draw(st.integers(0, 2))
    wb = bm.take_writebacks(max_blocks, min_free)
    if max_blocks is not None:
      assert len(wb) <= max_blocks
    self._check_host_index()  # nothing published by this step's write-backs yet
    d2h = list(zip(self.d2h.srcs, self.d2h.dsts)) + list(zip(wb.srcs, wb.dsts))
    h2d = list(zip(self.h2d.srcs, self.h2d.dsts))
    self._check_copy_lists(d2h, h2d)
    gathered = [(h, self.dev_start[d]) for d, h in d2h]  # every D2H gather reads the last model step's cache
    for h, data_ in gathered:
      self.host[h] = list(data_)
    for h, d in h2d:
      self.dev[d] = list(self.host[h])
    # The model step writes each scheduled chunk's KV, into blocks only that request owns.
    sched = []
    for kind, x in self.plan:
      sched += [x] if kind == "chunk" else x
    for rid in sched:
      s = bm.seqs[rid]
      req = self.reqs[rid]
      for t in range(s.num_computed, s.num_tokens):
        b = s.dev[t // bs]
        n = bm.device_references(b)  # (a shared run is one owner slot for all its members: count the requests)
        assert n == 1, f"model step writes block {b} of {rid!r}, held by {n} requests"
        assert not bm.device.published(b), f"model step writes published block {b} ({bm.device.hash_of[b]!r})"
        blk = list(self.dev[b])
        blk[t % bs] = req.value(t)
        self.dev[b] = blk
    for kind, x in self.plan:
      if kind == "chunk":
        bm.mark_computed(x, self.expect[x][0])
        self.expect[x][1] = self.expect[x][0]
      else:
        bm.mark_computed_next(x)
        for rid in x:
          self.expect[rid][1] += 1
    for rid in sched:  # a request whose known tokens all have KV samples its next one
      req = self.reqs[rid]
      if self.expect[rid][1] == len(req.tokens) and len(req.tokens) < req.cap:
        req.tokens.append(data.draw(st.sampled_from(VOCAB)))
        req.sampled = True
    # Between steps (``on_step_done``): requests finish or are aborted, any of them, before the next step's
    # ``begin_step`` publishes the host copies the closed step made.
    if self.expect and data.draw(st.integers(0, 2)) == 0:
      for rid in data.draw(st.lists(st.sampled_from(sorted(self.expect)), min_size=1, max_size=2, unique=True)):
        bm.free(rid)
        del self.reqs[rid]
        del self.expect[rid]
        self.done_ids.append(rid)
        self.stats["finished_between_steps"] += 1
    parked = {b for group in _parked_groups(bm).values() for b in group}
    for b in bm.device.free_ids():
      if b not in parked:  # a parked block keeps its KV until the queue hands it out (poisoned then)
        self.dev[b] = [POISON] * bs
    for h in bm.host.free_ids():
      self.host[h] = [POISON] * bs
    self.stats["steps"] += 1
    self._open_step()
    bm.begin_step()

  # One weighted rule (instead of one rule per operation) so that swarm testing does not starve the long
  # sequences that matter (admit with hits, rotate out, write back, step, rotate in, evict, ...).
  OPS = (["admit"] * 5 + ["plain"] + ["evict"] * 2 + ["grow"] * 2 + ["out"] * 4 + ["out_all"] + ["in"] * 4
         + ["finish"] * 3 + ["preempt"] + ["drop"] + ["step"] * 7)

  @rule(data=st.data(), op=st.sampled_from(OPS))
  def op(self, data, op):
    {"admit": self.admit, "plain": self.admit_plain, "evict": lambda d: self.admit_plain(d, evict=True),
     "grow": self.grow, "out": self.rotate_out, "out_all": lambda d: self.rotate_out(d, everyone=True),
     "in": self.rotate_in, "finish": self.finish, "preempt": self.preempt, "drop": self.drop_mirrors,
     "step": self.step}[op](data)

  # ------------------------------------------------------------------------------------------ checks
  @invariant()
  def consistent(self):
    bm, bs = self.bm, self.bs
    bm.check_invariants()
    assert set(bm.seqs) == set(self.reqs) == set(self.expect)
    for rid, (nt, nc, on_host) in self.expect.items():
      s = bm.seqs[rid]
      assert (s.num_tokens, s.num_computed, s.on_host) == (nt, nc, on_host), (
          f"{rid!r}: manager says {(s.num_tokens, s.num_computed, s.on_host)}, shadow {(nt, nc, on_host)}")
    self._check_ownership()
    vhost, vdev = self._overlays()
    self._check_copy_lists(list(zip(self.d2h.srcs, self.d2h.dsts)), list(zip(self.h2d.srcs, self.h2d.dsts)))
    # No hash findable before its KV is written.
    for key, b in bm.device.published_items().items():
      assert isinstance(key, int), f"device index key {key!r}"
      got = vdev.get(b, self.dev[b])
      assert got == self._expected_block(key), f"device block {b} findable under a hash, holds {got}"
    # A rotated-out request's parked blocks (re-adopted by its swap-in with no copy) hold its KV: they are its
    # computed logical blocks from its park_start on, in order.
    for rid, group in _parked_groups(bm).items():
      s = bm.seqs[rid]
      nh = s.park_start
      for j, b in enumerate(group):
        i = nh + j
        k = computed_in_block(s, i, bs)
        got = vdev.get(b, self.dev[b])
        assert got[:k] == self.reqs[rid].values(i * bs, i * bs + k), (
            f"device block {b} parked for {rid!r} (logical {i}) holds {got[:k]}")
    self._check_host_index()
    # No lost KV: computed tokens where the manager says they are; host copies hold what host_tokens says.
    for rid, s in bm.seqs.items():
      req = self.reqs[rid]
      for i in range(len(s.host)):
        k = computed_in_block(s, i, bs)
        h = s.host[i]
        if s.on_host:
          got = vhost.get(h, self.host[h])
        else:
          b = s.dev[i]
          got = vdev.get(b, self.dev[b])
        assert got[:k] == req.values(i * bs, i * bs + k), (
            f"lost KV: {rid!r} logical block {i} ({'host' if s.on_host else 'device'} "
            f"{h if s.on_host else s.dev[i]}) holds {got[:k]}")
        if h != NO_BLOCK:
          ht = s.host_tokens[i]
          got = vhost.get(h, self.host[h])
          assert got[:ht] == req.values(i * bs, i * bs + ht), (
              f"lost KV: {rid!r} host copy {h} of logical block {i} ({ht} tokens) holds {got[:ht]}")

  def _check_ownership(self):
    """No referenced block free or evictable; reference counts equal the live references."""
    bm = self.bm
    dev_own = collections.Counter()
    host_own = collections.Counter()
    for s in bm.seqs.values():
      if not s.on_host:
        dev_own.update(s.dev.tolist())
      host_own.update(h for h in s.host.tolist() if h != NO_BLOCK)
    for name, pool, own in (("device", bm.device, dev_own), ("host", bm.host, host_own)):
      free = pool.free_ids()
      evictable = set(pool.evictable)
      parked = [b for g in _parked_groups(bm).values() for b in g] if name == "device" else []
      fset = set(free)
      pset = set(parked)
      assert len(fset) == len(free) and len(pset) == len(parked)
      assert not fset & evictable and pset <= fset  # parked blocks sit on the free queue
      for b, n in own.items():
        assert b not in fset, f"referenced {name} block {b} ({n} owners) is on the free queue"
        assert b not in evictable, f"referenced {name} block {b} ({n} owners) is evictable"
        assert b not in pset, f"referenced {name} block {b} ({n} owners) is parked"
        count = bm.device_references(b) if name == "device" else pool.owners(b)
        assert count == n, f"{name} block {b}: {n} live references, count says {count}"
      for b in pool.refs:
        assert own[b] > 1, f"{name} block {b} has refs {pool.refs[b]} but {own[b]} live references"
      assert len(own) + len(fset) + len(evictable) == pool.num_blocks, (
          f"{name}: {len(own)} owned + {len(fset)} free + {len(evictable)} evictable "
          f"!= {pool.num_blocks}")
      assert pool.num_free == len(fset) + len(evictable)


class AnyRotationMachine(PrefixCacheMachine):
  """Rotates out any fully computed resident request, a prefilling one included: what ``swap_out`` allows."""
  ROTATE_ANY = True


SETTINGS = settings(max_examples=100, stateful_step_count=80, deadline=None, derandomize=True,
                    report_multiple_bugs=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TestPrefixCacheStateMachine = PrefixCacheMachine.TestCase
TestPrefixCacheStateMachine.settings = SETTINGS
TestPrefixCacheAnyRotation = AnyRotationMachine.TestCase
TestPrefixCacheAnyRotation.settings = SETTINGS


def test_swap_in_does_not_readopt_a_partially_computed_hashed_block():
  """The minimal case ``TestPrefixCacheAnyRotation`` shrinks to. ``y`` is rotated out in the middle of its
  prefill, its hashed logical block 0 holding 1 of 2 computed tokens; ``x`` computed the same block in full and
  published it. ``y``'s swap-in must not re-adopt ``x``'s block for its half-computed block 0: its next prefill
  token would be written into a block another request shares, and one published as already computed."""
  bm = BlockManager(8, 8, 2)
  hashes = block_hashes((30, 31, 32, 33), 2)
  out = PairList.from_columns([], [])
  bm.begin_step()
  assert bm.allocate_prefix("x", hashes, 0, 0, 3, h2d_pairs())  # prefill chunk of 3: block 0 full
  assert bm.allocate_prefix("y", hashes, 0, 0, 1, h2d_pairs())  # prefill chunk of 1: block 0 half full
  bm.take_writebacks(0)
  bm.mark_computed("x", 3)
  bm.mark_computed("y", 1)
  bm.begin_step()
  published = bm.seqs["x"].dev[0]
  assert bm.device.lookup(hashes[0]) == published
  assert bm.swap_out_many(["y"], out) == (1, 1)
  bm.take_writebacks(0)
  bm.begin_step()
  assert len(bm.swap_in_many(["y"], 0, h2d_pairs())) == 1
  bm.check_invariants()
  assert bm.seqs["y"].dev[0] != published, "y re-adopted x's published block for its half-computed block 0"
  assert bm.append_slots("y", 1)  # y's next prefill token goes into its block 0
  b = bm.seqs["y"].dev[0]
  assert bm.device.owners(b) == 1 and not bm.device.published(b)
