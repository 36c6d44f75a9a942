"""``rotasched_code``: the reference code's rotation behaviour (docs/paper.md §2.2)."""
from __future__ import annotations

import heapq

from superinfer_jax.sched.policies.base import ROTARY, WAITING, Policy


class RotaSchedCode(Policy):
  """The reference code's per-step algorithm (docs/paper.md §2.2), for comparison with ``rotasched``."""
  name = "rotasched_code"
  uses_running_needs = True

  def waiting_key(self, r, config):
    return (r.state_time,)  # in_waiting_since: arrival, or the time it was preempted

  def preempted_key(self, r, config):
    return (r.state_time,)  # the fork appends preempted requests to the tail

  def rotary_key(self, r, config):
    return (r.state_time,)  # in_waiting_since = the rotation time

  def candidates(self, step):
    merged = heapq.merge(step.waiting.entries(), step.rotary.entries(), key=lambda e: e[0])
    return (e[2] for e in merged)

  def schedule_step(self, step):
    cfg = step.config
    bm = step.bm
    b = cfg.proactive_swap_budget
    rotated = False
    if b > 0:
      grow, _ = step.running_needs()
      if bm.num_free_device_blocks < grow + step.demand_blocks:  # not can_hold_all
        step.mark_contention()
        if bm.host_usage() < cfg.code_swap_host_gate and bm.num_free_device_blocks < b:
          acc = 0
          victims = []
          for v in step.running.values():  # longest running first
            if not (step.rotatable(v) and step.resident_long_enough(v)):
              continue
            n = bm.num_blocks(v.req_id)
            if acc + n >= b:
              break
            acc += n
            victims.append(v)
          for v in victims:
            rotated |= step.rotate_out(v)  # host full: it stays running
    evicted = step.schedule_running("recompute")
    if evicted and not rotated:
      return
    # Admission over waiting + rotary by in_waiting_since; this step's victims sort last (their key is now)
    # and may be swapped straight back in if room is left, as the fork's admission loop does.
    for r in self.candidates(step):
      if step.budget_left() <= 0 or step.seats_left() <= 0:
        break
      if r.state is ROTARY:
        if not step.swap_in(r, round_trip=True):
          break
        continue
      if r.state is WAITING and bm.num_host_blocks and bm.host_usage() > cfg.code_admit_host_gate:
        continue  # protect the DRAM pool: fresh (not preempted) requests wait
      if not step.admit_waiting(r):
        break
