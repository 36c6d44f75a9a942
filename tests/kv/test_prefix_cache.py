"""Prefix caching in the block pools and the block manager, hand-worked: the LRU order of cached blocks, tail-first
freeing, never-published blocks reused first, salts isolate hashes, host copies findable only a step after
their copy, rotation re-adopting blocks still on device, admission counting only the blocks it takes, and the
load-or-recompute rule."""
from array import array

import pytest

from superinfer_jax.kv.block_manager import BlockManager
from superinfer_jax.kv.block_pool import BlockPool
from superinfer_jax.kv.pairs import DEV_IDS, PairList, h2d_pairs
from superinfer_jax.kv.prefix_hash import block_hashes, extra_key_of, id_block_hashes
from superinfer_jax.sched import Request, Scheduler, SchedulerConfig, VirtualClock

BS = 4


def k(name: str) -> int:
  """An int key (pools index ints: content hashes) named for readability."""
  return int.from_bytes(name.encode(), "little")


def _pool(n=6):
  return BlockPool(1, n, DEV_IDS)


def test_lru_order_and_never_published_blocks_first():
  p = _pool(6)
  a = p.take(4)                     # blocks 1..4 owned
  for b, key in zip(a, map(k, "wxyz")):
    p.publish(b, key)
  p.release(array(DEV_IDS, [3, 1, 4, 2]))   # all published: into the LRU in this order
  assert list(p.evictable) == [3, 1, 4, 2] and p.num_free == 6
  p.share(p.lookup(k("w")))            # re-adopt block 1: out of the LRU, KV intact
  assert list(p.evictable) == [3, 4, 2] and p.num_free == 5
  got = p.take(3)                   # the free queue (5, 6: never published) first, then the oldest cached (3)
  assert got.tolist() == [5, 6, 3]
  assert p.lookup(k("y")) is None and p.lookup(k("x")) == 2 and p.evictions == 1
  assert p.take(3) is None          # 2 left (4, 2): all-or-nothing
  assert p.take(2).tolist() == [4, 2] and p.evictions == 3
  assert p.published_items() == {k("w"): 1}  # the re-adopted one stays
  p.check()


def test_releasing_many_blocks_in_bulk_keeps_both_orders():
  """A release of many blocks without extra owners (a finished request's) sorts them in one pass: the published
  ones into the LRU and the others onto the free queue, each in the order released, as one by one would."""
  p = _pool(40)
  a = p.take(20)                     # blocks 1..20
  p.publish_many(a[::3], [k(f"k{b}") for b in a[::3]])   # 1, 4, 7, ..., 19 published
  p.share(4)                         # block 4 gains an owner: this release cannot go in bulk
  one_by_one = _pool(40)
  one_by_one.take(20)
  one_by_one.publish_many(a[::3], [k(f"k{b}") for b in a[::3]])
  rest = a[4:][::-1]                 # 20..5, tail first: none with extra owners (>= 16 of them: the bulk path)
  p.release(rest)
  for b in rest:
    one_by_one.release([b])
  assert list(p.evictable) == list(one_by_one.evictable) == [19, 16, 13, 10, 7]
  assert p.free_ids() == one_by_one.free_ids() and p.free_ids()[-3:] == [8, 6, 5]
  assert p.owners(4) == 2 and p.num_published == 7
  p.release([4])
  assert p.owners(4) == 1 and 4 not in p.evictable   # its extra owner went first (the per-block path)
  p.check()


def test_publish_many_counts_what_it_published():
  p = _pool(4)
  a = p.take(3)
  assert p.publish_many(a, [k("x"), k("y"), k("x")]) == 2     # the third: "x" is published already (block 1)
  assert p.publish_many([a[0]], [k("z")]) == 0          # block 1 is published under another key
  assert p.published_items() == {k("x"): 1, k("y"): 2} and p.num_published == 2
  p.check()


def test_share_many_counts_a_block_listed_m_times_as_m_owners():
  # A rotation batch shares a prefix's blocks once per request (a long list is counted first): an evictable block
  # listed 12 times leaves the LRU (its first owner) and gains 11 extra owners; one in use gains one per listing.
  # The same counts as sharing them one at a time (the short-list path).
  pools = []
  for one_by_one in (False, True):
    p = _pool(4)
    a = p.take(2)
    p.publish_many(a, [k("p0"), k("p1")])
    p.release(a[:1])                          # block 1: nobody's, published: evictable
    blocks = [1, 2, 1, 2, 1] * 4
    for part in ([[b] for b in blocks] if one_by_one else [blocks]):
      p.share_many(part)
    assert 1 not in p.evictable and p.owners(1) == 12 and p.owners(2) == 9
    p.check()
    pools.append(p)
  assert pools[0].refs == pools[1].refs == {1: 11, 2: 8}


