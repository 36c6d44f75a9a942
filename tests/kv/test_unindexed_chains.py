"""Unindexed chains (``kv/block_pool.py``): a chain of blocks only its publisher has published stays out of the
index until a lookup names its root or another publisher shares it, with the same results as indexing every key at
once. Hand-worked cases at the pool and the manager, then a differential run of random block-manager operations
against a twin whose pools index every key (``BlockPool.index_all``), compared after every operation."""
import random

import pytest

from superinfer_jax.kv.block_manager import BlockManager
from superinfer_jax.kv.block_pool import BlockPool
from superinfer_jax.kv.pairs import DEV_IDS, HOST_IDS, PairList, h2d_pairs
from superinfer_jax.kv.prefix_hash import block_hashes, id_block_hashes


def _chain(n: int, first: int = 0) -> tuple:
  """``n`` chained hashes (a chain's content hashes from its root)."""
  return id_block_hashes(range(first, first + n))


def _published_chain(num_blocks: int, n: int):
  """A device pool of ``num_blocks`` whose first ``n`` blocks one owner took and published as a chain's blocks
  0..n-1: ``(pool, owner, hashes, blocks)``."""
  p = BlockPool(1, num_blocks, DEV_IDS)
  owner = object()
  hashes = _chain(n)
  blocks = p.take(n)
  assert p.publish_chain(blocks, hashes, 0, owner) == n
  return p, owner, hashes, blocks


def test_a_chain_one_owner_publishes_stays_unindexed_until_a_lookup_names_its_root():
  p = BlockPool(1, 8, DEV_IDS)
  owner = object()
  hashes = _chain(4)
  blocks = p.take(4)
  assert p.publish_chain(blocks[:2], hashes, 0, owner) == 2   # a prefill chunk
  assert p.publish_chain(blocks[2:3], hashes, 2, owner) == 1  # the next block
  assert p.index_entries == 0 and p.lazy_entries == 3 and p.num_published == 3 and p.shared
  assert p.lookup_at(hashes, 3) is None and p.index_entries == 0   # past the chain's end: no indexing
  assert p.published_run(hashes, 3, 4) == 3 and p.index_entries == 0
  p.check()
  assert p.lookup_chain(hashes[:4]) == [1, 2, 3, None]          # names the root: indexed
  assert p.index_entries == 3 and p.lazy_entries == 0 and hashes[0] in p.eager_roots and not p.pending
  assert p.publish_chain(blocks[3:], hashes, 3, owner) == 1     # indexed from then on
  assert p.index_entries == 4 and p.lookup(hashes[3]) == 4
  p.check()


def test_unindexed_end_says_where_lookups_miss_with_no_work():
  p = BlockPool(0, 8, HOST_IDS)
  owner = object()
  hashes = _chain(5)
  assert p.unindexed_end(hashes) == 0                 # nothing under this root yet
  p.publish_chain(p.take(3), hashes, 0, owner)
  assert p.unindexed_end(hashes) == 3
  assert p.lookup_at(hashes, 1) == 1                  # before the end: indexes the chain
  assert p.unindexed_end(hashes) == -1 and p.index_entries == 3


def test_host_copies_are_published_as_runs_and_only_those_still_held():
  bs = 2
  bm = BlockManager(16, 16, bs)
  prompt = list(range(20, 29))                       # 4 full blocks
  assert bm.allocate_prefix("a", block_hashes(prompt, bs), 0, 0, len(prompt), h2d_pairs())
  bm.mark_computed("a", len(prompt))
  assert len(bm.take_writebacks()) == 4
  assert [(rid, start, hosts.tolist()) for rid, _, start, hosts in bm._host_published] == [("a", 0, [0, 1, 2, 3])]
  bm.begin_step()
  assert bm.host.num_published == 4 and bm.host.lazy_entries == 4
  bm.append_slots("a", 4)
  bm.mark_computed("a", len(prompt) + 4)             # 2 more full blocks (no hashes: decode tokens)
  bm.take_writebacks()
  assert bm._host_published == []                    # blocks without a hash are not recorded
  b = list(range(40, 47))
  assert bm.allocate_prefix("b", block_hashes(b, bs), 0, 0, len(b), h2d_pairs())
  bm.mark_computed("b", len(b))
  bm.take_writebacks()
  bm.drop_host_mirrors("b")                          # its copies gone before the next step: none published
  bm.begin_step()
  assert bm.host.num_published == 4
  bm.check_invariants()


