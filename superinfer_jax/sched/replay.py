"""Deterministic replay scenarios and plan fingerprints: a regression check that a change to the scheduler
(or to the block manager under it) leaves every decision unchanged.

``plan_hashes(policies, scenarios, steps)`` drives a fresh ``Scheduler`` + ``BlockManager`` per (policy,
scenario) through ``steps`` steps of a seeded workload on a ``VirtualClock`` and returns, per pair, the
SHA-256 of everything the scheduler decided: every ``StepPlan`` field (each ``ScheduledSeq`` with its block
table, the three copy lists column by column, the request-id lists, the counters), the ids each
``on_step_done`` finished, and the final ``totals``. Equal hashes before and after a change mean the plans
are identical, including block ids and tie-breaking; ``scripts/bench_scheduler.py --plan_hashes`` prints
them and ``tests/sched/test_sched_replay.py`` pins them.

Scenarios (``SCENARIOS``; each drives the paths the others do not):
  * ``bench``: ``bench_scheduler.py``'s workload at a smaller scale: constant live count (finished requests
    are replaced), heavy oversubscription of the device pool, ample host pool, paper knobs.
  * ``small_host``: host pool smaller than the device pool (rotations fail, clean mirrors are reclaimed,
    reactive evictions fall back to recompute), ``proactive_recompute``, ``min_residency``, a tight B_xfer,
    per-request SLOs.
  * ``lookahead``: plans made while the previous step is in flight (``schedule(lookahead=True)``), engine
    stops (``finished=``) and aborts, sampled token ids, ``beta_b`` > 0, capped write-back.
  * ``bench_1k``: ``bench_scheduler.py``'s workload at its defaults (1,000 live requests, 8,192 blocks).

Pure Python, no JAX.
"""
from __future__ import annotations

import dataclasses
import gc
import hashlib
import random
import sys
from typing import Iterable

from superinfer_jax.kv.block_manager import BlockManager
from superinfer_jax.kv.prefix_hash import id_block_hashes
from superinfer_jax.sched.clock import VirtualClock
from superinfer_jax.sched.config import SchedulerConfig
from superinfer_jax.sched.plan import StepPlan
from superinfer_jax.sched.request import Request
from superinfer_jax.sched.scheduler import Scheduler


@dataclasses.dataclass(frozen=True)
class Scenario:
  """One replay workload: pools, scheduler knobs and the request stream (see the module docstring)."""
  device_blocks: int
  host_blocks: int
  block_size: int
  num_requests: int            # live requests kept in the scheduler (finished ones are replaced)
  prompt_len: tuple[int, int]  # inclusive range
  max_tokens: tuple[int, int]  # inclusive range
  config: dict                 # SchedulerConfig overrides (the policy is set per run)
  step_s: float = 0.05         # virtual seconds per step
  lookahead: bool = False      # plan step k+1 before step k completes
  slo_jitter: bool = False     # per-request TTFT / TBT SLOs drawn around the defaults
  stop_prob: float = 0.0       # per sampled token: the engine stops the request (finished=)
  abort_every: int = 0         # abort the oldest live request every this many steps (0: never)
  # Prefix caching: > 0 gives every request block hashes (Request.block_hashes): its first blocks (up to
  # prefix_blocks, within its prompt) are one of shared_prefixes shared prefixes, the rest its own. 0: none.
  shared_prefixes: int = 0
  prefix_blocks: int = 8


SCENARIOS: dict[str, Scenario] = {
    "bench": Scenario(device_blocks=1024, host_blocks=8192, block_size=16, num_requests=200,
                      prompt_len=(32, 512), max_tokens=(16, 256),
                      config=dict(max_num_seqs=96, max_num_batched_tokens=2048)),
    "small_host": Scenario(device_blocks=384, host_blocks=160, block_size=8, num_requests=60,
                           prompt_len=(8, 300), max_tokens=(4, 120),
                           config=dict(max_num_seqs=24, max_num_batched_tokens=512, proactive_swap_budget=40,
                                       proactive_recompute=True, min_residency=2),
                           slo_jitter=True),
    "lookahead": Scenario(device_blocks=512, host_blocks=2048, block_size=16, num_requests=120,
                          prompt_len=(16, 400), max_tokens=(8, 200),
                          config=dict(max_num_seqs=48, max_num_batched_tokens=1024, proactive_swap_budget=300,
                                      beta_b=0.5, max_writeback_blocks=32),
                          lookahead=True, stop_prob=0.01, abort_every=17),
    # bench_scheduler.py at its defaults (--num_requests=1000 --device_blocks=8192).
    "bench_1k": Scenario(device_blocks=8192, host_blocks=8 * 8192, block_size=16, num_requests=1000,
                         prompt_len=(32, 1024), max_tokens=(32, 512),
                         config=dict(max_num_seqs=256, max_num_batched_tokens=8192)),
}


