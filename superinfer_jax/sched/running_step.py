"""Step building blocks for the running set: token budget and seats, next-step needs, scheduling the
running requests, reactive eviction and recompute preemption. Mixed into ``Scheduler`` (``scheduler.py``),
whose state (``running``, ``bm``, the per-step ``_plan`` / ``_budget``) these methods read and update; they
decide exactly what the scheduler core's contract (its module docstring) says and never touch KV data.
"""
from __future__ import annotations

from superinfer_jax.sched.plan import ScheduledSeq
from superinfer_jax.sched.request import Request, RequestState

RUNNING = RequestState.RUNNING
PREEMPTED = RequestState.PREEMPTED


class RunningStepMixin:
  """Running-set building blocks of ``Scheduler`` (see the module docstring)."""

  def will_finish(self, r: Request) -> bool:
    """True when in-flight samples already take the request to max_tokens (do not schedule it again)."""
    return r.num_generated + r.inflight_samples >= r.max_tokens

  def budget_left(self) -> int:
    return self._budget

  def seats_left(self) -> int:
    return self.config.max_num_seqs - len(self.running)

  def running_needs(self) -> tuple[int, int]:
    """(device blocks, tokens) running requests need this step, in admission order under the token budget.

    At the start of a step (nothing planned yet) this is the total ``_finalize`` kept for the running set
    when it fits the budget (policies with ``uses_running_needs``); otherwise one pass over the running
    requests (``_running_needs_scan``, the definition).
    """
    need = self._need
    plan = self._plan
    if (need is not None and need[1] <= self._budget and plan is not None and not plan.scheduled
        and not plan.rotated_out and not plan.preempted):
      return need
    return self._running_needs_scan()

  def _need_of(self, r: Request) -> tuple[int, int]:
    """(blocks, tokens) running request ``r`` needs next step, without a budget (``running_needs``'s term)."""
    gen = r.num_generated + r.inflight_samples
    c = r.num_computed_tokens
    rem = r.prompt_len + gen - c
    if rem <= 0 or gen >= r.max_tokens:
      return 0, 0
    bs = self.bm.block_size
    return (c + rem + bs - 1) // bs - (c + bs - 1) // bs, rem

  def _running_needs_scan(self) -> tuple[int, int]:
    """``running_needs`` by one pass over the running requests in admission order."""
    budget = self._budget
    blocks = 0
    bs = self.bm.block_size
    for r in self.running.values():
      if budget <= 0:
        break
      gen = r.num_generated + r.inflight_samples
      c = r.num_computed_tokens
      rem = r.prompt_len + gen - c
      if rem <= 0 or gen >= r.max_tokens:
        continue
      n = rem if rem < budget else budget
      # Resident: the manager covers exactly num_computed_tokens slots.
      blocks += (c + n + bs - 1) // bs - (c + bs - 1) // bs
      budget -= n
    return blocks, self._budget - budget

  def _emit(self, r: Request, n: int) -> None:
    c = r.num_computed_tokens
    rid = r.req_id
    self._plan.scheduled.append(ScheduledSeq(rid, n, c, self.bm.block_table(rid),
                                             c + n == r.prompt_len + r.num_generated + r.inflight_samples))
    self._budget -= n

  def schedule_running(self, reactive_mode: str = "recompute", swap_cap: int | None = None) -> bool:
    """Step 2: give running requests their tokens; evict the last-admitted one when memory runs out.

    Returns True if any reactive eviction happened. ``reactive_mode`` is "recompute" or "swap" (swap falls back
    to recompute for mid-prefill victims, when ``swap_cap`` would be exceeded, or when the host pool is full).
    """
    bm = self.bm
    append_slots = bm.append_slots
    block_table = bm.block_table
    emit = self._plan.scheduled.append
    step = self._step
    evicted = False
    budget = self._budget  # kept local in the loop (evictions do not touch it); stored back below
    for r in list(self.running.values()):
      if r.state is not RUNNING or r._touched_step == step:
        continue  # evicted in this loop, or admitted/rotated in this step (already scheduled)
      if budget <= 0:
        self._running_cut = True  # requests after this one keep their need unscheduled
        break
      gen = r.num_generated + r.inflight_samples
      rem = r.prompt_len + gen - r.num_computed_tokens
      if rem <= 0 or gen >= r.max_tokens:  # nothing to compute, or will_finish(r)
        continue
      n = rem if rem < budget else budget
      rid = r.req_id
      while not append_slots(rid, n):
        victim = self._reactive_victim(r, reactive_mode, swap_cap)
        self.evict(victim, reactive_mode, swap_cap)
        evicted = True
        if victim is r:
          break
      else:  # _emit(r, n), inline
        emit(ScheduledSeq(rid, n, r.num_computed_tokens, block_table(rid), n == rem))
        budget -= n
    self._budget = budget
    return evicted

  def _reactive_victim(self, r: Request, mode: str, swap_cap: int | None) -> Request:
    """The last-admitted running request; in swap mode, the last-admitted one that can be rotated (not yet
    scheduled this step, decode phase, copies within ``swap_cap``), so that KV is parked rather than dropped."""
    last = next(reversed(self.running.values()))
    if mode != "swap" or (self.rotatable(last) and last is not r):
      return last
    for v in reversed(self.running.values()):
      if v is r:
        break  # requests before r were scheduled already this step
      if self.rotatable(v) and self.out_fits(self.bm.swap_out_copies(v.req_id), swap_cap):
        return v
    return last

  def evict(self, r: Request, mode: str, swap_cap: int | None = None) -> str:
    """Evicts a running request: rotate out if ``mode == "swap"`` and allowed, else recompute preemption."""
    if mode == "swap" and self.rotatable(r):  # mid-prefill victims are recomputed, never rotated
      if swap_cap is None or self.out_fits(self.bm.swap_out_copies(r.req_id), swap_cap):
        if self.rotate_out(r):
          return "swap"
    self.preempt(r)
    return "recompute"

  def preempt(self, r: Request) -> None:
    """Running -> PREEMPTED: drop the KV (recompute later)."""
    assert r.state is RUNNING, r
    self.bm.free(r.req_id)
    del self.running[r.req_id]
    r.num_computed_tokens = 0
    r.state = PREEMPTED
    r.state_time = self._now
    r._touched_step = self._step
    r.num_preemptions += 1
    self._plan.preempted.append(r.req_id)
    self._enqueue_waiting(r, preempted=True)
