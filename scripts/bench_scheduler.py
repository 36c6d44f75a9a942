"""Times ``Scheduler.schedule()`` with N live requests in mixed states (running / waiting / rotary), for a
policy and a baseline policy side by side in one run, and reports the ratio of their costs.

Setup: block size 16, a device pool sized for ``--device_blocks`` blocks, a host pool 8x larger, the paper's
knobs (B_xfer = 2400, max_num_batched_tokens 8192, max_num_seqs 256). N requests (prompt 32..1024,
output 32..512 tokens) arrive over the first second of a virtual clock; the loop warms up for
``--warmup`` steps, then times ``--steps`` calls to ``schedule()`` (only that call; completing the step is
not timed). Finished requests are replaced so N stays constant. The workload is ``sched.replay.Replay`` (the
``bench_1k`` replay scenario at the defaults).

  python scripts/bench_scheduler.py --policy=rotasched --num_requests=1000

prints one JSON line per policy and run, ``{"policy", "num_requests", "mean_ms", "p99_ms", ...,
"plan_hash"}``, then a summary line ``{"policy", "baseline", "p99_ratio", "mean_ratio", "p99_ratios",
"loadavg_1m", ...}``. ``--baseline`` (default fcfs; empty: none) is timed on the same seeds, its runs
interleaved with the policy's (policy, baseline, policy, baseline, ... for ``--repeats`` rounds) so that a
change in machine load hits both; ``p99_ratio`` is the ratio of the best (lowest) p99 of each policy over
the rounds, ``p99_ratios`` the per-round ratios (their spread shows the noise). ``plan_hash`` is the SHA-256
of every plan of the run (``sched/replay.py``): equal hashes before and after a change mean identical
decisions.

The cost of a step is O(running + blocks rotated + log N): with B_xfer = 2400 and heavy oversubscription
rotasched moves up to 2400 blocks each way per step, and that bookkeeping dominates (see WORKSPACE_NOTES).
``mean_ms``/``p99_ms`` are CPU time of the calling thread (``time.thread_time``), so that other processes on
a shared box do not inflate them; ``wall_mean_ms``/``wall_p99_ms`` are wall-clock times of the same calls.

Python's cyclic GC runs inside ``schedule()`` whenever the step's allocations (plan lists, ``ScheduledSeq``
objects; block pairs are ``PairList`` int columns, not tuples) cross its threshold, so its pauses are part of
``mean_ms``/``p99_ms``. ``gc_mean_ms`` is the CPU time those collections took per timed step, and
``p99_ms_ex_gc`` the p99 of the per-step CPU time minus its GC time: the scheduler's own work.

``--plan_hashes`` skips the timing and prints ``{policy: {scenario: sha256}}`` for every policy over the
replay scenarios (``sched/replay.py``; ``--hash_steps`` steps each): the plan-hash check, pinned by
``tests/test_sched_replay.py``.
"""
import dataclasses
import gc
import json
import os
import time

from absl import app, flags

from superinfer_jax import configtree
from superinfer_jax.sched import POLICIES, SchedulerConfig
from superinfer_jax.sched import replay

# Every scheduler knob is a flag generated from SchedulerConfig (one name, default and help per setting);
# this benchmark only moves two defaults to the paper's artifact scale.
configtree.define_flags(SchedulerConfig)
flags.FLAGS.set_default("max_num_seqs", 256)
flags.FLAGS.set_default("max_num_batched_tokens", 8192)
flags.DEFINE_integer("num_requests", 1000, "live requests kept in the scheduler")
flags.DEFINE_integer("steps", 500, "timed schedule() calls")
flags.DEFINE_integer("warmup", 200, "untimed steps first")
flags.DEFINE_integer("device_blocks", 8192, "device pool size in 16-token blocks")
flags.DEFINE_integer("seed", 0, "random seed (round i uses seed + i)")
flags.DEFINE_float("step_s", 0.05, "virtual seconds per step")
flags.DEFINE_integer("repeats", 1, "rounds of timed runs (fresh state each); the best p99 of each policy is kept")
flags.DEFINE_string("baseline", "fcfs", "policy timed side by side with --policy (empty: none)")
flags.DEFINE_bool("plan_hashes", False, "print the plan hashes of every policy over the replay scenarios")
flags.DEFINE_integer("hash_steps", 400, "steps per replay scenario for --plan_hashes")
F = flags.FLAGS


def scenario_from_flags() -> replay.Scenario:
  cfg = configtree.from_flags(SchedulerConfig)
  knobs = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "policy"}
  return replay.Scenario(device_blocks=F.device_blocks, host_blocks=8 * F.device_blocks, block_size=16,
                         num_requests=F.num_requests, prompt_len=(32, 1024), max_tokens=(32, 512),
                         config=knobs, step_s=F.step_s)


