"""PairList: a list of (src, dst) block-id pairs stored as two columns; must read like a list of 2-tuples."""
import collections.abc
import copy
import pickle
import random

import pytest

from superinfer_jax.kv.block_manager import BlockManager
from superinfer_jax.kv.pairs import PairList, columns


def test_empty():
  p = PairList()
  assert len(p) == 0 and not p and p == [] and list(p) == [] and p.srcs == [] and p.dsts == []
  assert repr(p) == "PairList([])"


def test_construct_from_pairs_and_columns():
  ref = [(3, 7), (1, 2), (9, 0)]
  a = PairList(ref)
  b = PairList.from_columns([3, 1, 9], [7, 2, 0])
  assert a == b == ref and ref == a and a.srcs == [3, 1, 9] and a.dsts == [7, 2, 0]
  assert PairList([[3, 7], [1, 2], [9, 0]]) == ref  # any 2-sequences in, tuples out
  assert PairList(iter(ref)) == ref
  c = PairList(a)  # copies
  c.append((4, 4))
  assert a == ref and len(c) == 4
  with pytest.raises(ValueError):
    PairList.from_columns([1, 2], [3])
  with pytest.raises(ValueError):
    PairList([(1, 2, 3)])


def test_iteration_order_and_tuples():
  ref = [(i, 100 - i) for i in range(10)]
  p = PairList(ref)
  got = list(p)
  assert got == ref and all(type(t) is tuple for t in got)
  assert list(reversed(p)) == ref[::-1]
  assert [s for s, _ in p] == p.srcs and [d for _, d in p] == p.dsts
  assert dict(p) == dict(ref) and sorted(p, reverse=True) == sorted(ref, reverse=True)


def test_equality_like_a_list_of_tuples():
  p = PairList([(1, 2), (3, 4)])
  assert p == [(1, 2), (3, 4)] and [(1, 2), (3, 4)] == p
  assert p != [(3, 4), (1, 2)]  # order matters
  assert p != [(1, 2)] and p != [(1, 2), (3, 4), (5, 6)]
  assert p != [(1, 2), (3, 5)]
  assert p != [[1, 2], [3, 4]]  # like list: a 2-list is not a 2-tuple
  assert p != ((1, 2), (3, 4))  # like list: not equal to a tuple
  assert p == PairList([(1, 2), (3, 4)]) and p != PairList([(1, 2)])
  assert not p == "x" and p != None  # pylint: disable=singleton-comparison
  assert PairList() == [] and PairList() != [(0, 0)] and PairList(None) == []
  with pytest.raises(TypeError):
    hash(p)


def test_indexing_and_slicing():
  ref = [(i, i * 10) for i in range(8)]
  p = PairList(ref)
  assert p[0] == (0, 0) and p[-1] == (7, 70) and type(p[3]) is tuple
  with pytest.raises(IndexError):
    p[8]  # pylint: disable=pointless-statement
  for sl in (slice(2, 5), slice(None, None, 2), slice(-3, None), slice(5, 2), slice(None, None, -1)):
    got = p[sl]
    assert isinstance(got, PairList) and got == ref[sl], sl
  q = p[1:3]
  q.append((99, 99))
  assert p == ref  # a slice is a copy
  assert (3, 30) in p and (3, 31) not in p and (30, 3) not in p and 5 not in p
  assert p.index((4, 40)) == 4 and p.count((4, 40)) == 1 and p.count((4, 41)) == 0 and p.count(7) == 0
  twice = PairList([(1, 2), (1, 3), (1, 2)])
  assert twice.index((1, 2)) == 0 and twice.index((1, 2), 1) == 2 and twice.count((1, 2)) == 2
  for args in [((1, 4),), ((1, 2), 1, 2), (5,)]:
    with pytest.raises(ValueError):
      twice.index(*args)
  assert isinstance(p, collections.abc.Sequence) and not isinstance(p, list)


def test_extend_append_iadd_add():
  p = PairList([(1, 2)])
  p.append((3, 4))
  p.extend([(5, 6), [7, 8]])
  p.extend(PairList([(9, 10)]))  # column-wise fast path
  p += PairList([(11, 12)])
  p += [(13, 14)]
  p.extend(iter([(15, 16)]))
  assert p == [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12), (13, 14), (15, 16)]
  assert len(p.srcs) == len(p.dsts) == 8
  with pytest.raises((TypeError, ValueError)):
    p.extend([(17, 18), (19,)])
  assert len(p) == 8 and len(p.srcs) == len(p.dsts)  # a failed extend leaves no half pair
  a = PairList([(1, 1)])
  b = a + [(2, 2)]
  c = [(0, 0)] + a
  d = a + PairList([(3, 3)])
  assert isinstance(b, PairList) and b == [(1, 1), (2, 2)] and a == [(1, 1)]
  assert isinstance(c, PairList) and c == [(0, 0), (1, 1)]
  assert d == [(1, 1), (3, 3)]
  alias = a
  a += [(5, 5)]
  assert alias is a and alias == [(1, 1), (5, 5)]  # in place, like list
  a.clear()
  assert a == [] and not a


