"""configs/experiments/gpu.flags at CPU scale (gpu_tiny.flags): the contended experiment, the simulator replaying
the same requests, the real-vs-simulated table and its plots; and the policy-entry syntax it uses."""
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from superinfer_jax.sweep import SweepSpec, parse_policy_entry, variant_label

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The policies that rotate on every contended step; wf's few rotations depend on timing under load.
ROTATING = ("rotasched", "rotasched_strict", "rotasched[proactive_swap_budget=8]")


def test_policy_entries_carry_their_own_settings():
  assert parse_policy_entry("rotasched") == ("rotasched", {})
  assert parse_policy_entry("rotasched[proactive_swap_budget=8, alpha=2]") == (
      "rotasched", {"proactive_swap_budget": "8", "alpha": "2"})
  spec = SweepSpec(policies="fcfs,rotasched[proactive_swap_budget=8,alpha=2]", vary="alpha:1,3")
  assert spec.policy_names == ["fcfs", "rotasched"]
  assert spec.arms == [("fcfs", {"alpha": "1"}), ("fcfs", {"alpha": "3"}),
                       ("rotasched", {"alpha": "2", "proactive_swap_budget": "8"}),
                       ("rotasched", {"alpha": "2", "proactive_swap_budget": "8"})]
  label = variant_label("rotasched", {"proactive_swap_budget": "8", "alpha": "2"})
  assert SweepSpec(policies=f"fcfs,{label}").arms[1] == ("rotasched", {"proactive_swap_budget": "8", "alpha": "2"})
  for bad in ("rotasched[", "rotasched[x]", "[x=1]", "rotasched[x=]"):
    with pytest.raises(ValueError):
      SweepSpec(policies=bad)


@pytest.mark.slow
def test_gpu_flagfile_at_cpu_scale(tmp_path):
  out = tmp_path / "gpu"
  cmd = [sys.executable, str(ROOT / "scripts" / "run_experiment.py"),
         "--flagfile=configs/experiments/gpu.flags", "--flagfile=configs/experiments/gpu_tiny.flags",
         f"--output_dir={out}", "--noprogress"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  doc = json.loads((out / "real_vs_sim.json").read_text())
  entries = {e["policy"]: e for e in doc["entries"]}
  assert set(entries) == {"fcfs", "fcfs_swap", "sf", "wf", "rotasched", "rotasched_strict",
                          "rotasched[proactive_swap_budget=8]"}
  for e in entries.values():
    for src in ("real", "sim"):
      for key in doc["columns"]:
        v = e[src][key]
        assert v is not None and math.isfinite(v), (e["run"], src, key, v)
  # Contention by construction: live KV exceeds the pool, and the rotation policies rotate under it.
  assert entries["fcfs"]["real"]["kv_demand_p99"] > 1.0
  for policy in ROTATING:
    real = entries[policy]["real"]
    assert real["contended_steps"] > 0 and real["num_rotations"] > 0, (policy, real)
    assert real["bytes_moved"] > 0
  assert entries["fcfs"]["real"]["num_rotations"] == 0
  table = (out / "real_vs_sim.table.md").read_text()
  assert all(f"| {e['run']}" in table for e in entries.values())
  for name in ("occupancy.png", "rotations_per_step.png", "transfer_split.png"):
    assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
