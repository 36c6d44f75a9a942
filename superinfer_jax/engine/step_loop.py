"""The step loop: the engine core's one driver of the scheduler; plan, issue transfers, dispatch, read back,
in one of three orders.

``StepLoop`` owns the request lifecycle on the scheduler side: it alone calls the scheduler (``add_request``
when the engine admits a request, ``abort``, ``schedule``, ``on_step_done``, ``pop_finished``, ``stats``,
``check_invariants``); ``RequestBook`` holds the requests and ``LLMEngine`` goes through this class.
Finishes come back from ``on_step_done`` with their reason: "length" (``max_tokens``, decided there and
only there) or the engine's own stop (eos, stop ids, stop strings: ``RequestBook.append_token``), which wins
when a token is both (vLLM's order: a token that is eos and the last allowed one finishes with "stop").

One engine step (docs/architecture.md "One engine step"):

  1. ``Scheduler.schedule()`` returns a ``StepPlan``: sequences with token counts (chunked prefill under a
     token budget), requests rotated out / in, preempted.
  2. ``runner.issue_transfers`` starts the plan's KV copies (rotation + eager write-back) ahead of the step.
  3. ``HostBatch`` packs the ragged batch into one int32 buffer; ``runner.dispatch`` puts it on the device and
     enqueues the step, which samples on the device.
  4. ``runner.read_step`` reads the sampled ids back (the only device->host read); ``RequestBook`` runs
     the engine's stop checks; ``Scheduler.on_step_done`` is told the new tokens and those stops, and returns
     every request that finished (length stops included), which the book then marks finished.

Three loops (``EngineConfig.pipeline`` and ``zero_bubble``):

* zero-bubble (both on, the default): with step k in flight, the host plans step k+1 with
  ``schedule(lookahead=True)`` (requests in flight are assumed to gain one token), issues its transfers and
  dispatches it at once, each continuing sequence's newest token fed on the device from step k's output
  (``packing.feed_tokens``). Only then does it read step k's ids, one step behind, so the device never waits
  for the host. A request that stopped at step k was already in step k+1: that token is discarded
  (``EngineStats.discarded_tokens``); its blocks, freed when step k's stop is seen, are reused only by steps
  dispatched later (which write before they read, in device order).
* pipelined (pipeline on, zero_bubble off; the ablation): plan and issue k+1 while k runs, read k's ids, drop
  requests that finished at k from plan k+1 (``rescheduled_drops``), then dispatch k+1 with host tokens.
* sync (pipeline off): plan, issue, dispatch and read back in sequence.

All three give the same tokens and the same timestamp rule: a token's timestamp is the clock time at which its
step's ids were read. None makes an implicit transfer (tested under ``jax.transfer_guard("disallow")``).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

from superinfer_jax.engine.config import FINISH_ABORT
from superinfer_jax.engine import logit_processing
from superinfer_jax.engine.request_book import EngineRequest, RequestBook, RequestError
from superinfer_jax.engine.host_batch import HostBatch, SeqInput
from superinfer_jax.engine.sampling import sampling_mode
from superinfer_jax.engine.stats import EngineStats
from superinfer_jax.kv.prefix_hash import block_hashes, extra_key_of
from superinfer_jax.sched import Request

_STATES = (("rotated_out", "rotary"), ("preempted", "preempted"), ("rotated_in", "running"),
           ("admitted", "running"))   # plan field -> the state it records, in the order they happen


@dataclasses.dataclass
class DispatchedStep:
  """A dispatched model step whose sampled ids are not read yet."""
  plan: Any
  tokens: Any                            # the runner's handle of its sampled ids
  rows: dict[str, int]                   # request id -> logits row, for each sequence that samples
  scheduled: list[str]                   # request ids in the step
  read_time: float = 0.0                 # perf_counter() when its ids were read back
  probe_step: int = -1                   # the idle probe's index of this step


class StepLoop:
  """Drives ``scheduler``, ``book`` and ``runner`` one step at a time (module docstring); the only caller of
  ``scheduler``.

  ``on_read`` (optional) is called with each ``DispatchedStep`` once its ids are read and processed (the engine
  releases requests through it). ``step_observer`` (optional) is called with ``(plan, now)`` for every plan,
  run or empty, right before the scheduler is told it is done (``experiment/sim_validation.py`` records the
  steps through it). ``idle_probe``: an ``engine.idle_probe.DeviceIdleProbe`` or None.
  """

  def __init__(self, config, scheduler, book: RequestBook, runner, stats: EngineStats, clock,
               model_key: str = ""):
    """``model_key``: the model's identity in prefix-cache hashes (``kv/prefix_hash.extra_key_of``)."""
    self.config = config
    self.model_key = model_key
    self.scheduler = scheduler
    self.book = book
    self.runner = runner
    self.stats = stats
    self.clock = clock
    self.host_batch = HostBatch(config.block_size, token_floor=config.token_bucket_floor,
                                seq_floor=config.seq_bucket_floor, blocks_floor=config.blocks_bucket_floor)
    self.idle_probe = None
    self.inflight: Optional[DispatchedStep] = None
    self.on_read = None
    self.step_observer = None
    self._empty_steps = 0

  # ------------------------------------------------------------------------------------------ lifecycle
  def add_request(self, r: EngineRequest) -> None:
    """Queues a request made by ``RequestBook.new_request`` on the scheduler (its refusal -> ``RequestError``,
    nothing changed), then puts it in the book."""
    hashes = None
    if self.config.scheduler.enable_prefix_caching:
      hashes = block_hashes(r.prompt_token_ids, self.config.block_size, extra_key_of(self.model_key, r.cache_salt))
    try:
      self.scheduler.add_request(Request(r.request_id, len(r.prompt_token_ids), r.max_tokens, r.arrival_time,
                                         ttft_slo=r.ttft_slo, tbt_slo=r.tbt_slo, block_hashes=hashes))
    except ValueError as e:
      raise RequestError(str(e)) from None
    self.book.add(r)

  def abort(self, request_id: str) -> bool:
    """Ends a waiting, running or rotary request on the scheduler (its blocks freed) and in the book (final
    output "abort" with the next outputs). False if the id is unknown or already finished."""
    r = self.book.reqs.get(request_id)
    if r is None or r.finished:
      return False
    self.scheduler.abort(request_id)
    self.book.finish(r, FINISH_ABORT)
    return True

  def scheduler_stats(self):
    """The scheduler's ``SchedulerStats`` now (request counts, pool occupancy, cumulative counters)."""
    return self.scheduler.stats()

  def check_invariants(self) -> None:
    """The scheduler's and its block manager's invariants (``AssertionError`` on the first violation)."""
    self.scheduler.check_invariants()

  # ------------------------------------------------------------------------------------------ the steps
  def step(self) -> None:
    """One step of the configured loop; stats updated."""
    t0 = time.perf_counter()
    if not self.config.pipeline:
      wait = self._step_sync()
    elif self.config.zero_bubble:
      wait = self._step_zero_bubble()
    else:
      wait = self._step_pipelined()
    dt = time.perf_counter() - t0
    st = self.stats
    st.steps += 1
    st.step_time_s += dt
    st.wait_time_s += wait
    st.host_time_s += dt - wait

  # ------------------------------------------------------------------------------------------ the loops
  def _step_sync(self) -> float:
    t0 = time.perf_counter()
    plan = self._schedule(lookahead=False)
    self._issue(plan)
    inflight = self._dispatch(plan)
    if inflight is None:
      self._on_step_done(plan, {}, {})
      self._break_probe_chain()
      self.stats.exposed_host_time_s += time.perf_counter() - t0
      return 0.0
    t1 = time.perf_counter()
    wait = self._complete(inflight)
    self.stats.exposed_host_time_s += (t1 - t0) + (time.perf_counter() - t1 - wait)
    return wait

  def _start_pipeline(self) -> bool:
    """With nothing in flight: plan and dispatch a step without lookahead. False when it ran nothing."""
    plan = self._schedule(lookahead=False)
    self._issue(plan)
    self.inflight = self._dispatch(plan)
    self._finish_if_empty(plan)
    return self.inflight is not None

  def _finish_if_empty(self, plan) -> None:
    """A plan that dispatched nothing (no sequences) completes at once."""
    if self.inflight is None:
      self._on_step_done(plan, {}, {})
      self._break_probe_chain()

  def _step_pipelined(self) -> float:
    if self.inflight is None and not self._start_pipeline():
      return 0.0
    next_plan = self._schedule(lookahead=True)   # step k runs meanwhile
    self._issue(next_plan)
    inflight, self.inflight = self.inflight, None
    wait = self._complete(inflight)
    self.inflight = self._dispatch(next_plan)
    self._finish_if_empty(next_plan)
    self.stats.exposed_host_time_s += time.perf_counter() - inflight.read_time
    return wait

  def _step_zero_bubble(self) -> float:
    if self.inflight is None and not self._start_pipeline():
      return 0.0
    next_plan = self._schedule(lookahead=True)   # step k runs meanwhile
    self._issue(next_plan)
    inflight = self.inflight
    self.inflight = self._dispatch(next_plan, prev=inflight)
    wait = self._complete(inflight)
    self._finish_if_empty(next_plan)
    return wait

  def _break_probe_chain(self) -> None:
    if self.idle_probe is not None:
      self.idle_probe.break_chain()

  # -------------------------------------------------------------------------------------------- phases
  def _schedule(self, lookahead: bool):
    t = time.perf_counter()
    plan = self.scheduler.schedule(lookahead=lookahead) if lookahead else self.scheduler.schedule()
    st = self.stats
    st.schedule_time_s += time.perf_counter() - t
    st.rotations_out += len(plan.rotated_out)
    st.rotations_in += len(plan.rotated_in)
    st.round_trips += len(plan.round_trips)
    st.residency_steps += plan.residency_steps
    st.recompute_preemptions += len(plan.preempted)
    st.contended_steps += bool(plan.contention)
    for field, state in _STATES:
      for rid in getattr(plan, field):
        self.book.record_state(rid, plan.time, state)
    if plan.admitted:
      admitted = set(plan.admitted)
      for seq in plan.scheduled:
        if seq.req_id in admitted:  # an admission's prefill starts after its cached prefix
          self.book.record_cached(seq.req_id, seq.num_computed_tokens)
    return plan

  def _issue(self, plan) -> None:
    swap_out, writeback, swap_in = plan.swap_out, plan.writeback, plan.swap_in
    if not (swap_out or writeback or swap_in):
      return
    st = self.stats
    bb = self.runner.kv_spec.block_bytes
    st.blocks_out += len(swap_out)
    st.blocks_writeback += len(writeback)
    st.blocks_in += len(swap_in)
    st.bytes_out += (len(swap_out) + len(writeback)) * bb
    st.bytes_in += len(swap_in) * bb
    t = time.perf_counter()
    self.runner.issue_transfers(swap_out, writeback, swap_in, round_trip=bool(plan.round_trips))
    st.issue_time_s += time.perf_counter() - t

  def _dispatch(self, plan, prev: Optional[DispatchedStep] = None) -> Optional[DispatchedStep]:
    """Builds the inputs of ``plan`` (skipping finished requests) and dispatches the step. ``prev``: the step
    in flight whose ids the host has not read (zero-bubble); a request it samples has one more token than the
    host knows, fed from ``prev.tokens`` on the device."""
    t0, c0 = time.perf_counter(), time.thread_time()
    seqs, rows, num_tokens = self._seq_inputs(plan, prev.rows if prev is not None else {})
    if not seqs:
      return None
    rebuilds = self.host_batch.rebuilds
    packed, dims = self.host_batch.build(seqs)
    if dims[3] > self.runner.out_rows:
      raise RuntimeError(f"plan has {len(seqs)} sequences: more than max_num_seqs "
                         f"({self.config.scheduler.max_num_seqs}) allows ({self.runner.out_rows} output rows)")
    mode = sampling_mode(s.sampling for s in seqs if s.sampling is not None)
    processing, num_logprobs = self._logit_extras(rows, dims[3])
    tokens = self.runner.dispatch(packed, dims, mode, prev.tokens if prev is not None else None,
                                  processing=processing, num_logprobs=num_logprobs)
    probe_step = self.idle_probe.dispatched(tokens.tokens) if self.idle_probe is not None else -1
    st = self.stats
    st.model_steps += 1
    st.batch_rebuilds += self.host_batch.rebuilds - rebuilds
    st.tokens_scheduled += num_tokens
    st.dispatch_time_s += time.perf_counter() - t0
    st.dispatch_cpu_time_s += time.thread_time() - c0
    return DispatchedStep(plan=plan, tokens=tokens, rows=rows, scheduled=[q.key for q in seqs], probe_step=probe_step)

  def _logit_extras(self, rows: dict[str, int], num_rows: int):
    """The step's logit-processing buffer (None when no sampling row processes logits) and its logprobs
    top-k (0 when no sampling row asks for logprobs); ``engine/logit_processing.py``."""
    processed, wants_logprobs = [], False
    for rid, row in rows.items():
      r = self.book.reqs[rid]
      p = r.params
      wants_logprobs |= p.logprobs is not None
      if p.processes_logits:
        processed.append((row, p, r.prompt_token_ids, r.output_counts))
    return logit_processing.step_extras(processed, wants_logprobs, num_rows)

  def _seq_inputs(self, plan, pending: dict[str, int]) -> tuple[list[SeqInput], dict[str, int], int]:
    """The plan's sequences as ``SeqInput``s, the logits row of each that samples, and the token count.
    ``pending``: request id -> row of the unread step in flight holding its newest token."""
    fresh = set(plan.rotated_in) | set(plan.admitted)
    seqs: list[SeqInput] = []
    rows: dict[str, int] = {}
    num_tokens = 0
    for s in plan.scheduled:
      r = self.book.reqs.get(s.req_id)
      if r is None or r.finished:
        self.stats.rescheduled_drops += 1
        continue
      num_out = len(r.output_token_ids)
      known = len(r.prompt_token_ids) + num_out
      feed_row = pending.get(s.req_id, -1)
      start, stop = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
      if feed_row >= 0:
        if stop <= known:
          feed_row = -1        # the chunk ends before the token in flight (not fed)
        known += 1
      if stop > known:
        raise RuntimeError(f"scheduler planned tokens [{start}, {stop}) of {s.req_id!r} which has only "
                           f"{known} tokens")
      sample = stop == known   # the chunk reaches the end of the known tokens: sample
      if s.sample != sample:
        raise RuntimeError(f"plan says sample={s.sample} for {s.req_id!r} tokens [{start}, {stop}) but the "
                           f"request has {known} tokens")
      tokens = (r.tokens(start, stop - 1) if stop - start > 1 else ()) if feed_row >= 0 else r.tokens(start, stop)
      if sample:
        rows[s.req_id] = len(seqs)
      num_tokens += stop - start
      seqs.append(SeqInput(s.req_id, tokens, start, s.block_table, feed_row, s.req_id in fresh,
                           r.sampling if sample else None, num_out + (feed_row >= 0)))
    return seqs, rows, num_tokens

  def _complete(self, inflight: DispatchedStep) -> float:
    """Reads back a step's sampled ids, runs the engine's stop checks, tells the scheduler and finishes what
    it returns (module docstring). Returns seconds waited."""
    t = time.perf_counter()
    tokens, logprobs = self.runner.read_step(inflight.tokens)
    inflight.read_time = t_read = time.perf_counter()
    if self.idle_probe is not None and inflight.probe_step >= 0:
      self.idle_probe.read(inflight.probe_step)
    now = self.clock.now()
    new_tokens: dict[str, int] = {}
    finished: dict[str, str] = {}
    for rid, row in inflight.rows.items():
      r = self.book.reqs[rid]
      if r.finished:        # aborted while in flight, or (zero-bubble) stopped at the step before
        self.stats.discarded_tokens += r.finish_reason != FINISH_ABORT
        continue
      new_tokens[rid] = tokens[row]
      reason = self.book.append_token(r, tokens[row], now,
                                      None if logprobs is None else (logprobs[0][row], logprobs[1][row]))
      if reason is not None:
        finished[rid] = reason
    self._on_step_done(inflight.plan, new_tokens, finished, now)
    if self.on_read is not None:
      self.on_read(inflight)
    self.stats.tokens_generated += len(new_tokens)
    self.stats.process_time_s += time.perf_counter() - t_read
    return t_read - t

  def _on_step_done(self, plan, new_tokens, finished, now=None) -> None:
    """Tells the scheduler the step of ``plan`` is done with ``new_tokens`` and the engine's stops
    (``finished``), and finishes in the book every request it reports finished: with the engine's reason
    where there is one (a token that is both a stop and the last allowed one is a "stop"), else the
    scheduler's ("length")."""
    now = self.clock.now() if now is None else now
    if self.step_observer is not None:
      self.step_observer(plan, now)
    done = self.scheduler.on_step_done(plan, new_tokens, finished, now)
    self.scheduler.pop_finished()  # the engine keeps its own results: the scheduler must not hoard them
    for rid, reason in {**done, **finished}.items():
      r = self.book.reqs.get(rid)
      if r is not None:
        self.book.finish(r, reason)
    if self.book.unfinished and not new_tokens and not plan.has_work:
      self._empty_steps += 1
      if self._empty_steps > 1000:
        raise RuntimeError("the scheduler made no progress for 1000 steps with requests pending "
                           f"({len(self.book.unfinished)} unfinished); stuck")
    else:
      self._empty_steps = 0
