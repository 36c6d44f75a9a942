"""The discrete-event loop: the real ``Scheduler`` and ``BlockManager`` on a ``VirtualClock``, a cost model
for each step's duration, the same per-request timelines as the real engine's replay.

Nothing here decides anything: every plan comes from ``Scheduler.schedule`` and every finish from
``Scheduler.on_step_done`` (lengths only: ``new_tokens=None``), called in the order ``LLMEngine`` calls them
(``engine/step_loop.py``, the engine's one caller of the scheduler), and this module only adds up time.

Time. The clock is the host's: plans are made, and state changes stamped, at its reading; a step's tokens
are stamped when the step ends (the engine stamps them at read-back). With ``pipeline`` off, one iteration
is ``schedule()`` -> copies (``X`` s) -> model step (``C`` s) -> ``on_step_done`` at ``t + X + C``. With
``pipeline`` on, one iteration is one ``StepLoop._step_pipelined`` call: with step k in flight (dispatched,
ending at ``end_k``), plan k+1 with ``schedule(lookahead=True)`` at the host's time and start its copies
(on a link that is busy until the previous copies finish), advance to ``end_k``, ``on_step_done(k)``, drop
the requests that finished at k from plan k+1's batch, and dispatch k+1: it starts when both step k and its
copies are done, so only the part of the copies that exceeds the step in flight is exposed. If the pipe
is empty (first step, or a plan whose batch was dropped entirely) the iteration plans without lookahead and
dispatches, and the copies of that plan are fully exposed. A plan whose batch is empty is completed at once,
as the engine does; the host then spends ``cost.empty_step_s``. When no request is live the clock jumps to
the next arrival. Arrivals are added before each iteration (``experiment/workload_replay.py`` adds them between
``engine.step()`` calls) with their scheduled time as the arrival time; a closed-loop request (the next turn
of a conversation, ``RequestSpec.after_request_id``) arrives ``think_time_s`` after its predecessor's last token,
as in the replay (both read ``workload.closed_loop.ArrivalQueue``).

The cost model is any object with ``step_time(seqs) -> s`` (the dispatched ``ScheduledSeq``s),
``transfer_time(blocks_out, blocks_in) -> s`` (D2H = swap-out + write-back blocks) and ``empty_step_s``;
``RooflineCost`` is the real one (``cost.py`` + ``transfer.py``). No JAX.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional, Sequence

from superinfer_jax.kv.block_manager import BlockManager
from superinfer_jax.kv.prefix_hash import block_hashes
from superinfer_jax.kv.layout import KVCacheSpec
from superinfer_jax.metrics.timeline import PREEMPTED, ROTARY, RUNNING, RequestTimeline, TimelineRecorder
from superinfer_jax.sched import Request, Scheduler, VirtualClock
from superinfer_jax.sim import cost as cost_lib
from superinfer_jax.sim import transfer as transfer_lib
from superinfer_jax.util import progress_bar
from superinfer_jax.workload.closed_loop import ArrivalQueue

MAX_IDLE_PLANS = 100_000   # consecutive plans without work or tokens while requests are live -> stuck


class RooflineCost:
  """The cost model of ``cost.py`` (step roofline) and ``transfer.py`` (copies) for one run.

  Args:
    model: ``cost.ModelProfile``; hw: ``profiles.HardwareProfile`` (already with any bandwidth override);
    kv_spec: the KV layout the copies move (``KVCacheSpec``, dtype and layout included);
    transfer_mode: naive | merged | duplex; tensor_parallel_size: TP degree;
    fixed_step_s: > 0 replaces the roofline by a constant step time (transfers still modelled);
    buckets: the engine's shape buckets (``cost.Buckets.of(engine_config)``), charged instead of the real
      batch when the profile says ``pad_to_buckets`` (required then).
  """

  def __init__(self, model: cost_lib.ModelProfile, hw, kv_spec: KVCacheSpec, transfer_mode: str, *,
               tensor_parallel_size: int = 1, fixed_step_s: float = 0.0,
               buckets: Optional[cost_lib.Buckets] = None):
    if transfer_mode not in transfer_lib.MODES:
      raise ValueError(f"unknown transfer mode {transfer_mode!r}; known: {transfer_lib.MODES}")
    self.model = model
    self.hw = hw
    self.kv_spec = kv_spec
    self.transfer_mode = transfer_mode
    self.tensor_parallel_size = tensor_parallel_size
    self.fixed_step_s = fixed_step_s
    self.empty_step_s = hw.step_overhead_s if hw.step_overhead_s > 0 else 1e-4
    self.copies_overlap_compute = hw.copies_overlap_compute
    self.block_bytes = kv_spec.block_bytes
    if hw.pad_to_buckets and buckets is None:
      raise ValueError(f"hardware profile {hw.name!r} charges padded shapes (pad_to_buckets): pass the engine's "
                       "buckets")
    self.buckets = buckets if hw.pad_to_buckets else None

  def step_time(self, seqs: Sequence) -> float:
    if self.fixed_step_s > 0:
      return self.fixed_step_s
    if self.buckets is not None:
      shape = cost_lib.padded_shape(((s.num_new_tokens, s.num_computed_tokens) for s in seqs), self.buckets)
    else:
      shape = cost_lib.batch_shape(seqs)
    return cost_lib.step_time(shape, self.model, self.hw, self.tensor_parallel_size)

  def transfer_time(self, blocks_out: int, blocks_in: int) -> float:
    return transfer_lib.transfer_time(blocks_out, blocks_in, self.kv_spec, self.hw.link, self.transfer_mode)

  def prefix_rule_costs(self, batch_blocks: int = 256, chunk_tokens: int = 2048) -> tuple[float, float]:
    """The load-or-recompute rule's two sides on this hardware (``SchedulerConfig.loads_host_prefix``):
    seconds per block of an H2D load of ``batch_blocks`` blocks, and seconds per token of a prefill chunk of
    ``chunk_tokens`` tokens from an empty context (the roofline, compute-bound at that size)."""
    load = self.transfer_time(0, batch_blocks) / batch_blocks
    shape = cost_lib.pairs_shape([(chunk_tokens, 0)])
    return load, cost_lib.step_time(shape, self.model, self.hw, self.tensor_parallel_size) / chunk_tokens


@dataclasses.dataclass
class SimResult:
  """What one simulated run produced. Times are seconds on the virtual clock (starting at 0)."""
  timelines: list[RequestTimeline]
  duration_s: float                 # start -> last token (or the time limit)
  counters: dict[str, Any]
  step_times_s: list[float]         # each model step: its compute plus the copy time it waited for
  rejected: list[tuple[str, str]]   # (request id, error) refused by add_request
  wall_s: float                     # real seconds the simulation took
  timed_out: bool = False
  # Per plan, as fractions of the device pool, read right after ``schedule()``: ``occupancy`` = blocks
  # resident; ``kv_demand`` = blocks resident plus the blocks every queued (waiting / rotary) request needs.
  occupancy: list[float] = dataclasses.field(default_factory=list)
  kv_demand: list[float] = dataclasses.field(default_factory=list)


class _SimRun:
  """The mutable state of one ``Simulator.run``: the pending arrivals (sorted), the live set, the timeline
  recorder, the counters and per-plan series, the link's busy-until time and the idle-plan count. Its methods
  are the loop's named steps; ``Simulator.run`` owns the loop. Never reads the wall clock except ``wall0``."""

  def __init__(self, sim: "Simulator", requests: Sequence[Any], progress: bool, desc: str):
    self.sim, self.sched, self.clock, self.cost = sim, sim.sched, sim.clock, sim.cost
    self.wall0 = time.perf_counter()
    self.queue = ArrivalQueue(requests)   # open-loop arrivals, and closed-loop turns released by finishes
    self.t0 = self.clock.now()
    self.rec = TimelineRecorder()
    self.live: set = set()
    self.rejected: list[tuple[str, str]] = []
    self.bar = progress_bar(len(self.queue), desc, progress)
    self.c = dict(plans=0, model_steps=0, rotations_out=0, rotations_in=0, blocks_out=0, blocks_writeback=0,
                  blocks_in=0, recompute_preemptions=0, round_trips=0, contended_steps=0, kv_contended_steps=0,
                  dropped_seqs=0,
                  transfer_s=0.0, exposed_transfer_s=0.0, residency_steps=0, empty_plans=0)
    self.step_times: list[float] = []
    self.occupancy: list[float] = []
    self.kv_demand: list[float] = []
    self.pool = self.sched.stats().device_blocks
    self.link_free, self.last_token, self.idle = self.t0, self.t0, 0

  def arrivals(self, now: float) -> None:
    """Adds every request due by ``now`` (s) to the scheduler and the recorder; one the scheduler refuses
    (``ValueError``) is recorded in ``rejected`` and never goes live, nor do the requests waiting on it."""
    for spec, due_s in self.queue.due(now - self.t0):
      rid = str(spec.request_id)
      arrival = self.t0 + due_s
      self.rec.add_request(rid, arrival, spec.prompt_len, target_output_len=spec.output_len,
                           source=getattr(spec, "source", "") or "")
      hashes = self.sim.hashes_of(spec) if self.sim.hashes_of is not None else None
      try:
        self.sched.add_request(Request(rid, spec.prompt_len, spec.output_len, arrival, block_hashes=hashes))
      except ValueError as e:
        self.rejected.append((rid, str(e)))
        dropped = self.queue.dropped(rid)
        self.rejected.extend((str(d.request_id), f"never submitted: it comes after {rid}, which was refused")
                             for d in dropped)
        if self.bar is not None:
          self.bar.update(1 + len(dropped))
        continue
      self.live.add(rid)

  def planned(self, plan) -> float:
    """Bookkeeping of a fresh plan (state changes at plan time, counters, occupancy); returns its copy
    time (s), 0 when it moves no block."""
    if self.sim.plan_hook is not None:
      self.sim.plan_hook(plan)
    c, t, live, rec = self.c, plan.time, self.live, self.rec
    c["plans"] += 1
    if plan.rotated_out:
      c["rotations_out"] += len(plan.rotated_out)
      c["residency_steps"] += plan.residency_steps
      for rid in plan.rotated_out:
        if rid in live:
          rec.state(rid, t, ROTARY)
    if plan.preempted:
      c["recompute_preemptions"] += len(plan.preempted)
      for rid in plan.preempted:
        if rid in live:
          rec.state(rid, t, PREEMPTED)
    for ids in (plan.rotated_in, plan.admitted):
      for rid in ids:
        if rid in live:
          rec.state(rid, t, RUNNING)
    c["rotations_in"] += len(plan.rotated_in)
    c["round_trips"] += len(plan.round_trips)
    if plan.contention:
      c["contended_steps"] += 1
    self._record_pool()
    return self._plan_copies(plan)

  def _record_pool(self) -> None:
    """Appends the device pool's occupancy and KV demand (shares of the pool) after a plan, read from the
    scheduler's ``stats()``, counting a KV-contended step where demand exceeds the pool; nothing with an
    empty pool."""
    pool = self.pool
    if pool:
      st = self.sched.stats()
      used = pool - st.free_device_blocks
      self.occupancy.append(used / pool)
      self.kv_demand.append((used + st.demand_blocks) / pool)
      if used + st.demand_blocks > pool:
        self.c["kv_contended_steps"] += 1

  def _plan_copies(self, plan) -> float:
    """Counts ``plan``'s copies (blocks out, write-back, in) and returns their time (s) from the cost model."""
    c = self.c
    n_out = len(plan.swap_out) + len(plan.writeback)
    n_in = len(plan.swap_in)
    if not (n_out or n_in):
      return 0.0
    c["blocks_out"] += len(plan.swap_out)
    c["blocks_writeback"] += len(plan.writeback)
    c["blocks_in"] += n_in
    x = self.cost.transfer_time(n_out, n_in)
    c["transfer_s"] += x
    return x

  def completed(self, plan, seqs, t: float) -> list:
    """Step of ``plan`` (batch ``seqs``) ended at ``t``: tokens, ``on_step_done``, finishes; returns the
    finished ids. ``RuntimeError`` after ``MAX_IDLE_PLANS`` plans in a row without work while requests
    are live."""
    n_tok = 0
    for s in seqs:
      if s.sample:
        self.rec.token(s.req_id, t)
        n_tok += 1
    if n_tok:
      self.last_token = t
    done = self.sched.on_step_done(plan, None, None, now=t)
    for rid in done:
      self.rec.finish(rid, t, "length")
      self.live.discard(rid)
      self.queue.finished(rid, t - self.t0)
    if done and self.bar is not None:
      self.bar.update(len(done))
    self.sched.pop_finished()
    if n_tok or plan.has_work:
      self.idle = 0
    else:
      self.idle += 1
      self.c["empty_plans"] += 1
      if self.idle > MAX_IDLE_PLANS and self.live:
        raise RuntimeError(f"the scheduler made no progress for {MAX_IDLE_PLANS} plans with {len(self.live)} "
                           f"requests live at t={t:.3f}s; stuck")
    return done

  def start_copies(self, now: float, x: float) -> float:
    """Copies of ``x`` s issued at ``now`` on the (possibly busy) link; returns when they finish."""
    if x <= 0:
      return now
    end = max(now, self.link_free) + x
    self.link_free = end
    return end

  def dispatched(self, seqs, copies_end: float, ready: float) -> float:
    """A model step of ``seqs`` starts once both the copies (``copies_end``) and the previous step
    (``ready``) are done: counts it and its exposed copy time; returns when it ends (s)."""
    start = max(ready, copies_end)
    step = self.cost.step_time(seqs)
    self.c["model_steps"] += 1
    self.c["exposed_transfer_s"] += start - ready
    self.step_times.append(start - ready + step)
    return start + step

  def first_step(self, now: float):
    """With nothing in flight at ``now``: plans a step and runs or dispatches it. Returns the in-flight
    ``(plan, seqs, end)`` under pipelining, else None (the step, if any, already completed)."""
    sched, clock = self.sched, self.clock
    plan = sched.schedule(lookahead=False) if self.sim.pipeline else sched.schedule()
    xfer_end = self.start_copies(now, self.planned(plan))
    seqs = plan.scheduled
    if not seqs:
      clock.set(max(xfer_end, now + self.cost.empty_step_s))
      self.completed(plan, (), clock.now())
      return None
    end = self.dispatched(seqs, xfer_end, now)
    if not self.sim.pipeline:
      clock.set(end)
      self.completed(plan, seqs, clock.now())
      return None
    return (plan, seqs, end)

  def next_step(self, inflight, overlap: bool):
    """Step k (``inflight``) is in flight: plans k+1 (lookahead) and starts its copies (only once step k
    has finished where copies share its cores, ``overlap`` False), completes k, then dispatches k+1 minus
    the seqs that finished at k. Returns the new in-flight triple, or None when k+1 has nothing to run."""
    clock = self.clock
    nxt_plan = self.sched.schedule(lookahead=True)
    x = self.planned(nxt_plan)
    plan, seqs, end = inflight
    xfer_end = self.start_copies(clock.now() if overlap else max(end, clock.now()), x)
    clock.set(end)
    done = self.completed(plan, seqs, end)
    seqs = nxt_plan.scheduled
    if done and seqs:
      gone = set(done)
      kept = [s for s in seqs if s.req_id not in gone]
      self.c["dropped_seqs"] += len(seqs) - len(kept)
      seqs = kept
    if not seqs:
      self.completed(nxt_plan, (), end)   # nothing to dispatch: the engine completes the plan at once
      return None
    return (nxt_plan, seqs, self.dispatched(seqs, xfer_end, end))

  def result(self, timed_out: bool) -> SimResult:
    """The run's ``SimResult``: duration to the last token (to now when ``timed_out``), bytes counters."""
    c, bb = self.c, self.sim.block_bytes
    c["swap_out_bytes"] = (c["blocks_out"] + c["blocks_writeback"]) * bb
    c["swap_in_bytes"] = c["blocks_in"] * bb
    c["prefix_cache"] = dict(self.sched.stats().prefix_cache)
    duration = (self.clock.now() - self.t0) if timed_out else (self.last_token - self.t0)
    return SimResult(timelines=self.rec.timelines(), duration_s=max(duration, 1e-9), counters=c,
                     step_times_s=self.step_times, rejected=self.rejected, wall_s=time.perf_counter() - self.wall0,
                     timed_out=timed_out, occupancy=self.occupancy, kv_demand=self.kv_demand)


