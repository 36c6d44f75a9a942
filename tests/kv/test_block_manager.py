"""Unit tests for the KV block manager (superinfer_jax/kv/block_manager.py)."""
import collections
from array import array
import os
import random
import subprocess
import sys

import pytest

from superinfer_jax.kv import swap
from superinfer_jax.kv.block_manager import BlockManager
from superinfer_jax.kv.block_pool import BlockPool
from superinfer_jax.kv.layout import PADDING_BLOCK
from superinfer_jax.kv.pairs import PairList, h2d_pairs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_block_pool_fifo_take_release_and_compaction():
  """Hand-worked: takes pop the head, releases go to the tail, compaction keeps the queue's order."""
  p = BlockPool(1, 6, "i")
  assert p.num_blocks == 6 and p.num_free == 6 and p.usage() == 0.0 and p.free_ids() == [1, 2, 3, 4, 5, 6]
  assert p.take(2).tolist() == [1, 2]  # consumed prefix 2 of 6: below half, no compaction
  assert p.head == 2 and p.free_ids() == [3, 4, 5, 6]
  p.release(array("i", [2]))  # to the tail
  assert p.free_ids() == [3, 4, 5, 6, 2] and p.num_free == 5
  assert p.take(1).tolist() == [3] and p.head == 3  # 3 of 7 consumed
  assert p.take(1).tolist() == [4]  # 4 of 7: compacted, same order
  assert p.head == 0 and p.ids.tolist() == [5, 6, 2]
  p.release([1])  # any iterable of ids
  assert p.free_ids() == [5, 6, 2, 1] and p.usage() == 1 - 4 / 6
  assert p.take(5) is None and p.free_ids() == [5, 6, 2, 1]  # over-take: None, nothing changes
  with pytest.raises(ValueError):
    p.consume(5)
  assert p.free_ids() == [5, 6, 2, 1] and p.head == 0
  assert p.ids[p.head:p.head + 2].tolist() == [5, 6]  # a hot path reads the head, then consumes it
  p.consume(2)
  assert p.free_ids() == [2, 1]
  p.check()
  p.ids.append(2)
  with pytest.raises(AssertionError):
    p.check()  # duplicate on the queue
  p.ids[-1] = 7
  with pytest.raises(AssertionError):
    p.check()  # outside [1, 7)
  empty = BlockPool(0, 0, "i")
  assert empty.num_free == 0 and empty.usage() == 1.0 and empty.take(0).tolist() == [] and empty.take(1) is None


def test_pools_and_padding_block():
  bm = BlockManager(4, 3, block_size=4)
  assert bm.num_free_device_blocks == 4 and bm.num_free_host_blocks == 3
  assert bm.append_slots("a", 16)  # exactly the whole pool
  assert sorted(bm.block_table("a")) == [1, 2, 3, 4]
  assert PADDING_BLOCK not in bm.block_table("a")
  assert bm.num_free_device_blocks == 0 and bm.device_usage() == 1.0
  assert not bm.append_slots("a", 1)
  bm.check_invariants()


def test_append_all_or_nothing_and_growth_queries():
  bm = BlockManager(3, 0, block_size=4)
  assert bm.blocks_to_grow("a", 5) == 2
  assert bm.append_slots("a", 5)
  assert bm.blocks_to_grow("a", 8) == 0 and bm.blocks_to_grow("a", 9) == 1 and bm.blocks_to_grow("a", 13) == 2
  assert bm.append_slots("a", 3)  # fills block 2, no allocation
  assert bm.num_blocks("a") == 2 and bm.num_free_device_blocks == 1
  assert not bm.append_slots("a", 5)  # needs 2, has 1: nothing changes
  assert bm.num_tokens("a") == 8 and bm.num_free_device_blocks == 1
  assert not bm.append_slots("b", 5)  # a new request that does not fit is not created
  assert "b" not in bm
  bm.check_invariants()


def test_mark_computed_bounds():
  bm = BlockManager(4, 4, block_size=4)
  bm.append_slots("a", 6)
  bm.mark_computed("a", 3)
  with pytest.raises(ValueError):
    bm.mark_computed("a", 2)  # decreasing
  with pytest.raises(ValueError):
    bm.mark_computed("a", 7)  # beyond the slots
  bm.mark_computed("a", 6)
  assert bm.num_computed("a") == 6


