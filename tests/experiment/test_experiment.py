"""run_experiment.py on a tiny random model: every request finishes under fcfs and rotasched, rotasched
rotates, and the outputs follow the results / per-request schemas."""
import json
import os
import subprocess
import sys

import pytest

from superinfer_jax.experiment.real_sweep import parse_float_list
from superinfer_jax.metrics.results import RESULTS_KEYS, read_results, validate_results_row
from superinfer_jax.metrics.timeline import read_timelines, requests_filename

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_parse_float_list():
  assert parse_float_list("1, 2.5,inf") == [1.0, 2.5, float("inf")]
  with pytest.raises(ValueError, match="not a number"):
    parse_float_list("1,fast")
  with pytest.raises(ValueError, match="empty"):
    parse_float_list(" , ")


def test_run_experiment_tiny_model(tiny_model_dir, tmp_path):
  out = tmp_path / "exp"
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "run_experiment.py"), f"--model={tiny_model_dir}",
         "--dataset=synthetic", "--num_requests=12", "--rps=40", "--policies=fcfs,rotasched",
         "--synthetic_prompt_len=uniform:20,60", "--synthetic_output_len=uniform:20,40",
         "--num_device_blocks=14", "--num_host_blocks=128", "--block_size=8", "--max_num_seqs=8",
         "--proactive_swap_budget=8", "--ttft_slo=0.05", "--tbt_slo=0.02", "--beta_f=0",
         f"--output_dir={out}", "--noprogress"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = read_results(str(out / "results.jsonl"))
  assert [r["policy"] for r in rows] == ["fcfs", "rotasched"]
  for r in rows:
    validate_results_row(r)
    assert set(RESULTS_KEYS) <= set(r)
    assert r["engine"] == "real" and r["rps"] == 40 and r["num_requests"] == 12
    assert r["num_finished"] == 12, r
    tls = read_timelines(str(out / requests_filename(r["policy"], 40)))
    assert len(tls) == 12
    for tl in tls:
      assert tl.finished and tl.output_len == tl.target_output_len == len(tl.token_times_s)
      assert tl.state_changes[0][1] == "waiting" and tl.state_changes[-1][1] == "finished"
  rota = rows[1]
  assert rota["num_rotations"] > 0 and rota["swap_out_bytes"] > 0 and rota["swap_in_bytes"] > 0
  rota_tls = read_timelines(str(out / requests_filename("rotasched", 40)))
  assert sum(tl.num_rotations for tl in rota_tls) > 0   # rotations visible in the timelines too
  with open(out / "config.json") as f:
    snap = json.load(f)
  assert snap["engine"]["num_device_blocks"] == 14 and snap["sweep"]["policies"] == ["fcfs", "rotasched"]
  pngs = [p for p in os.listdir(out) if p.endswith(".png")]
  # One load: bars per policy, not lone points on an RPS axis.
  assert "attainment_bars.png" in pngs and "slo_attainment_vs_rps.png" not in pngs
  assert any(p.startswith("timeline-rotasched") for p in pngs)
  assert "rotasched" in proc.stdout and "fcfs" in proc.stdout   # the comparison table


def test_run_experiment_rejects_unknown_policy(tiny_model_dir, tmp_path):
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "run_experiment.py"), f"--model={tiny_model_dir}",
         "--dataset=synthetic", "--policies=fcfs,nope", f"--output_dir={tmp_path}/x"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode != 0 and "unknown policies ['nope']" in proc.stderr


def test_run_sweep_hands_each_timed_engine_to_on_engine(tiny_model_dir, tmp_path):
  """``on_engine`` sees every timed run's engine once, in run order (repeats interleaved ABBA), and not the
  warm-up's; each engine runs the policy its label names."""
  from superinfer_jax.engine.config import EngineConfig
  from superinfer_jax.experiment.real_sweep import SweepSpec, run_sweep
  spec = SweepSpec(model=tiny_model_dir, dataset="synthetic", num_requests=3, rps="inf",
                   policies="fcfs,rotasched", repeats=2, synthetic_prompt_len="uniform:8,12",
                   synthetic_output_len="uniform:3,4", output_dir=str(tmp_path / "exp"), progress=False)
  seen = []
  rows = run_sweep(spec, EngineConfig.create(num_device_blocks=32, num_host_blocks=32, block_size=8,
                                             max_num_seqs=4),
                   on_engine=lambda engine, label: seen.append((label, engine.config.scheduler.policy,
                                                                engine.has_unfinished())))
  assert [r["policy"] for r in rows] == ["fcfs", "rotasched", "rotasched", "fcfs"]
  assert seen == [(p, p, False) for p in ("fcfs", "rotasched", "rotasched", "fcfs")]


def test_run_sweep_freezes_the_heap_before_its_engines(tiny_model_dir, tmp_path):
  """``freeze_heap=True``: the loaded model is frozen before the first engine, so every engine stays visible to
  the cyclic collector and is freed after its run (a frozen one in a cycle would keep its KV pool)."""
  import gc
  import weakref
  from superinfer_jax.engine.config import EngineConfig
  from superinfer_jax.experiment.real_sweep import SweepSpec, run_sweep
  spec = SweepSpec(model=tiny_model_dir, dataset="synthetic", num_requests=3, rps="inf", policies="fcfs,rotasched",
                   synthetic_prompt_len="uniform:8,12", synthetic_output_len="uniform:3,4",
                   output_dir=str(tmp_path / "exp"), progress=False)
  engines = []

  def on_engine(engine, label):
    del label
    assert gc.get_freeze_count() > 0 and any(o is engine for o in gc.get_objects())   # frozen before; not it
    engines.append(weakref.ref(engine))

  try:
    rows = run_sweep(spec, EngineConfig.create(num_device_blocks=32, num_host_blocks=32, block_size=8,
                                               max_num_seqs=4), on_engine=on_engine, freeze_heap=True)
    assert len(rows) == len(engines) == 2
    gc.collect()
    assert all(ref() is None for ref in engines)
  finally:
    gc.unfreeze()
