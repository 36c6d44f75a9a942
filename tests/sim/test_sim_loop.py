"""The simulator drives the real scheduler: its plans equal those of a direct driver on the same clock
schedule (pipeline off and on, fcfs and rotasched); timelines, counters and overlap accounting."""
import pytest

from superinfer_jax.engine.config import EngineConfig
from superinfer_jax.kv.block_manager import BlockManager
from superinfer_jax.model.config import load_config
from superinfer_jax.sched import Request, Scheduler, VirtualClock
from superinfer_jax.sim import cost as cost_lib
from superinfer_jax.sim.event_loop import RooflineCost, Simulator, derived_counters, simulate
from superinfer_jax.sim.profiles import load_hardware_profile
from superinfer_jax.workload import make_workload
from superinfer_jax.workload.types import RequestSpec

STEP = 0.01


class ConstCost:
  """A stub cost model: every model step takes ``step`` s, every plan's copies ``xfer`` s (0: none)."""

  def __init__(self, step=STEP, xfer=0.0):
    self.step = step
    self.xfer = xfer
    self.empty_step_s = step
    self.block_bytes = 1000

  def step_time(self, seqs):
    return self.step

  def transfer_time(self, blocks_out, blocks_in):
    return self.xfer if (blocks_out or blocks_in) else 0.0


def _config(policy, pipeline):
  return EngineConfig.create(policy=policy, pipeline=pipeline, num_device_blocks=20, num_host_blocks=256,
                             block_size=8, max_num_seqs=8, max_num_batched_tokens=64, proactive_swap_budget=8,
                             ttft_slo=0.05, tbt_slo=0.02, beta_f=0.0)


def _workload(n=24, rps=60.0, seed=3):
  return list(make_workload("synthetic", None, num_requests=n, rps=rps, seed=seed,
                            synthetic_prompt_len="uniform:10,50", synthetic_output_len="uniform:4,40",
                            max_total_len=20 * 8, vocab_size=256))


def _snap(plan):
  return dict(step_id=plan.step_id, time=round(plan.time, 9), lookahead=plan.lookahead,
              scheduled=[(s.req_id, s.num_new_tokens, s.num_computed_tokens, s.sample, tuple(s.block_table))
                         for s in plan.scheduled],
              rotated_out=list(plan.rotated_out), rotated_in=list(plan.rotated_in),
              preempted=list(plan.preempted), admitted=list(plan.admitted),
              swap_out=list(plan.swap_out), swap_in=list(plan.swap_in), writeback=list(plan.writeback))


def drive_directly(requests, cfg, step_s=STEP, empty_s=STEP):
  """The engine's call order written out by hand: fresh scheduler, fixed step time, no copy time."""
  clock = VirtualClock()
  sched = Scheduler(cfg.scheduler, BlockManager(cfg.num_device_blocks, cfg.num_host_blocks, cfg.block_size),
                    clock)
  pend = sorted(requests, key=lambda s: (s.arrival_s, s.request_id))
  plans, i, inflight = [], 0, None
  while True:
    while i < len(pend) and pend[i].arrival_s <= clock.now():
      sched.add_request(Request(pend[i].request_id, pend[i].prompt_len, pend[i].output_len, pend[i].arrival_s))
      i += 1
    if inflight is None:
      if not sched.has_unfinished():
        if i == len(pend):
          return plans
        clock.set(pend[i].arrival_s)
        continue
      plan = sched.schedule()
      plans.append(_snap(plan))
      if not plan.scheduled or not cfg.pipeline:
        clock.advance(step_s if plan.scheduled else empty_s)
        sched.on_step_done(plan, now=clock.now())
        continue
      inflight = (plan, clock.now() + step_s)
    nxt = sched.schedule(lookahead=True)          # plan k+1 while k is in flight
    plans.append(_snap(nxt))
    plan, end = inflight
    clock.set(end)
    done = set(sched.on_step_done(plan, now=end))  # complete k
    if not [s for s in nxt.scheduled if s.req_id not in done]:
      sched.on_step_done(nxt, now=end)
      inflight = None
    else:
      inflight = (nxt, end + step_s)               # dispatch k+1 without the finished ones


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("policy", ["fcfs", "rotasched"])
def test_simulator_plans_equal_a_direct_drive_of_the_scheduler(policy, pipeline):
  reqs = _workload()
  cfg = _config(policy, pipeline)
  seen = []
  res = simulate(reqs, cfg, ConstCost(), plan_hook=lambda p: seen.append(_snap(p)))
  expected = drive_directly(reqs, cfg)
  assert len(seen) == len(expected) > 20
  for a, b in zip(seen, expected):
    assert a == b
  assert all(tl.finished and tl.output_len == tl.target_output_len for tl in res.timelines)
  assert len(res.timelines) == len(reqs)
  assert any(p["lookahead"] for p in seen) == pipeline
  if policy == "rotasched":
    assert res.counters["rotations_out"] > 0 and any(p["rotated_out"] for p in seen)
    assert res.counters["rotations_out"] == sum(len(p["rotated_out"]) for p in seen)
    assert res.counters["blocks_in"] == sum(len(p["swap_in"]) for p in seen)
  else:
    assert res.counters["rotations_out"] == 0
  # Finishing by length is known at plan time (the step skips a request whose in-flight samples reach max_tokens), so no lookahead slot is wasted on a
  # request that finishes in the step in flight; the loop still drops such seqs as the engine does.
  assert res.counters["dropped_seqs"] == 0


