"""Scheduling policies: one scheduler core (``scheduler.py``), pluggable step logic.

* ``fcfs``: vLLM v1 default (docs/paper.md §3). Arrival order; when a running request cannot grow, the
  last-admitted running request is preempted by **recompute** and re-queued at the **head** of waiting; no
  admission in a step that preempted; head-of-line blocking. No rotation.
* ``fcfs_swap``: vLLM v1 with swap preemption. As fcfs, but the reactive victim is **swapped** to host
  (recompute if mid-prefill or the host is full) and re-queued at the head, as fcfs re-queues its recompute
  victims: the most recently evicted request resumes first (LIFO), before any new one. No proactive rotation.
* ``wf``: Waiting-First (docs/paper.md §3, the paper's "WF" of Fig. 1): a static priority, waiting > running >
  rotary, with no lag rule and no B_xfer. Waiting requests are admitted in arrival order, and running ones
  rotate out (latest arrival first) to make room; rotary requests resume only when no request waits.
* ``sf``: Swapped-First (docs/paper.md §3), vLLM v0's swap policy: no proactive rotation; the reactive victim is
  swapped to host; in a step without evictions, swapped requests resume oldest-swap first (FIFO), and new
  requests are admitted only while no request is swapped out. It protects TBT and degenerates to about FCFS.
* ``rotasched``: the paper's Algorithm 1 (docs/paper.md §2.1) with VLT (alpha, beta_B, beta_F, S_F = TTFT SLO,
  S_B = TBT SLO).
* ``rotasched_code``: the reference code's behaviour (docs/paper.md §2.2): oldest ``in_waiting_since`` first, keep
  B blocks free by rotating out longest-running decode requests (victims go to the tail of the one
  waiting order, and the admission loop may swap them straight back in within the step, as the fork's
  does), host-usage gates 0.95 (swap-out) / 0.9 (only WAITING requests, not PREEMPTED ones), recompute on
  the reactive path, swap-in not bounded by B.
* ``edf`` (beyond the paper): earliest SLO deadline first (waiting: t_arr + TTFT SLO; rotary: t_last + TBT
  SLO) inside Algorithm 1; only candidates already past their deadline may displace running requests, the
  others use free memory only. A deadline-driven baseline to set against VLT's weighted lag.

Algorithm 1 as implemented (``RotationPolicy.schedule_step`` = ``prioritize`` -> ``pick_victims`` ->
``execute``, or ``schedule_without_rotation``), per step at time ``now``:
  0. ``B_HBM`` = free device blocks minus the blocks running requests need for this step's tokens.
  1. Contention check: if ``B_HBM >= sum(blk(r) for r in waiting + rotary)`` (kept incrementally, O(1)): no
     rotation; schedule running, then admit candidates in policy order (no contention: all fit).
  2. Otherwise scan candidates (waiting + rotary, merged lazily in priority order; at most
     ``lvf_scan_limit``, stopping after ``lvf_max_skips`` consecutive misfits or when B_left is spent) and
     build R: ``r`` joins if it is *urgent* (VLT >= 0, which ReLU makes true for every
     waiting/rotary request; for edf: deadline passed) and ``blk(r) <= B_left`` (``B_left = B_HBM + B_xfer``
     for urgent candidates, ``B_HBM`` left for non-urgent ones), its swap-in fits the B_xfer in-budget, and
     tokens and seats remain. ``blk(r) = ceil(planned_tokens / block_size)``.
  3. ``B_swap = sum(blk(R)) - B_HBM`` and ``seats = |R| - free seats``; scan running requests from the tail of
     L (longest-running, i.e. smallest VLT, first): while ``B_swap > 0`` or ``seats > 0``, take ``r`` if its
     VLT < 0 (it has run for a positive time), it is in decode phase (never mid-prefill) and its D2H copies
     fit the B_xfer out-budget.
  4. Rotate out P, schedule running requests (reactive eviction = rotation if allowed, else recompute),
     then admit R in order, skipping those that do not fit. A victim the host pool cannot take stays running
     unless ``proactive_recompute`` is set (then it is preempted by recompute). Either way, when memory
     really runs out (a running request cannot grow) the reactive path falls back to recompute.
Queues stay sorted by time-invariant keys (VLT order within a state never changes), so a step costs
O(running + |R| + blocks rotated + log N), not a sort of all N requests.

Reading of the paper's conceptual example (docs/paper.md §2.1, [S]): "the longest-running request rotates out once
a waiting request's positive VLT exceeds its |VLT|". With the §1.2 formula a crossing test cannot be what
Algorithm 1 does: a waiting request's VLT and a running request's |VLT| both grow at rate 1, so a waiting
request could never displace one that started running before it arrived + beta_F * S_F. We implement
Algorithm 1 as written (a waiting/rotary request has VLT >= 0 thanks to ReLU and so outranks every running
request, whose VLT < 0 once it has run for any time); the victim is the tail of L, i.e. the longest-running
request, and a request that entered RUNNING this instant (VLT = 0) is never a victim. Under contention this
rotates up to B_xfer blocks per step (the paper's "(H)" ablation, TBT collapse without DuplexKV, is
consistent with that). ``tests/test_sched.py::test_conceptual_example_longest_running_rotates_out`` works
the example through.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import operator
from typing import Iterator

from superinfer_jax.sched.request import Request, RequestState
from superinfer_jax.sched.vlt import rotary_ref_time

RUNNING = RequestState.RUNNING
ROTARY = RequestState.ROTARY
WAITING = RequestState.WAITING


class Policy:
  """Base: FCFS-style queue keys and step logic (vLLM v1 ``fcfs``)."""
  name = "base"
  reactive_mode = "recompute"
  uses_host_pool = True   # False: KV never goes to host, so eager write-back would only waste D2H bandwidth
  uses_running_needs = False  # True: schedule_step calls sched.running_needs() first (kept incrementally)

  def __init__(self):
    self._head_counter = 0

  # Queue keys: ascending = head of the queue. Fixed while the request sits in the queue.
  def waiting_key(self, r: Request, sched) -> tuple:
    return (1, r.arrival_time)

  def preempted_key(self, r: Request, sched) -> tuple:
    self._head_counter += 1
    return (0, -self._head_counter)  # re-queued at the head (vLLM v1)

  def rotary_key(self, r: Request, sched) -> tuple:
    return (r.state_time,)

  def rotary_keys(self, rs, sched) -> list:
    """``[rotary_key(r, sched) for r in rs]`` (policies override it where one pass is cheaper)."""
    return [self.rotary_key(r, sched) for r in rs]

  def candidates(self, sched, now: float) -> Iterator[Request]:
    """Waiting + rotary requests, highest priority first."""
    return sched.waiting.iter_requests()

  def scan_candidates(self, sched, now: float) -> Iterator[Request]:
    """``candidates()`` for a scan that changes no queue while it runs (``prioritize``), which may read the
    queues without a snapshot (``SortedQueue.view``). Default: ``candidates()``."""
    return self.candidates(sched, now)

  def schedule_step(self, sched, plan, now: float) -> None:
    raise NotImplementedError


class FCFS(Policy):
  """vLLM v1: arrival order, reactive recompute preemption of the last admitted, head-of-line blocking."""
  name = "fcfs"
  uses_host_pool = False

  def schedule_step(self, sched, plan, now):
    evicted = sched.schedule_running(self.reactive_mode)
    if evicted:
      return
    for r in self.candidates(sched, now):
      if sched.budget_left() <= 0 or sched.seats_left() <= 0:
        break
      if not sched.admit(r):
        break


class FCFSSwap(FCFS):
  """vLLM v1 with swap preemption: reactive victims go to host and re-queue at the head (LIFO, as fcfs's
  recompute victims do); swapped requests resume before new ones; no admission in a step that evicted."""
  name = "fcfs_swap"
  reactive_mode = "swap"
  uses_host_pool = True

  def rotary_key(self, r, sched):
    self._head_counter += 1
    return (-self._head_counter,)  # the latest victim at the head

  def candidates(self, sched, now):
    return itertools.chain(sched.rotary.iter_requests(), sched.waiting.iter_requests())


class SwappedFirst(FCFS):
  """Swapped-First (docs/paper.md §3), as vLLM v0's scheduler does it with swap preemption.

  Per step: running requests first, in admission order; one that cannot grow evicts the last-admitted
  running request by **swap** (recompute if it is mid-prefill or the host pool is full). If nothing was
  evicted, rotary requests resume oldest-swap first (FIFO by rotation time) while they fit; new requests are
  admitted (arrival order, head-of-line) only when no request is rotary. No proactive rotation, so under
  contention it behaves about like FCFS: TBT of started requests is protected, new requests wait.

  How it differs from ``fcfs_swap`` (vLLM v1 with swap preemption): ``fcfs_swap`` re-queues a victim at the
  head of the one queue, so the most recently evicted request resumes first (LIFO); ``sf`` keeps swapped
  requests in their own queue and resumes the longest-parked one first (FIFO), and it refuses new requests
  while any request is rotary even when the rotary ones cannot be tried this step (a victim whose sampled
  token is still in flight). Both stop admission at the first request that does not fit, so apart from the
  resume order they decide alike: that is the paper's "SF degenerates to about FCFS". Neither rotates a
  running request out to admit a waiting one (``wf`` and ``rotasched`` do).
  """
  name = "sf"
  reactive_mode = "swap"
  uses_host_pool = True

  def schedule_step(self, sched, plan, now):
    if sched.schedule_running(self.reactive_mode):
      return  # v0: no swap-in in a step that evicted
    for r in sched.rotary.iter_requests():
      if sched.budget_left() <= 0 or sched.seats_left() <= 0 or not sched.swap_in(r):
        return
    if sched.rotary:
      return  # v0: no new prefill while any request is swapped out
    for r in sched.waiting.iter_requests():
      if sched.budget_left() <= 0 or sched.seats_left() <= 0 or not sched.admit_waiting(r):
        return


class RotationPolicy(Policy):
  """Algorithm 1 (docs/paper.md §2.1) with a policy-defined candidate order (see the module docstring)."""
  name = "rotation"
  reactive_mode = "swap"
  uses_running_needs = True

  def waiting_key(self, r, sched):
    return (r.arrival_time,)

  def preempted_key(self, r, sched):
    return self.waiting_key(r, sched)

  def urgent(self, r: Request, now: float) -> bool:
    return True  # VLT >= 0 holds for every waiting / rotary request (ReLU)

  def victim_ok(self, r: Request, now: float) -> bool:
    return now - r.state_time > 0  # VLT(r) = -(now - t_run) < 0

  def schedule_step(self, sched, plan, now):
    """Algorithm 1, one step: contention check, prioritize (R), pick victims (P), execute."""
    bx = sched.config.proactive_swap_budget
    grow, run_tokens = sched.running_needs()
    b_hbm = sched.bm.num_free_device_blocks - grow
    if b_hbm >= sched.demand_blocks or bx == 0:
      self.schedule_without_rotation(sched, now)
      return
    plan.contention = True
    R, b_used = self.prioritize(sched, now, b_hbm, sched.budget_left() - run_tokens)
    victims = self.pick_victims(sched, now, b_swap=b_used - b_hbm, seats=len(R) - sched.seats_left())
    self.execute(sched, victims, R)

  def schedule_without_rotation(self, sched, now) -> None:
    """Step 1's fallback (no contention, or B_xfer = 0): running requests, then admission in policy order."""
    bx = sched.config.proactive_swap_budget
    sched.schedule_running(self.reactive_mode, swap_cap=bx)
    for r in self.candidates(sched, now):
      if sched.budget_left() <= 0 or sched.seats_left() <= 0:
        break
      if not sched.admit(r, cap=bx):
        break

  def prioritize(self, sched, now: float, b_hbm: int, tokens: int) -> tuple[list[Request], int]:
    """Step 2: scan candidates in priority order and build R. Returns (R, blocks R needs).

    A candidate joins when it is urgent and ``blk(r)`` fits ``B_HBM + B_xfer`` (non-urgent: ``B_HBM``), its
    swap-in fits the B_xfer in-budget, and tokens and seats remain. Hot loop: request fields are read inline.
    """
    cfg = sched.config
    bs = sched.bm.block_size
    bx = cfg.proactive_swap_budget
    step = sched.step_id
    b_used = 0
    in_blocks = 0
    R = []
    skips = 0
    max_skips = cfg.lvf_max_skips
    max_seqs = cfg.max_num_seqs
    b_all = b_hbm + bx
    if tokens <= 0 or max_seqs <= 0 or b_all <= 0:
      return R, b_used
    urgent = None if type(self).urgent is RotationPolicy.urgent else self.urgent  # None: always urgent
    # At most lvf_scan_limit candidates; the other stopping rules are checked where their inputs change.
    for r in itertools.islice(self.scan_candidates(sched, now), cfg.lvf_scan_limit):
      if r.touched_step == step or r.inflight_samples:
        continue
      blk = r.queued_demand  # blocks_for(planned_tokens), kept by the queues (inflight_samples is 0 here)
      if b_used + blk > (b_all if urgent is None or urgent(r, now) else b_hbm):
        skips += 1
        if skips >= max_skips:
          break
        continue
      if r.state is ROTARY:
        # bm.blocks_to_swap_in(r.req_id): a rotary request's host blocks cover exactly its computed tokens.
        nin = (r.num_computed_tokens + bs - 1) // bs
        if in_blocks and in_blocks + nin > bx:
          skips += 1
          if skips >= max_skips:
            break
          continue
        in_blocks += nin
        tokens -= 1
      else:
        rem = r.prompt_len + r.num_generated - r.num_computed_tokens
        tokens -= rem if rem < tokens else tokens
      skips = 0
      R.append(r)
      b_used += blk
      if tokens <= 0 or len(R) >= max_seqs or b_used >= b_all:
        break
    return R, b_used

  def pick_victims(self, sched, now: float, b_swap: int, seats: int) -> list[Request]:
    """Step 3: running requests to rotate out, from the tail of L (longest-running first), while R still
    needs ``b_swap`` blocks or ``seats`` seats. A victim has VLT < 0, is rotatable (decode phase, sampled
    since it last entered RUNNING, not about to finish), has been resident ``min_residency`` steps, and its
    D2H copies fit the B_xfer out-budget."""
    if b_swap <= 0 and seats <= 0:
      return []
    bm = sched.bm
    bs = bm.block_size
    bx = sched.config.proactive_swap_budget
    step = sched.step_id
    oldest_admit = step - sched.config.min_residency  # resident_long_enough(v), inline
    victims = []
    out_copies = 0
    victim_ok = None if type(self).victim_ok is RotationPolicy.victim_ok else self.victim_ok
    copies_of = bm.swap_out_copies
    # The out-budget check needs each victim's D2H copies only if they could add up to more than bx. A
    # swap-out copies the request's full dirty blocks, which are queued for write-back, plus at most its
    # tail block, so any set of victims copies at most pending_writebacks() + its size: when that bound
    # fits, every check passes and the copies are not counted.
    exact = bm.pending_writebacks() + len(sched.running) > bx
    for v in sched.running.values():
      if b_swap <= 0 and seats <= 0:
        break
      if victim_ok is None:
        if not now - v.state_time > 0:  # RotationPolicy.victim_ok: VLT(v) < 0
          continue
      elif not victim_ok(v, now):
        continue
      # Scheduler.rotatable(v), inline.
      gen = v.num_generated + v.inflight_samples
      if (v.prompt_len + gen - v.num_computed_tokens != 1 or v.touched_step == step
          or gen <= v.generated_at_admit or gen >= v.max_tokens or v.admit_step > oldest_admit):
        continue
      if exact:
        copies = copies_of(v.req_id)
        if not (out_copies + copies <= bx or out_copies == 0):
          continue
        out_copies += copies
      victims.append(v)
      b_swap -= (v.num_computed_tokens + bs - 1) // bs  # bm.num_blocks(rid): running => all computed
      seats -= 1
    return victims

  def execute(self, sched, victims: list[Request], R: list[Request]) -> None:
    """Step 4: rotate P out, schedule running requests (reactive eviction = rotation if allowed, else
    recompute), then admit R in order, skipping those that do not fit."""
    cfg = sched.config
    bx = cfg.proactive_swap_budget
    # pick_victims checked rotatable(v) in this step; a victim the host pool cannot take stays running, or
    # falls back to recompute (opt-in; see SchedulerConfig).
    sched.rotate_out_many(victims, recompute_if_full=cfg.proactive_recompute)
    sched.schedule_running(self.reactive_mode, swap_cap=bx)
    sched.admit_in_order(R, cap=bx, prechecked=True)  # R: prioritize's, checked in this step


