"""Admission building blocks: swapping rotary requests back in and admitting waiting ones, within the token
budget, free device blocks, ``max_num_seqs`` and the swap-in cap. Mixed into ``Scheduler``
(``scheduler.py``); batched forms decide exactly as one call per request would.
"""
from __future__ import annotations

from superinfer_jax.sched.plan import ScheduledSeq
from superinfer_jax.sched.request import Request, RequestState

RUNNING = RequestState.RUNNING
WAITING = RequestState.WAITING
ROTARY = RequestState.ROTARY
PREEMPTED = RequestState.PREEMPTED


class AdmissionMixin:
  """Admission building blocks of ``Scheduler`` (see the module docstring)."""

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
        need, nblk = r._demand, 0  # device blocks for the computed tokens plus the pending slot (blocks_for)
      else:
        if not self._swap_in_ready(r, step, round_trip):
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

  @staticmethod
  def _swap_in_ready(r: Request, step: int, round_trip: bool) -> bool:
    """A rotary request may swap in at ``step``: untouched in it (or, with ``round_trip``, rotated out in it)
    and with nothing in flight."""
    if r._touched_step == step:  # moved earlier in this step (rotated out in it: _out_step == step too)
      return round_trip and r._out_step == step
    return not r.inflight_samples

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