def test_token_times_are_step_ends_and_state_changes_come_from_plans():
  reqs = _workload(n=16)
  res = simulate(reqs, _config("rotasched", True), ConstCost())
  for tl in res.timelines:
    assert tl.state_changes[0][1] == "waiting" and tl.state_changes[-1][1] == "finished"
    assert tl.first_scheduled_s is not None and tl.first_scheduled_s >= tl.arrival_s
    ticks = [t / STEP for t in tl.token_times_s]
    assert all(abs(x - round(x)) < 1e-6 for x in ticks)   # every token lands at the end of a 10 ms step
    tl.validate()
  rot = sum(tl.num_rotations for tl in res.timelines)
  assert rot == res.counters["rotations_out"] > 0
  d = derived_counters(res.counters)
  assert d["rotations_per_step"] == pytest.approx(res.counters["rotations_out"] / res.counters["plans"])
  assert d["mean_residency_steps"] is not None


def test_idle_clock_jumps_to_the_next_arrival():
  reqs = [RequestSpec(f"r{i}", "", 10, 3, arrival_s=10.0 * i) for i in range(3)]
  res = simulate(reqs, _config("fcfs", True), ConstCost())
  for i, tl in enumerate(res.timelines):
    assert tl.ttft_s == pytest.approx(STEP)      # alone: its prefill is the first step after arrival
    assert tl.token_times_s[-1] == pytest.approx(10.0 * i + 3 * STEP)
  assert res.counters["model_steps"] == 9
  assert res.duration_s == pytest.approx(20.0 + 3 * STEP)


def test_pipeline_hides_copies_behind_the_step_in_flight():
  reqs = _workload()
  off = simulate(reqs, _config("rotasched", False), ConstCost(xfer=0.004))
  on = simulate(reqs, _config("rotasched", True), ConstCost(xfer=0.004))
  assert off.counters["transfer_s"] > 0 and on.counters["transfer_s"] > 0
  # off: every dispatched plan's copies add to its step
  assert off.counters["exposed_transfer_s"] <= off.counters["transfer_s"] + 1e-12
  assert off.counters["exposed_transfer_s"] > 0.5 * off.counters["transfer_s"]
  # on: copies (4 ms) shorter than the step in flight (10 ms) are hidden; only an empty pipe exposes them
  assert on.counters["exposed_transfer_s"] < 0.2 * on.counters["transfer_s"]
  slow = simulate(reqs, _config("rotasched", True), ConstCost(xfer=0.025))
  assert slow.counters["exposed_transfer_s"] > 0.3 * slow.counters["transfer_s"]


def test_copies_that_share_the_steps_cores_are_not_hidden():
  # A CPU profile (copies_overlap_compute false): a plan's copies start only when the step in flight ends,
  # so the same 4 ms copies that the pipeline hid behind a 10 ms step are now all exposed.
  reqs = _workload()
  hidden = simulate(reqs, _config("rotasched", True), ConstCost(xfer=0.004))
  shared = ConstCost(xfer=0.004)
  shared.copies_overlap_compute = False
  serial = simulate(reqs, _config("rotasched", True), shared)
  assert serial.counters["transfer_s"] > 0
  assert serial.counters["exposed_transfer_s"] > 0.9 * serial.counters["transfer_s"]
  assert hidden.counters["exposed_transfer_s"] < 0.2 * hidden.counters["transfer_s"]
  assert serial.duration_s > hidden.duration_s
  assert load_hardware_profile("cpu").copies_overlap_compute is False
  assert load_hardware_profile("gh200").copies_overlap_compute is True


def test_time_limit_is_virtual_time():
  reqs = _workload(n=24, rps=5.0)
  res = simulate(reqs, _config("fcfs", True), ConstCost(), time_limit_s=1.0)
  assert res.timed_out
  assert res.duration_s == pytest.approx(1.0, abs=2 * STEP)
  assert any(tl.finish_reason is None for tl in res.timelines) or len(res.timelines) < len(reqs)