def test_index_shards_stay_small_and_exact_under_churn():
  # A pool of 5000 blocks gets 8 shards (<= 1024 keys each on average); one of 1024 blocks one. Every block
  # published, then evicted and published again under a new key, round after round: each key in its shard, the
  # entry count exact, every current key found, no evicted key found, no shard past twice its share.
  assert len(BlockPool(1, 1024, DEV_IDS).index) == 1
  p = BlockPool(0, 5000, DEV_IDS)
  assert len(p.index) == 8 and p.index_mask == 7
  keys = iter(id_block_hashes(range(5000 * 4)))
  owned = p.take(5000)
  current = dict(zip(owned.tolist(), (next(keys) for _ in range(5000))))
  p.publish_many(owned, [current[b] for b in owned])
  old = []
  for _ in range(3):
    p.release(owned)                      # all published: to the LRU
    owned = p.take(5000)                  # every one evicted
    old += current.values()
    current = dict(zip(owned.tolist(), (next(keys) for _ in range(5000))))
    assert p.publish_many(owned, [current[b] for b in owned]) == 5000
    p.check()                             # each key in its shard, index_entries exact
    assert p.index_entries == 5000 and max(map(len, p.index)) <= 2 * 5000 // 8
  assert p.lookup_many(list(current.values())) == list(current)
  assert p.lookup_many(old[::97]) == [None] * len(old[::97])


def test_a_block_published_again_under_a_new_key_leaves_no_stale_entry():
  # Parked (hidden), handed out, published by its new owner under another key: the old key's entry goes, the
  # count stays one entry per key, the old key is never found.
  p = _pool(2)
  a = p.take(1)
  p.publish(a[0], k("old"))
  p.park(a)
  got = p.take(2)                          # block 2, then the parked block 1
  assert p.publish(got[1], k("new")) and p.index_entries == 1
  assert p.lookup(k("old")) is None and p.lookup(k("new")) == 1
  p.check()


def test_shared_block_freed_only_by_its_last_owner():
  p = _pool(3)
  b = p.take(1)[0]
  p.publish(b, k("k"))
  p.share(b)
  p.share(b)
  assert p.owners(b) == 3
  p.release([b])
  p.release([b])
  assert p.owners(b) == 1 and b not in p.evictable and p.num_free == 2
  p.release([b])
  assert b in p.evictable and p.num_free == 3
  p.check()


def test_parked_group_sits_on_the_free_queue_tail_first_and_unparks_what_is_left():
  p = _pool(8)
  a = p.take(4)                      # blocks 1..4, logical order
  for b, key in zip(a[:3], map(k, "abc")):
    p.publish(b, key)
  r = (p.park(a), 4)                 # every block changes generation (the 3 published ones are not found)
  assert r[0] == p.head_position + 8  # its end: past the 4 free blocks before it and its own 4
  assert p.free_ids() == [5, 6, 7, 8, 4, 3, 2, 1] and p.num_free == 8
  assert p.lookup(k("a")) is None and p.lookup(k("c")) is None and p.untaken(*r) == 4  # parked: not found
  assert p.parked_blocks(*r).tolist() == [1, 2, 3, 4]
  assert p.take(5).tolist() == [5, 6, 7, 8, 4]   # the queue reaches the group's tail first
  assert p.untaken(*r) == 3
  assert p.unpark(*r).tolist() == [1, 2, 3]      # what is left: a leading part, in order
  assert p.lookup(k("a")) == 1 and p.lookup(k("c")) == 3  # found again
  assert p.free_ids() == [] and p.num_free == 0
  p.check()


def test_unparking_a_group_behind_others_leaves_a_hole_takes_skip():
  p = _pool(6)
  x = p.take(2)
  y = p.take(2)
  p.publish(y[0], k("y0"))
  gx, gy = [(end, 2) for end in p.park_many([x, y])]
  assert p.free_ids() == [5, 6, 2, 1, 4, 3]
  assert p.unpark(*gx).tolist() == [1, 2] and p.ntomb == 2  # behind 5, 6: a hole
  assert p.free_ids() == [5, 6, 4, 3] and p.num_free == 4
  assert p.take(3).tolist() == [5, 6, 4]         # skips the hole
  assert p.ntomb == 0 and p.lookup(k("y0")) is None  # y's block 3 still parked
  assert p.unpark(*gy).tolist() == [3] and p.lookup(k("y0")) == 3
  p.check()