def test_copy_pickle_repr_tolist():
  p = PairList([(1, 2), (3, 4)])
  for q in (p.copy(), copy.copy(p), copy.deepcopy(p), pickle.loads(pickle.dumps(p))):
    assert isinstance(q, PairList) and q == p and q.srcs is not p.srcs
  assert repr(p) == "PairList([(1, 2), (3, 4)])"
  assert p.tolist() == [(1, 2), (3, 4)] and type(p.tolist()) is list


def test_columns_helper():
  p = PairList([(1, 2), (3, 4)])
  s, d = columns(p)
  assert s is p.srcs and d is p.dsts
  assert columns([(1, 2), (3, 4)]) == ([1, 3], [2, 4])
  assert tuple(map(list, columns(None))) == ([], [])
  assert tuple(map(list, columns([]))) == ([], [])


def test_matches_list_under_random_operations():
  rng = random.Random(0)
  p, ref = PairList(), []
  for _ in range(500):
    op = rng.randrange(4)
    new = [(rng.randrange(50), rng.randrange(50)) for _ in range(rng.randrange(4))]
    if op == 0:
      p.extend(PairList(new))
      ref.extend(new)
    elif op == 1:
      p += new
      ref += new
    elif op == 2 and new:
      p.append(new[0])
      ref.append(new[0])
    else:
      i, j = sorted(rng.randrange(len(ref) + 1) for _ in range(2))
      assert p[i:j] == ref[i:j]
    assert p == ref and list(p) == ref and len(p) == len(ref)


def test_block_manager_returns_pairlists():
  bm = BlockManager(8, 8, 4)
  assert bm.append_slots("a", 10)
  bm.mark_computed("a", 10)
  wb = bm.take_writebacks()
  assert isinstance(wb, PairList) and len(wb) == 2
  out = bm.swap_out("a")
  assert isinstance(out, PairList) and len(out) == 1  # only the partial tail block is dirty
  inn = bm.swap_in("a")
  assert isinstance(inn, PairList) and len(inn) == 3
  assert inn.srcs == [h for _, h in wb] + [out.dsts[0]]  # host blocks, logical order
  assert inn.dsts == bm.block_table("a").tolist()


@pytest.mark.parametrize("mode", ["duplex", "merged", "naive"])
def test_duplexkv_takes_pairlists_like_lists(mode):
  """DuplexKV reads PairLists column-wise: same data, same stats and same validation as lists of tuples."""
  import jax  # pylint: disable=import-outside-toplevel  (the PairList tests above need no JAX)
  import numpy as np  # pylint: disable=import-outside-toplevel
  from superinfer_jax.kv.layout import KVCacheSpec  # pylint: disable=import-outside-toplevel
  from superinfer_jax.rotation import DuplexKV, read_device_block  # pylint: disable=import-outside-toplevel
  spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32",
                     layout="block_first")
  rng = np.random.default_rng(0)
  blocks = rng.standard_normal((9, 2, 2, 4, 2, 4)).astype(np.float32)
  out_pairs = [(1, 0), (2, 3), (5, 1)]
  wb_pairs = [(7, 6)]
  in_pairs = [(0, 2), (3, 8), (6, 1)]  # device 2 and 1 were just swapped out: same-step reuse
  results = []
  for wrap in (list, PairList, lambda p: PairList.from_columns([np.int64(s) for s, _ in p], [d for _, d in p])):
    eng = DuplexKV(spec, 8, mode=mode)
    cache = jax.device_put(blocks)
    cache = eng.issue(cache, swap_out=wrap(out_pairs), writeback=wrap(wb_pairs))
    if mode == "duplex":
      eng.prefetch(wrap(in_pairs))
    cache = eng.issue(cache, swap_in=wrap(in_pairs))
    eng.wait()
    results.append(([read_device_block(cache, spec, b) for b in range(9)],
                     [eng.read_host_block(h) for h in (0, 1, 3, 6)], eng.stats.as_dict()))
    with pytest.raises(ValueError, match="D2H destination twice"):
      eng.issue(cache, swap_out=wrap([(1, 4)]), writeback=wrap([(2, 4)]))
    with pytest.raises(ValueError, match="out of range"):
      eng.issue(cache, swap_out=wrap([(0, 4)]))
  ref_dev, ref_host, ref_stats = results[0]
  np.testing.assert_array_equal(ref_dev[8], blocks[2])  # device 2 -> host 3 -> device 8
  np.testing.assert_array_equal(ref_dev[1], blocks[7])  # device 7 -> host 6 -> device 1
  for got_dev, got_host, got_stats in results[1:]:
    for a, b in zip(got_dev + got_host, ref_dev + ref_host):
      np.testing.assert_array_equal(a, b)
    untimed = lambda st: {k: v for k, v in st.items() if not k.endswith("_time_s")}  # noqa: E731
    assert untimed(got_stats) == untimed(ref_stats)  # clock readings differ run to run; counts must not