class Simulator:
  """Drives ``scheduler`` (any ``SchedulerProtocol``; its clock must be ``clock``) through a workload.

  ``block_bytes`` converts block counts into the bytes counters. ``plan_hook(plan)``, if given, sees every
  plan right after ``schedule()`` returns it (tests compare them with a direct driver's).
  """

  def __init__(self, scheduler, clock: VirtualClock, cost, *, pipeline: bool = True, block_bytes: int = 0,
               plan_hook: Optional[Callable[[Any], None]] = None,
               hashes_of: Optional[Callable[[Any], Optional[tuple]]] = None):
    """``hashes_of(spec)``: the prefix-cache block hashes a request gets (``Request.block_hashes``), or None
    (the default for every request): no prefix caching for it."""
    self.hashes_of = hashes_of
    self.sched = scheduler
    self.clock = clock
    self.cost = cost
    self.pipeline = bool(pipeline)
    self.block_bytes = int(block_bytes)
    self.plan_hook = plan_hook

  def run(self, requests: Sequence[Any], *, progress: bool = False, desc: str = "sim",
          time_limit_s: Optional[float] = None) -> SimResult:
    """Simulates ``requests`` (``workload.RequestSpec``s: ``request_id``, ``prompt_len``, ``output_len``,
    ``arrival_s`` seconds after the start) to completion, or until ``time_limit_s`` of virtual time."""
    st = _SimRun(self, requests, progress, desc)
    clock, t0 = self.clock, st.t0
    inflight = None   # (plan, dispatched seqs, end time of the step)
    overlap = getattr(self.cost, "copies_overlap_compute", True)
    timed_out = False
    try:
      while True:
        now = clock.now()
        if time_limit_s is not None and now - t0 > time_limit_s:
          timed_out = True
          break
        st.arrivals(now)
        if inflight is None:
          if not st.live:
            nxt_s = st.queue.next_due_s()
            if nxt_s is None:   # nothing left (or only turns of a refused request's conversation)
              break
            clock.set(max(now, t0 + nxt_s))
            continue
          inflight = st.first_step(now)
          if inflight is None:
            continue
        inflight = st.next_step(inflight, overlap)
    finally:
      if st.bar is not None:
        st.bar.close()
    return st.result(timed_out)