def test_a_parked_group_the_queue_passed_has_nothing_left():
  p = _pool(3)
  g = (p.park(p.take(2)), 2)
  assert p.take(3).tolist() == [3, 2, 1] and p.untaken(*g) == 0
  p.release([1, 2, 3])
  assert p.take(1).tolist() == [1] and p.untaken(*g) == 0  # later positions: never the group's again
  assert p.unpark(*g).tolist() == [] and p.free_ids() == [2, 3]
  p.check()


def test_a_parked_block_handed_out_is_never_found_under_its_old_key():
  p = _pool(2)
  a = p.take(1)
  p.publish(a[0], k("old"))
  r = (p.park(a), 1)
  got = p.take(1)                    # the free queue's head is block 2, then the parked block 1
  got += p.take(1)
  assert got.tolist() == [2, 1] and p.untaken(*r) == 0  # r lost it to the queue
  e = (p.park(got[1:]), 1)           # its new owner parks and unparks it (never published by it)
  assert p.unpark(*e).tolist() == [1]
  assert p.lookup(k("old")) is None and not p.published(1)
  assert p.unpark(*r).tolist() == []
  assert p.publish(1, k("new")) and p.lookup(k("new")) == 1 and p.lookup(k("old")) is None
  p.check()


def test_a_group_parked_without_hiding_keeps_its_generations():
  # park_many's hidden: only the leading parts of groups that may hold published blocks move generation (and move
  # back on unpark, as far as the queue left them).
  p = _pool(8)
  x = p.take(2)                      # 1, 2: unpublished
  y = p.take(3)                      # 3, 4, 5: 3 published
  p.publish(y[0], k("y0"))
  gens = p.gen.tolist()
  gx, gy = [(end, n) for end, n in zip(p.park_many([x, y], [y[:1]]), (2, 3))]
  assert p.lookup(k("y0")) is None                   # y's first block hidden
  moved = [b for b in range(1, 9) if p.gen[b] != gens[b]]
  assert moved == [3]                                # x's and y's other generations untouched
  assert p.unpark_many([gx, gy], [0, 1]) == [array(DEV_IDS, [1, 2]), array(DEV_IDS, [3, 4, 5])]
  assert p.lookup(k("y0")) == 3 and p.gen.tolist() == gens  # (the lookup applies the queued moves)
  p.check()


def test_pub_end_bounds_what_moves_generation_at_a_rotation():
  # pub_end: past it no device block of the request is published. Raised as its blocks are published or it takes
  # published ones; a swap-in lowers it to what it re-adopts (its hits, then its group's part parked hidden that
  # the queue left); a swap-out moves generation for its group's part before it only.
  bm = BlockManager(8, 16, BS)
  _admit(bm, "a", list(range(2 * BS + 2)))           # blocks 0, 1 full and published
  s = bm.seqs["a"]
  assert s.pub_end == 2
  bm.take_writebacks()
  assert bm.append_slots("a", BS)
  bm.mark_computed("a", 3 * BS + 2)                  # block 2 fills: no hash (past the prompt), unpublished
  assert s.pub_end == 2
  gens = bm.device.gen.tolist()
  table = bm.block_table("a").tolist()
  bm.swap_out_to("a", PairList.from_columns([], []))
  assert bm.device.published_items() == {}           # hidden while parked
  moved = [b for b in range(9) if bm.device.gen[b] != gens[b]]
  assert moved == sorted(table[:2])                  # only blocks 0, 1 (before pub_end) moved
  bm.swap_in_to("a", h2d_pairs())                    # all four re-adopted: the queue handed out nothing
  assert len(bm.device.published_items()) == 2      # (applies the queued moves)
  assert bm.readopted_blocks == 4 and s.pub_end == 2 and bm.device.gen.tolist() == gens
  bm.check_invariants()
  bm.swap_out_to("a", PairList.from_columns([], []))
  assert bm.append_slots("big", 7 * BS)              # the free queue (4) then a's group tail first: blocks 3, 2, 1
  bm.free("big")
  bm.swap_in_to("a", h2d_pairs())                    # block 0 left on device, re-adopted (still published)
  assert s.pub_end == 1 and bm.readopted_blocks == 5
  bm.check_invariants()
  # A request with the same prompt shares a's block 0 (published) and publishes its own block 1 (a's is a copy).
  _admit(bm, "b", list(range(2 * BS + 3)))
  assert bm.seqs["b"].pub_end == 2 and bm.device.owners(bm.block_table("a")[0]) == 2
  bm.check_invariants()