def test_a_second_publisher_of_a_root_indexes_the_chain_and_keeps_the_first_copy():
  p = BlockPool(1, 8, DEV_IDS)
  a, b = object(), object()
  hashes = _chain(3)
  mine = p.take(3)
  theirs = p.take(3)
  assert p.publish_chain(mine, hashes, 0, a) == 3 and p.index_entries == 0
  assert p.publish_chain(theirs, hashes, 0, b) == 0      # same content: the first copy stays the one found
  assert p.index_entries == 3 and p.lookup_chain(hashes) == mine.tolist()
  assert not any(p.published(x) for x in theirs)
  p.check()


def test_an_owner_publishing_a_position_again_indexes_its_chain():
  """Positions of one owner's chain only grow while unindexed; an earlier one (a recompute) indexes it first, so
  the rule "a key published once" is checked against the index."""
  p, owner, hashes, _ = _published_chain(8, 2)
  again = p.take(2)
  assert p.publish_chain(again, hashes, 0, owner) == 0 and p.index_entries == 2
  p.check()


def test_a_parked_unindexed_block_is_hidden_then_found_and_never_under_an_old_key():
  p, _, hashes, blocks = _published_chain(4, 2)
  end = p.park(blocks)                               # rotated out: both hidden, both on the free queue
  assert p.lookup(hashes[0]) is None and p.lazy_entries == 2 and not p.published(1)
  back = p.unpark(end, 2)                            # rotated back in before the queue handed them out
  assert back.tolist() == [1, 2] and p.lookup(hashes[1]) == 2
  end = p.park(back)
  got = p.take(4)                                    # the queue hands out 3, 4, then the group's tail first: 2, 1
  assert got.tolist() == [3, 4, 2, 1]
  other = _chain(1, first=100)
  assert p.publish_chain(got[3:], other, 0, object()) == 1   # block 1 under a new key
  assert p.lookup_chain(hashes) == [None, None]       # indexing the old chain skips what left it
  assert p.lookup(other[0]) == 1 and p.index_entries == 1   # block 2's stale entry (handed out hidden) indexed
  p.check()


def test_evicting_unindexed_blocks_counts_and_forgets_them():
  p, _, hashes, blocks = _published_chain(3, 3)
  p.release(blocks[::-1])                            # tail first into the LRU
  assert list(p.evictable) == [3, 2, 1] and p.num_free == 3
  assert p.take(2).tolist() == [3, 2] and p.evictions == 2 and p.lazy_entries == 1
  assert p.lookup_chain(hashes) == [1, None, None]
  p.take(1)
  assert p.evictions == 3 and p.lazy_entries == 0 and p.index_entries == 0 and not p.shared
  p.check()


def test_dead_chains_are_pruned_and_live_ones_kept():
  """Once there are more unindexed chains than blocks, each new one prunes the dead among the two oldest (nothing of
  them left: evicted), so their number stays bounded; a live one (its block still owned) is kept."""
  p = BlockPool(1, 2, DEV_IDS)
  roots = [_chain(1, first=10 * r) for r in range(12)]
  held = p.take(1)                                   # block 1: the oldest chain's, owned throughout
  assert p.publish_chain(held, roots[0], 0, object()) == 1
  for hashes in roots[1:]:
    block = p.take(1)                                # block 2 each time: the last chain's copy evicted
    assert p.publish_chain(block, hashes, 0, object()) == 1
    p.release(block)                                 # cached: published, in the LRU
    assert len(p.pending) <= 2 * p.num_blocks
  assert p.evictions == 10 and p.lazy_entries == 2
  assert p.lookup_chain(roots[0]) == [1] and p.lookup_chain(roots[-1]) == [2] and p.lookup_chain(roots[1]) == [None]
  p.check()


