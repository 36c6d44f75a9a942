"""Multi-host through ``jax.distributed`` on one machine: two CPU processes joined on loopback (one CPU device
each, a 2-device "tp" mesh across them) complete ``generate.py`` with the tokens of one process, every
process made the same plans (same digest), and only process 0 prints. Also the host-side pieces of
replicated scheduling: flag / env parsing, the shared clock, and divergence detection."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from superinfer_jax.parallel.distributed import (PlanDivergenceError, ReplicatedSchedule, distributed_args,
                                                 plan_fingerprint)
from superinfer_jax.sched.plan import ScheduledSeq, StepPlan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(num_devices: int) -> dict[str, str]:
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(num_devices), PYTHONPATH=ROOT)
  for k in ("XLA_FLAGS", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(k, None)
  return env


def test_two_processes_generate_the_tokens_of_one(tiny_model_dir):
  rng = np.random.default_rng(0)
  prompts = [",".join(map(str, rng.integers(3, 128, n))) for n in (21, 34, 27, 40)]
  base = [sys.executable, os.path.join(ROOT, "scripts", "generate.py"), f"--model={tiny_model_dir}", "--json",
          "--max_tokens=16", "--ignore_eos", "--policy=rotasched", "--num_device_blocks=10",
          "--num_host_blocks=64", "--attention=reference"] + [f"--prompt_token_ids={p}" for p in prompts]
  single = subprocess.run(base + ["--stats"], env=_env(1), capture_output=True, text=True, timeout=600)
  assert single.returncode == 0, single.stderr[-4000:]
  want = [json.loads(line) for line in single.stdout.splitlines() if line.startswith("{")]
  assert len(want) == len(prompts) and all(len(r["token_ids"]) == 16 for r in want)
  assert json.loads(single.stderr.strip().splitlines()[-1])["rotations_out"] > 0   # under rotation pressure

  addr = f"127.0.0.1:{_free_port()}"
  procs = [subprocess.Popen(base + ["--tensor_parallel_size=2", f"--coordinator_address={addr}",
                                    "--num_processes=2", f"--process_id={i}"],
                            env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  results = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=600)
      results.append((p.returncode, out, err))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for i, (rc, _, err) in enumerate(results):
    assert rc == 0, f"process {i}: {err[-4000:]}"
  got = [json.loads(line) for line in results[0][1].splitlines() if line.startswith("{")]
  assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want]
  # Only process 0 prints results (gloo's own "[Gloo] Rank ..." lines go to stdout from C++ in both).
  assert not [line for line in results[1][1].splitlines() if line.strip() and not line.startswith("[Gloo]")]
  digests = []
  for i, (_, _, err) in enumerate(results):
    line = next(l for l in err.splitlines() if l.startswith(f"[distributed] process {i}:"))
    digests.append(line.split(":", 1)[1])
  assert digests[0] == digests[1] and " 0 plans" not in digests[0]


# ------------------------------------------------------------------------------------------- host-side

def test_distributed_args_from_flags_and_env():
  assert distributed_args(None, None, None, env={}) is None
  assert distributed_args(None, 1, None, env={}) is None
  assert distributed_args("h:1", 2, 1, env={}) == dict(coordinator_address="h:1", num_processes=2, process_id=1)
  env = {"JAX_COORDINATOR_ADDRESS": "h:2", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
  assert distributed_args(None, None, None, env=env) == dict(coordinator_address="h:2", num_processes=4,
                                                             process_id=3)
  assert distributed_args(None, None, 0, env=env)["process_id"] == 0          # a flag beats the env
  with pytest.raises(ValueError, match="process_id"):
    distributed_args("h:1", 2, None, env={})
  with pytest.raises(ValueError, match=r"not in \[0, 2\)"):
    distributed_args("h:1", 2, 2, env={})
  with pytest.raises(ValueError, match="num_processes"):
    distributed_args("h:1", None, 0, env={})
  with pytest.raises(ValueError, match="not an integer"):
    distributed_args(None, None, None, env={"JAX_NUM_PROCESSES": "two"})


class _Clock:
  def __init__(self, t):
    self.t = t

  def now(self):
    return self.t


def _plan(step_id, table):
  p = StepPlan(step_id=step_id, time=0.0)
  p.scheduled.append(ScheduledSeq("r0", 4, 0, list(table), True))
  return p


class _Group:
  """Two in-process replicas exchanging through a fake all-gather (the real one is a JAX collective)."""

  def __init__(self, times):
    self.replicas = [ReplicatedSchedule(_Clock(t), allgather=self._gather) for t in times]
    self.pending = {}

  def _gather(self, words):
    # Each replica's exchange sees every replica's current words (the others' computed here, as the
    # collective would deliver them).
    return np.stack([np.concatenate([np.array([r.inner.now()], np.float64).view(np.int32),
                                     np.frombuffer(r._hash.digest(), np.int32)])  # pylint: disable=protected-access
                     for r in self.replicas])


def test_shared_clock_takes_process_zero_and_detects_divergence():
  g = _Group([10.25, 99.0])
  assert [r.now() for r in g.replicas] == [10.25, 10.25]     # process 0's reading everywhere
  for r in g.replicas:
    r.record(_plan(0, [1, 2]))
  assert g.replicas[0].digest == g.replicas[1].digest
  assert g.replicas[1].now() == 10.25
  g.replicas[0].record(_plan(1, [1, 2, 3]))
  g.replicas[1].record(_plan(1, [1, 2, 4]))                  # a different block table: diverged
  with pytest.raises(PlanDivergenceError, match=r"processes \[1\]"):
    g.replicas[0].now()


def test_plan_fingerprint_covers_copies_and_batch():
  a, b = _plan(3, [1, 2]), _plan(3, [1, 2])
  assert plan_fingerprint(a) == plan_fingerprint(b)
  b.swap_out.append((2, 7))
  assert plan_fingerprint(a) != plan_fingerprint(b)
  c = _plan(3, [1, 2])
  c.scheduled[0].num_new_tokens = 5
  assert plan_fingerprint(a) != plan_fingerprint(c)