def test_pub_end_is_a_bound_not_a_count():
  # Rotated out mid-prefill, every block copied back in (pub_end 0), its prompt then finishes: blocks 1 and 2 fill
  # and are published, block 0 (a copy) is not. pub_end covers them, so the next rotation hides both.
  bm = BlockManager(8, 16, BS)
  toks = list(range(3 * BS + 1))
  hashes = block_hashes(toks, BS)
  assert bm.allocate_prefix("a", hashes, 0, 0, len(toks), h2d_pairs())
  bm.mark_computed("a", BS + 2)                      # block 0 full and published; block 1 half written
  bm.take_writebacks()
  bm.swap_out_to("a", PairList.from_columns([], []))
  assert bm.append_slots("big", 8 * BS)              # every free block, a's parked group among them
  bm.free("big")
  bm.swap_in_to("a", h2d_pairs())                    # every block copied
  s = bm.seqs["a"]
  assert s.pub_end == 0
  assert bm.append_slots("a", len(toks) - BS - 2)
  bm.mark_computed("a", len(toks))
  assert [bm.device.published(b) for b in s.dev] == [False, True, True, False] and s.pub_end == 3
  bm.check_invariants()
  bm.swap_out_to("a", PairList.from_columns([], []))
  assert bm.device.published_items() == {}          # blocks 1, 2 hidden while parked
  assert bm.device.published_run(hashes, 0, 3) == 0 and bm.device.published_run(hashes, 2, 1) == 2
  bm.check_invariants()


def test_a_request_holding_no_published_block_parks_without_hiding():
  # pub_end 0 after a swap-in that copies every block; a swap-out of a request without published blocks moves no
  # generation.
  bm = BlockManager(4, 16, BS)
  _admit(bm, "a", list(range(2 * BS + 2)))           # blocks 0, 1 full and published
  bm.take_writebacks()
  assert bm.seqs["a"].pub_end == 2
  bm.swap_out_to("a", PairList.from_columns([], []))
  assert bm.device.published_items() == {}           # hidden while parked
  assert bm.append_slots("big", 4 * BS)              # takes every block, a's group among them
  bm.free("big")
  bm.swap_in_to("a", h2d_pairs())                    # nothing left on device: every block copied, none published
  s = bm.seqs["a"]
  assert s.pub_end == 0 and bm.readopted_blocks == 0
  gens = bm.device.gen.tolist()
  bm.swap_out_to("a", PairList.from_columns([], []))
  bm.device.lookup(k("any"))                         # (applies whatever was queued)
  assert bm.device.gen.tolist() == gens              # parked without a generation update
  bm.swap_in_to("a", h2d_pairs())
  assert bm.readopted_blocks == 3 and s.pub_end == 0  # re-adopted, still unpublished
  assert bm.append_slots("a", 2)
  bm.mark_computed("a", 3 * BS)                      # block 2 fills: no hash (past the prompt), unpublished
  assert s.pub_end == 0
  bm.check_invariants()


def test_hashes_chain_and_salts_isolate():
  toks = list(range(10, 10 + 3 * BS + 2))
  h = block_hashes(toks, BS)
  assert len(h) == 3 and len(set(h)) == 3
  assert block_hashes(toks[:2 * BS], BS) == h[:2]                       # a prefix has the prefix's hashes
  other = [99] + toks[1:]
  assert not set(block_hashes(other, BS)) & set(h)                    # a different first block changes all
  a, b = extra_key_of("m", "alice"), extra_key_of("m", "bob")
  assert block_hashes(toks, BS, a) == block_hashes(toks, BS, a)
  assert not set(block_hashes(toks, BS, a)) & set(block_hashes(toks, BS, b))
  assert not set(block_hashes(toks, BS, a)) & set(block_hashes(toks, BS, extra_key_of("m")))
  assert not set(block_hashes(toks, BS, extra_key_of("m"))) & set(block_hashes(toks, BS, extra_key_of("m2")))
  assert id_block_hashes([7, 8]) == id_block_hashes([7, 8, 9])[:2]