def test_a_new_turn_finds_the_previous_turns_blocks_on_both_tiers():
  """A conversation's second turn shares the first's root: its lookup indexes the first turn's chains (device, then
  host) and finds every block the first turn published."""
  bs = 2
  bm = BlockManager(16, 16, bs)
  turn1 = list(range(10, 19))                        # 4 full blocks and one token
  h1 = block_hashes(turn1, bs)
  assert bm.lookup_prefix(h1, 4) == (0, 0)
  assert bm.allocate_prefix("t1", h1, 0, 0, len(turn1), h2d_pairs())
  bm.mark_computed("t1", len(turn1))
  bm.take_writebacks()
  bm.begin_step()                                    # the host copies are published a step later
  assert bm.device.index_entries == 0 and bm.host.index_entries == 0
  assert bm.device.lazy_entries == 4 and bm.host.lazy_entries == 4
  turn2 = turn1 + [7, 8, 9]
  h2 = block_hashes(turn2, bs)
  assert bm.lookup_prefix(h2, 5) == (4, 0)
  assert bm.device.index_entries == 4 and bm.host.index_entries == 0   # the host chain: not reached
  out = PairList.from_columns([], [])
  assert bm.swap_out_many(["t1"], out) == (1, 1)       # the tail's copy; its full blocks are parked, hidden
  assert bm.lookup_prefix(h2, 5) == (0, 4)           # only the host copies are found now
  assert bm.host.index_entries == 4
  bm.check_invariants()


# ------------------------------------------------------------------------------------------- differential
def _snapshot(bm: BlockManager) -> tuple:
  """What a caller can observe: every request's columns, both pools' queues, LRUs, owners, published keys."""
  seqs = tuple((rid, s.dev.tolist(), s.host.tolist(), list(s.host_tokens), s.num_tokens, s.num_computed,
                s.on_host, s.nhost, s.park_start, s.park_end, s.pub_end) for rid, s in sorted(bm.seqs.items()))
  pools = tuple((p.free_ids(), list(p.evictable), sorted(p.refs.items()), sorted(p.published_items().items()),
                 p.num_free, p.evictions, p.shared) for p in (bm.device, bm.host))
  return seqs, pools, list(bm.writebacks), bm.prefix_cache_stats(), bm.reclaimable_host_blocks()