class WaitingFirst(Policy):
  """Waiting-First, the paper's "WF" (docs/paper.md §3, Fig. 1): waiting requests are admitted first, in
  arrival order, and running requests rotate out to host (the latest-arriving first) to make room for them;
  rotary requests resume, oldest rotation first, only in a step that leaves no request waiting.

  The priority is static (waiting > running > rotary, ties by arrival): no VLT, no lag rule, and the
  proactive swap-out is not capped by B_xfer. Per step: the waiting requests that this step's token budget
  and seats take, in arrival order (head-of-line: the first that cannot fit even with every rotatable
  running request gone stops the scan), set how many device blocks must be freed; victims rotate out until
  they are; then running requests are scheduled (reactive eviction by swap, as ``fcfs_swap``), the waiting
  requests admitted, and rotary ones resumed only if nothing waits any more.
  """
  name = "wf"
  reactive_mode = "swap"
  uses_running_needs = True

  def waiting_key(self, r, sched):
    return (r.arrival_time,)

  def preempted_key(self, r, sched):
    return self.waiting_key(r, sched)

  def rotary_key(self, r, sched):
    return (r.state_time,)

  def candidates(self, sched, now):
    return itertools.chain(sched.waiting.iter_requests(), sched.rotary.iter_requests())

  def schedule_step(self, sched, plan, now):
    if sched.waiting:
      grow, run_tokens = sched.running_needs()
      free = sched.bm.num_free_device_blocks - grow
      if free < sched.demand_blocks:
        plan.contention = True
      if plan.contention or sched.seats_left() < len(sched.waiting):  # else every waiting request fits
        victims = self.pick_victims(sched, free, sched.budget_left() - run_tokens)
        if victims:
          sched.rotate_out_many(victims)
    evicted = sched.schedule_running(self.reactive_mode)
    if evicted:
      return
    for r in sched.waiting.iter_requests():
      if sched.budget_left() <= 0 or sched.seats_left() <= 0 or not sched.admit_waiting(r):
        return
    if sched.waiting:
      return
    for r in sched.rotary.iter_requests():
      if sched.budget_left() <= 0 or sched.seats_left() <= 0:
        return
      sched.swap_in(r)

  def pick_victims(self, sched, free: int, tokens: int) -> list[Request]:
    """Running requests to rotate out so that the waiting requests this step can take fit ``free`` device
    blocks: latest arrival first, rotatable ones only (decode phase, sampled since they last entered
    RUNNING)."""
    bs = sched.bm.block_size
    seats = sched.seats_left()
    pool = sorted((v for v in sched.running.values() if sched.rotatable(v)), key=lambda v: -v.arrival_time)
    held = [(v.num_computed_tokens + bs - 1) // bs for v in pool]  # running: blocks cover the computed tokens
    left = sum(held)
    victims = []
    i = 0
    for r in sched.waiting.iter_requests():
      if tokens <= 0 or r.touched_step == sched.step_id or r.inflight_samples:
        break
      c = r.num_computed_tokens
      n = min(r.planned_tokens - c, tokens)
      need = (c + n + bs - 1) // bs - (c + bs - 1) // bs
      if need > free + left or (seats <= 0 and i == len(pool)):
        break  # head-of-line: it cannot fit even with every rotatable running request gone
      while need > free or seats <= 0:
        victims.append(pool[i])
        free += held[i]
        left -= held[i]
        seats += 1
        i += 1
      free -= need
      seats -= 1
      tokens -= n
    return victims


class RotaSched(RotationPolicy):
  """Largest-VLT-First. Queue keys are the VLT "zero points": VLT = ReLU(now - key) (x alpha for rotary)."""
  name = "rotasched"

  def waiting_key(self, r, sched):
    cfg = sched.config
    sf = r.ttft_slo if r.ttft_slo is not None else cfg.ttft_slo
    return (r.arrival_time + cfg.beta_f * sf,)

  def rotary_key(self, r, sched):
    return self.rotary_keys((r,), sched)[0]

  def rotary_keys(self, rs, sched):
    # (rotary_ref_time(r) + beta_b * S_B,) per request, inline: victims are keyed in one pass per step.
    cfg = sched.config
    beta_b = cfg.beta_b
    tbt_slo = cfg.tbt_slo
    return [((r.last_token_time if r.last_token_time is not None else r.state_time)
             + beta_b * (r.tbt_slo if r.tbt_slo is not None else tbt_slo),) for r in rs]

  def candidates(self, sched, now):
    return _lvf_merge(sched.waiting.entries(), sched.rotary.entries(), now, sched.config.alpha)

  def scan_candidates(self, sched, now):
    return _lvf_merge(sched.waiting.view(), sched.rotary.view(), now, sched.config.alpha)


class RotaSchedStrict(RotaSched):
  """RotaSched that rotates only for requests that really lag (beyond the paper's Algorithm 1 as read).

  Algorithm 1 prioritises every candidate with VLT >= 0, which the ReLU makes true for all waiting and
  rotary requests, so under contention a running request is displaced after a single token (see
  WORKSPACE_NOTES "Open questions"). The paper's own [P] wording is "largest *positive* VLT": here only a
  candidate past its VLT zero point (waiting: ``t_arr + beta_F * S_F``; rotary: ``t_last + beta_B * S_B``)
  may use B_xfer to displace running requests; the others are admitted into free HBM only. With the
  default beta_B = 0 a rotary request lags from its last token, so time slicing between rotary and
  running requests remains; a positive beta_B gives each rotation a grace period.
  """
  name = "rotasched_strict"

  def urgent(self, r, now):
    k = r.queue_key
    return k is not None and k[0] < now


class EDF(RotationPolicy):
  """Earliest SLO deadline first; only late candidates may displace running requests."""
  name = "edf"

  def waiting_key(self, r, sched):
    sf = r.ttft_slo if r.ttft_slo is not None else sched.config.ttft_slo
    return (r.arrival_time + sf,)

  def rotary_key(self, r, sched):
    sb = r.tbt_slo if r.tbt_slo is not None else sched.config.tbt_slo
    return (rotary_ref_time(r) + sb,)

  def candidates(self, sched, now):
    merged = heapq.merge(sched.waiting.entries(), sched.rotary.entries(), key=lambda e: e[0])
    return (e[2] for e in merged)

  def urgent(self, r, now):
    k = r.queue_key
    return k is not None and k[0] <= now


class RotaSchedCode(Policy):
  """The reference code's per-step algorithm (docs/paper.md §2.2), for comparison with ``rotasched``."""
  name = "rotasched_code"
  uses_running_needs = True

  def waiting_key(self, r, sched):
    return (r.state_time,)  # in_waiting_since: arrival, or the time it was preempted

  def preempted_key(self, r, sched):
    return (r.state_time,)  # the fork appends preempted requests to the tail

  def rotary_key(self, r, sched):
    return (r.state_time,)  # in_waiting_since = the rotation time

  def candidates(self, sched, now):
    merged = heapq.merge(sched.waiting.entries(), sched.rotary.entries(), key=lambda e: e[0])
    return (e[2] for e in merged)

  def schedule_step(self, sched, plan, now):
    cfg = sched.config
    bm = sched.bm
    b = cfg.proactive_swap_budget
    rotated = False
    if b > 0:
      grow, _ = sched.running_needs()
      if bm.num_free_device_blocks < grow + sched.demand_blocks:  # not can_hold_all
        plan.contention = True
        if bm.host_usage() < cfg.code_swap_host_gate and bm.num_free_device_blocks < b:
          acc = 0
          victims = []
          for v in sched.running.values():  # longest running first
            if not (sched.rotatable(v) and sched.resident_long_enough(v)):
              continue
            n = bm.num_blocks(v.req_id)
            if acc + n >= b:
              break
            acc += n
            victims.append(v)
          for v in victims:
            rotated |= sched.rotate_out(v)  # host full: it stays running
    evicted = sched.schedule_running("recompute")
    if evicted and not rotated:
      return
    # Admission over waiting + rotary by in_waiting_since; this step's victims sort last (their key is now)
    # and may be swapped straight back in if room is left, as the fork's admission loop does.
    for r in self.candidates(sched, now):
      if sched.budget_left() <= 0 or sched.seats_left() <= 0:
        break
      if r.state is ROTARY:
        if not sched.swap_in(r, round_trip=True):
          break
        continue
      if r.state is WAITING and bm.num_host_blocks and bm.host_usage() > cfg.code_admit_host_gate:
        continue  # protect the DRAM pool: fresh (not preempted) requests wait
      if not sched.admit_waiting(r):
        break


def _lvf_merge(waiting: list, rotary: list, now: float, alpha: float) -> Iterator[Request]:
  """Largest VLT first over the two queues' entry lists (each sorted by its VLT zero point, ascending):
  snapshots, or the queues' own lists for a read-only scan (``scan_candidates``).

  The same order as ``heapq.merge(waiting, rotary, key=k)`` with ``k = (-VLT, -x)``, ``x`` the un-ReLU'd lag
  (``now - key`` for waiting, ``alpha * (now - key)`` for rotary), ties going to waiting. Since
  ``VLT = max(x, 0)`` is monotone in ``x``, ``(VLT, x)`` orders exactly as ``x`` does: rotary comes first iff
  its ``x`` is strictly larger. The scan runs every step, so the merge works run by run: along a queue
  ``x`` never grows (the keys ascend; float subtraction and, for ``alpha >= 0``, multiplication are
  monotone), so the entries that go before the other queue's head form a prefix, found by bisection and
  passed on as one lazy slice (``islice``: no copy, as a run is often consumed only in part). Per request only
  C code runs (``map``, ``chain``); Python work is per run.
  A negative alpha reverses the rotary order of ``x``: then the plain element-wise merge is used.
  """
  if alpha < 0:
    return _lvf_merge_pairwise(waiting, rotary, now, alpha)
  return itertools.chain.from_iterable(_lvf_runs(waiting, rotary, now, alpha))


def _lvf_runs(waiting: list, rotary: list, now: float, alpha: float) -> Iterator:
  """``_lvf_merge``'s runs (``alpha >= 0``): iterables of requests, alternately from each queue."""
  nw = len(waiting)
  nr = len(rotary)
  i = j = 0
  bisect_left = bisect.bisect_left
  islice = itertools.islice  # runs are lazy views of the lists (no copy: a run is often consumed only in part)
  while i < nw and j < nr:
    xw = now - waiting[i][0][0]
    # Rotary entries that go before waiting[i]: those with alpha * (now - key) > xw (a prefix from j).
    k = bisect_left(rotary, True, j, nr, key=lambda e: not alpha * (now - e[0][0]) > xw)
    if k > j:
      yield map(_REQ, islice(rotary, j, k))
      j = k
      if j == nr:
        break
    xr = alpha * (now - rotary[j][0][0])
    # Waiting entries that go before rotary[j]: those with not xr > now - key (a prefix from i, >= 1 long).
    k = bisect_left(waiting, True, i + 1, nw, key=lambda e: xr > now - e[0][0])
    yield map(_REQ, islice(waiting, i, k))
    i = k
  if i < nw:
    yield map(_REQ, islice(waiting, i, None))
  if j < nr:
    yield map(_REQ, islice(rotary, j, None))


_REQ = operator.itemgetter(2)  # a queue entry's request


def _lvf_merge_pairwise(waiting: list, rotary: list, now: float, alpha: float) -> Iterator[Request]:
  """``_lvf_merge`` one entry at a time (any alpha): compares the two heads' ``x``, yields the larger."""
  nw = len(waiting)
  nr = len(rotary)
  i = j = 0
  if nw and nr:
    xw = now - waiting[0][0][0]
    xr = alpha * (now - rotary[0][0][0])
    while True:
      if xr > xw:
        yield rotary[j][2]
        j += 1
        if j == nr:
          break
        xr = alpha * (now - rotary[j][0][0])
      else:
        yield waiting[i][2]
        i += 1
        if i == nw:
          break
        xw = now - waiting[i][0][0]
  while i < nw:
    yield waiting[i][2]
    i += 1
  while j < nr:
    yield rotary[j][2]
    j += 1


POLICIES = {p.name: p for p in (FCFS, FCFSSwap, WaitingFirst, SwappedFirst, RotaSched, RotaSchedStrict,
                                 RotaSchedCode, EDF)}


def make_policy(name: str) -> Policy:
  try:
    return POLICIES[name]()
  except KeyError:
    raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
