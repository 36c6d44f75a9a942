"""``StepBuilder``: one scheduling step under construction, the only surface a policy acts through.

``Scheduler.schedule()`` creates one per call, hands it to ``policy.schedule_step(step)`` and then calls
``step.finalize()``; nothing of it outlives the call. It holds the plan being built (private: a policy never
writes a plan field), the step's token budget, the D2H / H2D volume moved so far (the B_xfer caps), the
swap-in batches still to mark in the block manager, and whether the running loop was cut short by the budget.

What a policy sees (everything else is private):
  * reads: ``config``, ``now`` (the clock reading of the plan), ``step_id``, ``bm`` (the block manager, for
    capacity queries only: a policy never mutates it), ``running`` (a read-only mapping id -> ``Request`` in
    admission order), ``waiting`` / ``rotary`` (``queue.QueueView``: the pending queues head first),
    ``demand_blocks`` (device blocks every waiting + rotary request would need), ``budget_left()``,
    ``seats_left()``, ``running_needs()``, ``rotatable(r)``, ``resident_long_enough(r)``, ``out_fits`` (the
    B_xfer out-cap);
  * operations, in the order a step takes them: ``mark_contention()``; proactive rotation ``rotate_out(r)`` /
    ``rotate_out_many(victims)``; the running set ``schedule_running(reactive_mode, swap_cap)`` (with
    reactive ``evict`` / ``preempt``); admission ``swap_in(r)``, ``admit_waiting(r)``, ``admit(r)``,
    ``admit_in_order(rs)``. Each either does everything or returns False / 0 and changes nothing.

Request state changes go through ``request.py``'s transitions, queue placement through ``pending.py``, block
movements through the block manager; this module decides when. The batched forms (``rotate_out_many``,
``admit_in_order``) decide exactly as one call per request would and move a step's rotations through one
block-manager call per run (the hot path under rotation: ``scripts/bench_scheduler.py``). Ordering contract of
the copy lists: ``kv/block_manager.py``. Pure Python, no JAX.
"""
from __future__ import annotations

from superinfer_jax.sched.plan import ScheduledSeq, StepPlan
from superinfer_jax.sched.request import (Request, RequestState, record_scheduled, rotate_in_all,
                                          rotate_out_all)

RUNNING = RequestState.RUNNING
ROTARY = RequestState.ROTARY