def plan_fingerprint(plan: StepPlan) -> tuple:
  """Every decision in ``plan`` as a tuple of plain values (ints, floats, strings, tuples)."""
  return (
      plan.step_id, plan.time, plan.lookahead, plan.contention, plan.num_batched_tokens, plan.residency_steps,
      tuple((q.req_id, q.num_new_tokens, q.num_computed_tokens, tuple(q.block_table), q.sample)
            for q in plan.scheduled),
      tuple(plan.swap_out.srcs), tuple(plan.swap_out.dsts), tuple(plan.swap_in.srcs), tuple(plan.swap_in.dsts),
      tuple(plan.writeback.srcs), tuple(plan.writeback.dsts),
      tuple(plan.rotated_out), tuple(plan.rotated_in), tuple(plan.preempted), tuple(plan.admitted),
      tuple(plan.round_trips), (),  # () : a slot plans no longer have, kept so the pinned hashes still compare
  )


class Replay:
  """One seeded run of a ``Scenario`` under one policy: ``plan = replay.schedule()`` plans the next step (the
  call ``bench_scheduler.py`` times), ``replay.complete(plan)`` lets virtual time pass and finishes it;
  ``digest`` accumulates the fingerprint of every decision (``hexdigest()`` adds the final totals).

  Per step: without lookahead, schedule at ``t``, advance the clock by ``step_s``, complete the plan at
  ``t + step_s`` (sampled tokens, engine stops), replace finished requests. With lookahead, plan step k+1
  while k is in flight, then complete k (the engine's order), then advance. Aborts (``abort_every``) happen
  before planning. The request stream draws from ``Random(seed)`` (prompt length, then max tokens, per
  request: the same stream as ``bench_scheduler.py`` always used); sampled ids and stops from another.
  """

  def __init__(self, policy: str, scenario: Scenario, seed: int = 0, policy_obj=None):
    """``policy``: a policy name (``SchedulerConfig.policy``); ``policy_obj``: a ``Policy`` instance to run
    instead (tests compare a policy with a reference implementation of it)."""
    sc = self.scenario = scenario
    self._rng = random.Random(seed)
    self._tok_rng = random.Random(seed + 1)
    self._prefix_rng = random.Random(seed + 2)  # its own stream: the request stream stays the same
    self.clock = VirtualClock()
    self.config = SchedulerConfig(**{**sc.config, "policy": policy})
    self.bm = BlockManager(sc.device_blocks, sc.host_blocks, sc.block_size,
                           host_prefix_cache=self.config.host_prefix_cache)
    self.sched = Scheduler(self.config, self.bm, self.clock, policy_obj)
    self.digest = hashlib.sha256()
    self._next_id = 0
    self._inflight: StepPlan | None = None
    self._step = 0
    for i in range(sc.num_requests):
      self._add(i / sc.num_requests)

  def _add(self, t: float) -> None:
    sc, rng, cfg = self.scenario, self._rng, self.config
    ttft = tbt = None
    if sc.slo_jitter:
      ttft = cfg.ttft_slo * rng.choice((0.25, 0.5, 1.0, 2.0))
      tbt = cfg.tbt_slo * rng.choice((0.5, 1.0, 3.0))
    prompt = rng.randint(*sc.prompt_len)
    hashes = None
    if sc.shared_prefixes:
      nfull = prompt // sc.block_size
      shared = min(sc.prefix_blocks, nfull)
      p = self._prefix_rng.randrange(sc.shared_prefixes)
      ids = [p * 4096 + i for i in range(shared)] + [(1 << 40) + self._next_id * 4096 + i
                                                     for i in range(shared, nfull)]
      hashes = id_block_hashes(ids)
    self.sched.add_request(Request(self._next_id, prompt, rng.randint(*sc.max_tokens), t,
                                   ttft_slo=ttft, tbt_slo=tbt, block_hashes=hashes))
    self._next_id += 1

  def schedule(self) -> StepPlan:
    """Aborts due this step, then the plan (not yet fingerprinted: ``complete`` does that)."""
    sc, sched = self.scenario, self.sched
    if sc.abort_every and self._step % sc.abort_every == sc.abort_every - 1 and sched.requests:
      rid = min(sched.requests)
      self.digest.update(repr(("abort", self._step, rid, sched.abort(rid))).encode())
      self._add(self.clock.now())
    self._step += 1
    return sched.schedule(lookahead=self._inflight is not None)

  def complete(self, plan: StepPlan) -> list:
    """Fingerprints ``plan``, finishes the step due now (see the class docstring); returns finished ids."""
    self.digest.update(repr(plan_fingerprint(plan)).encode())
    if self.scenario.lookahead:
      done = self._finish(self._inflight) if self._inflight is not None else []
      self._inflight = plan
      self.clock.advance(self.scenario.step_s)
      return done
    self.clock.advance(self.scenario.step_s)
    return self._finish(plan)

  def _finish(self, plan: StepPlan) -> list:
    sc, rng = self.scenario, self._tok_rng
    sampled = {q.req_id: rng.randrange(50000) for q in plan.scheduled if q.sample}
    stops = {rid: "stop" for rid in sampled if sc.stop_prob and rng.random() < sc.stop_prob}
    done = list(self.sched.on_step_done(plan, new_tokens=sampled, finished=stops))
    self.digest.update(repr(("done", plan.step_id, done)).encode())
    now = self.clock.now()
    for _ in done:
      self._add(now)
    return done

  def hexdigest(self) -> str:
    """SHA-256 of every decision so far plus the scheduler's totals (the plan in flight is not completed)."""
    d = self.digest.copy()
    d.update(repr(sorted(self.sched.totals.items())).encode())
    return d.hexdigest()