def test_roofline_cost_on_gh200_runs_and_rejects_what_never_fits():
  hw = load_hardware_profile("gh200")
  mcfg = load_config("llama-3-8b")
  spec = mcfg.kv_spec(16, "bfloat16")
  cost = RooflineCost(cost_lib.ModelProfile.from_model_config(mcfg, "bfloat16"), hw, spec, "duplex")
  cfg = EngineConfig.create(policy="rotasched", num_device_blocks=64, num_host_blocks=4096, block_size=16,
                            max_num_seqs=32, max_num_batched_tokens=2048, proactive_swap_budget=64,
                            dtype="bfloat16", ttft_slo=0.2, tbt_slo=0.03)
  reqs = list(make_workload("synthetic", None, num_requests=40, rps=200.0, seed=1,
                            synthetic_prompt_len="uniform:64,512", synthetic_output_len="uniform:16,128",
                            vocab_size=mcfg.vocab_size))
  reqs.append(RequestSpec("huge", "", 2000, 10, arrival_s=0.0))   # 2010 tokens > 64 x 16: never fits
  res = simulate(reqs, cfg, cost)
  assert [r for r, _ in res.rejected] == ["huge"]
  finished = [tl for tl in res.timelines if tl.finished]
  assert len(finished) == 40
  assert res.counters["rotations_out"] > 0 and res.counters["transfer_s"] > 0
  step_p50 = sorted(res.step_times_s)[len(res.step_times_s) // 2]
  assert 3e-3 < step_p50 < 30e-3     # a GH200 Llama-3-8B step: milliseconds


def test_simulator_accepts_an_injected_scheduler():
  reqs = _workload(n=8)
  cfg = _config("fcfs", False)
  clock = VirtualClock(start=100.0)
  sched = Scheduler(cfg.scheduler, BlockManager(20, 256, 8), clock)
  res = Simulator(sched, clock, ConstCost(), pipeline=False, block_bytes=1000).run(reqs)
  assert all(tl.arrival_s >= 100.0 and tl.finished for tl in res.timelines)
  assert not sched.has_unfinished()


@pytest.mark.parametrize("policy", ["fcfs", "fcfs_swap", "sf", "wf", "rotasched", "rotasched_strict",
                                    "rotasched_code", "edf"])
def test_every_policy_finishes_every_request(policy):
  reqs = _workload(n=30, rps=100.0, seed=7)
  res = simulate(reqs, _config(policy, True), ConstCost(xfer=0.003))
  assert len(res.timelines) == 30 and all(tl.finished for tl in res.timelines), policy
  for tl in res.timelines:
    tl.validate()
    assert tl.output_len == tl.target_output_len
  c = res.counters
  assert c["swap_out_bytes"] == (c["blocks_out"] + c["blocks_writeback"]) * 1000


def test_pool_occupancy_and_kv_demand_per_plan():
  """4-block pool, block size 8, fcfs, no pipeline: A (prompt 16 = 2 blocks, 4 tokens) and B (prompt 24 = 3
  blocks, 2 tokens) arrive at 0. Plan 0: A's prefill (2 of 4 blocks resident), B queued needing 3: demand
  5/4. Plans 1-3: A decodes tokens 17-19 (a 3rd block), B still queued: 3/4 resident, demand 6/4. Plan 4: A
  is done, B's prefill (3/4, nothing queued); plan 5: B's 25th token takes the 4th block."""
  cfg = EngineConfig.create(policy="fcfs", pipeline=False, num_device_blocks=4, num_host_blocks=16, block_size=8,
                            max_num_seqs=4, max_num_batched_tokens=64)
  reqs = [RequestSpec("A", "", 16, 4, 0.0), RequestSpec("B", "", 24, 2, 0.0)]
  res = simulate(reqs, cfg, ConstCost())
  assert res.occupancy == [0.5, 0.75, 0.75, 0.75, 0.75, 1.0]
  assert res.kv_demand == [1.25, 1.5, 1.5, 1.5, 0.75, 1.0]
  assert res.counters["kv_contended_steps"] == 4
  assert res.counters["contended_steps"] == 0     # fcfs flags nothing itself: the loop measures contention
  assert len(res.occupancy) == res.counters["plans"]


def test_contention_summary():
  from superinfer_jax.sim.sim_sweep import contention_summary
  s = contention_summary([0.1 * i for i in range(101)], [1.0] * 101)
  assert s["pool_occupancy_p50"] == pytest.approx(5.0) and s["pool_occupancy_p99"] == pytest.approx(9.9)
  assert s["kv_demand_p99"] == 1.0
  assert contention_summary([], []) == dict.fromkeys(
      ("pool_occupancy_p50", "pool_occupancy_p99", "kv_demand_p50", "kv_demand_p99"))
