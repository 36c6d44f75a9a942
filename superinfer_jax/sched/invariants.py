"""``check_scheduler``: the scheduler's invariants (``scheduler.py``'s docstring) and its block manager's.

The queues, the request states, the block manager's residency and the incremental demand / need counters
agree. Reads only: never changes any state. O(requests + blocks); for tests and debug.
"""
from __future__ import annotations

from superinfer_jax.sched.request import RequestState
from superinfer_jax.kv.layout import blocks_for

RUNNING = RequestState.RUNNING
WAITING = RequestState.WAITING
ROTARY = RequestState.ROTARY
PREEMPTED = RequestState.PREEMPTED


def check_scheduler(sched) -> None:
  """Asserts the invariants of ``sched`` (a ``Scheduler``); raises ``AssertionError`` naming the offending
  request."""
  bm = sched.bm
  bs = bm.block_size
  bm.check_invariants()
  seen = set()
  for rid, r in sched.running.items():
    assert r.state is RUNNING and r.queue_key is None, r
    assert bm.has_request(rid) and not bm.is_swapped(rid), r
    assert bm.num_tokens(rid) == r.num_computed_tokens == bm.num_computed(rid), (r, bm.num_tokens(rid))
    seen.add(rid)
  demand = 0
  for r in sched.waiting.requests():
    assert r.state in (WAITING, PREEMPTED), r
    assert not bm.has_request(r.req_id) and r.num_computed_tokens == 0, r
    assert r.req_id not in seen, r
    seen.add(r.req_id)
    demand += r.queued_demand
    assert r.queued_demand == blocks_for(r.planned_tokens, bs), r
  for r in sched.rotary.requests():
    assert r.state is ROTARY, r
    assert bm.has_request(r.req_id) and bm.is_swapped(r.req_id), r
    assert bm.num_computed(r.req_id) == r.num_computed_tokens, r
    assert r.planned_tokens - r.num_computed_tokens == 1, r  # rotary requests are in decode phase
    assert r.queued_demand == blocks_for(r.planned_tokens, bs), r  # prioritize() reads blk from it
    assert r.req_id not in seen, r
    seen.add(r.req_id)
    demand += r.queued_demand
  assert seen == set(sched.requests), "queues and the live set differ"
  assert demand == sched.demand_blocks, (demand, sched.demand_blocks)
  assert len(sched.running) <= sched.config.max_num_seqs
  need = sched.running_need
  if need is not None:
    needs = [r.next_step_need(bs) for r in sched.running.values()]
    assert need == (sum(b for b, _ in needs), sum(t for _, t in needs)), (need, needs)
  assert bm.num_requests == len(sched.running) + len(sched.rotary), "block manager holds stray requests"
  for r in sched.requests.values():
    assert 0 <= r.inflight_samples <= sched.num_inflight_plans and r.num_generated < r.max_tokens, r