def test_eager_writeback_only_full_computed_blocks():
  bm = BlockManager(8, 8, block_size=4)
  bm.append_slots("a", 10)  # 3 blocks
  assert bm.take_writebacks() == []  # nothing computed
  bm.mark_computed("a", 3)
  assert bm.take_writebacks() == []  # block 0 not full yet
  bm.mark_computed("a", 9)  # blocks 0 and 1 full, block 2 partial
  dev = bm.block_table("a").tolist()
  wb = bm.take_writebacks()
  assert [d for d, _ in wb] == dev[:2]
  assert len({h for _, h in wb}) == 2
  assert bm.take_writebacks() == []  # now clean: not copied twice
  assert bm.num_free_host_blocks == 6
  bm.check_invariants()


def test_writeback_max_blocks_and_host_room():
  bm = BlockManager(8, 2, block_size=2)
  bm.append_slots("a", 8)
  bm.mark_computed("a", 8)  # 4 full blocks
  assert len(bm.take_writebacks(max_blocks=1)) == 1
  assert bm.take_writebacks(min_free_host=1) == []  # would leave 0 < 1 free
  assert len(bm.take_writebacks()) == 1  # host pool now full
  assert bm.take_writebacks() == [] and bm.pending_writebacks() == 2  # kept for later, not lost
  bm.check_invariants()


def test_swap_out_copies_only_dirty_tail_after_writeback():
  bm = BlockManager(8, 8, block_size=4)
  bm.append_slots("a", 10)
  bm.mark_computed("a", 10)
  dev = bm.block_table("a")
  wb = bm.take_writebacks()
  assert len(wb) == 2
  assert bm.blocks_to_swap_out("a") == 1 and bm.swap_out_copies("a") == 1
  pairs = bm.swap_out("a")
  assert len(pairs) == 1 and pairs[0][0] == dev[2]  # only the dirty tail block
  assert bm.is_swapped("a")
  assert bm.num_free_device_blocks == 8  # all device blocks freed
  with pytest.raises(ValueError):
    bm.block_table("a")
  bm.check_invariants()


def test_swap_out_without_writeback_copies_everything():
  bm = BlockManager(8, 8, block_size=4)
  bm.append_slots("a", 10)
  bm.mark_computed("a", 10)
  dev = bm.block_table("a").tolist()
  pairs = bm.swap_out("a")
  assert [d for d, _ in pairs] == dev
  assert bm.host_block_table("a") == [h for _, h in pairs]


def test_swap_out_drops_uncomputed_slots():
  bm = BlockManager(8, 8, block_size=4)
  bm.append_slots("a", 9)
  bm.mark_computed("a", 4)  # block 1 and 2 hold no computed token
  pairs = bm.swap_out("a")
  assert len(pairs) == 1
  assert bm.num_tokens("a") == 4 and bm.num_blocks("a") == 1
  bm.check_invariants()


def test_swap_in_keeps_clean_mirrors_and_next_swap_out_copies_only_tail():
  bm = BlockManager(8, 8, block_size=4)
  bm.append_slots("a", 10)
  bm.mark_computed("a", 10)
  out = bm.swap_out("a")
  host = bm.host_block_table("a")
  assert bm.blocks_to_swap_in("a") == 3
  pairs = bm.swap_in("a")
  assert [h for h, _ in pairs] == host
  assert [d for _, d in pairs] == bm.block_table("a").tolist()
  assert len(out) == 3
  assert bm.swap_out_copies("a") == 0  # nothing changed since: clean
  bm.append_slots("a", 1)
  bm.mark_computed("a", 11)
  assert bm.swap_out_copies("a") == 1 and bm.blocks_to_swap_out("a") == 0
  again = bm.swap_out("a")
  assert len(again) == 1 and again[0][1] == host[2]  # the stale tail copy is overwritten in place
  bm.check_invariants()


def test_tail_block_filled_after_swap_in_is_written_back_to_same_host_block():
  bm = BlockManager(8, 8, block_size=4)
  bm.append_slots("a", 6)
  bm.mark_computed("a", 6)
  bm.swap_out("a")
  host = bm.host_block_table("a")
  bm.swap_in("a")
  bm.append_slots("a", 2)
  bm.mark_computed("a", 8)
  wb = bm.take_writebacks()
  assert wb == [(bm.block_table("a")[1], host[1])]
  bm.check_invariants()


def test_swap_out_host_full_returns_none_and_changes_nothing():
  bm = BlockManager(8, 2, block_size=4)
  bm.append_slots("a", 12)
  bm.mark_computed("a", 12)
  table = bm.block_table("a")
  assert bm.swap_out("a") is None
  assert not bm.is_swapped("a") and bm.block_table("a") == table
  assert bm.num_free_host_blocks == 2 and bm.num_free_device_blocks == 5
  bm.check_invariants()


