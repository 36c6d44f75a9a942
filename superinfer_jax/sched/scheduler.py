"""The scheduler core: request queues, the step plan, lifecycle bookkeeping. Policies live in ``policies.py``.

Public API
----------
``Scheduler(config: SchedulerConfig, block_manager: BlockManager, clock, policy="rotasched")``
  ``policy`` is a name from ``policies.POLICIES`` (fcfs, fcfs_swap, wf, sf, rotasched, rotasched_strict,
  rotasched_code, edf) or a ``Policy`` instance; None (default): ``config.policy``. ``clock`` is any object with ``now() -> float`` (``WallClock``, ``VirtualClock``).

  * ``add_request(req: Request) -> None``: queue a new request (state WAITING). Raises ``ValueError`` if the id
    is live already, or if the request can never fit the device pool
    (``ceil((prompt_len + max_tokens - 1) / block_size) > num_device_blocks``).
  * ``abort(req_id) -> bool``: end a live request (ABORTED) and release its blocks; False if unknown.
  * ``schedule(lookahead=False) -> StepPlan``: plan the next step at ``clock.now()``. With ``lookahead=True``
    at most one earlier plan may still be in flight (not yet passed to ``on_step_done``); each request in
    flight that samples is assumed to gain exactly one token (docs/paper.md §4.5). Without lookahead, no plan may
    be in flight. The scheduler marks the plan's tokens computed in the block manager (ordering contract 2
    of ``kv/block_manager.py``): the engine must dispatch the plan's model step (after issuing its copies)
    before calling ``schedule()`` again.
  * ``on_step_done(plan, new_tokens=None, finished=None, now=None) -> list[req_id]``: the step of ``plan``
    finished. ``new_tokens[req_id]`` is the sampled token id of every seq with ``sample=True`` (missing or
    None: lengths only, as in the simulator). ``finished[req_id] = reason`` ends requests the engine stopped
    (EOS, stop string). Requests reaching ``max_tokens`` finish with reason "length". Stamps first/last token
    times at ``now`` (default ``clock.now()``). Returns the ids that finished; under lookahead the engine must
    drop them from the next plan's ``scheduled`` before dispatching it.
  * ``pop_finished() -> list[Request]``: terminal requests since the last call (for metrics).
  * Per-step counters are on the ``StepPlan`` (``plan.py``); cumulative ones in ``totals``.
  * Queries: ``num_waiting``, ``num_running``, ``num_rotary``, ``num_unfinished``, ``has_unfinished()``,
    ``get(req_id)``, ``running_ids()``, ``waiting_ids()``, ``rotary_ids()``, ``vlt(req_id)``,
    ``totals`` (cumulative counters dict), ``check_invariants()``.

Step structure (each policy composes these; see ``policies.py``)
  1. optional proactive rotation (the policy picks running victims; swap_out; when the host pool is full,
     clean host mirrors of other running requests are reclaimed first, and if that is not enough the victim
     stays running, or is recompute-preempted with ``proactive_recompute=True``);
  2. running requests in admission order get their next tokens (chunked prefill under
     ``max_num_batched_tokens``); when one cannot grow, the last-admitted running request is evicted
     (reactive preemption: recompute, or swap per policy with recompute as the fallback when the host pool
     is full, the victim is mid-prefill or the B_xfer cap is spent);
  3. admission of waiting / rotary requests in the policy's order, within the token budget, free device
     blocks, ``max_num_seqs`` and the swap-in budget;
  4. eager write-back pairs are taken last, then the plan's tokens are marked computed.

Building blocks for policies (``policies.py``): ``running_needs()``, ``schedule_running()``, ``rotate_out(r)`` /
``rotate_out_many(victims)``, ``swap_in(r)``, ``admit_waiting(r)``, ``admit_in_order(rs)``, ``preempt(r)``,
``evict(r)``, ``rotatable(r)``. The ``*_many`` / ``admit_in_order`` forms decide exactly as one call per
request would and move a step's rotations through batched block-manager calls (the hot path under
rotation: ``scripts/bench_scheduler.py``). ``running_needs()`` is kept incrementally by ``_finalize`` for
policies that set ``uses_running_needs`` (checked by ``check_invariants``). ``tests/test_sched_replay.py``
pins every policy's plans (``sched/replay.py``); ``tests/test_sched_equivalence.py`` checks the fast paths
against plain reference implementations.

Invariants (``check_invariants``): every live request is in exactly one of running / waiting (WAITING or
PREEMPTED) / rotary matching its state; RUNNING <=> resident in the block manager with
``num_tokens == num_computed_tokens``; ROTARY <=> swapped in the block manager; WAITING/PREEMPTED <=> no
blocks and ``num_computed_tokens == 0``; the incremental demand equals the sum over waiting + rotary;
``len(running) <= max_num_seqs``; the block manager's own invariants hold.
Rules every policy obeys: a request is never rotated out and in within one step (except ``rotasched_code``'s
round trips, listed in ``StepPlan.round_trips``); proactive victims have been RUNNING ``min_residency``
steps at least; mid-prefill requests are
never rotated (a mid-prefill victim is preempted by recompute): a request is rotatable only when exactly one
of its tokens lacks KV *and* it has sampled a token since it last entered RUNNING, which also guarantees
progress between two evictions of the same request (no livelock); a request moved this step is not moved
again in the same step; proactive swap volume is capped by ``proactive_swap_budget`` (B_xfer) in each direction,
except that a single request larger than B_xfer may move alone (otherwise it could never come back).
"""
from __future__ import annotations

