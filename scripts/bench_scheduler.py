"""Times ``Scheduler.schedule()`` with N live requests in mixed states (running / waiting / rotary), for a
policy and a baseline policy side by side in one run, and reports the ratio of their costs.

Setup: block size 16, a device pool sized for ``--device_blocks`` blocks, a host pool 8x larger, the paper's
knobs (B_xfer = 2400, max_num_batched_tokens 8192, max_num_seqs 256). N requests (prompt 32..1024,
output 32..512 tokens) arrive over the first second of a virtual clock; the loop warms up for
``--warmup`` steps, then runs ``--steps`` more and times their calls to ``schedule()`` (only that call;
completing the step is not timed, nor is freeing the previous step's plan (it is released outside the
timer); nor are the first ``--rewarm`` steps of each chunk, below). Finished
requests are replaced so N stays constant. The workload is ``sched.replay.Replay`` (the ``bench_1k`` replay
scenario at the defaults).

  python scripts/bench_scheduler.py --policy=rotasched --num_requests=1000

prints one JSON line per policy and run, ``{"policy", "num_requests", "mean_ms", "p99_ms", ...,
"plan_hash"}``, then a summary line ``{"policy", "baseline", "p99_ratio", "mean_ratio", "p99_ratios",
"loadavg_1m", "machine", ...}`` (``machine``: ``util.machine_description()``, the CPU and its L2 / L3
sizes: the ratio moves with the core's cache). ``--baseline`` (default fcfs; empty: none) is timed on the same seeds in the same
process. Each round (``--repeats`` rounds, seeds ``seed + i``) builds both replays and warms both up, then
times the policy's steps and then the baseline's (policy, baseline, policy, baseline, ... over the rounds).
The first ``--rewarm`` (3) timed-window steps of each run are run but not timed: they refill the caches the
other replay evicted (the first steps after a switch are slower than a steady step, for both policies). ``steps`` in a row = timed calls, ``--steps`` minus ``--rewarm`` per chunk; every replay still runs
``--warmup + --steps`` steps, so ``plan_hash`` is that of a plain run.

``--chunk=K`` (default 0: one chunk per run) alternates the two replays every ``K`` steps instead, so that a
change in machine load hits both alike, each chunk starting with ``--rewarm`` untimed steps. Not the
default: each switch leaves cold-cache steps in both policies' tails, which biases the p99 ratio low.

Summary: ``p50_ms`` / ``p99_ms`` / ``baseline_*`` and ``p99_ratio`` / ``mean_ratio`` are over every timed
step of each policy in the run, pooled over the rounds (``samples`` steps each; with 3 x 497 samples the
p99 is the 15th largest step, not the 6th of one round, so one noisy burst no longer decides it).
``running_ratio`` is the policy's mean number of running requests a step over the baseline's (the work a step
schedules: above 1 where prefix caching's hits shorten prefills and more requests run). ``p99_ratios`` are the
per-round ratios (their spread shows the noise), ``median_round_p99_ratio`` their
median, and ``best_p99_ratio`` the ratio of the lowest per-round p99 of each policy (it compares whichever
round of each policy was luckiest). ``plan_hash`` is the
SHA-256 of every plan of the run (``sched/replay.py``): equal hashes before and after a change mean
identical decisions.

The cost of a step is O(running + blocks rotated + log N): with B_xfer = 2400 and heavy oversubscription
rotasched moves up to 2400 blocks each way per step, and that bookkeeping dominates.
``mean_ms``/``p99_ms`` are CPU time of the calling thread (``time.thread_time``), so that other processes on
a shared box do not inflate them; ``wall_mean_ms``/``wall_p99_ms`` are wall-clock times of the same calls.

Python's cyclic GC runs inside ``schedule()`` whenever the step's allocations (plan lists, ``ScheduledSeq``
objects; block pairs are ``PairList`` int columns, not tuples) cross its threshold, so its pauses are part of
``mean_ms``/``p99_ms``. ``gc_mean_ms`` is the CPU time those collections took per timed step, and
``p99_ms_ex_gc`` the p99 of the per-step CPU time minus its GC time: the scheduler's own work.

``--count_opcodes=K`` (default 0: off) adds ``opcodes_per_step`` / ``baseline_opcodes_per_step`` and ``opcode_ratio``
to the summary: the mean number of bytecode instructions one ``schedule()`` call executes
(``sched.replay.count_opcodes``, ``sys.settrace`` opcode events), over ``K`` traced calls of a fresh replay per policy
after ``--warmup`` steps (with ``--baseline_no_caching``: the policy with caching on and off). Unlike the timings it
does not move with machine load (same state, same count), so it shows a change in the scheduler's Python work on a
noisy box. It is not the whole cost: work inside C functions counts as one instruction (a list copy,
``sum(map(...))``), and cache misses count nothing, so the time ratio runs above it. Do not optimise for it: moving
per-element work into ``map(attrgetter(...))`` lowers the count but costs more machine instructions than a
comprehension; judge hot-path changes by callgrind instructions.

``--shared_prefixes=K`` gives every request block hashes (prefix caching engages: its first
``--prefix_blocks`` blocks are one of ``K`` shared prefixes); ``--baseline_no_caching`` then times the policy
against itself with ``enable_prefix_caching`` off on the same workload (the baseline row's policy is
``<policy>:no_caching``): prefix caching's scheduler cost side by side. With shared prefixes caching changes
the decisions (hits shorten prefills: more requests run per step), so the ratio includes that work;
``--prefix_blocks=0`` gives every request blocks of its own (hashed, never hit): the same requests run and
rotate as with caching off (unless a re-adopted parked group saves transfer budget), so the ratio is the
bookkeeping alone.

``--plan_hashes`` skips the timing and prints ``{policy: {scenario: sha256}}`` for every policy over the
replay scenarios (``sched/replay.py``; ``--hash_steps`` steps each): the plan-hash check, pinned by
``tests/sched/test_sched_replay.py``.
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
from superinfer_jax.util import machine_description

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
flags.DEFINE_integer("repeats", 1, "rounds of timed runs (fresh state each, seeds seed..seed+repeats-1)")
flags.DEFINE_integer("chunk", 0, "timed steps alternate between the policy and the baseline in chunks of this many "
                     "steps (the first --rewarm of each untimed); 0: each run's steps in one chunk")
flags.DEFINE_integer("rewarm", 3, "untimed steps at the start of each chunk (caches refill after the other replay ran)")
flags.DEFINE_string("baseline", "fcfs", "policy timed side by side with --policy (empty: none)")
flags.DEFINE_integer("count_opcodes", 0, "also count the bytecode instructions of this many schedule() calls per "
                     "policy (fresh replays after --warmup steps, seed --seed; untimed): noise-free, see the docstring")
flags.DEFINE_integer("shared_prefixes", 0, "prefix caching: requests carry block hashes, their first --prefix_blocks "
                     "blocks one of this many shared prefixes (0: no hashes, caching never engages)")
flags.DEFINE_integer("prefix_blocks", 8, "blocks of the shared prefix (within the prompt)")
flags.DEFINE_bool("baseline_no_caching", False, "the baseline is --policy itself with enable_prefix_caching off "
                  "(same workload, hashes ignored): prefix caching's cost side by side (needs --shared_prefixes)")
flags.DEFINE_bool("plan_hashes", False, "print the plan hashes of every policy over the replay scenarios")
flags.DEFINE_integer("hash_steps", 400, "steps per replay scenario for --plan_hashes")
F = flags.FLAGS


NO_CACHING = ":no_caching"  # a run label suffix: the policy with enable_prefix_caching off


def scenario_from_flags(caching: bool = True) -> replay.Scenario:
  cfg = configtree.from_flags(SchedulerConfig)
  knobs = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "policy"}
  if not caching:
    knobs["enable_prefix_caching"] = False
  return replay.Scenario(device_blocks=F.device_blocks, host_blocks=8 * F.device_blocks, block_size=16,
                         num_requests=F.num_requests, prompt_len=(32, 1024), max_tokens=(32, 512),
                         config=knobs, step_s=F.step_s, shared_prefixes=F.shared_prefixes,
                         prefix_blocks=F.prefix_blocks)


def _p99(sorted_values: list) -> float:
  n = len(sorted_values)
  return sorted_values[min(n - 1, int(0.99 * n))]


class _TimedRun:
  """One (policy, seed) replay whose ``schedule()`` calls are timed chunk by chunk (see the module docstring).

  ``advance(n)`` runs the replay's next ``n`` steps; the first ``F.warmup`` steps of the run and the first
  ``F.rewarm`` steps of every call after the warm-up are not timed (they refill the caches the other replay's
  chunk evicted).
  """

  def __init__(self, policy: str, seed: int):
    self.policy = policy
    self.seed = seed
    name = policy[:-len(NO_CACHING)] if policy.endswith(NO_CACHING) else policy
    self.rp = replay.Replay(name, scenario_from_flags(caching=name == policy), seed)
    self.step = 0
    self.times = []
    self.wall = []
    self.gc_times = []
    self.mix = {"running": 0, "waiting": 0, "rotary": 0}

  def advance(self, n: int) -> None:
    rp = self.rp
    sched = rp.sched
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
      for i in range(n):
        gc_state["total"] = 0.0
        gc_state["in_step"] = True
        t0 = time.perf_counter()
        c0 = time.thread_time()
        plan = rp.schedule()
        dc = time.thread_time() - c0
        dt = time.perf_counter() - t0
        gc_state["in_step"] = False
        if self.step >= F.warmup and i >= F.rewarm:
          self.times.append(dc)
          self.wall.append(dt)
          self.gc_times.append(gc_state["total"])
          self.mix["running"] += sched.num_running
          self.mix["waiting"] += sched.num_waiting
          self.mix["rotary"] += sched.num_rotary
        self.step += 1
        rp.complete(plan)
        plan = None  # freed here, untimed: else the next call's timer would also cover this plan's deallocation
    finally:
      gc.callbacks.remove(on_gc)

  def row(self) -> dict:
    sched = self.rp.sched
    ex_gc = sorted(t - g for t, g in zip(self.times, self.gc_times))
    times = sorted(self.times)
    wall = sorted(self.wall)
    n = len(times)
    return {
        "policy": self.policy,
        "num_requests": F.num_requests,
        "seed": self.seed,
        "mean_ms": round(1e3 * sum(times) / n, 4),
        "p50_ms": round(1e3 * times[n // 2], 4),
        "p99_ms": round(1e3 * _p99(times), 4),
        "wall_mean_ms": round(1e3 * sum(wall) / n, 4),
        "wall_p99_ms": round(1e3 * _p99(wall), 4),
        "gc_mean_ms": round(1e3 * sum(self.gc_times) / n, 4),
        "p99_ms_ex_gc": round(1e3 * _p99(ex_gc), 4),
        "mean_running": round(self.mix["running"] / n, 1),
        "mean_waiting": round(self.mix["waiting"] / n, 1),
        "mean_rotary": round(self.mix["rotary"] / n, 1),
        "rotations": sched.totals["rotations_out"] + sched.totals["rotations_in"],
        "recompute_preemptions": sched.totals["recompute_preemptions"],
        "steps": n,
        "plan_hash": self.rp.hexdigest(),
    }


def _chunks(total: int, chunk: int) -> list[int]:
  """``total`` steps as consecutive chunks of at most ``chunk`` (> ``--rewarm``: each chunk's first steps are
  untimed)."""
  chunk = max(F.rewarm + 1, chunk)
  return [min(chunk, total - i) for i in range(0, total, chunk)]


def run_round(policies: list[str], seed: int) -> list[_TimedRun]:
  """One round: each policy's replay warmed up, then their timed steps alternated chunk by chunk."""
  runs = [_TimedRun(p, seed) for p in policies]
  for run in runs:
    run.advance(F.warmup)
  for n in _chunks(F.steps, F.chunk if F.chunk > 0 else F.steps):
    for run in runs:
      run.advance(n)
  return runs


