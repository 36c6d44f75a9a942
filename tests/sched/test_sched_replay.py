"""The plan-hash check: every policy over every replay scenario (``sched/replay.py``) makes exactly the plans
it made when ``tests/fixtures/sched_plan_hashes.json`` was recorded (block ids and tie-breaking included).

A change meant to be behaviour-preserving (an optimisation) must leave the hashes alone. A deliberate change
of what a policy decides re-records them with
``python scripts/bench_scheduler.py --plan_hashes > tests/fixtures/sched_plan_hashes.json`` and says so.
"""
import dataclasses
import gc
import json
import os
import sys

import pytest

from superinfer_jax.sched import POLICIES
from superinfer_jax.sched import replay
from superinfer_jax.util import machine_description

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "sched_plan_hashes.json")
STEPS = 400  # scripts/bench_scheduler.py --hash_steps default, with which the fixture was recorded


def _pinned():
  with open(FIXTURE) as f:
    return json.load(f)


def test_fixture_covers_every_policy_and_scenario():
  pinned = _pinned()
  assert sorted(pinned) == sorted(POLICIES)
  for p in pinned:
    assert sorted(pinned[p]) == sorted(replay.SCENARIOS), p


@pytest.mark.parametrize("scenario", sorted(replay.SCENARIOS))
def test_plans_unchanged(scenario):
  pinned = _pinned()
  got = replay.plan_hashes(sorted(POLICIES), [scenario], STEPS)
  assert {p: got[p][scenario] for p in got} == {p: pinned[p][scenario] for p in pinned}


def test_hash_sees_a_changed_decision():
  """The fingerprint is sensitive: a pool one block smaller, or a smaller B_xfer, changes the hash; and
  one field of one plan changes its fingerprint."""
  sc = replay.SCENARIOS["bench"]
  base = replay.run_scenario("rotasched", sc, 60)
  assert replay.run_scenario("rotasched", sc, 60) == base  # deterministic
  smaller = dataclasses.replace(sc, device_blocks=sc.device_blocks - 1)
  assert replay.run_scenario("rotasched", smaller, 60) != base
  tighter = dataclasses.replace(sc, config={**sc.config, "proactive_swap_budget": 100})
  assert replay.run_scenario("rotasched", tighter, 60) != base
  rp = replay.Replay("rotasched", sc)
  plan = rp.schedule()
  before = replay.plan_fingerprint(plan)
  plan.scheduled[-1].block_table[-1] += 1
  assert replay.plan_fingerprint(plan) != before


def test_replay_keeps_invariants():
  for name, sc in replay.SCENARIOS.items():
    if name != "bench_1k":
      replay.run_scenario("rotasched", sc, 120, check_every=10)