from typing import Hashable

from superinfer_jax.kv.block_manager import BlockManager
from superinfer_jax.sched import vlt as vlt_lib
from superinfer_jax.sched.config import SchedulerConfig
from superinfer_jax.sched.plan import ScheduledSeq, StepPlan
from superinfer_jax.sched.queue import SortedQueue
from superinfer_jax.sched.request import Request, RequestState

RUNNING = RequestState.RUNNING
WAITING = RequestState.WAITING
ROTARY = RequestState.ROTARY
PREEMPTED = RequestState.PREEMPTED


class Scheduler:
  """One scheduler core with a pluggable policy. See the module docstring for the API and invariants."""

  def __init__(self, config: SchedulerConfig, block_manager: BlockManager, clock, policy=None):
    from superinfer_jax.sched.policies import make_policy  # policies import the scheduler's helpers' types
    self.config = config
    self.bm = block_manager
    self.clock = clock
    if policy is None:
      policy = config.policy
    self.policy = make_policy(policy) if isinstance(policy, str) else policy
    self.requests: dict[Hashable, Request] = {}
    self.running: dict[Hashable, Request] = {}  # admission order == t_run order
    self.waiting = SortedQueue()  # WAITING + PREEMPTED, policy order
    self.rotary = SortedQueue()  # ROTARY, policy order
    self._demand = 0  # sum of blocks_for(planned_tokens) over waiting + rotary
    self._step = 0
    self._inflight: list[int] = []
    self._finished: list[Request] = []
    self.totals = dict(steps=0, rotations_out=0, rotations_in=0, blocks_out=0, blocks_in=0,
                       blocks_writeback=0, recompute_preemptions=0, admitted=0, finished=0, aborted=0,
                       scheduled_tokens=0, round_trips=0, residency_steps=0)
    # per-step context
    self._plan: StepPlan | None = None
    self._now = 0.0
    self._budget = 0
    self._out_moved = 0
    self._in_moved = 0
    # running_needs() kept incrementally: (blocks, tokens) the running requests need next step, or None
    # (unknown: recompute); _running_cut: this step's running loop stopped at the token budget.
    self._need: tuple[int, int] | None = None
    self._running_cut = False
    # this step's swap-in batches: (index of the first in plan.scheduled, their ids, the requests)
    self._swapins: list[tuple[int, list, list[Request]]] = []
    self._swapin_need = [0, 0]  # (blocks, tokens) the swap-in batches' requests need next step (running_needs)

  # ------------------------------------------------------------------ queries
  @property
  def num_waiting(self) -> int:
    return len(self.waiting)

  @property
  def num_running(self) -> int:
    return len(self.running)

  @property
  def num_rotary(self) -> int:
    return len(self.rotary)

  @property
  def num_unfinished(self) -> int:
    return len(self.requests)

  @property
  def step_id(self) -> int:
    return self._step

  @property
  def demand_blocks(self) -> int:
    return self._demand

  def has_unfinished(self) -> bool:
    return bool(self.requests)

  def get(self, req_id) -> Request | None:
    return self.requests.get(req_id)

  def running_ids(self) -> list:
    return list(self.running)

  def waiting_ids(self) -> list:
    return [r.req_id for r in self.waiting.requests()]

  def rotary_ids(self) -> list:
    return [r.req_id for r in self.rotary.requests()]

  def vlt(self, req_id, now: float | None = None) -> float:
    return vlt_lib.vlt(self.requests[req_id], self.clock.now() if now is None else now,
                       **self.config.vlt_kwargs())

  def pop_finished(self) -> list[Request]:
    out, self._finished = self._finished, []
    return out

  def blocks_for(self, num_tokens: int) -> int:
    return -(-num_tokens // self.bm.block_size)

  # ------------------------------------------------------------------ lifecycle
  def add_request(self, req: Request) -> None:
    if req.req_id in self.requests:
      raise ValueError(f"request {req.req_id!r} is already live")
    need = self.blocks_for(req.prompt_len + req.max_tokens - 1)
    if need > self.bm.num_device_blocks:
      raise ValueError(
          f"request {req.req_id!r} can never fit: prompt_len {req.prompt_len} + max_tokens {req.max_tokens} "
          f"needs {need} device blocks of {self.bm.block_size} tokens, the pool has {self.bm.num_device_blocks}")
    if req.state is not WAITING or req.num_generated or req.num_computed_tokens:
      raise ValueError(f"request {req.req_id!r} must be fresh (WAITING, nothing generated)")
    self.requests[req.req_id] = req
    req.state_time = req.arrival_time
    self._enqueue_waiting(req, preempted=False)

  def abort(self, req_id) -> bool:
    r = self.requests.get(req_id)
    if r is None:
      return False
    self._finish(r, "abort", self.clock.now(), aborted=True)
    return True

  def _enqueue_waiting(self, r: Request, preempted: bool) -> None:
    key = self.policy.preempted_key(r, self) if preempted else self.policy.waiting_key(r, self)
    self.waiting.push(r, key)
    d = -(-(r.prompt_len + r.num_generated + r.inflight_samples) // self.bm.block_size)
    r._demand = d
    self._demand += d

  def _enqueue_rotary(self, r: Request) -> None:
    self.rotary.push(r, self.policy.rotary_key(r, self))
    d = -(-(r.prompt_len + r.num_generated + r.inflight_samples) // self.bm.block_size)
    r._demand = d
    self._demand += d

  def _dequeue(self, r: Request) -> None:
    if r.state is ROTARY:
      self.rotary.remove(r)
    else:
      self.waiting.remove(r)
    self._demand -= r._demand
    r._demand = 0

  def _finish(self, r: Request, reason: str, now: float, aborted: bool = False) -> None:
    if r.state is RUNNING:
      del self.running[r.req_id]
      need = self._need
      if need is not None:
        if self._plan is None:  # between steps: its need was counted by _finalize
          blk, tok = self._need_of(r)
          self._need = (need[0] - blk, need[1] - tok)
        else:
          self._need = None
    elif r._qentry is not None:
      self._dequeue(r)
    self.bm.free(r.req_id)
    r.state = RequestState.ABORTED if aborted else RequestState.FINISHED
    r.state_time = now
    r.finish_time = now
    r.finish_reason = reason
    del self.requests[r.req_id]
    self._finished.append(r)
    self.totals["aborted" if aborted else "finished"] += 1

  # ------------------------------------------------------------------ schedule
  def schedule(self, lookahead: bool = False) -> StepPlan:
    if self._inflight and not lookahead:
      raise RuntimeError(f"plan(s) {self._inflight} still in flight; call on_step_done first or use lookahead")
    if len(self._inflight) > 1:
      raise RuntimeError("lookahead depth is 1: two plans are already in flight")
    now = self.clock.now()
    plan = StepPlan(step_id=self._step, time=now, lookahead=bool(self._inflight))
    self._plan = plan
    self._now = now
    self._budget = self.config.max_num_batched_tokens
    self._out_moved = 0
    self._in_moved = 0
    self._running_cut = False
    self._swapins = []
    self._swapin_need = [0, 0]
    self.policy.schedule_step(self, plan, now)
    self._finalize(plan)
    self._plan = None
    self._inflight.append(plan.step_id)
    self._step += 1
    return plan

  def _finalize(self, plan: StepPlan) -> None:
    cfg = self.config
    bm = self.bm
    if cfg.writeback and self.policy.uses_host_pool:
      reserve = cfg.writeback_min_free_host
      if reserve is None:
        reserve = min(cfg.proactive_swap_budget, bm.num_host_blocks // 4)
      plan.writeback = bm.take_writebacks(cfg.max_writeback_blocks, reserve)
    reqs = self.requests
    mark = bm.mark_computed
    total = 0
    # Rotation policies also sum what each scheduled request will need next step: running_needs()'s totals,
    # kept incrementally. A request's need changes only here (on_step_done moves a token from in flight to
    # generated, which leaves it alone); a running request not scheduled in this step needs nothing unless
    # the token budget cut the running loop short, and then running_needs() scans.
    track = self.policy.uses_running_needs
    bs = bm.block_size
    need_tok = need_blk = 0
    scheduled = plan.scheduled
    # The swap-in batches (_apply_swap_ins: spans of ``scheduled`` whose seqs each compute one pending token and
    # sample) take a shorter path; the other seqs the general one. Both mark in plan order (write-back order).
    spans = self._swapins
    pos = 0
    for start, rids, batch in (*spans, (len(scheduled), None, None)):
      for seq in scheduled[pos:start] if spans else scheduled:
        rid = seq.req_id
        r = reqs[rid]
        n = seq.num_new_tokens
        new = seq.num_computed_tokens + n
        mark(rid, new)
        r.num_computed_tokens = new
        if seq.sample:
          r.inflight_samples += 1
          if track and r.num_generated + r.inflight_samples < r.max_tokens:  # else will_finish: no need
            need_tok += 1  # the sampled token's KV
            if new % bs == 0:
              need_blk += 1
        elif track:  # a prefill chunk short of the known tokens
          rem = r.prompt_len + r.num_generated + r.inflight_samples - new
          need_tok += rem
          need_blk += (new + rem + bs - 1) // bs - (new + bs - 1) // bs
        total += n
      if batch is None:
        break
      bm.mark_computed_next(rids)  # mark(rid, num_computed_tokens + 1) for each (fields: _apply_swap_ins)
      total += len(batch)
      pos = start + len(batch)
    if spans:
      need_blk += self._swapin_need[0]
      need_tok += self._swapin_need[1]
    if track:
      self._need = (need_blk, need_tok) if not self._running_cut else None
    plan.num_batched_tokens = total
    t = self.totals
    t["steps"] += 1
    t["rotations_out"] += len(plan.rotated_out)
    t["residency_steps"] += plan.residency_steps
    t["rotations_in"] += len(plan.rotated_in)
    t["blocks_out"] += len(plan.swap_out)
    t["blocks_in"] += len(plan.swap_in)
    t["blocks_writeback"] += len(plan.writeback)
    t["recompute_preemptions"] += len(plan.preempted)
    t["admitted"] += len(plan.admitted)
    t["scheduled_tokens"] += total

  # ---- building blocks used by policies -------------------------------------
  def will_finish(self, r: Request) -> bool:
    """True when in-flight samples already take the request to max_tokens (do not schedule it again)."""
    return r.num_generated + r.inflight_samples >= r.max_tokens

  def rotatable(self, r: Request) -> bool:
    """A running request may be rotated out now: decode phase (one token without KV, and it has sampled a
    token since it last entered RUNNING, so a prefill, first or recompute, is never interrupted and every
    rotation follows progress), not moved earlier in this step, and not about to finish (its in-flight step
    samples its last token: rotating it out would copy KV that is freed a step later)."""
    gen = r.num_generated + r.inflight_samples
    return (r.planned_tokens - r.num_computed_tokens == 1 and r._touched_step != self._step
            and gen > r._gen_at_admit and gen < r.max_tokens)

  def resident_long_enough(self, r: Request) -> bool:
    """``min_residency``: a proactive victim must have been RUNNING for that many steps (0: always)."""
    return self._step - r._admit_step >= self.config.min_residency

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

  def out_fits(self, copies: int, cap: int | None) -> bool:
    return cap is None or self._out_moved + copies <= cap or self._out_moved == 0

  def in_fits(self, blocks: int, cap: int | None) -> bool:
    return cap is None or self._in_moved + blocks <= cap or self._in_moved == 0

  def rotate_out(self, r: Request) -> bool:
    """Running -> ROTARY (KV to host). False (no change) if the host pool lacks room."""
    assert r.state is RUNNING and self.rotatable(r), r
    return self.rotate_out_many([r]) == 1

  def rotate_out_many(self, victims: list[Request], recompute_if_full: bool = False) -> int:
    """``rotate_out`` for each of ``victims`` in order (callers checked ``rotatable`` in this step); returns
    how many rotated out. One the host pool cannot take, even after clean mirrors of other running requests
    are reclaimed, stays running, or is recompute-preempted with ``recompute_if_full``. The same decisions
    as one ``rotate_out`` call per victim; the block manager swaps each run of victims that fit in one call.
    """
    bm = self.bm
    out = self._plan.swap_out
    rids = [v.req_id for v in victims]
    n = len(victims)
    i = rotated = 0
    while i < n:
      k, moved = bm.swap_out_many(rids[i:] if i else rids, out)
      if k:
        self._rotated_out(victims[i:i + k], moved, rids[i:i + k])
        rotated += k
        i += k
      if i == n:
        break
      r = victims[i]  # the host pool cannot take it as things stand
      moved = None
      if self._reclaim_host_mirrors(bm.blocks_to_swap_out(r.req_id), r):
        moved = bm.swap_out_to(r.req_id, out)
      if moved is not None:
        self._rotated_out([r], moved, [r.req_id])
        rotated += 1
      elif recompute_if_full:
        self.preempt(r)
      i += 1
    return rotated

  def _rotated_out(self, rs: list[Request], moved: int, rids: list) -> None:
    """Bookkeeping of requests just swapped out (``moved`` D2H pairs in all; ``rids``: their ids): RUNNING ->
    ROTARY, queued."""
    plan = self._plan
    step = self._step
    now = self._now
    bs = self.bm.block_size
    running = self.running
    residency = demand = 0
    for r in rs:
      del running[r.req_id]
      r.state = ROTARY
      r.state_time = now
      r._touched_step = r._out_step = step
      r.num_rotations += 1
      residency += step - r._admit_step
      # _enqueue_rotary(r), inline: a rotatable request is in decode phase (planned = computed + 1)
      r._demand = d = r.num_computed_tokens // bs + 1
      demand += d
    self.rotary.push_many(rs, self.policy.rotary_keys(rs, self))  # keyed after the state change
    plan.residency_steps += residency
    plan.rotated_out += rids
    self._out_moved += moved
    self._demand += demand

  def _reclaim_host_mirrors(self, need: int, keep: Request) -> bool:
    """Frees host blocks held by clean mirrors of running requests (most recently admitted first) until
    ``need`` are free. Mirrors are redundant copies, so nothing is lost; requests moved in this step are
    skipped (their host blocks are this step's H2D sources: ordering contract 3). True if enough are free."""
    bm = self.bm
    if need > bm.num_free_host_blocks + bm.reclaimable_host_blocks():
      return False
    for v in reversed(self.running.values()):
      if bm.num_free_host_blocks >= need:
        break
      if v is keep or v._touched_step == self._step:
        continue
      bm.drop_host_mirrors(v.req_id)
    return bm.num_free_host_blocks >= need

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

  def swap_in(self, r: Request, cap: int | None = None, round_trip: bool = False) -> bool:
    """ROTARY -> RUNNING and schedule its pending token. False (no change) if it does not fit now.

    A request rotated out in this step comes back in it only with ``round_trip=True`` (``rotasched_code``:
    the reference fork's admission loop may swap a victim straight back in). Its host copy is then this
    step's D2H destination and H2D source at once; the plan lists it in ``round_trips`` and the engine
    issues the step's D2H copies before its H2D copies (block manager ordering contract 3).
    """
    assert r.state is ROTARY, r
    return self.admit_in_order((r,), cap, round_trip) == 1

  def admit_in_order(self, rs, cap: int | None = None, round_trip: bool = False, prechecked: bool = False) -> int:
    """Admits ``rs`` in order, skipping those that do not fit now, until the token budget or the seats run
    out; returns how many were admitted. A rotary request is swapped in (``swap_in`` with ``cap`` and
    ``round_trip``), a waiting one gets a prefill chunk (``admit_waiting``). The same decisions as one
    ``swap_in`` / ``admit_waiting`` call per request; the swap-ins between two waiting requests are applied
    with one block-manager call.

    A rotary request is in its decode phase (an invariant): its one pending token needs one slot
    (``planned_tokens - num_computed_tokens == 1``) and its host blocks cover exactly its computed tokens.

    ``prechecked=True``: ``rs`` is this step's ``prioritize`` result and nothing was swapped in since (each
    rotary one is untouched in this step, has nothing in flight, and its swap-in fits ``cap`` after the ones
    before it in ``rs``, which admission only thins out), so those three checks always pass and are skipped.
    """
    step = self._step
    bs = self.bm.block_size
    max_seqs = self.config.max_num_seqs
    budget = self._budget  # at the start of the current batch; each swap-in takes one token and one seat
    room = min(budget, max_seqs - len(self.running))  # minus len(batch): tokens and seats both remain
    free = self.bm.num_free_device_blocks
    in_moved = self._in_moved
    admitted = 0
    batch = []  # rotary requests that fit, not yet swapped in
    for r in rs:
      if room <= 0:
        break
      if r.state is not ROTARY:
        if batch:
          self._apply_swap_ins(batch, budget - len(batch), round_trip)
          admitted += len(batch)
          batch = []
        if self.admit_waiting(r):
          admitted += 1
        budget = self._budget
        room = min(budget, max_seqs - len(self.running))
        free = self.bm.num_free_device_blocks
        in_moved = self._in_moved
        continue
      if prechecked:
        need = r._demand  # device blocks for the computed tokens plus the pending slot (blocks_for(planned))
        if need > free:
          continue
        free -= need
        room -= 1
        batch.append(r)
        continue
      if r._touched_step == step:  # moved earlier in this step (rotated out in it: _out_step == step too)
        if not round_trip or r._out_step != step:
          continue
      elif r.inflight_samples:
        continue
      c = r.num_computed_tokens
      nblk = (c + bs - 1) // bs  # bm.blocks_to_swap_in(rid), inline
      if cap is not None and in_moved and in_moved + nblk > cap:  # not in_fits(nblk, cap)
        continue
      need = c // bs + 1  # device blocks for the computed tokens plus the pending token's slot
      if need > free:
        continue
      free -= need
      room -= 1
      in_moved += nblk
      batch.append(r)
    if batch:
      self._apply_swap_ins(batch, budget - len(batch), round_trip)
      admitted += len(batch)
    return admitted

  def _apply_swap_ins(self, batch: list[Request], budget: int, round_trip: bool = False) -> None:
    """Swaps in the rotary requests of ``batch`` (checked to fit): H2D pairs and the pending token's slot
    from the block manager, ROTARY -> RUNNING, each scheduled for its pending token. ``budget`` is the
    token budget after them; the swap-in volume grows by their H2D pairs (one per host block).
    ``round_trip``: ``batch`` may hold requests rotated out in this step (``swap_in``'s flag).

    The requests' own fields are brought to their end-of-step values here (the pending token counted as
    computed and in flight, as ``_finalize`` would: nothing later in the step reads them), and what they
    need next step is added to ``_swapin_need``; ``_finalize`` marks their tokens in the block manager at
    their place in plan order (after the write-backs: ordering contract 2)."""
    plan = self._plan
    rids = [r.req_id for r in batch]
    pairs_before = len(plan.swap_in)
    tables = self.bm.swap_in_many(rids, 1, plan.swap_in)
    assert len(tables) == len(batch)
    self.rotary.remove_many(batch)  # _dequeue(r) for each, with the demand below (hot under rotation)
    step = self._step
    if round_trip:
      trips = [r.req_id for r in batch if r._out_step == step]  # rotated out in this step (rotasched_code)
      plan.round_trips += trips
      self.totals["round_trips"] += len(trips)
    scheduled = plan.scheduled
    self._swapins.append((len(scheduled), rids, batch))  # _finalize marks these seqs in the block manager
    emit = scheduled.append
    self.running.update(zip(rids, batch))
    now = self._now
    bs = self.bm.block_size
    need_tok = need_blk = demand = 0
    track = self.policy.uses_running_needs
    for r, table in zip(batch, tables):
      demand += r._demand  # leaves the queued demand (a running request's _demand is not read)
      c = r.num_computed_tokens
      emit(ScheduledSeq(r.req_id, 1, c, table, True))  # _emit(r, 1), inline: c + 1 == planned_tokens
      c += 1  # the pending token, computed by this step
      # _to_running(r), inline
      r.state = RUNNING
      r.state_time = now
      r._touched_step = r._admit_step = step
      r._gen_at_admit = gen = c - r.prompt_len  # num_generated + inflight_samples
      # _finalize's general path for this seq, less the block manager's mark (done there, in plan order)
      r.num_computed_tokens = c
      r.inflight_samples += 1
      if track and gen < r.max_tokens - 1:  # gen + 1 < max_tokens
        need_tok += 1
        if not c % bs:
          need_blk += 1
    self._demand -= demand
    sn = self._swapin_need
    sn[0] += need_blk
    sn[1] += need_tok
    plan.rotated_in += rids
    self._budget = budget
    self._in_moved += len(plan.swap_in) - pairs_before

  def admit_waiting(self, r: Request) -> bool:
    """WAITING/PREEMPTED -> RUNNING with a prefill chunk. False (no change) if it does not fit now."""
    assert r.state in (WAITING, PREEMPTED), r
    if r._touched_step == self._step or r.inflight_samples:
      return False
    rem = r.planned_tokens - r.num_computed_tokens
    n = rem if rem < self._budget else self._budget
    if n <= 0 or len(self.running) >= self.config.max_num_seqs:
      return False
    if not self.bm.append_slots(r.req_id, n):
      return False
    self._dequeue(r)
    self._plan.admitted.append(r.req_id)
    self._to_running(r)
    self._emit(r, n)
    return True

  def admit(self, r: Request, cap: int | None = None) -> bool:
    if r.state is ROTARY:
      return self.swap_in(r, cap)
    return self.admit_waiting(r)

  def _to_running(self, r: Request) -> None:
    r.state = RUNNING
    r.state_time = self._now
    r._touched_step = self._step
    r._admit_step = self._step
    r._gen_at_admit = r.num_generated + r.inflight_samples
    self.running[r.req_id] = r

  # ------------------------------------------------------------------ step done
  def on_step_done(self, plan: StepPlan, new_tokens: dict | None = None, finished: dict | None = None,
                   now: float | None = None) -> list:
    if not self._inflight or self._inflight[0] != plan.step_id:
      raise RuntimeError(f"on_step_done for step {plan.step_id}, but in flight: {self._inflight}")
    self._inflight.pop(0)
    if now is None:
      now = self.clock.now()
    done = []
    reqs = self.requests
    for seq in plan.scheduled:
      if not seq.sample:
        continue
      r = reqs.get(seq.req_id)
      if r is None:
        continue  # finished or aborted meanwhile
      r.inflight_samples -= 1
      if r.output_token_ids is not None:
        r.output_token_ids.append(new_tokens.get(seq.req_id) if new_tokens else None)
      queued = r._qentry is not None
      if queued:
        self._dequeue(r)
      r.num_generated += 1
      if r.first_token_time is None:
        r.first_token_time = now
      else:
        gap = now - r.last_token_time
        if gap > r.tbt_max:
          r.tbt_max = gap
      r.last_token_time = now
      if queued:  # lookahead: a request rotated/preempted while in flight; its key or demand may change
        if r.state is ROTARY:
          self._enqueue_rotary(r)
        else:
          self._enqueue_waiting(r, preempted=r.state is PREEMPTED)
      if r.num_generated >= r.max_tokens:
        self._finish(r, "length", now)
        done.append(r.req_id)
    if finished:
      for rid, reason in finished.items():
        r = reqs.get(rid)
        if r is not None:
          self._finish(r, reason, now)
          done.append(rid)
    return done

  # ------------------------------------------------------------------ invariants
  def check_invariants(self) -> None:
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