class StepBuilder:
  """One step being planned (module docstring). Built by ``Scheduler.schedule`` only."""

  def __init__(self, sched, plan: StepPlan, count_needs: bool):
    """``sched``: the ``Scheduler`` whose containers (running set, pending queues, live requests) this step
    changes; ``count_needs``: keep ``running_needs()``'s totals for the next step (``next_need``)."""
    self.config = sched.config
    self.bm = sched.bm
    self.now = plan.time
    self.step_id = plan.step_id
    self.running = sched.running_view
    self.waiting = sched.pending.waiting_view
    self.rotary = sched.pending.rotary_view
    self._plan = plan
    self._running = sched.running
    self._pending = sched.pending
    self._requests = sched.requests
    self._need = sched.running_need  # (blocks, tokens) the running set needs, kept by the last finalize
    self._count_needs = count_needs
    self._budget = sched.config.max_num_batched_tokens
    self._out_moved = 0  # D2H pairs of this step's swap-outs
    self._in_moved = 0  # H2D pairs of this step's swap-ins
    self._running_cut = False  # the running loop stopped at the token budget
    # swap-in batches: (index of the first in plan.scheduled, their ids, the requests), marked by finalize
    self._swapins: list[tuple[int, list, list[Request]]] = []
    self._swapin_need = [0, 0]  # (blocks, tokens) the swapped-in requests need next step
    self.next_need: tuple[int, int] | None = None  # finalize's running_needs() total for the next step

  # --------------------------------------------------------------------------------------------- reads
  @property
  def demand_blocks(self) -> int:
    return self._pending.demand

  def budget_left(self) -> int:
    return self._budget

  def seats_left(self) -> int:
    return self.config.max_num_seqs - len(self._running)

  def rotatable(self, r: Request) -> bool:
    """``r.rotatable(step_id)``: it may be rotated out in this step (``Request.rotatable``)."""
    return r.rotatable(self.step_id)

  def resident_long_enough(self, r: Request) -> bool:
    """``min_residency``: a proactive victim must have been RUNNING for that many steps (0: always)."""
    return r.resident_for(self.step_id) >= self.config.min_residency

  def out_fits(self, copies: int, cap: int | None) -> bool:
    """``copies`` more D2H pairs fit the cap (the first swap-out of a step always fits: a request larger than
    B_xfer may move alone)."""
    return cap is None or self._out_moved + copies <= cap or self._out_moved == 0

  def running_needs(self) -> tuple[int, int]:
    """(device blocks, tokens) the running requests need this step, in admission order under the token budget.

    At the start of a step (nothing planned yet) this is the total the last ``finalize`` kept when it fits
    the budget (policies with ``uses_running_needs``); otherwise one pass over the running requests, the
    definition (``need_of`` per request, cut at the budget).
    """
    need = self._need
    plan = self._plan
    if (need is not None and need[1] <= self._budget and not plan.scheduled and not plan.rotated_out
        and not plan.preempted):
      return need
    budget = self._budget
    blocks = 0
    bs = self.bm.block_size
    for r in self._running.values():
      if budget <= 0:
        break
      gen = r.num_generated + r.inflight_samples
      c = r.num_computed_tokens
      rem = r.prompt_len + gen - c
      if rem <= 0 or gen >= r.max_tokens:
        continue
      n = rem if rem < budget else budget
      # Resident: the manager covers exactly num_computed_tokens slots (blocks_for(c + n) - blocks_for(c), inline).
      blocks += (c + n + bs - 1) // bs - (c + bs - 1) // bs
      budget -= n
    return blocks, self._budget - budget

  # ------------------------------------------------------------------------------ contention, preemption
  def mark_contention(self) -> None:
    """The step runs under memory contention (rotation was considered): ``StepPlan.contention``."""
    self._plan.contention = True

  def preempt(self, r: Request) -> None:
    """Running -> PREEMPTED: drop the KV (recompute later), re-queued as the policy places preempted ones."""
    self.bm.free(r.req_id)
    del self._running[r.req_id]
    r.preempt(self.step_id, self.now)
    self._plan.preempted.append(r.req_id)
    self._pending.enqueue_waiting(r, preempted=True)

  def evict(self, r: Request, mode: str, swap_cap: int | None = None) -> str:
    """Evicts a running request: rotate out if ``mode == "swap"`` and allowed, else recompute preemption."""
    if mode == "swap" and r.rotatable(self.step_id):  # mid-prefill victims are recomputed, never rotated
      if swap_cap is None or self.out_fits(self.bm.swap_out_copies(r.req_id), swap_cap):
        if self.rotate_out(r):
          return "swap"
    self.preempt(r)
    return "recompute"

  # -------------------------------------------------------------------------------------- running set
  def schedule_running(self, reactive_mode: str = "recompute", swap_cap: int | None = None) -> bool:
    """Give running requests their tokens in admission order (chunked prefill under the token budget); when
    one cannot grow, evict the last-admitted one. Returns True if any reactive eviction happened.
    ``reactive_mode`` is "recompute" or "swap" (swap falls back to recompute for mid-prefill victims, when
    ``swap_cap`` would be exceeded, or when the host pool is full)."""
    bm = self.bm
    append_slots = bm.append_slots
    block_table = bm.block_table
    emit = self._plan.scheduled.append
    step = self.step_id
    evicted = False
    budget = self._budget  # kept local in the loop (evictions do not touch it); stored back below
    for r in list(self._running.values()):
      if r.state is not RUNNING or r.touched_step == step:
        continue  # evicted in this loop, or admitted/rotated in this step (already scheduled)
      if budget <= 0:
        self._running_cut = True  # requests after this one keep their need unscheduled
        break
      gen = r.num_generated + r.inflight_samples
      rem = r.prompt_len + gen - r.num_computed_tokens
      if rem <= 0 or gen >= r.max_tokens:  # nothing to compute, or in-flight samples reach max_tokens
        continue
      n = rem if rem < budget else budget
      rid = r.req_id
      while not append_slots(rid, n):
        victim = self._reactive_victim(r, reactive_mode, swap_cap)
        self.evict(victim, reactive_mode, swap_cap)
        evicted = True
        if victim is r:
          break
      else:
        emit(ScheduledSeq(rid, n, r.num_computed_tokens, block_table(rid), n == rem))
        budget -= n
    self._budget = budget
    return evicted

  def _reactive_victim(self, r: Request, mode: str, swap_cap: int | None) -> Request:
    """The last-admitted running request; in swap mode, the last-admitted one that can be rotated (not yet
    scheduled this step, decode phase, copies within ``swap_cap``), so that KV is parked rather than dropped."""
    step = self.step_id
    last = next(reversed(self._running.values()))
    if mode != "swap" or (last.rotatable(step) and last is not r):
      return last
    for v in reversed(self._running.values()):
      if v is r:
        break  # requests before r were scheduled already this step
      if v.rotatable(step) and self.out_fits(self.bm.swap_out_copies(v.req_id), swap_cap):
        return v
    return last

  # ----------------------------------------------------------------------------------- rotation out
  def rotate_out(self, r: Request) -> bool:
    """Running -> ROTARY (KV to host). False (no change) if the host pool lacks room."""
    if not r.rotatable(self.step_id):
      raise RuntimeError(f"rotate_out: {r!r} is not rotatable in step {self.step_id}")
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
    """Bookkeeping of requests just swapped out (``moved`` D2H pairs in all; ``rids``: their ids)."""
    running = self._running
    for rid in rids:
      del running[rid]
    plan = self._plan
    plan.residency_steps += rotate_out_all(rs, self.step_id, self.now)
    self._pending.enqueue_rotary_many(rs)  # keyed after the state change
    plan.rotated_out += rids
    self._out_moved += moved

  def _reclaim_host_mirrors(self, need: int, keep: Request) -> bool:
    """Frees host blocks held by clean mirrors of running requests (most recently admitted first) until
    ``need`` are free. Mirrors are redundant copies, so nothing is lost; requests moved in this step are
    skipped (their host blocks are this step's H2D sources: ordering contract 3). True if enough are free."""
    bm = self.bm
    if need > bm.num_free_host_blocks + bm.reclaimable_host_blocks():
      return False
    for v in reversed(self._running.values()):
      if bm.num_free_host_blocks >= need:
        break
      if v is keep or v.touched_step == self.step_id:
        continue
      bm.drop_host_mirrors(v.req_id)
    return bm.num_free_host_blocks >= need

  # ------------------------------------------------------------------------------------- admission
  def admit(self, r: Request, cap: int | None = None) -> bool:
    """``swap_in(r, cap)`` for a rotary request, else ``admit_waiting(r)``."""
    if r.state is ROTARY:
      return self.swap_in(r, cap)
    return self.admit_waiting(r)

  def swap_in(self, r: Request, cap: int | None = None, round_trip: bool = False) -> bool:
    """ROTARY -> RUNNING and schedule its pending token. False (no change) if it does not fit now.

    A request rotated out in this step comes back in it only with ``round_trip=True`` (``rotasched_code``:
    the reference fork's admission loop may swap a victim straight back in). Its host copy is then this
    step's D2H destination and H2D source at once; the plan lists it in ``round_trips`` and the engine
    issues the step's D2H copies before its H2D copies (block manager ordering contract 3).
    """
    if r.state is not ROTARY:
      raise RuntimeError(f"swap_in: {r!r} is not rotary")
    return self.admit_in_order((r,), cap, round_trip) == 1

  def admit_waiting(self, r: Request) -> bool:
    """WAITING/PREEMPTED -> RUNNING with a prefill chunk. False (no change) if it does not fit now."""
    if r.touched_step == self.step_id or r.inflight_samples:
      return False
    if r.block_hashes is not None and self.config.enable_prefix_caching:
      return self._admit_cached(r)
    rem = r.planned_tokens - r.num_computed_tokens
    budget = self._budget
    n = rem if rem < budget else budget
    if n <= 0 or len(self._running) >= self.config.max_num_seqs:
      return False
    rid = r.req_id
    if not self.bm.append_slots(rid, n):
      return False
    self._admitted(r, n, rem, 0)
    return True

  def _admit_cached(self, r: Request) -> bool:
    """``admit_waiting`` for a request taking part in prefix caching: its longest cached prefix in whole
    blocks, at most up to its last known token (that one is always computed), comes from the device (shared,
    no copy) and then from host (loaded by H2D pairs in the plan's ``swap_in`` when ``loads_host_prefix``
    says so); the prefill chunk starts after it, and the device blocks checked are only those it really
    takes (``BlockManager.allocate_prefix``)."""
    budget = self._budget
    if budget <= 0 or len(self._running) >= self.config.max_num_seqs:
      return False
    bm = self.bm
    bs = bm.block_size
    planned = r.planned_tokens
    hashes = r.block_hashes
    dev, host = bm.lookup_prefix(hashes, (planned - 1) // bs)
    if host and not self.config.loads_host_prefix(bs):
      host = 0
    c = (dev + host) * bs
    rem = planned - c
    n = rem if rem < budget else budget
    plan = self._plan
    if not bm.allocate_prefix(r.req_id, hashes, dev, host, c + n, plan.swap_in):
      return False
    if r.num_cached_tokens is None:  # its first admission: hits across requests
      plan.prefix_queried += len(hashes)
      plan.prefix_device_hits += dev
      plan.prefix_host_hits += host
    else:
      plan.prefix_rehits += dev + host
    self._in_moved += host
    self._admitted(r, n, rem, c)
    return True

  def _admitted(self, r: Request, n: int, rem: int, cached: int) -> None:
    """Bookkeeping of a waiting request the block manager just took: out of its queue, RUNNING, its prefill
    chunk of ``n`` of its ``rem`` remaining tokens scheduled after ``cached`` cached tokens."""
    rid = r.req_id
    budget = self._budget
    self._pending.dequeue(r)
    self._plan.admitted.append(rid)
    r.admit(self.step_id, self.now, cached)
    self._running[rid] = r
    self._plan.scheduled.append(ScheduledSeq(rid, n, r.num_computed_tokens, self.bm.block_table(rid),
                                             n == rem))
    self._budget = budget - n

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
    step = self.step_id
    bs = self.bm.block_size
    max_seqs = self.config.max_num_seqs
    running = self._running
    budget = self._budget  # at the start of the current batch; each swap-in takes one token and one seat
    room = min(budget, max_seqs - len(running))  # minus len(batch): tokens and seats both remain
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
        room = min(budget, max_seqs - len(running))
        free = self.bm.num_free_device_blocks
        in_moved = self._in_moved
        continue
      if prechecked:
        need, nblk = r.queued_demand, 0  # device blocks for the computed tokens plus the pending slot
      else:
        if r.touched_step == step:  # moved earlier in this step: back only as a round trip
          if not (round_trip and r.out_step == step):
            continue
        elif r.inflight_samples:
          continue
        c = r.num_computed_tokens
        nblk = (c + bs - 1) // bs  # bm.blocks_to_swap_in(rid) (blocks_for, inline)
        if cap is not None and in_moved and in_moved + nblk > cap:  # the in-cap (the first swap-in always fits)
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
    token budget after them. ``round_trip``: ``batch`` may hold requests rotated out in this step.
    ``finalize`` marks their tokens in the block manager at their place in plan order (after the
    write-backs: ordering contract 2)."""
    plan = self._plan
    rids = [r.req_id for r in batch]
    pairs_before = len(plan.swap_in)
    tables = self.bm.swap_in_many(rids, 1, plan.swap_in)
    assert len(tables) == len(batch)
    self._pending.rotary.remove_many(batch)
    step = self.step_id
    if round_trip:
      plan.round_trips += [r.req_id for r in batch if r.out_step == step]  # rotated out in this step
    scheduled = plan.scheduled
    self._swapins.append((len(scheduled), rids, batch))
    scheduled += [ScheduledSeq(r.req_id, 1, r.num_computed_tokens, table, True)
                  for r, table in zip(batch, tables)]
    self._running.update(zip(rids, batch))
    need_blk, need_tok = rotate_in_all(batch, step, self.now, self.bm.block_size, self._count_needs)
    sn = self._swapin_need
    sn[0] += need_blk
    sn[1] += need_tok
    plan.rotated_in += rids
    self._budget = budget
    self._in_moved += len(plan.swap_in) - pairs_before

  # -------------------------------------------------------------------------------------- finalize
  def finalize(self, writeback_reserve: int | None) -> StepPlan:
    """Ends the step: takes the eager write-back pairs (``writeback_reserve`` host blocks left free; None:
    no write-back), then marks every scheduled chunk computed in the block manager in plan order (ordering
    contract 2) and advances the requests' token accounting. Sets ``next_need`` (the running set's need
    next step, or None when unknown) and ``plan.num_batched_tokens``; returns the plan."""
    plan = self._plan
    bm = self.bm
    if writeback_reserve is not None:
      plan.writeback = bm.take_writebacks(self.config.max_writeback_blocks, writeback_reserve)
    reqs = self._requests
    mark = bm.mark_computed
    count = self._count_needs
    bs = bm.block_size
    scheduled = plan.scheduled
    total = need_blk = need_tok = 0
    pos = 0
    # The swap-in batches (spans of ``scheduled`` whose requests' fields are already at their end-of-step
    # values) are marked with one block-manager call each; the other seqs one by one. Both in plan order.
    for start, rids, _ in (*self._swapins, (len(scheduled), None, None)):
      seqs = scheduled[pos:start] if pos or start < len(scheduled) else scheduled
      tok, blk, ntok = record_scheduled(reqs, seqs, bs, count, mark)
      total += tok
      need_blk += blk
      need_tok += ntok
      if rids is None:
        break
      bm.mark_computed_next(rids)
      total += len(rids)
      pos = start + len(rids)
    if count:
      sn = self._swapin_need
      self.next_need = None if self._running_cut else (need_blk + sn[0], need_tok + sn[1])
    plan.num_batched_tokens = total
    return plan