def _parked(bm, rid):
  """What is left of swapped-out ``rid``'s parked group (its swap-in would re-adopt it)."""
  s = bm.seqs[rid]
  return bm.device.parked_blocks(s.park_end, s.park_count)


def _admit(bm, rid, toks, total=None):
  """A request on its cached prefix (capped so its last token is computed), its prefill marked computed."""
  hashes = block_hashes(toks, BS)
  dev, host = bm.lookup_prefix(hashes, (len(toks) - 1) // BS)
  out = h2d_pairs()
  assert bm.allocate_prefix(rid, hashes, dev, host, total or len(toks), out)
  bm.mark_computed(rid, len(toks))
  return dev, host, out


def test_tail_first_freeing_keeps_the_shared_head_longest():
  bm = BlockManager(6, 0, BS)
  toks = list(range(3 * BS + 1))
  _admit(bm, "a", toks)
  table = bm.block_table("a").tolist()
  bm.free("a")
  assert list(bm.device.evictable) == table[:3][::-1]    # published full blocks, tail first
  assert table[3] in bm.device.free_ids()                # the partial block was never published
  assert bm.append_slots("big", 4 * BS)                  # 3 never-published + the oldest cached: a's tail
  assert bm.lookup_prefix(block_hashes(toks, BS), 3) == (2, 0)
  bm.check_invariants()


def test_admission_takes_only_the_blocks_it_needs():
  bm = BlockManager(5, 0, BS)
  toks = list(range(3 * BS + 1))
  _admit(bm, "a", toks)                                  # 4 blocks, 3 published
  assert bm.num_free_device_blocks == 1
  dev, host, out = _admit(bm, "b", toks)                 # shares 3, needs 1 fresh: fits in 1 free
  assert (dev, host, len(out)) == (3, 0, 0)
  assert bm.block_table("b").tolist()[:3] == bm.block_table("a").tolist()[:3]
  assert bm.num_free_device_blocks == 0
  bm.check_invariants()
  bm.free("a")
  bm.free("b")
  assert bm.num_free_device_blocks == 5
  bm.check_invariants()


def test_host_copy_findable_only_after_the_next_begin_step():
  bm = BlockManager(8, 8, BS)
  toks = list(range(2 * BS + 1))
  _admit(bm, "a", toks)
  wb = bm.take_writebacks()
  assert len(wb) == 2
  assert not bm.host.published_items()                               # copied this step: not findable yet
  bm.begin_step()
  assert len(bm.host.published_items()) == 2
  bm.free("a")
  assert len(bm.host.evictable) == 2                     # outlives its request on host
  for rid in ("x", "y"):                                 # fill the device so a's blocks are evicted there
    assert bm.append_slots(rid, 4 * BS)
  bm.free("x")
  bm.free("y")
  assert bm.lookup_prefix(block_hashes(toks, BS), 2) == (0, 2)
  dev, host, out = _admit(bm, "b", toks)
  assert (dev, host) == (0, 2) and len(out) == 2 and bm.num_host_mirrors("b") == 2
  bm.check_invariants()


def test_rotation_readopts_blocks_still_on_device():
  bm = BlockManager(8, 16, BS)
  toks = list(range(2 * BS + 2))
  _admit(bm, "a", toks)
  bm.take_writebacks()
  before = bm.block_table("a").tolist()
  out = PairList.from_columns([], [])
  assert bm.swap_out_to("a", out) == 1                    # only the dirty tail moves
  assert bm.is_swapped("a")
  back = h2d_pairs()
  assert bm.swap_in_to("a", back) == 3
  assert len(back) == 0 and bm.readopted_blocks == 3      # every block still on device: no copy
  assert bm.block_table("a").tolist() == before
  out = PairList.from_columns([], [])
  bm.swap_out_to("a", out)
  assert bm.append_slots("big", 8 * BS)                   # evicts all of a's device blocks
  bm.free("big")
  back = h2d_pairs()
  bm.swap_in_to("a", back)
  assert len(back) == 3 and bm.readopted_blocks == 3
  bm.check_invariants()


def test_rotation_keeps_blocks_others_share_and_parks_the_rest():
  bm = BlockManager(12, 16, BS)
  toks = list(range(3 * BS + 1))
  _admit(bm, "a", toks)                                   # publishes a's 3 full blocks
  dev, _, _ = _admit(bm, "b", toks[:2 * BS] + [90, 91, 92, 93, 94])  # shares a's first 2 blocks
  assert dev == 2
  a0, a1, a2, a3 = bm.block_table("a").tolist()
  bm.take_writebacks()
  out = PairList.from_columns([], [])
  assert bm.swap_out_to("a", out) == 1                    # the dirty tail
  assert bm.device.owners(a0) == 1 and bm.device.owners(a1) == 1  # b keeps the shared run
  assert bm.seqs["a"].park_start == 2 and _parked(bm, "a").tolist() == [a2, a3]
  hashes = block_hashes(toks, BS)
  assert bm.device.lookup(hashes[1]) == a1 and bm.device.lookup(hashes[2]) is None  # parked: not found
  back = h2d_pairs()
  assert bm.swap_in_to("a", back) == 4 and len(back) == 0  # shared run found again, the group re-adopted
  assert bm.block_table("a").tolist() == [a0, a1, a2, a3] and bm.device_references(a1) == 2
  assert bm.seqs["a"].run is bm.seqs["b"].run and bm.device.owners(a1) == 1  # a joined b's run: one owner slot
  assert bm.device.lookup(hashes[2]) == a2
  bm.check_invariants()


def test_rotation_when_a_shared_block_follows_an_own_one():
  """A block others share after the request's first own block (a hash a third request published first): its
  hashed blocks are released one by one (the shared one stays with its other owner) and only the rest parked."""
  bm = BlockManager(12, 16, BS)
  toks = list(range(2 * BS + 1))
  hashes = block_hashes(toks, BS)
  for rid in ("c", "a"):                                  # both prefill from scratch, in the same step
    assert bm.allocate_prefix(rid, hashes, 0, 0, len(toks), h2d_pairs())
  bm.mark_computed("c", BS)                               # c publishes block 0 first
  bm.mark_computed("a", len(toks))                        # a's block 0 stays unpublished, its block 1 published
  a0, a1, a2 = bm.block_table("a").tolist()
  assert bm.device.lookup(hashes[0]) != a0 and bm.device.lookup(hashes[1]) == a1
  dev, _, _ = _admit(bm, "b", toks)                       # b shares c's block 0 and a's block 1
  assert dev == 2 and bm.device.owners(a1) == 2
  bm.take_writebacks()
  assert bm.swap_out_to("a", PairList.from_columns([], [])) == 1
  assert bm.seqs["a"].park_start == 2 and _parked(bm, "a").tolist() == [a2]
  assert bm.device.owners(a1) == 1 and bm.device.lookup(hashes[1]) == a1  # b keeps it, still found
  back = h2d_pairs()
  assert bm.swap_in_to("a", back) == 3 and len(back) == 0   # c's block 0 and a1 by hash, a2 from its group
  assert bm.block_table("a").tolist()[1:] == [a1, a2]
  bm.check_invariants()


def test_a_bad_rotation_batch_changes_nothing():
  bm = BlockManager(12, 16, BS)
  toks = list(range(2 * BS + 1))
  _admit(bm, "a", toks)
  _admit(bm, "b", [7] + toks[1:])
  bm.take_writebacks()
  free = bm.device.num_free
  for batch in (["a", "a"], ["a", "zz"]):
    with pytest.raises((ValueError, KeyError)):
      bm.swap_out_many(batch, PairList.from_columns([], []))
    assert not bm.is_swapped("a") and bm.device.num_free == free
  assert bm.swap_out_many(["a", "b"], PairList.from_columns([], [])) == (2, 2)
  free = bm.device.num_free
  with pytest.raises(ValueError):
    bm.swap_in_many(["a", "a"], 0, h2d_pairs())
  assert bm.is_swapped("a") and bm.device.num_free == free
  bm.check_invariants()


def test_a_shared_run_unparked_by_an_earlier_batch_is_found_by_the_next():
  """a parks everything (its blocks are its own once b released the shared run); swapping a in takes them back,
  and b's swap-in in a later batch re-adopts its shared run from a with no copy."""
  bm = BlockManager(16, 16, BS)
  toks = list(range(30, 30 + 2 * BS + 1))
  _admit(bm, "a", toks)
  _admit(bm, "b", toks)                                   # shares a's two full blocks
  bm.take_writebacks()
  bm.begin_step()
  assert bm.swap_out_many(["b"], PairList.from_columns([], []))[0] == 1 and bm.seqs["b"].park_start == 2
  assert bm.swap_out_many(["a"], PairList.from_columns([], []))[0] == 1
  bm.take_writebacks()
  bm.begin_step()
  assert len(bm.swap_in_many(["a"], 0, h2d_pairs())) == 1
  back = h2d_pairs()
  assert len(bm.swap_in_many(["b"], 0, back)) == 1
  assert bm.block_table("b")[:2] == bm.block_table("a")[:2]   # re-adopted: the same blocks,
  assert len(back) == 0                                     # and its tail from its own parked group
  bm.check_invariants()


def test_a_swap_in_batch_counts_a_shared_revival_once():
  """Two requests of one swap-in batch re-adopt the same evictable block: it takes one free block, not two."""
  bm = BlockManager(6, 16, BS)
  toks = list(range(BS + 1))
  _admit(bm, "c", toks[:BS])                              # publishes block 1 (its one block)
  _admit(bm, "a", toks)                                   # share it, plus a partial block each (2, 3)
  _admit(bm, "b", toks)
  assert bm.append_slots("big", 3 * BS)                   # the rest of the pool
  bm.take_writebacks()
  bm.begin_step()
  assert bm.swap_out_many(["a", "b"], PairList.from_columns([], [])) == (2, 2)  # their tails parked
  bm.free("c")                                            # block 1: nobody's now, published: evictable
  assert bm.device.is_evictable(1) and bm.device.num_free == 3
  back = h2d_pairs()
  assert len(bm.swap_in_many(["a", "b"], 0, back)) == 2   # 1 revived once + 2 tails: both fit
  assert len(back) == 0 and bm.device_references(1) == 2 and bm.device.num_free == 0
  assert bm.seqs["a"].run is bm.seqs["b"].run and bm.device.owners(1) == 1  # one run the batch registered for both
  bm.check_invariants()


@pytest.mark.parametrize("rule, load_s, per_token_s, loads", [
    ("cost", 1e-5, 1e-6, False),      # a block loads in 1e-5 s, recomputes in 4 x 1e-6 s: recompute
    ("cost", 1e-6, 1e-6, True),       # 1e-6 < 4e-6: load
    ("cost", 5e-6, 1e-6, False),      # 5e-6 >= 4e-6: recompute
    ("cost", None, 1e-6, True),       # a side unset: loads count as free
    ("always", 1.0, 0.0, True), ("never", 0.0, 1.0, False)])
def test_load_or_recompute_rule(rule, load_s, per_token_s, loads):
  cfg = SchedulerConfig(host_prefix_load=rule, prefix_load_s_per_block=load_s, prefill_s_per_token=per_token_s)
  assert cfg.loads_host_prefix(BS) is loads


@pytest.mark.parametrize("rule", ["always", "never"])
def test_scheduler_loads_or_recomputes_a_host_prefix(rule):
  bm = BlockManager(8, 16, BS)
  sched = Scheduler(SchedulerConfig(policy="fcfs", host_prefix_load=rule, max_num_batched_tokens=64), bm,
                    VirtualClock())
  toks = list(range(3 * BS + 1))
  first = Request("a", len(toks), 3, 0.0, block_hashes=block_hashes(toks, BS))
  sched.add_request(first)
  while sched.has_unfinished():  # prefill, then two decode steps: the first writes its full blocks back
    sched.on_step_done(sched.schedule())
  bm.begin_step()                                         # the copies' step is over: publish them
  assert len(bm.host.published_items()) == 3
  assert bm.append_slots("big", 8 * BS)                   # evict a's blocks on device
  bm.free("big")
  sched.add_request(Request("b", len(toks), 1, 0.0, block_hashes=block_hashes(toks, BS)))
  plan = sched.schedule()
  seq = plan.scheduled[0]
  if rule == "always":
    assert (seq.num_computed_tokens, seq.num_new_tokens, len(plan.swap_in)) == (3 * BS, 1, 3)
    assert plan.prefix_host_hits == 3
  else:
    assert (seq.num_computed_tokens, seq.num_new_tokens, len(plan.swap_in)) == (0, 3 * BS + 1, 0)
    assert plan.prefix_host_hits == 0
  sched.check_invariants()


def test_requests_of_one_prefix_hold_it_as_one_shared_run():
  """b and c find a's first two blocks: they hold them through one run (one owner slot besides a's own, two
  members). Rotating b out and back in moves no per-block count: the run keeps the blocks for c, and b joins it
  again with no lookup."""
  bm = BlockManager(16, 32, BS)
  toks = list(range(3 * BS + 1))
  _admit(bm, "a", toks)
  a0, a1 = bm.block_table("a").tolist()[:2]
  for rid, tail in (("b", [90, 91]), ("c", [95, 96, 97])):
    dev, _, _ = _admit(bm, rid, toks[:2 * BS] + tail)
    assert dev == 2 and bm.block_table(rid).tolist()[:2] == [a0, a1]
  run = bm.seqs["b"].run
  assert run is bm.seqs["c"].run and bm.seqs["a"].run is None and list(bm.runs.values()) == [run]
  assert run.blocks.tolist() == [a0, a1] and run.members == 2
  assert bm.device.owners(a0) == 2 and bm.device_references(a0) == 3 and bm.device.refs == {a0: 1, a1: 1}
  bm.take_writebacks()
  bm.begin_step()
  assert bm.swap_out_many(["b"], PairList.from_columns([], [])) == (1, 1)
  assert bm.seqs["b"].run is None and run.members == 1 and bm.device.refs == {a0: 1, a1: 1}  # nothing moved
  assert bm.seqs["b"].park_start == 2                    # its own blocks parked, the run's kept for c
  back = h2d_pairs()
  assert len(bm.swap_in_many(["b"], 0, back)) == 1 and len(back) == 0
  assert bm.seqs["b"].run is run and run.members == 2 and bm.block_table("b").tolist()[:2] == [a0, a1]
  bm.check_invariants()


def test_the_last_member_of_a_run_inherits_its_blocks():
  """When the last member leaves, the run is gone and its blocks are that member's own (no pool change): a
  swap-out then releases those others share and parks the rest; a free releases them tail first."""
  bm = BlockManager(16, 32, BS)
  toks = list(range(3 * BS + 1))
  _admit(bm, "a", toks)
  a0, a1 = bm.block_table("a").tolist()[:2]
  _admit(bm, "b", toks[:2 * BS] + [90, 91])
  _admit(bm, "c", toks[:2 * BS] + [95, 96])
  bm.take_writebacks()
  bm.begin_step()
  bm.free("a")                                            # a's blocks: a0, a1 stay with the run
  assert not bm.device.refs and bm.device.owners(a0) == 1 and not bm.device.is_evictable(a0)
  assert bm.swap_out_many(["b"], PairList.from_columns([], [])) == (1, 1)
  assert bm.seqs["b"].park_start == 2 and len(bm.runs) == 1  # c still holds the run
  assert bm.swap_out_many(["c"], PairList.from_columns([], [])) == (1, 1)
  # c was the last member: it inherited a0, a1 (nobody else holds them) and parked them with its tail.
  assert not bm.runs and bm.seqs["c"].park_start == 0 and _parked(bm, "c").tolist()[:2] == [a0, a1]
  assert bm.device.lookup(block_hashes(toks, BS)[0]) is None   # parked: not found while c is out
  back = h2d_pairs()
  assert len(bm.swap_in_many(["c"], 0, back)) == 1 and len(back) == 0  # c re-adopts its whole group
  assert bm.block_table("c").tolist()[:2] == [a0, a1] and bm.seqs["c"].run is None
  bm.free("c")                                            # its own blocks now: tail first into the LRU
  assert list(bm.device.evictable)[-2:] == [a1, a0]
  bm.check_invariants()


def test_a_swap_in_batch_registers_one_run_for_the_requests_that_found_a_prefix():
  """Two rotated-out requests find the same leading blocks (nobody holds a run of them): the batch shares them once,
  for a run both join, and a later request joins it at admission with no lookup."""
  bm = BlockManager(16, 32, BS)
  toks = list(range(2 * BS + 1))
  _admit(bm, "a", toks)
  _admit(bm, "b", toks[:2 * BS] + [90])
  _admit(bm, "c", toks[:2 * BS] + [91])
  bm.take_writebacks()
  bm.begin_step()
  assert bm.swap_out_many(["b", "c"], PairList.from_columns([], [])) == (2, 2)
  assert not bm.runs                                      # c was the run's last member; it released a's blocks
  back = h2d_pairs()
  assert len(bm.swap_in_many(["b", "c"], 0, back)) == 2 and len(back) == 0
  run = bm.seqs["b"].run
  assert run is bm.seqs["c"].run and run.members == 2 and bm.device.owners(run.blocks[0]) == 2  # a's + the run's
  dev, _, _ = _admit(bm, "d", toks[:2 * BS] + [92])
  assert dev == 2 and bm.seqs["d"].run is run and run.members == 3
  bm.check_invariants()
