"""Algorithm 1 (``RotationPolicy``: prioritize -> pick_victims -> execute) and its policies: rotasched (VLT),
rotasched_strict, edf. See ``policies/__init__.py`` for the algorithm as implemented."""
from __future__ import annotations

import heapq
import itertools

from superinfer_jax.sched.policies.base import ROTARY, Policy
from superinfer_jax.sched.policies.lvf import _lvf_merge
from superinfer_jax.sched.request import Request
from superinfer_jax.sched.vlt import rotary_ref_time
from superinfer_jax.kv.layout import blocks_for


class RotationPolicy(Policy):
  """Algorithm 1 (docs/paper.md §2.1) with a policy-defined candidate order (see the module docstring)."""
  name = "rotation"
  reactive_mode = "swap"
  uses_running_needs = True

  def preempted_key(self, r, config):
    return self.waiting_key(r, config)  # a recompute-preempted request is ranked as a waiting one

  def urgent(self, r: Request, now: float) -> bool:
    return True  # VLT >= 0 holds for every waiting / rotary request (ReLU)

  def victim_ok(self, r: Request, now: float) -> bool:
    return now - r.state_time > 0  # VLT(r) = -(now - t_run) < 0

  def schedule_step(self, step):
    """Algorithm 1, one step: contention check, prioritize (R), pick victims (P), execute."""
    bx = step.config.proactive_swap_budget
    grow, run_tokens = step.running_needs()
    b_hbm = step.bm.num_free_device_blocks - grow
    if b_hbm >= step.demand_blocks or bx == 0:
      self.schedule_without_rotation(step)
      return
    step.mark_contention()
    R, b_used = self.prioritize(step, b_hbm, step.budget_left() - run_tokens)
    victims = self.pick_victims(step, b_swap=b_used - b_hbm, seats=len(R) - step.seats_left())
    self.execute(step, victims, R)

  def schedule_without_rotation(self, step) -> None:
    """Step 1's fallback (no contention, or B_xfer = 0): running requests, then admission in policy order."""
    bx = step.config.proactive_swap_budget
    step.schedule_running(self.reactive_mode, swap_cap=bx)
    for r in self.candidates(step):
      if step.budget_left() <= 0 or step.seats_left() <= 0:
        break
      if not step.admit(r, cap=bx):
        break

  def prioritize(self, step, b_hbm: int, tokens: int) -> tuple[list[Request], int]:
    """Step 2: scan candidates in priority order and build R. Returns (R, blocks R needs).

    A candidate joins when it is urgent and ``blk(r)`` fits ``B_HBM + B_xfer`` (non-urgent: ``B_HBM``), its
    swap-in fits the B_xfer in-budget, and tokens and seats remain. Hot loop: request fields are read inline.
    """
    cfg = step.config
    bs = step.bm.block_size
    bx = cfg.proactive_swap_budget
    now = step.now
    step_id = step.step_id
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
    for r in itertools.islice(self.scan_candidates(step), cfg.lvf_scan_limit):
      if r.touched_step == step_id or r.inflight_samples:
        continue
      blk = r.queued_demand  # blocks_for(planned_tokens), kept by the queues (inflight_samples is 0 here)
      if b_used + blk > (b_all if urgent is None or urgent(r, now) else b_hbm):
        skips += 1
        if skips >= max_skips:
          break
        continue
      if r.state is ROTARY:
        # bm.blocks_to_swap_in(r.req_id): a rotary request's host blocks cover exactly its computed tokens.
        nin = (r.num_computed_tokens + bs - 1) // bs  # blocks_for, inline
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

  def pick_victims(self, step, b_swap: int, seats: int) -> list[Request]:
    """Step 3: running requests to rotate out, from the tail of L (longest-running first), while R still
    needs ``b_swap`` blocks or ``seats`` seats. A victim has VLT < 0, is rotatable (decode phase, sampled
    since it last entered RUNNING, not about to finish), has been resident ``min_residency`` steps, has been
    rotated out fewer than ``max_rotations_per_request`` times (when set), and its D2H copies fit the B_xfer
    out-budget."""
    if b_swap <= 0 and seats <= 0:
      return []
    bm = step.bm
    bs = bm.block_size
    cfg = step.config
    bx = cfg.proactive_swap_budget
    now = step.now
    step_id = step.step_id
    min_residency = cfg.min_residency
    max_rot = cfg.max_rotations_per_request
    victims = []
    out_copies = 0
    victim_ok = None if type(self).victim_ok is RotationPolicy.victim_ok else self.victim_ok
    copies_of = bm.swap_out_copies
    # The out-budget check needs each victim's D2H copies only if they could add up to more than bx. A
    # swap-out copies the request's full dirty blocks, which are queued for write-back, plus at most its
    # tail block, so any set of victims copies at most pending_writebacks() + its size: when that bound
    # fits, every check passes and the copies are not counted.
    exact = bm.pending_writebacks() + len(step.running) > bx
    for v in step.running.values():
      if b_swap <= 0 and seats <= 0:
        break
      if victim_ok is None:
        if not now - v.state_time > 0:  # RotationPolicy.victim_ok: VLT(v) < 0
          continue
      elif not victim_ok(v, now):
        continue
      if not v.rotatable(step_id) or (min_residency and v.resident_for(step_id) < min_residency):
        continue
      if max_rot is not None and v.num_rotations >= max_rot:
        continue
      if exact:
        copies = copies_of(v.req_id)
        if not (out_copies + copies <= bx or out_copies == 0):
          continue
        out_copies += copies
      victims.append(v)
      b_swap -= blocks_for(v.num_computed_tokens, bs)  # bm.num_blocks(rid): running => all computed
      seats -= 1
    return victims

  def execute(self, step, victims: list[Request], R: list[Request]) -> None:
    """Step 4: rotate P out, schedule running requests (reactive eviction = rotation if allowed, else
    recompute), then admit R in order, skipping those that do not fit."""
    cfg = step.config
    bx = cfg.proactive_swap_budget
    # pick_victims checked rotatable(v) in this step; a victim the host pool cannot take stays running, or
    # falls back to recompute (opt-in; see SchedulerConfig).
    step.rotate_out_many(victims, recompute_if_full=cfg.proactive_recompute)
    step.schedule_running(self.reactive_mode, swap_cap=bx)
    step.admit_in_order(R, cap=bx, prechecked=True)  # R: prioritize's, checked in this step