def count_opcodes(fn, *args):
  """Calls ``fn(*args)`` with ``sys.settrace`` counting opcode events; returns ``(result, opcodes)``.

  ``opcodes``: bytecode instructions executed in every Python frame the call runs (callees and resumed
  generators included; work done inside C functions, such as a list copy, counts as the one call). For a
  replay's ``schedule()`` it is a work measure that machine load cannot move: on a noisy box timings swing
  ~1.7x between runs minutes apart, the count not at all (same state, same count). The cyclic GC is paused
  during the call: a collection could otherwise run other objects' Python finalizers or ``gc.callbacks`` inside
  it, and when it fires depends on the whole process. The tracer slows the call ~50x, so count a few steps,
  not the timed ones. It is a check that Python-level work did not grow, not a cost: a ``map`` over a C
  function counts once however many elements it calls the function on.
  """
  count = 0

  def trace(frame, event, arg):
    nonlocal count
    if event == "opcode":
      count += 1
    elif event == "call":
      frame.f_trace_lines = False
      frame.f_trace_opcodes = True
    return trace

  previous = sys.gettrace()
  gc_was_enabled = gc.isenabled()
  gc.disable()
  sys.settrace(trace)
  try:
    result = fn(*args)
  finally:
    sys.settrace(previous)
    if gc_was_enabled:
      gc.enable()
  return result, count


def schedule_opcodes(policy: str, scenario: Scenario, warmup: int, steps: int, seed: int = 0) -> float:
  """Mean opcodes per ``schedule()`` call (``count_opcodes``) over ``steps`` steps of a fresh replay, after
  ``warmup`` untraced steps."""
  rp = Replay(policy, scenario, seed)
  for _ in range(warmup):
    rp.complete(rp.schedule())
  total = 0
  for _ in range(steps):
    plan, n = count_opcodes(rp.schedule)
    total += n
    rp.complete(plan)
  return total / steps


def run_scenario(policy: str, scenario: Scenario, steps: int, seed: int = 0, check_every: int = 0) -> str:
  """SHA-256 (hex) of ``steps`` steps of ``scenario`` under ``policy`` (see ``Replay``).

  ``check_every`` > 0 also runs ``Scheduler.check_invariants()`` every that many steps (slow; for tests).
  """
  rp = Replay(policy, scenario, seed)
  for step in range(steps):
    rp.complete(rp.schedule())
    if check_every and step % check_every == 0:
      rp.sched.check_invariants()
  return rp.hexdigest()


def plan_hashes(policies: Iterable[str], scenarios: Iterable[str], steps: int, seed: int = 0) -> dict:
  """``{policy: {scenario: sha256 hex}}`` over every pair (see ``run_scenario``)."""
  scenarios = list(scenarios)
  for name in scenarios:
    if name not in SCENARIOS:
      raise ValueError(f"unknown replay scenario {name!r}; choose from {sorted(SCENARIOS)}")
  return {p: {s: run_scenario(p, SCENARIOS[s], steps, seed) for s in scenarios} for p in policies}