def compare(policy: str, baseline: str, repeats: int, seed: int) -> tuple[list, dict | None]:
  """Rounds of both policies (chunks alternated within a round); returns (every run's row, the summary row or None)."""
  rows = []
  ratios = []
  samples = {policy: [], baseline: []}
  for i in range(repeats):
    runs = run_round([policy, baseline] if baseline else [policy], seed + i)
    for run in runs:
      rows.append(run.row())
      samples[run.policy] += run.times
    if baseline:
      ratios.append(round(rows[-2]["p99_ms"] / rows[-1]["p99_ms"], 3))
  if not baseline:
    return rows, None
  pooled = {p: sorted(samples[p]) for p in (policy, baseline)}
  p99 = {p: 1e3 * _p99(v) for p, v in pooled.items()}
  mean = {p: 1e3 * sum(v) / len(v) for p, v in pooled.items()}
  best = {p: min(r["p99_ms"] for r in rows if r["policy"] == p) for p in (policy, baseline)}
  running = {p: sum(r["mean_running"] for r in rows if r["policy"] == p) for p in (policy, baseline)}
  summary = {
      "policy": policy, "baseline": baseline, "num_requests": F.num_requests, "repeats": repeats,
      "chunk": F.chunk, "samples": len(pooled[policy]),
      "p50_ms": round(1e3 * pooled[policy][len(pooled[policy]) // 2], 4), "p99_ms": round(p99[policy], 4),
      "baseline_p50_ms": round(1e3 * pooled[baseline][len(pooled[baseline]) // 2], 4),
      "baseline_p99_ms": round(p99[baseline], 4),
      "p99_ratio": round(p99[policy] / p99[baseline], 3),
      "mean_ratio": round(mean[policy] / mean[baseline], 3),
      "running_ratio": round(running[policy] / running[baseline], 3),
      "p99_ratios": ratios,
      "median_round_p99_ratio": sorted(ratios)[len(ratios) // 2],
      "best_p99_ratio": round(best[policy] / best[baseline], 3),
      "loadavg_1m": os.getloadavg()[0],
      "machine": machine_description(),
  }
  return rows, summary


def main(argv):
  del argv
  if F.plan_hashes:
    print(json.dumps(replay.plan_hashes(sorted(POLICIES), sorted(replay.SCENARIOS), F.hash_steps), indent=1))
    return
  if F.baseline and F.baseline not in POLICIES:
    raise app.UsageError(f"--baseline={F.baseline!r}: not a policy ({sorted(POLICIES)})")
  if F.baseline_no_caching and not F.shared_prefixes:
    raise app.UsageError("--baseline_no_caching needs --shared_prefixes > 0 (else caching never engages)")
  baseline = F.policy + NO_CACHING if F.baseline_no_caching else F.baseline
  rows, summary = compare(F.policy, baseline if baseline != F.policy else "", F.repeats, F.seed)
  if summary is not None and F.count_opcodes > 0:
    ops = {p: replay.schedule_opcodes(p.removesuffix(NO_CACHING),
                                      scenario_from_flags(caching=not p.endswith(NO_CACHING)),
                                      F.warmup, F.count_opcodes, F.seed)
           for p in (F.policy, baseline)}
    summary.update(opcodes_per_step=round(ops[F.policy], 1), baseline_opcodes_per_step=round(ops[baseline], 1),
                   opcode_ratio=round(ops[F.policy] / ops[baseline], 3))
  for row in rows:
    print(json.dumps(row))
  if summary is not None:
    print(json.dumps(summary))


if __name__ == "__main__":
  app.run(main)