class RotaSched(RotationPolicy):
  """Largest-VLT-First. Queue keys are the VLT "zero points": VLT = ReLU(now - key) (x alpha for rotary)."""
  name = "rotasched"

  def waiting_key(self, r, config):
    sf = r.ttft_slo if r.ttft_slo is not None else config.ttft_slo
    return (r.arrival_time + config.beta_f * sf,)

  def rotary_key(self, r, config):
    return self.rotary_keys((r,), config)[0]

  def rotary_keys(self, rs, config):
    # (rotary_ref_time(r) + beta_b * S_B,) per request, inline: victims are keyed in one pass per step.
    cfg = config
    beta_b = cfg.beta_b
    tbt_slo = cfg.tbt_slo
    return [((r.last_token_time if r.last_token_time is not None else r.state_time)
             + beta_b * (r.tbt_slo if r.tbt_slo is not None else tbt_slo),) for r in rs]

  def candidates(self, step):
    return _lvf_merge(step.waiting.entries(), step.rotary.entries(), step.now, step.config.alpha)

  def scan_candidates(self, step):
    return _lvf_merge(step.waiting.view(), step.rotary.view(), step.now, step.config.alpha)


class RotaSchedStrict(RotaSched):
  """RotaSched that rotates only for requests that really lag (beyond the paper's Algorithm 1 as read).

  Algorithm 1 prioritises every candidate with VLT >= 0, which the ReLU makes true for all waiting and
  rotary requests, so under contention a running request is displaced after a single token. The paper's own [P] wording is "largest *positive* VLT": here only a
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

  def waiting_key(self, r, config):
    sf = r.ttft_slo if r.ttft_slo is not None else config.ttft_slo
    return (r.arrival_time + sf,)

  def rotary_key(self, r, config):
    sb = r.tbt_slo if r.tbt_slo is not None else config.tbt_slo
    return (rotary_ref_time(r) + sb,)

  def candidates(self, step):
    merged = heapq.merge(step.waiting.entries(), step.rotary.entries(), key=lambda e: e[0])
    return (e[2] for e in merged)

  def urgent(self, r, now):
    k = r.queue_key
    return k is not None and k[0] <= now
