"""Policies without proactive rotation by lag: fcfs, fcfs_swap, sf (vLLM v1 / v0 baselines) and wf (a static
priority waiting > running > rotary). See ``policies/__init__.py`` for each one's behaviour."""
from __future__ import annotations

import itertools

from superinfer_jax.sched.policies.base import Policy
from superinfer_jax.sched.request import Request
from superinfer_jax.kv.layout import blocks_for


class FCFS(Policy):
  """vLLM v1: arrival order, reactive recompute preemption of the last admitted, head-of-line blocking."""
  name = "fcfs"
  uses_host_pool = False

  def schedule_step(self, step):
    evicted = step.schedule_running(self.reactive_mode)
    if evicted:
      return
    for r in self.candidates(step):
      if step.budget_left() <= 0 or step.seats_left() <= 0:
        break
      if not step.admit(r):
        break


class FCFSSwap(FCFS):
  """vLLM v1 with swap preemption: reactive victims go to host and re-queue at the head (LIFO, as fcfs's
  recompute victims do); swapped requests resume before new ones; no admission in a step that evicted."""
  name = "fcfs_swap"
  reactive_mode = "swap"
  uses_host_pool = True

  def rotary_key(self, r, config):
    self._head_counter += 1
    return (-self._head_counter,)  # the latest victim at the head

  def candidates(self, step):
    return itertools.chain(step.rotary.iter_requests(), step.waiting.iter_requests())


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

  def schedule_step(self, step):
    if step.schedule_running(self.reactive_mode):
      return  # v0: no swap-in in a step that evicted
    for r in step.rotary.iter_requests():
      if step.budget_left() <= 0 or step.seats_left() <= 0 or not step.swap_in(r):
        return
    if step.rotary:
      return  # v0: no new prefill while any request is swapped out
    for r in step.waiting.iter_requests():
      if step.budget_left() <= 0 or step.seats_left() <= 0 or not step.admit_waiting(r):
        return


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

  def waiting_key(self, r, config):
    return (r.arrival_time,)

  def preempted_key(self, r, config):
    return self.waiting_key(r, config)

  def rotary_key(self, r, config):
    return (r.state_time,)

  def candidates(self, step):
    return itertools.chain(step.waiting.iter_requests(), step.rotary.iter_requests())

  def schedule_step(self, step):
    if step.waiting:
      grow, run_tokens = step.running_needs()
      free = step.bm.num_free_device_blocks - grow
      contended = free < step.demand_blocks
      if contended:
        step.mark_contention()
      if contended or step.seats_left() < len(step.waiting):  # else every waiting request fits
        victims = self.pick_victims(step, free, step.budget_left() - run_tokens)
        if victims:
          step.rotate_out_many(victims)
    evicted = step.schedule_running(self.reactive_mode)
    if evicted:
      return
    for r in step.waiting.iter_requests():
      if step.budget_left() <= 0 or step.seats_left() <= 0 or not step.admit_waiting(r):
        return
    if step.waiting:
      return
    for r in step.rotary.iter_requests():
      if step.budget_left() <= 0 or step.seats_left() <= 0:
        return
      step.swap_in(r)

  def pick_victims(self, step, free: int, tokens: int) -> list[Request]:
    """Running requests to rotate out so that the waiting requests this step can take fit ``free`` device
    blocks: latest arrival first, rotatable ones only (decode phase, sampled since they last entered
    RUNNING)."""
    bs = step.bm.block_size
    seats = step.seats_left()
    pool = sorted((v for v in step.running.values() if step.rotatable(v)), key=lambda v: -v.arrival_time)
    held = [blocks_for(v.num_computed_tokens, bs) for v in pool]  # running: blocks cover the computed tokens
    left = sum(held)
    victims = []
    i = 0
    for r in step.waiting.iter_requests():
      if tokens <= 0 or r.touched_step == step.step_id or r.inflight_samples:
        break
      c = r.num_computed_tokens
      n = min(r.planned_tokens - c, tokens)
      need = blocks_for(c + n, bs) - blocks_for(c, bs)
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
