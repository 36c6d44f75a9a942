"""The scheduler's invariant check, a mixin of ``Scheduler`` (``scheduler.py``): the queues, the request
states, the block manager's residency and the incremental demand / need counters agree.

The mixin reads ``Scheduler``'s fields (``bm``, ``running``, ``waiting``, ``rotary``, ``requests``, ``config``,
``_demand``, ``_need``, ``_inflight``) and calls ``blocks_for`` / ``_need_of``; it defines nothing else.
"""
from __future__ import annotations

from superinfer_jax.sched.request import RequestState

RUNNING = RequestState.RUNNING
WAITING = RequestState.WAITING
ROTARY = RequestState.ROTARY
PREEMPTED = RequestState.PREEMPTED


class InvariantsMixin:
  """``check_invariants()`` for ``Scheduler``."""

  def check_invariants(self) -> None:
    """Asserts the scheduler's invariants (``scheduler.py``'s docstring) and the block manager's; raises
    ``AssertionError`` naming the offending request. Reads only: never changes any state."""
    bm = self.bm
    bm.check_invariants()
    seen = set()
    for rid, r in self.running.items():
      assert r.state is RUNNING and r._qentry is None, r
      assert bm.has_request(rid) and not bm.is_swapped(rid), r
      assert bm.num_tokens(rid) == r.num_computed_tokens == bm.num_computed(rid), (r, bm.num_tokens(rid))
      seen.add(rid)
    demand = 0
    for r in self.waiting.requests():
      assert r.state in (WAITING, PREEMPTED), r
      assert not bm.has_request(r.req_id) and r.num_computed_tokens == 0, r
      assert r.req_id not in seen, r
      seen.add(r.req_id)
      demand += r._demand
      assert r._demand == self.blocks_for(r.planned_tokens), r
    for r in self.rotary.requests():
      assert r.state is ROTARY, r
      assert bm.has_request(r.req_id) and bm.is_swapped(r.req_id), r
      assert bm.num_computed(r.req_id) == r.num_computed_tokens, r
      assert r.planned_tokens - r.num_computed_tokens == 1, r  # rotary requests are in decode phase
      assert r._demand == self.blocks_for(r.planned_tokens), r  # prioritize() reads blk from it
      assert r.req_id not in seen, r
      seen.add(r.req_id)
      demand += r._demand
    assert seen == set(self.requests), "queues and the live set differ"
    assert demand == self._demand, (demand, self._demand)
    assert len(self.running) <= self.config.max_num_seqs
    if self._need is not None:
      needs = [self._need_of(r) for r in self.running.values()]
      assert self._need == (sum(b for b, _ in needs), sum(t for _, t in needs)), (self._need, needs)
    assert bm.num_requests == len(self.running) + len(self.rotary), "block manager holds stray requests"
    for r in self.requests.values():
      assert 0 <= r.inflight_samples <= len(self._inflight) and r.num_generated < r.max_tokens, r