def _p99(sorted_values: list) -> float:
  n = len(sorted_values)
  return sorted_values[min(n - 1, int(0.99 * n))]


def run_once(policy: str, seed: int) -> dict:
  rp = replay.Replay(policy, scenario_from_flags(), seed)
  sched = rp.sched
  times = []
  wall = []
  gc_times = []
  mix = {"running": 0, "waiting": 0, "rotary": 0}
  gc_state = {"in_step": False, "start": 0.0, "total": 0.0}

  def on_gc(phase, info):
    del info
    if gc_state["in_step"]:
      if phase == "start":
        gc_state["start"] = time.thread_time()
      else:
        gc_state["total"] += time.thread_time() - gc_state["start"]

  gc.callbacks.append(on_gc)
  try:
    for step in range(F.warmup + F.steps):
      gc_state["total"] = 0.0
      gc_state["in_step"] = True
      t0 = time.perf_counter()
      c0 = time.thread_time()
      plan = rp.schedule()
      dc = time.thread_time() - c0
      dt = time.perf_counter() - t0
      gc_state["in_step"] = False
      if step >= F.warmup:
        times.append(dc)
        wall.append(dt)
        gc_times.append(gc_state["total"])
        mix["running"] += sched.num_running
        mix["waiting"] += sched.num_waiting
        mix["rotary"] += sched.num_rotary
      rp.complete(plan)
  finally:
    gc.callbacks.remove(on_gc)
  ex_gc = sorted(t - g for t, g in zip(times, gc_times))
  times.sort()
  wall.sort()
  n = len(times)
  return {
      "policy": policy,
      "num_requests": F.num_requests,
      "seed": seed,
      "mean_ms": round(1e3 * sum(times) / n, 4),
      "p50_ms": round(1e3 * times[n // 2], 4),
      "p99_ms": round(1e3 * _p99(times), 4),
      "wall_mean_ms": round(1e3 * sum(wall) / n, 4),
      "wall_p99_ms": round(1e3 * _p99(wall), 4),
      "gc_mean_ms": round(1e3 * sum(gc_times) / n, 4),
      "p99_ms_ex_gc": round(1e3 * _p99(ex_gc), 4),
      "mean_running": round(mix["running"] / n, 1),
      "mean_waiting": round(mix["waiting"] / n, 1),
      "mean_rotary": round(mix["rotary"] / n, 1),
      "rotations": sched.totals["rotations_out"] + sched.totals["rotations_in"],
      "recompute_preemptions": sched.totals["recompute_preemptions"],
      "steps": n,
      "plan_hash": rp.hexdigest(),
  }


def compare(policy: str, baseline: str, repeats: int, seed: int) -> tuple[list, dict | None]:
  """Interleaved rounds of both policies; returns (every run's row, the summary row or None)."""
  rows = []
  ratios = []
  for i in range(repeats):
    mine = run_once(policy, seed + i)
    rows.append(mine)
    if baseline:
      base = run_once(baseline, seed + i)
      rows.append(base)
      ratios.append(round(mine["p99_ms"] / base["p99_ms"], 3))
  if not baseline:
    return rows, None
  best = {p: min((r for r in rows if r["policy"] == p), key=lambda r: r["p99_ms"]) for p in (policy, baseline)}
  summary = {
      "policy": policy, "baseline": baseline, "num_requests": F.num_requests, "repeats": repeats,
      "p50_ms": best[policy]["p50_ms"], "p99_ms": best[policy]["p99_ms"],
      "baseline_p50_ms": best[baseline]["p50_ms"], "baseline_p99_ms": best[baseline]["p99_ms"],
      "p99_ratio": round(best[policy]["p99_ms"] / best[baseline]["p99_ms"], 3),
      "mean_ratio": round(best[policy]["mean_ms"] / best[baseline]["mean_ms"], 3),
      "p99_ratios": ratios,
      "loadavg_1m": os.getloadavg()[0],
  }
  return rows, summary


def main(argv):
  del argv
  if F.plan_hashes:
    print(json.dumps(replay.plan_hashes(sorted(POLICIES), sorted(replay.SCENARIOS), F.hash_steps), indent=1))
    return
  if F.baseline and F.baseline not in POLICIES:
    raise app.UsageError(f"--baseline={F.baseline!r}: not a policy ({sorted(POLICIES)})")
  rows, summary = compare(F.policy, F.baseline if F.baseline != F.policy else "", F.repeats, F.seed)
  for row in rows:
    print(json.dumps(row))
  if summary is not None:
    print(json.dumps(summary))


if __name__ == "__main__":
  app.run(main)
