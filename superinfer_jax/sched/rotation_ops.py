"""Proactive rotation building blocks: which running requests may rotate out, the B_xfer caps, rotating
victims out (with host-mirror reclaim when the host pool is full). Mixed into ``Scheduler``
(``scheduler.py``); a victim moves RUNNING -> ROTARY through one batched block-manager call per step.
"""
from __future__ import annotations

from superinfer_jax.sched.request import Request, RequestState

RUNNING = RequestState.RUNNING
ROTARY = RequestState.ROTARY


class RotationOpsMixin:
  """Rotation-out building blocks of ``Scheduler`` (see the module docstring)."""

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
