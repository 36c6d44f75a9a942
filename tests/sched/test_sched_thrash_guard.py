"""The rotation thrash guard (``max_rotations_per_request``), hand-worked.

Three requests share a 2-block pool (block size 8: one block each; B_xfer 1 block per step, steps of 0.1 s,
TBT SLO 0.1 s). Under Algorithm 1 as written a rotary request is urgent as soon as it lags (the ReLU), so
``rotasched`` time-slices: every step the longest-running request is rotated out for the most-lagging rotary
one, and each request goes round many times. With the guard at 1, a request rotated out once is never a
proactive victim again: after the first round nobody is displaced and the rest runs to completion.
"""
import pytest

from test_sched import add, make, step

CFG = dict(dev=2, bs=8, proactive_swap_budget=1, max_num_batched_tokens=32, ttft_slo=0.5, tbt_slo=0.1,
           alpha=3.0, beta_f=0.0, beta_b=0.0)


def _rotations(policy, **knobs):
  s, _, clk = make(policy, **{**CFG, **knobs})
  reqs = [add(s, rid, 0.0, max_tokens=7) for rid in "ABC"]
  for _ in range(200):
    if not s.has_unfinished():
      break
    step(s, clk)
  assert not s.has_unfinished()
  return {r.req_id: r.num_rotations for r in reqs}


@pytest.mark.parametrize("policy", ["rotasched", "rotasched_strict"])
def test_without_the_guard_requests_rotate_repeatedly_and_with_it_at_most_once(policy):
  free = _rotations(policy)
  assert max(free.values()) >= 2, free
  guarded = _rotations(policy, max_rotations_per_request=1)
  assert max(guarded.values()) == 1 and sum(guarded.values()) < sum(free.values()), (free, guarded)


def test_the_guard_is_validated():
  with pytest.raises(ValueError):
    make("rotasched", max_rotations_per_request=-1)