def test_swap_in_device_full_returns_none_and_changes_nothing():
  bm = BlockManager(3, 8, block_size=4)
  bm.append_slots("a", 12)
  bm.mark_computed("a", 12)
  bm.swap_out("a")
  assert bm.append_slots("b", 4)
  assert bm.swap_in("a") is None
  assert bm.is_swapped("a") and bm.num_free_device_blocks == 2
  bm.free("b")
  assert len(bm.swap_in("a")) == 3
  bm.check_invariants()


def test_swap_out_to_and_swap_in_to_append_to_a_pairlist():
  bm = BlockManager(8, 8, block_size=4)
  for rid in ("a", "b"):
    bm.append_slots(rid, 6)
    bm.mark_computed(rid, 6)
  dev_a, dev_b = bm.block_table("a"), bm.block_table("b")
  out = PairList([(99, 98)])
  assert bm.swap_out_to("a", out) == 2  # no write-back yet: both blocks
  assert bm.swap_out_to("b", out) == 2
  hosts = bm.host_block_table("a") + bm.host_block_table("b")
  assert out == [(99, 98)] + list(zip(dev_a + dev_b, hosts))
  inn = PairList()
  assert bm.swap_in_to("a", inn) == 2 and bm.swap_in_to("b", inn) == 2
  assert inn == list(zip(hosts, bm.block_table("a") + bm.block_table("b")))
  bm.check_invariants()
  tiny = BlockManager(8, 1, block_size=4)
  tiny.append_slots("a", 8)
  tiny.mark_computed("a", 8)
  out = PairList([(1, 1)])
  assert tiny.swap_out_to("a", out) is None and out == [(1, 1)]  # None: out unchanged


@pytest.mark.parametrize("stale_tail", [False, True])
def test_swap_out_dirty_tail_only_matches_per_block_rule(stale_tail):
  """The usual rotation (full blocks written back, partial tail dirty) gives exactly the general rule's
  pairs: one ``(device tail, host tail)`` pair, the host tail reused if it exists, else the free list's head."""
  bm = BlockManager(16, 16, block_size=4)
  bm.append_slots("x", 4)  # takes host block 0 below, so host ids are not trivially the device ids
  bm.mark_computed("x", 4)
  bm.take_writebacks()
  bm.append_slots("a", 10 if stale_tail else 9)
  bm.mark_computed("a", 10 if stale_tail else 9)
  if stale_tail:  # rotate once so the tail has a stale host copy, then grow inside the tail block
    bm.swap_out("a")
    bm.swap_in("a")
    bm.append_slots("a", 1)
    bm.mark_computed("a", 11)
  bm.take_writebacks()
  dev, host = bm.block_table("a"), bm.host_block_table("a")
  free_head = bm.host.free_ids()[0]
  assert bm.swap_out_copies("a") == 1
  pairs = bm.swap_out("a")
  expect_host = host[2] if stale_tail else free_head
  assert pairs == [(dev[2], expect_host)]
  assert bm.host_block_table("a") == host[:2] + [expect_host]
  assert bm.seqs["a"].host_tokens == [4, 4, 3 if stale_tail else 1]
  bm.check_invariants()


def test_freed_device_block_reused_in_same_step():
  # Ordering contract 1: gathers of a step happen before its scatters, so a block freed by swap_out may be
  # the swap_in target of another request within the same step.
  bm = BlockManager(2, 8, block_size=4)
  bm.append_slots("a", 4)
  bm.mark_computed("a", 4)
  bm.swap_out("a")
  bm.append_slots("b", 8)
  bm.mark_computed("b", 8)
  out = bm.swap_out("b")
  inn = bm.swap_in("a")
  assert {d for d, _ in out} & {d for _, d in inn}  # a freed block is reused
  bm.check_invariants()


def test_free_releases_everything_and_is_idempotent():
  bm = BlockManager(4, 4, block_size=4)
  bm.append_slots("a", 8)
  bm.mark_computed("a", 8)
  bm.take_writebacks()
  bm.free("a")
  bm.free("a")
  bm.free("never-existed")
  assert bm.num_free_device_blocks == 4 and bm.num_free_host_blocks == 4 and bm.num_requests == 0
  assert bm.pending_writebacks() == 0
  bm.check_invariants()


