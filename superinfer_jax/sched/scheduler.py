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

The step's operations (``step.py``, ``StepBuilder``): ``schedule()`` builds one ``StepBuilder`` per call,
the policy acts only through it (``policy.schedule_step(step)``), and ``finalize`` closes the plan. Request
state changes go through ``request.py``'s transitions; queue placement through ``pending.py``.
``tests/sched/test_sched_replay.py`` pins every policy's plans (``sched/replay.py``);
``tests/sched/test_sched_equivalence.py`` checks the fast paths against plain reference implementations.

Invariants (``check_invariants``, ``invariants.py``): every live request is in exactly one of running / waiting (WAITING or
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

import types
from typing import Hashable

from superinfer_jax.kv.block_manager import BlockManager
from superinfer_jax.sched import vlt as vlt_lib
from superinfer_jax.sched.config import SchedulerConfig
from superinfer_jax.sched.invariants import check_scheduler
from superinfer_jax.sched.pending import PendingQueues
from superinfer_jax.sched.plan import StepPlan
from superinfer_jax.sched.policies import make_policy
from superinfer_jax.sched.protocol import SchedulerStats
from superinfer_jax.sched.request import Request, RequestState
from superinfer_jax.sched.step import StepBuilder
from superinfer_jax.kv.layout import blocks_for

RUNNING = RequestState.RUNNING
WAITING = RequestState.WAITING
ROTARY = RequestState.ROTARY


class Scheduler:
  """One scheduler core with a pluggable policy. See the module docstring for the API and invariants."""

  def __init__(self, config: SchedulerConfig, block_manager: BlockManager, clock, policy=None):
    self.config = config
    self.bm = block_manager
    self.clock = clock
    if policy is None:
      policy = config.policy
    self.policy = make_policy(policy) if isinstance(policy, str) else policy
    self.requests: dict[Hashable, Request] = {}
    self.running: dict[Hashable, Request] = {}  # admission order == t_run order
    self.running_view = types.MappingProxyType(self.running)
    self.pending = PendingQueues(self.policy, config, block_manager.block_size)
    self.waiting = self.pending.waiting_view  # WAITING + PREEMPTED, policy order
    self.rotary = self.pending.rotary_view  # ROTARY, policy order
    # (blocks, tokens) the running requests need next step, kept by each step's finalize for policies with
    # ``uses_running_needs`` (None: unknown, the step scans).
    self.running_need: tuple[int, int] | None = None
    self._step = 0
    self._inflight: list[int] = []
    self._finished: list[Request] = []
    self.totals = dict(steps=0, rotations_out=0, rotations_in=0, blocks_out=0, blocks_in=0,
                       blocks_writeback=0, recompute_preemptions=0, admitted=0, finished=0, aborted=0,
                       scheduled_tokens=0, round_trips=0, residency_steps=0)
    # Prefix caching, blocks (StepPlan's prefix counters summed; kept apart from totals, which the replay
    # fingerprints pin).
    self.prefix_totals = dict(queried=0, device_hits=0, host_hits=0, rehits=0)

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
  def num_inflight_plans(self) -> int:
    """Plans returned by ``schedule()`` and not yet passed to ``on_step_done`` (0 or 1, 2 under lookahead)."""
    return len(self._inflight)

  @property
  def demand_blocks(self) -> int:
    return self.pending.demand

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
                          num_rotary=len(self.rotary), demand_blocks=self.pending.demand,
                          device_blocks=bm.num_device_blocks, free_device_blocks=bm.num_free_device_blocks,
                          host_blocks=bm.num_host_blocks, free_host_blocks=bm.num_free_host_blocks,
                          pending_writebacks=bm.pending_writebacks(), totals=dict(self.totals),
                          prefix_cache={**self.prefix_totals, **bm.prefix_cache_stats()})

  def pop_finished(self) -> list[Request]:
    out, self._finished = self._finished, []
    return out

  def check_invariants(self) -> None:
    """Asserts the invariants of the module docstring and the block manager's (``invariants.py``)."""
    check_scheduler(self)

  # ------------------------------------------------------------------ lifecycle
  def add_request(self, req: Request) -> None:
    if req.req_id in self.requests:
      raise ValueError(f"request {req.req_id!r} is already live")
    need = blocks_for(req.prompt_len + req.max_tokens - 1, self.bm.block_size)
    if need > self.bm.num_device_blocks:
      raise ValueError(
          f"request {req.req_id!r} can never fit: prompt_len {req.prompt_len} + max_tokens {req.max_tokens} "
          f"needs {need} device blocks of {self.bm.block_size} tokens, the pool has {self.bm.num_device_blocks}")
    if req.state is not WAITING or req.num_generated or req.num_computed_tokens:
      raise ValueError(f"request {req.req_id!r} must be fresh (WAITING, nothing generated)")
    self.requests[req.req_id] = req
    self.pending.enqueue_waiting(req, preempted=False)

  def abort(self, req_id) -> bool:
    r = self.requests.get(req_id)
    if r is None:
      return False
    self._finish(r, "abort", self.clock.now(), aborted=True)
    return True

  def _finish(self, r: Request, reason: str, now: float, aborted: bool = False) -> None:
    """Ends a live request between steps: out of its queue or the running set, blocks released."""
    if r.state is RUNNING:
      del self.running[r.req_id]
      need = self.running_need
      if need is not None:  # its term of the running set's need goes with it
        blk, tok = r.next_step_need(self.bm.block_size)
        self.running_need = (need[0] - blk, need[1] - tok)
    elif r.queue_key is not None:
      self.pending.dequeue(r)
    self.bm.free(r.req_id)
    r.finish(reason, now, aborted)
    del self.requests[r.req_id]
    self._finished.append(r)
    self.totals["aborted" if aborted else "finished"] += 1

  # ------------------------------------------------------------------ schedule
  def schedule(self, lookahead: bool = False) -> StepPlan:
    if self._inflight and not lookahead:
      raise RuntimeError(f"plan(s) {self._inflight} still in flight; call on_step_done first or use lookahead")
    if len(self._inflight) > 1:
      raise RuntimeError("lookahead depth is 1: two plans are already in flight")
    self.bm.begin_step()
    policy = self.policy
    step = StepBuilder(self, StepPlan(step_id=self._step, time=self.clock.now(), lookahead=bool(self._inflight)),
                       policy.uses_running_needs)
    policy.schedule_step(step)
    plan = step.finalize(self._writeback_reserve())
    if policy.uses_running_needs:
      self.running_need = step.next_need
    self._add_totals(plan)
    self._inflight.append(plan.step_id)
    self._step += 1
    return plan

  def _writeback_reserve(self) -> int | None:
    """Host blocks eager write-back leaves free (``writeback_min_free_host``; default min(B_xfer, a quarter of
    the host pool)), or None when there is no write-back: off, or the policy never uses the host pool and
    the host prefix tier has no request to serve (it fills the tier under fcfs, as vLLM's CPU offloading
    does)."""
    cfg = self.config
    if not cfg.writeback:
      return None
    if not self.policy.uses_host_pool and not (self.bm.host_prefix_cache and self.bm.num_cached_requests):
      return None  # nothing would read the copies: no rotation, and no host prefix tier in use
    reserve = cfg.writeback_min_free_host
    return min(cfg.proactive_swap_budget, self.bm.num_host_blocks // 4) if reserve is None else reserve

  def _add_totals(self, plan: StepPlan) -> None:
    """Adds a finalized plan's per-step counters to ``totals``."""
    t = self.totals
    t["steps"] += 1
    t["rotations_out"] += len(plan.rotated_out)
    t["residency_steps"] += plan.residency_steps
    t["rotations_in"] += len(plan.rotated_in)
    t["round_trips"] += len(plan.round_trips)
    t["blocks_out"] += len(plan.swap_out)
    t["blocks_in"] += len(plan.swap_in)
    t["blocks_writeback"] += len(plan.writeback)
    t["recompute_preemptions"] += len(plan.preempted)
    t["admitted"] += len(plan.admitted)
    t["scheduled_tokens"] += plan.num_batched_tokens
    if plan.prefix_queried or plan.prefix_rehits:
      p = self.prefix_totals
      p["queried"] += plan.prefix_queried
      p["device_hits"] += plan.prefix_device_hits
      p["host_hits"] += plan.prefix_host_hits
      p["rehits"] += plan.prefix_rehits

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
      r.token_done(now)
      if r.queue_key is not None:  # lookahead: rotated out or preempted while in flight; key and demand move
        self.pending.requeue(r)
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