def test_bench_scheduler_times_both_policies_and_reports_the_ratio():
  import subprocess
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = subprocess.run(
      [sys.executable, os.path.join(root, "scripts", "bench_scheduler.py"), "--policy=rotasched",
       "--num_requests=60", "--device_blocks=256", "--steps=12", "--warmup=3", "--repeats=2", "--chunk=5",
       "--rewarm=1", "--count_opcodes=2"],
      check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": root}).stdout
  rows = [json.loads(line) for line in out.splitlines()]
  assert [r["policy"] for r in rows[:-1]] == ["rotasched", "fcfs", "rotasched", "fcfs"]
  assert [r["seed"] for r in rows[:-1]] == [0, 0, 1, 1]
  summary = rows[-1]
  assert summary["baseline"] == "fcfs" and len(summary["p99_ratios"]) == 2
  # chunks of 5, 5 and 2 steps, the first (--rewarm=1) of each untimed: 9 timed steps per run, 18 per policy pooled
  assert [r["steps"] for r in rows[:-1]] == [9] * 4 and summary["samples"] == 18
  best = {p: min(r["p99_ms"] for r in rows[:-1] if r["policy"] == p) for p in ("rotasched", "fcfs")}
  assert summary["best_p99_ratio"] == round(best["rotasched"] / best["fcfs"], 3)
  assert summary["opcodes_per_step"] > 0 and summary["baseline_opcodes_per_step"] > 0
  assert summary["opcode_ratio"] == pytest.approx(
      summary["opcodes_per_step"] / summary["baseline_opcodes_per_step"], abs=1e-3)
  ratio = summary["p99_ms"] / summary["baseline_p99_ms"]  # p99s rounded to 0.1 us
  assert abs(summary["p99_ratio"] - ratio) < 1e-2 * ratio
  # the pooled p99 (index int(0.99 * 18) = 17: the largest) is the largest per-run p99 of that policy here
  worst = {p: max(r["p99_ms"] for r in rows[:-1] if r["policy"] == p) for p in ("rotasched", "fcfs")}
  assert summary["p99_ms"] == worst["rotasched"] and summary["baseline_p99_ms"] == worst["fcfs"]
  assert summary["median_round_p99_ratio"] in summary["p99_ratios"]
  running = {p: sum(r["mean_running"] for r in rows[:-1] if r["policy"] == p) for p in ("rotasched", "fcfs")}
  assert summary["running_ratio"] == round(running["rotasched"] / running["fcfs"], 3) > 0
  assert summary["machine"] == machine_description()  # the ratio depends on the box: the row says which
  # the same seed replays the same plans (the plan hash is of the workload, not of the timing)
  again = replay.Replay("rotasched", replay.Scenario(
      device_blocks=256, host_blocks=8 * 256, block_size=16, num_requests=60, prompt_len=(32, 1024),
      max_tokens=(32, 512), config=dict(max_num_seqs=256, max_num_batched_tokens=8192)), 0)
  for _ in range(15):
    again.complete(again.schedule())
  assert again.hexdigest() == rows[0]["plan_hash"]


def test_opcode_count_is_deterministic_and_sees_the_rotation_work():
  sc = replay.SCENARIOS["bench"]
  rot = replay.schedule_opcodes("rotasched", sc, warmup=30, steps=4)
  assert rot == replay.schedule_opcodes("rotasched", sc, warmup=30, steps=4)  # a fresh replay counts the same
  fcfs = replay.schedule_opcodes("fcfs", sc, warmup=30, steps=4)
  assert 0 < fcfs < rot  # under contention rotasched also rotates requests out and in

  def three():
    return sum([1, 2])

  # a frame's own instructions and its callees' are counted; the tracer is removed afterwards
  result, n = replay.count_opcodes(three)
  assert result == 3 and n > 0 and replay.count_opcodes(lambda: three() + three())[1] > 2 * n - 1
  assert sys.gettrace() is None and gc.isenabled()  # the tracer is gone and the GC runs again


def test_replay_honours_the_host_tier_knob():
  # With shared prefixes both replays take part in prefix caching; only the one with the host tier on publishes
  # host copies (the block manager gets the scenario's host_prefix_cache).
  base = dataclasses.replace(replay.SCENARIOS["bench"], shared_prefixes=4, prefix_blocks=4)
  published = {}
  for host_tier in (True, False):
    sc = dataclasses.replace(base, config={**base.config, "host_prefix_cache": host_tier})
    rp = replay.Replay("rotasched", sc, 0)
    for _ in range(60):
      rp.complete(rp.schedule())
    assert rp.bm.host_prefix_cache is host_tier
    published[host_tier] = (rp.bm.num_cached_requests, rp.bm.host.num_published)
  assert published[True][0] > 0 and published[False][0] > 0
  assert published[True][1] > 0 and published[False][1] == 0


PREFIX_FIXTURE = os.path.join(os.path.dirname(FIXTURE), "sched_plan_hashes_prefix.json")
PREFIX_STEPS = 300


def _prefix_scenario(name: str) -> replay.Scenario:
  """``scenario/prefix_blocks=P``: a replay scenario whose requests share prefixes (4 of them, ``P`` blocks long;
  0: every request hashed, none shared): prefix caching engaged."""
  scenario, pb = name.split("/prefix_blocks=")
  return dataclasses.replace(replay.SCENARIOS[scenario], shared_prefixes=4, prefix_blocks=int(pb))


@pytest.mark.parametrize("scenario", ["bench", "small_host", "lookahead"])
def test_prefix_caching_plans_unchanged(scenario):
  """Every policy with prefix caching engaged makes the plans pinned in ``sched_plan_hashes_prefix.json``: a change
  meant to keep every decision (an optimisation of the prefix-caching paths, as shared runs were) leaves them."""
  with open(PREFIX_FIXTURE) as f:
    pinned = json.load(f)
  assert sorted(pinned) == sorted(POLICIES)
  names = [n for n in pinned["fcfs"] if n.startswith(scenario + "/")]
  assert len(names) == 3
  for name in names:
    sc = _prefix_scenario(name)
    got = {p: replay.run_scenario(p, sc, PREFIX_STEPS) for p in sorted(POLICIES)}
    assert got == {p: pinned[p][name] for p in pinned}, name
