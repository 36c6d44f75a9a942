"""PairList with ``array`` columns (a plan's H2D pairs) reads and compares like one with list columns."""
import array

from superinfer_jax.kv.block_manager import BlockManager
from superinfer_jax.kv.pairs import PairList, h2d_pairs
from superinfer_jax.sched.plan import StepPlan


def test_h2d_pairs_compare_and_extend_like_lists():
  p = h2d_pairs()
  assert isinstance(p.srcs, array.array) and p.srcs.typecode == "i" and not p.srcs
  assert isinstance(p.dsts, array.array) and p.dsts.typecode == "i" and not p.dsts
  p.extend(PairList([(5, 1), (7, 2)]))  # list columns into an array column
  assert p == [(5, 1), (7, 2)] and p == PairList([(5, 1), (7, 2)]) and PairList([(5, 1), (7, 2)]) == p
  assert p != PairList([(5, 1), (8, 2)]) and p != PairList([(5, 1)])
  q = PairList()
  q.extend(p)  # an array column into list columns
  assert q.srcs == [5, 7] and type(q.srcs) is list and q == p
  assert list(p) == [(5, 1), (7, 2)] and p[1] == (7, 2) and p[:1] == [(5, 1)] and (7, 2) in p


def test_plan_swap_in_is_filled_from_host_arrays():
  bm = BlockManager(8, 8, 4)
  assert bm.append_slots("a", 6)
  bm.mark_computed("a", 6)
  out = PairList()
  assert bm.swap_out_to("a", out) == 2
  host = bm.host_block_table("a")
  assert type(host) is list and host == out.dsts  # callers still get a list
  plan = StepPlan(step_id=0, time=0.0)
  tables = bm.swap_in_many(["a"], 1, plan.swap_in)
  assert isinstance(plan.swap_in.srcs, array.array) and plan.swap_in.srcs.tolist() == host
  assert plan.swap_in.dsts == tables[0][:2] and isinstance(tables[0], array.array)  # device ids: arrays too
  assert bm.block_table("a") == tables[0] and bm.block_table("a") is not bm.block_table("a")  # fresh copies
  bm.check_invariants()