class _Driver:
  """Random block-manager operations the way the scheduler issues them (prompts from a few shared heads)."""

  def __init__(self, rng: random.Random):
    self.rng = rng
    self.bs = rng.choice([1, 2, 3])
    self.ndev = rng.randint(5, 24)
    self.nhost = rng.choice([0, rng.randint(4, 30)])
    heads = [tuple(range(100 * p, 100 * p + rng.randint(1, 3) * self.bs)) for p in range(rng.randint(1, 3))]
    self.heads = heads + [()]
    self.prompts = []
    self.next_id = 0

  def op(self, bm: BlockManager) -> list:
    """One operation, drawn from the RNG and ``bm``'s state (the twin's is the same until they differ)."""
    r = self.rng
    bs = self.bs
    resident = sorted(rid for rid, s in bm.seqs.items() if not s.on_host)
    swapped = sorted(rid for rid, s in bm.seqs.items() if s.on_host)
    kind = r.choice(["admit"] * 6 + ["plain", "grow"] + ["mark"] * 5 + ["wb"] * 2 + ["step"] * 2 + ["out"] * 5
                    + ["in"] * 5 + ["free"] * 3 + ["drop"])
    if kind == "admit":
      if self.prompts and r.random() < 0.6:
        prompt = r.choice(self.prompts)              # a repeat, or the next turn of an earlier one
        prompt = prompt + tuple(r.randint(0, 3) for _ in range(r.choice([0, 0, bs, 2 * bs + 1])))
      else:
        prompt = r.choice(self.heads) + tuple(r.randint(0, 3) for _ in range(r.randint(1, 2 * bs + 1)))
      self.prompts.append(prompt)
      hashes = block_hashes(prompt, bs)
      total = len(prompt) + r.randint(0, 2 * bs)
      d, h = bm.lookup_prefix(hashes, (total - 1) // bs)
      if h and r.random() < 0.3:
        h = 0
      rid = self.next_id
      self.next_id += 1
      return ["admit", rid, prompt, d, h, max(total, (d + h) * bs + 1)]
    if kind == "plain":
      self.next_id += 1
      return ["plain", self.next_id - 1, r.randint(1, self.ndev * bs // 2)]
    if kind == "grow" and resident:
      return ["grow", r.choice(resident), r.randint(1, 2 * bs)]
    if kind == "mark" and resident:
      rid = r.choice(resident)
      s = bm.seqs[rid]
      return ["mark", rid, r.choice([s.num_tokens, r.randint(s.num_computed, s.num_tokens)])]
    if kind == "wb":
      return ["wb", r.choice([None, r.randint(0, 4)])]
    if kind == "out" and resident:
      return ["out", r.sample(resident, min(len(resident), r.choice([1, 2, 3])))]
    if kind == "in" and swapped:
      return ["in", r.sample(swapped, min(len(swapped), r.choice([1, 2, 3]))), r.choice([0, 1])]
    if kind == "free" and bm.seqs:
      return ["free", r.choice(sorted(bm.seqs))]
    if kind == "drop" and resident:
      return ["drop", r.choice(resident)]
    return ["step"]


def _apply(bm: BlockManager, op: list):
  kind = op[0]
  if kind == "admit":
    _, rid, prompt, d, h, total = op
    out = h2d_pairs()
    return bm.allocate_prefix(rid, block_hashes(prompt, bm.block_size), d, h, total, out), out.tolist()
  if kind in ("plain", "grow"):
    return bm.append_slots(op[1], op[2])
  if kind == "mark":
    return bm.mark_computed(op[1], op[2])
  if kind == "wb":
    return bm.take_writebacks(op[1]).tolist()
  if kind == "step":
    return bm.begin_step()
  if kind == "out":
    out = PairList.from_columns([], [])
    return bm.swap_out_many(op[1], out), out.tolist()
  if kind == "in":
    out = h2d_pairs()
    return [t.tolist() for t in bm.swap_in_many(op[1], op[2], out)], out.tolist()
  if kind == "free":
    return bm.free(op[1])
  return bm.drop_host_mirrors(op[1])


@pytest.mark.parametrize("seed", range(40))
def test_same_results_as_indexing_every_key(seed):
  rng = random.Random(seed)
  driver = _Driver(rng)
  lazy = BlockManager(driver.ndev, driver.nhost, driver.bs)
  eager = BlockManager(driver.ndev, driver.nhost, driver.bs)
  eager.device.index_all()
  eager.host.index_all()
  unindexed_seen = 0
  for i in range(300):
    op = driver.op(lazy)
    results = []
    for bm in (lazy, eager):
      try:
        results.append(_apply(bm, op))
      except ValueError as e:                        # a stale hit (the driver may ask for one): both refuse alike
        results.append(("ValueError", str(e)))
    assert results[0] == results[1], f"op {i} {op}: {results}"
    assert _snapshot(lazy) == _snapshot(eager), f"op {i} {op}"
    unindexed_seen += lazy.device.lazy_entries + lazy.host.lazy_entries
    if i % 25 == 0:
      lazy.check_invariants()
  lazy.check_invariants()
  assert eager.device.lazy_entries == eager.host.lazy_entries == 0 and not eager.device.pending
  assert unindexed_seen, "no chain stayed unindexed: the run tested nothing"
