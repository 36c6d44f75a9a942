"""Every flagfile in configs/experiments/ runs on a tiny model, and every ablation knob is a flag.

Each flagfile is run as written, with overrides after it that swap the real model and data for a tiny
random model and synthetic prompts (so the test takes seconds): the variants each flagfile sweeps must
come out as rows of results.jsonl with their settings applied, calibrated SLOs and the per-step rotation
figures.
"""
import glob
import json
import os
import subprocess
import sys

import pytest

from superinfer_jax.metrics.results import read_results
from superinfer_jax.sweep import SweepSpec, parse_policy_entry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# gpu.flags (real vs simulated, its own output layout) and its CPU-scale overlay gpu_tiny.flags are run by
# tests/experiment/test_gpu_experiment.py.
FLAGFILES = sorted(p for p in glob.glob(os.path.join(ROOT, "configs", "experiments", "*.flags"))
                   if not os.path.basename(p).startswith("gpu"))
ABLATION_KNOBS = ("proactive_swap_budget", "alpha", "beta_f", "beta_b", "writeback", "pipeline",
                  "transfer_mode", "kv_layout", "proactive_recompute", "min_residency")
TINY = ["--dataset=synthetic", "--num_requests=6", "--synthetic_prompt_len=uniform:10,40",
        "--synthetic_output_len=uniform:6,16", "--num_device_blocks=12", "--block_size=8",
        "--num_host_blocks=64", "--max_num_seqs=4", "--max_num_batched_tokens=64", "--seq_bucket_floor=4",
        "--blocks_bucket_floor=8", "--repeats=1", "--noprogress"]


def _run(args, timeout=600):
  return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "run_experiment.py")] + args,
                        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))


@pytest.mark.parametrize("script", ["run_experiment.py", "generate.py"])
def test_every_ablation_knob_is_a_flag(script):
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), "--helpfull"],
                        capture_output=True, text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert "--flagfile" in proc.stdout, proc.stderr[-2000:]   # absl prints the help (and exits 1)
  for knob in ABLATION_KNOBS:
    assert f"--{knob}" in proc.stdout or f"--[no]{knob}" in proc.stdout, (script, knob)


def _expected_variants(path):
  policies, vary = None, ""
  with open(path) as f:
    for line in f:
      line = line.strip()
      if line.startswith("--policies="):
        policies = [parse_policy_entry(e)[0] for e in SweepSpec(policies=line.split("=", 1)[1]).policy_entries]
      if line.startswith("--vary="):
        vary = line.split("=", 1)[1]
  n = 1
  for item in filter(None, vary.split(";")):
    n *= len(item.partition(":")[2].split(","))
  return policies, n


def test_there_is_a_flagfile_per_ablation():
  names = {os.path.basename(p) for p in FLAGFILES}
  for name in ("main", "ablation_duplexkv_modes", "ablation_writeback", "ablation_pipeline", "ablation_bxfer",
               "ablation_alpha_beta", "ablation_min_residency"):
    assert f"{name}.flags" in names


@pytest.mark.parametrize("flagfile", [p for p in FLAGFILES if os.path.basename(p) != "baselines.flags"],
                         ids=os.path.basename)
def test_flagfile_runs_on_a_tiny_model(flagfile, tiny_model_dir, tmp_path):
  out = tmp_path / "out"
  proc = _run([f"--flagfile={flagfile}", f"--model={tiny_model_dir}", f"--output_dir={out}"] + TINY)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = read_results(str(out / "results.jsonl"))
  policies, n_variants = _expected_variants(flagfile)
  if policies is None:  # inherited from main.flags
    policies, _ = _expected_variants(os.path.join(ROOT, "configs", "experiments", "main.flags"))
  assert len(rows) == len(policies) * n_variants
  assert {r["base_policy"] for r in rows} == set(policies)
  with open(out / "config.json") as f:
    snap = json.load(f)
  cal = snap["calibration"]
  assert cal is not None and cal["step_s"] > 0   # every flagfile inherits --calibrate from main.flags
  for r in rows:
    assert r["num_finished"] == r["num_requests"] == 6, r
    assert r["ttft_slo_s"] == pytest.approx(cal["ttft_slo_steps"] * cal["step_s"])
    assert r["tbt_slo_s"] == pytest.approx(cal["tbt_slo_steps"] * cal["step_s"])
    assert r["rps"] == pytest.approx(cal["rps"])
    assert "rotations_per_step" in r and "mean_residency_steps" in r and r["step_time_p50_s"] > 0
    for name, value in (r["variant"] or {}).items():   # the variant's setting really was applied
      assert str(r[name]).lower() == value.lower() or float(r[name]) == float(value), (name, r[name], value)
  labels = [r["policy"] for r in rows]
  assert len(set(labels)) == len(labels)
  assert "SLO%" in proc.stdout and "[calibrate]" in proc.stdout


def test_bad_vary_is_a_clear_error(tiny_model_dir, tmp_path):
  proc = _run([f"--model={tiny_model_dir}", "--vary=no_such_knob:1,2", f"--output_dir={tmp_path}/x"] + TINY)
  assert proc.returncode != 0 and "unknown engine setting 'no_such_knob'" in proc.stderr
  proc = _run([f"--model={tiny_model_dir}", "--vary=min_residency:fast", f"--output_dir={tmp_path}/y"] + TINY)
  assert proc.returncode != 0 and "'fast' is not a int" in proc.stderr