def derived_counters(counters: dict[str, Any]) -> dict[str, Any]:
  """Per-step figures of a run's counters (per plan, as the engine's ``rotations_per_step``)."""
  plans = counters["plans"] or 1
  return dict(
      rotations_per_step=counters["rotations_out"] / plans,
      rotations_in_per_step=counters["rotations_in"] / plans,
      blocks_out_per_step=counters["blocks_out"] / plans,
      blocks_writeback_per_step=counters["blocks_writeback"] / plans,
      blocks_in_per_step=counters["blocks_in"] / plans,
      bytes_out_per_step=counters["swap_out_bytes"] / plans,
      bytes_in_per_step=counters["swap_in_bytes"] / plans,
      mean_residency_steps=(counters["residency_steps"] / counters["rotations_out"]
                            if counters["rotations_out"] else None),
  )


def prefix_hashes_of(requests: Sequence[Any], block_size: int, content: str) -> Callable[[Any], Optional[tuple]]:
  """What prefix caching hashes in a simulated run (``SimConfig.prefix_content``), as ``spec -> hashes``:

  * a request with recorded block ids (a trace, ``RequestSpec.block_ids``): its full blocks' ids at
    ``block_size`` (``derived_block_ids``; the trace's ids are chained hashes already, so they are used as
    they are);
  * else, with token ids: their chained content hashes (``kv/prefix_hash.block_hashes``), under "tokens"
    always, under "recorded" only when the workload is multi-turn (some request follows another,
    ``after_request_id``): single-turn datasets' token ids are synthetic or unrelated prompts;
  * else None.
  """
  multiturn = any(getattr(r, "after_request_id", None) is not None for r in requests)
  use_tokens = content == "tokens" or (content == "recorded" and multiturn)

  def hashes_of(spec) -> Optional[tuple]:
    ids = spec.derived_block_ids(block_size) if getattr(spec, "block_ids", None) is not None else None
    if ids is not None:
      return tuple(ids[:spec.prompt_len // block_size])
    toks = getattr(spec, "prompt_token_ids", None)
    if use_tokens and toks is not None:
      return block_hashes(toks, block_size)
    return None
  return hashes_of


def simulate(requests: Sequence[Any], engine_config, cost, *, progress: bool = False, desc: str = "sim",
             time_limit_s: Optional[float] = None, plan_hook=None, prefix_content: str = "recorded") -> SimResult:
  """One run: a fresh ``BlockManager`` + ``Scheduler`` from ``engine_config`` (pools must be set:
  ``num_device_blocks`` and ``num_host_blocks`` not None) on a fresh ``VirtualClock``, ``engine_config.
  pipeline`` as the engine's, driven by ``Simulator``. ``cost`` as in the module docstring. With prefix
  caching on, requests get the hashes ``prefix_hashes_of(requests, block_size, prefix_content)`` gives, and
  the cost rule's unset sides come from ``cost.prefix_rule_costs()`` when the cost model has it."""
  if engine_config.num_device_blocks is None or engine_config.num_host_blocks is None:
    raise ValueError("simulate: num_device_blocks and num_host_blocks must be resolved (sim.sim_sweep sizes them "
                     "from the hardware profile)")
  clock = VirtualClock()
  sc = engine_config.scheduler
  bm = BlockManager(engine_config.num_device_blocks, engine_config.num_host_blocks, engine_config.block_size,
                    host_prefix_cache=sc.host_prefix_cache)
  hashes_of = None
  if sc.enable_prefix_caching and prefix_content != "none":
    hashes_of = prefix_hashes_of(requests, engine_config.block_size, prefix_content)
    rule = getattr(cost, "prefix_rule_costs", None)
    if sc.host_prefix_load == "cost" and rule is not None and (
        sc.prefix_load_s_per_block is None or sc.prefill_s_per_token is None):
      load_s, prefill_s = rule()
      sc = dataclasses.replace(sc, prefix_load_s_per_block=(sc.prefix_load_s_per_block
                                                            if sc.prefix_load_s_per_block is not None else load_s),
                               prefill_s_per_token=(sc.prefill_s_per_token if sc.prefill_s_per_token is not None
                                                    else prefill_s))
  sched = Scheduler(sc, bm, clock)
  sim = Simulator(sched, clock, cost, pipeline=engine_config.pipeline,
                  block_bytes=getattr(cost, "block_bytes", 0), plan_hook=plan_hook, hashes_of=hashes_of)
  return sim.run(requests, progress=progress, desc=desc, time_limit_s=time_limit_s)
