"""The scheduler core: request queues, the step plan, lifecycle bookkeeping. Policies live in ``policies/``.

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
    finished. Every seq with ``sample=True`` gained one token (``new_tokens``, the sampled ids, may be passed
    for the record; the scheduler keeps no token ids). ``finished[req_id] = reason`` ends requests the
    engine stopped (EOS, stop string). Requests reaching ``max_tokens`` finish with reason "length" (the one
    place the length stop is decided). Stamps first/last token times at ``now`` (default ``clock.now()``).
    Returns ``{req_id: reason}`` of the requests that finished, in finish order; under lookahead the engine
    must drop them from the next plan's ``scheduled`` before dispatching it.
  * ``stats() -> SchedulerStats``: counts per state, pool occupancy, totals (``protocol.py``).
  * ``pop_finished() -> list[Request]``: terminal requests since the last call (for metrics).
  * Per-step counters are on the ``StepPlan`` (``plan.py``); cumulative ones in ``totals``.
  * Queries: ``num_waiting``, ``num_running``, ``num_rotary``, ``num_unfinished``, ``has_unfinished()``,
    ``get(req_id)``, ``running_ids()``, ``waiting_ids()``, ``rotary_ids()``, ``vlt(req_id)``,
    ``totals`` (cumulative counters dict), ``check_invariants()``.

Step structure (each policy composes these; see ``policies/``)
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

Building blocks for policies (``policies/``), in mixins by concept: ``running_step.py`` (``running_needs()``,
``schedule_running()``, ``evict``, ``preempt``), ``rotation_ops.py`` (``rotatable``, ``rotate_out*``),
``admission.py`` (``swap_in``, ``admit_waiting``, ``admit_in_order``). In all: ``running_needs()``, ``schedule_running()``, ``rotate_out(r)`` /
``rotate_out_many(victims)``, ``swap_in(r)``, ``admit_waiting(r)``, ``admit_in_order(rs)``, ``preempt(r)``,
``evict(r)``, ``rotatable(r)``. The ``*_many`` / ``admit_in_order`` forms decide exactly as one call per
request would and move a step's rotations through batched block-manager calls (the hot path under
rotation: ``scripts/bench_scheduler.py``). ``running_needs()`` is kept incrementally by ``_finalize`` for
policies that set ``uses_running_needs`` (checked by ``check_invariants``). ``tests/test_sched_replay.py``
pins every policy's plans (``sched/replay.py``); ``tests/test_sched_equivalence.py`` checks the fast paths
against plain reference implementations.

Invariants (``check_invariants``, in ``invariants.py``): every live request is in exactly one of running / waiting (WAITING or
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
from superinfer_jax.sched.admission import AdmissionMixin
from superinfer_jax.sched.invariants import InvariantsMixin
from superinfer_jax.sched.plan import StepPlan
from superinfer_jax.sched.protocol import SchedulerStats
from superinfer_jax.sched.queue import SortedQueue
from superinfer_jax.sched.request import Request, RequestState
from superinfer_jax.sched.rotation_ops import RotationOpsMixin
from superinfer_jax.sched.running_step import RunningStepMixin

RUNNING = RequestState.RUNNING
WAITING = RequestState.WAITING
ROTARY = RequestState.ROTARY
PREEMPTED = RequestState.PREEMPTED

class Scheduler(RunningStepMixin, RotationOpsMixin, AdmissionMixin, InvariantsMixin):
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

  def stats(self) -> SchedulerStats:
    bm = self.bm
    return SchedulerStats(num_waiting=len(self.waiting), num_running=len(self.running),
                          num_rotary=len(self.rotary), demand_blocks=self._demand,
                          device_blocks=bm.num_device_blocks, free_device_blocks=bm.num_free_device_blocks,
                          host_blocks=bm.num_host_blocks, free_host_blocks=bm.num_free_host_blocks,
                          pending_writebacks=bm.pending_writebacks(), totals=dict(self.totals))

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
    bm = self.bm
    self._take_writebacks(plan)
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
    self._add_totals(plan)

  def _take_writebacks(self, plan: StepPlan) -> None:
    """Fills ``plan.writeback`` with this step's eager write-back pairs (``BlockManager.take_writebacks``),
    keeping ``writeback_min_free_host`` host blocks free (default: min(B_xfer, a quarter of the host pool)).
    Policies that do not use the host pool take none. Called before the plan's tokens are marked computed."""
    cfg = self.config
    if cfg.writeback and self.policy.uses_host_pool:
      reserve = cfg.writeback_min_free_host
      if reserve is None:
        reserve = min(cfg.proactive_swap_budget, self.bm.num_host_blocks // 4)
      plan.writeback = self.bm.take_writebacks(cfg.max_writeback_blocks, reserve)

  def _add_totals(self, plan: StepPlan) -> None:
    """Adds a finalized plan's per-step counters to ``totals``."""
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
    t["scheduled_tokens"] += plan.num_batched_tokens

  # ------------------------------------------------------------------ step done
  def on_step_done(self, plan: StepPlan, new_tokens: dict | None = None, finished: dict | None = None,
                   now: float | None = None) -> dict:
    if not self._inflight or self._inflight[0] != plan.step_id:
      raise RuntimeError(f"on_step_done for step {plan.step_id}, but in flight: {self._inflight}")
    self._inflight.pop(0)
    if now is None:
      now = self.clock.now()
    done = {}
    reqs = self.requests
    for seq in plan.scheduled:
      if not seq.sample:
        continue
      r = reqs.get(seq.req_id)
      if r is None:
        continue  # finished or aborted meanwhile
      r.inflight_samples -= 1
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
        done[r.req_id] = "length"
    if finished:
      for rid, reason in finished.items():
        r = reqs.get(rid)
        if r is not None:
          self._finish(r, reason, now)
          done[rid] = reason
    return done