def test_free_drops_pending_writebacks():
  bm = BlockManager(4, 4, block_size=4)
  bm.append_slots("a", 8)
  bm.mark_computed("a", 8)
  assert bm.pending_writebacks() == 2
  bm.free("a")
  assert bm.take_writebacks() == []


def test_drop_host_mirrors_requeues_full_blocks():
  bm = BlockManager(4, 4, block_size=4)
  bm.append_slots("a", 6)
  bm.mark_computed("a", 6)
  bm.swap_out("a")
  bm.swap_in("a")
  assert bm.drop_host_mirrors("a") == 2
  assert bm.num_free_host_blocks == 4
  assert bm.pending_writebacks() == 1  # block 0 is full: write it back again
  bm.check_invariants()


def test_swapped_request_rejects_device_ops():
  bm = BlockManager(4, 4, block_size=4)
  bm.append_slots("a", 4)
  bm.mark_computed("a", 4)
  bm.swap_out("a")
  with pytest.raises(ValueError):
    bm.append_slots("a", 1)
  with pytest.raises(ValueError):
    bm.swap_out("a")
  with pytest.raises(ValueError):
    bm.mark_computed("a", 4)


@pytest.mark.parametrize("seed", range(4))
def test_free_lists_stay_fifo_under_bulk_allocation(seed):
  """Bulk take/release (list slices + head index, with compaction) hands out exactly the blocks a FIFO deque
  would, in the same order, for every operation that allocates or frees."""
  rng = random.Random(seed)
  ndev, nhost, bs = 24, 40, 4
  bm = BlockManager(ndev, nhost, bs)
  dev_ref = collections.deque(range(1, ndev + 1))
  host_ref = collections.deque(range(nhost))
  live = {}  # rid -> (device table, host table) as the reference expects them
  for step in range(400):
    op = rng.choice(["new", "grow", "compute_wb", "out", "in", "free", "drop"])
    resident = sorted(r for r in live if not bm.is_swapped(r))
    swapped = sorted(r for r in live if bm.is_swapped(r))
    if op == "new":
      n = rng.randint(1, 3 * bs)
      if bm.append_slots(step, n):
        assert bm.block_table(step).tolist() == [dev_ref.popleft() for _ in range(-(-n // bs))]
        live[step] = True
    elif op == "grow" and resident:
      rid = rng.choice(resident)
      before = bm.block_table(rid)
      if bm.append_slots(rid, rng.randint(0, 2 * bs)):
        new = bm.block_table(rid)[len(before):].tolist()
        assert new == [dev_ref.popleft() for _ in new]
    elif op == "compute_wb" and resident:
      rid = rng.choice(resident)
      bm.mark_computed(rid, bm.num_tokens(rid))
      hosts_before = {r: bm.host_block_table(r) for r in live}
      pairs = bm.take_writebacks(max_blocks=rng.choice([None, 2]), min_free_host=rng.randint(0, 3))
      fresh = [h for _, h in pairs if all(h not in t for t in hosts_before.values())]
      assert fresh == [host_ref.popleft() for _ in fresh]
    elif op == "out" and resident:
      rid = rng.choice(resident)
      dev, host = bm.block_table(rid), bm.host_block_table(rid)
      pairs = bm.swap_out(rid)
      if pairs is not None:
        fresh = [h for _, h in pairs if h not in host]
        assert fresh == [host_ref.popleft() for _ in fresh]
        dev_ref.extend(dev)
        n = bm.num_blocks(rid)
        host_ref.extend(h for h in host[n:] if h != -1)
    elif op == "in" and swapped:
      rid = rng.choice(swapped)
      pairs = bm.swap_in(rid)
      if pairs is not None:
        assert [d for _, d in pairs] == [dev_ref.popleft() for _ in pairs]
    elif op == "free" and live:
      rid = rng.choice(sorted(live))
      dev = [] if bm.is_swapped(rid) else bm.block_table(rid)
      host = bm.host_block_table(rid)
      bm.free(rid)
      del live[rid]
      dev_ref.extend(dev)
      host_ref.extend(h for h in host if h != -1)
    elif op == "drop" and resident:
      rid = rng.choice(resident)
      host = bm.host_block_table(rid)
      bm.drop_host_mirrors(rid)
      host_ref.extend(h for h in host if h != -1)
    bm.check_invariants()
    assert bm.device.free_ids() == list(dev_ref)
    assert bm.host.free_ids() == list(host_ref)
    assert bm.num_free_device_blocks == len(dev_ref) and bm.num_free_host_blocks == len(host_ref)


@pytest.mark.parametrize("corrupt", ["double_owner", "lost_block", "free_list", "free_dup", "host_free_list",
                                     "host_out_of_range", "cover", "wb"])
def test_check_invariants_detects_corruption(corrupt):
  bm = BlockManager(6, 6, block_size=4)
  bm.append_slots("a", 8)
  bm.append_slots("b", 4)
  bm.mark_computed("a", 8)
  bm.take_writebacks(max_blocks=1)
  bm.check_invariants()
  s = bm.seqs["a"]
  if corrupt == "double_owner":
    bm.seqs["b"].dev[0] = s.dev[0]
  elif corrupt == "lost_block":  # a block neither owned nor free
    bm.device.head += 1
  elif corrupt == "free_list":
    bm.device.ids.append(s.dev[0])
  elif corrupt == "free_dup":
    bm.device.ids.append(bm.device.ids[-1])
  elif corrupt == "host_free_list":
    bm.host.ids.append(s.host[0])
  elif corrupt == "host_out_of_range":
    bm.host.ids.append(bm.num_host_blocks)
  elif corrupt == "cover":
    s.num_tokens = 9
  elif corrupt == "wb":
    bm.writebacks.entries.clear()
  with pytest.raises(AssertionError):
    bm.check_invariants()


def test_no_jax_import():
  """The block manager and the scheduler package import with JAX blocked."""
  code = ("import sys; sys.modules['jax'] = None; sys.modules['jaxlib'] = None\n"
          "import superinfer_jax.kv.block_manager\n"
          "import importlib, pkgutil, superinfer_jax.sched as p\n"
          "for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.'):\n"
          "  importlib.import_module(m.name)\n"
          "assert 'jax' not in [k for k, v in sys.modules.items() if v is not None and k.split('.')[0] == 'jax']\n"
          "print('ok')\n")
  env = dict(os.environ, PYTHONPATH=REPO)
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
  assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def _bm_state(bm):
  """Every piece of a manager's bookkeeping, comparable with ==."""
  seqs = {rid: (list(s.dev), list(s.host), list(s.host_tokens), s.num_tokens, s.num_computed, s.on_host,
                s.nwb, s.nhost) for rid, s in bm.seqs.items()}
  return (seqs, bm.device.free_ids(), bm.host.free_ids(), list(bm.writebacks), bm.reclaimable_host_blocks())


def _random_manager(rng, dev, host, bs, n):
  """A manager after a random history: growth, computed marks, write-backs, rotations out and in."""
  bm = BlockManager(dev, host, bs)
  for step in range(60):
    rid = rng.randrange(n)
    if rid in bm and bm.is_swapped(rid):
      if rng.random() < 0.5:
        bm.swap_in(rid)
      continue
    if bm.append_slots(rid, rng.randint(1, 3 * bs)):
      bm.mark_computed(rid, bm.num_tokens(rid) - rng.randint(0, 1))
    if rng.random() < 0.3:
      bm.take_writebacks(rng.choice([None, 2]))
    if rid in bm and rng.random() < 0.3:
      bm.swap_out(rid)
  return bm


def test_a_bad_rotation_batch_changes_nothing_without_caching():
  """A batch with a repeated id or one in the wrong state raises before anything moves (the plain paths read
  the free queues directly: a raise midway would leave blocks read but not taken)."""
  bm = BlockManager(12, 16, 4)
  for rid in ("a", "b", "c"):
    assert bm.append_slots(rid, 6)
    bm.mark_computed(rid, 6)
  bm.swap_out("c")
  before = _bm_state(bm)
  for batch in (["a", "b", "a"], ["a", "c"]):
    with pytest.raises(ValueError):
      bm.swap_out_many(batch, PairList())
    assert _bm_state(bm) == before
  for batch in (["c", "c"], ["c", "a"]):
    with pytest.raises(ValueError):
      bm.swap_in_many(batch, 1, PairList())
    assert _bm_state(bm) == before
  bm.check_invariants()


@pytest.mark.parametrize("seed", range(40))
def test_batched_swaps_equal_one_by_one(seed):
  """swap_out_many / swap_in_many take the same blocks, emit the same pairs and stop where one call at a
  time would first fail, as the single-request calls do."""
  import copy
  rng = random.Random(seed)
  bs = rng.choice([1, 4, 16])
  bm = _random_manager(rng, rng.randint(8, 40), rng.choice([0, 4, 16, 200]), bs, 8)
  resident = [r for r in bm.seqs if not bm.is_swapped(r)]
  rng.shuffle(resident)
  one = copy.deepcopy(bm)
  out_a, out_b = PairList(), PairList()
  k, moved = bm.swap_out_many(resident, out_a)
  done = 0
  for rid in resident:
    m = one.swap_out_to(rid, out_b)
    if m is None:
      break
    done += 1
  assert (k, moved) == (done, len(out_b)) and out_a == out_b
  assert _bm_state(bm) == _bm_state(one)
  bm.check_invariants()
  swapped = [r for r in bm.seqs if bm.is_swapped(r)]
  rng.shuffle(swapped)
  grow = rng.choice([0, 1, bs + 1])
  columns = copy.deepcopy(bm)  # the same swap-ins into array columns (the scheduler's h2d_pairs)
  host_before = {r: bm.host_block_table(r) for r in swapped}
  start = len(out_a)
  tables = bm.swap_in_many(swapped, grow, out_a)
  # Reference: each request swapped in, in order, pairs its host blocks (as they were) with its first new device
  # blocks; blocks added for the growth have no host copy and no pair.
  expected = [p for r, t in zip(swapped, tables) for p in zip(host_before[r], t[:len(host_before[r])])]
  assert list(out_a)[start:] == expected
  out_c = h2d_pairs()
  assert columns.swap_in_many(swapped, grow, out_c) == tables
  assert list(out_c) == expected and out_c.srcs.typecode == out_c.dsts.typecode == "i"
  assert _bm_state(columns) == _bm_state(bm)
  singles = []
  for rid in swapped:
    t = one.swap_in_grow(rid, grow, out_b)
    if t is None:
      break
    singles.append(t)
  assert tables == singles and out_a == out_b
  assert _bm_state(bm) == _bm_state(one)
  assert all(t == bm.block_table(r) for r, t in zip(swapped, tables))
  bm.check_invariants()


def test_swap_in_grow_is_swap_in_then_append():
  a = BlockManager(8, 8, 4)
  assert a.append_slots("r", 6)
  a.mark_computed("r", 6)
  a.swap_out("r")
  b = __import__("copy").deepcopy(a)
  table = a.swap_in_grow("r", 3, PairList())
  pairs = b.swap_in("r")
  assert b.append_slots("r", 3)
  assert table == b.block_table("r") == a.block_table("r") and len(pairs) == 2
  assert _bm_state(a) == _bm_state(b)
  with pytest.raises(ValueError):
    a.swap_in_grow("r", 1, PairList())  # not swapped out


@pytest.mark.parametrize("seed", range(40))
def test_swap_out_fast_paths_equal_the_general_path(seed):
  """swap_out_many's shortcuts (dirty tail block only; computed tokens on a block boundary with every full
  block clean, or with only the last one dirty) give exactly what the general path (every dirty block
  copied) gives."""
  import copy
  rng = random.Random(seed)
  bs = rng.choice([1, 4, 16])
  bm = _random_manager(rng, rng.randint(8, 40), rng.choice([4, 16, 200]), bs, 8)
  if rng.random() < 0.7:
    bm.take_writebacks()  # most requests now have clean full blocks: the shortcuts apply
  for rid in list(bm.seqs):  # fill a last block after the write-back (queued, dirty): the other shortcut
    if not bm.is_swapped(rid) and rng.random() < 0.5:
      room = -bm.num_tokens(rid) % bs
      if room and bm.append_slots(rid, room):
        bm.mark_computed(rid, bm.num_tokens(rid))
  for rid in [r for r in bm.seqs if not bm.is_swapped(r)]:
    ref = copy.deepcopy(bm)
    out_a, out_b = PairList(), PairList()
    k, moved = bm.swap_out_many((rid,), out_a)
    nhost = ref.seqs[rid].nhost
    m = swap.swap_out_general(ref.writebacks, rid, ref.seqs[rid], ref.device, ref.host, bs, out_b)
    assert (k == 1) == (m is not None)
    if m is not None:
      assert moved == m and out_a == out_b
    # swap_out_general leaves the mirror count to its caller: a swapped request's host blocks stop being mirrors.
    assert _bm_state(bm)[:-1] == _bm_state(ref)[:-1]
    assert bm.reclaimable_host_blocks() == ref.reclaimable_host_blocks() - (nhost if m is not None else 0)
  bm.check_invariants()
