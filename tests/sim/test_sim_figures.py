"""``--figure NAME`` (sim/figures.py): every paper experiment runs on a tiny configuration over two seeds and
writes its rows, per-part per-seed results directories, its summary, claims and figure; explicit settings win
over the figure's and the workload's; claims hold only on every contended seed; the script's flags."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from superinfer_jax.engine.config import EngineConfig
from superinfer_jax.metrics.results import read_results, validate_results_row
from superinfer_jax.sim.config import SimConfig
from superinfer_jax.sim.figure_summary import check_claims, summarize_points
from superinfer_jax.sim.figures import COMMON, FIGURES, Claim, Figure, Part, get_figure, part_configs, run_figure
from superinfer_jax.sweep import SweepSpec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What a user would override for a quick look: a small synthetic workload on small pools (the pools make the
# tiny load contended, so rotations happen).
TINY = dict(dataset="synthetic", num_requests=10, synthetic_prompt_len="uniform:64,200",
            synthetic_output_len="uniform:16,48", progress=False)
TINY_ENGINE = dict(num_device_blocks=40, num_host_blocks=400, max_num_seqs=16, max_num_batched_tokens=512)
PER_STEP = ("rotations_per_step", "blocks_out_per_step", "blocks_writeback_per_step", "blocks_in_per_step",
            "bytes_out_per_step", "bytes_in_per_step", "exposed_transfer_s", "exposed_transfer_per_step_s",
            "exposed_transfer_share")


def _base():
  spec = SweepSpec(**TINY)
  engine = EngineConfig().replace(dtype="bfloat16", **TINY_ENGINE)
  return spec, engine, SimConfig(), set(TINY) | set(TINY_ENGINE)


def _expected_rows(part) -> int:
  spec, engine, sim, explicit = _base()
  p_spec, _, _, _ = part_configs(part, spec, engine, sim, explicit=explicit, workload="sharegpt")
  return len(p_spec.policy_names) * len(p_spec.variants) * len(p_spec.rps_values)


SEEDS = (0, 1)


@pytest.mark.parametrize("name", sorted(n for n in FIGURES if n != "prefix_reuse"))  # a trace figure: its own test
def test_every_figure_runs_tiny(name, tmp_path):
  spec, engine, sim, explicit = _base()
  out = str(tmp_path / name)
  res = run_figure(name, spec, engine, sim, explicit=explicit, output_dir=out, log=lambda *_: None, seeds=SEEDS,
                   workload="sharegpt")
  fig = get_figure(name)
  assert os.path.isfile(res.plot) and res.plot == os.path.join(out, f"figure-{name}.png")
  assert os.path.getsize(res.plot) > 10_000
  meta = json.load(open(os.path.join(out, "figure.json")))
  assert meta["figure"] == name and [p["name"] for p in meta["parts"]] == [p.name for p in fig.parts]
  assert meta["seeds"] == list(SEEDS) and meta["workload"]["name"] == "sharegpt"
  assert len(res.claims) == len(fig.claims) and all(sorted(c["ratios"]) == list(SEEDS) for c in res.claims)
  assert os.path.isfile(os.path.join(out, "report.txt")) and os.path.isfile(os.path.join(out, "summary.jsonl"))
  for part in fig.parts:
    part_dir = out if len(fig.parts) == 1 else os.path.join(out, part.name)
    rows = [r for s in SEEDS for r in read_results(os.path.join(part_dir, f"seed-{s}", "results.jsonl"))]
    assert len(rows) == len(res.rows[part.name]) == len(SEEDS) * _expected_rows(part)
    assert sorted({r["seed"] for r in rows}) == list(SEEDS)
    points = [e for e in res.summary if e["part"] == part.name]
    assert len(points) == _expected_rows(part) and all(e["seeds"] == list(SEEDS) for e in points)
    for e in points:
      if e["slo_attainment"] is not None:
        assert e["slo_attainment"]["min"] <= e["slo_attainment"]["mean"] <= e["slo_attainment"]["max"]
    want_model = part.settings.get("model", COMMON["model"])
    for r in rows:
      validate_results_row(r)
      assert r["engine"] == "sim" and r["figure"] == name and r["figure_part"] == part.name
      assert r["hardware"] == "gh200" and r["model"] == want_model      # the figure's settings ...
      assert r["num_requests"] == 10 and r["num_device_blocks"] == 40    # ... under the explicit ones
      assert r["ttft_slo_s"] == 5.0 and r["tbt_slo_s"] == 0.1
      for k in PER_STEP:
        assert r[k] is not None and r[k] >= 0, k
      assert r[part.x_key] is not None, part.x_key
    if part.x_key != "rps":   # the swept setting is what each row reports
      values = part.settings["vary"].split(":", 1)[1].split(",")
      assert sorted({float(r[part.x_key]) for r in rows}) == sorted(float(v) for v in values)
    assert any(f.endswith(".png") for f in os.listdir(os.path.join(part_dir, "seed-0")))


def test_figure_settings_reach_the_runs(tmp_path):
  """The ablation's variants change what the runs did: naive copies expose more copy time than duplex at
  the same budget, and a budget of 300 allows fewer blocks in per step than 2400 on the same load."""
  spec, engine, sim, explicit = _base()
  spec = dataclasses.replace(spec, num_requests=24)
  res = run_figure("ablation", spec, engine, sim, explicit=explicit, output_dir=str(tmp_path / "abl"),
                   log=lambda *_: None, workload="sharegpt")
  rota = {(r["transfer_mode"], r["proactive_swap_budget"], r["rps"]): r for r in res.rows["rotasched"]}
  assert all(r["num_rotations"] == 0 for r in res.rows["fcfs"])
  assert any(r["num_rotations"] > 0 for r in rota.values())
  for rps in (10.0, 15.0, 20.0):
    naive, duplex = rota[("naive", 2400, rps)], rota[("duplex", 2400, rps)]
    if duplex["blocks_in"] > 0:
      assert naive["transfer_s"] > duplex["transfer_s"]
  assert max(r["blocks_in_per_step"] for k, r in rota.items() if k[1] == 300) <= 300


def test_bandwidth_figure_runs_vllms_swap():
  """Fig. 2 is vLLM with offloading: its part runs layer-by-layer copies (naive) that the step waits for
  (no pipeline), whatever the engine's defaults are."""
  spec, engine, sim, explicit = _base()
  part = get_figure("bandwidth").parts[0]
  _, p_eng, _, _ = part_configs(part, spec, engine, sim, explicit=explicit, workload="sharegpt")
  assert engine.pipeline and engine.rotation.transfer_mode == "duplex"
  assert not p_eng.pipeline and p_eng.rotation.transfer_mode == "naive"


def test_part_configs_explicit_wins_and_unknown_fails():
  spec, engine, sim, _ = _base()
  part = get_figure("main").parts[0]
  p_spec, p_eng, p_sim, settings = part_configs(part, spec, engine, sim, explicit={"rps", "hardware"})
  assert p_spec.model == "llama-3-8b" and p_spec.rps == spec.rps and p_spec.hardware == spec.hardware
  assert "rps" not in settings and p_eng.scheduler.proactive_swap_budget == 2400
  p_spec, _, p_sim, _ = part_configs(part, spec, engine, sim)
  assert p_spec.rps == "35,40,45,50,55,60" and p_spec.hardware == "gh200"
  assert p_spec.dataset == "sharegpt" and p_sim.length_scale == 1.05          # the default workload
  p_spec, _, p_sim, _ = part_configs(get_figure("main").parts[1], spec, engine, sim, workload="splitwise")
  assert p_spec.rps == "1.4375,2.875,3.7375,4.3125,5.175,5.75" and p_sim.trace == "splitwise" and p_sim.trace_arrivals == "rescale"
  with pytest.raises(ValueError, match="unknown figure workload"):
    part_configs(part, spec, engine, sim, workload="nope")
  with pytest.raises(ValueError, match="unknown figure"):
    get_figure("fig99")


def test_simulate_script_figure_flag(tmp_path):
  out = tmp_path / "fig"
  args = [sys.executable, os.path.join(ROOT, "scripts", "simulate.py"), "--figure=budget", "--dataset=synthetic",
          "--num_requests=8", "--num_device_blocks=40", "--num_host_blocks=400", "--max_num_batched_tokens=512",
          "--hardware=h200", "--noprogress", "--seeds=2", "--figure_workload=sharegpt", f"--output_dir={out}",
          f"--results_file={tmp_path / 'results.table.md'}"]
  proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "figure-budget.png" in proc.stdout and (out / "figure-budget.png").is_file()
  for seed in (0, 1):
    rows = read_results(str(out / f"seed-{seed}" / "results.jsonl"))
    assert len(rows) == 10 and {r["hardware"] for r in rows} == {"h200"}      # --hardware given: it wins
    assert {r["seed"] for r in rows} == {seed}
  assert "claims over seeds [0, 1]" in proc.stdout
  block = (tmp_path / "results.table.md").read_text().split("<!-- results:budget-sharegpt -->\n")[1]
  table = block.split("<!-- /results:budget-sharegpt -->")[0].splitlines()
  assert table[0].startswith("| figure | workload | claim |") and len(table) == 2 + len(get_figure("budget").claims)
  assert all(row.startswith("| budget | sharegpt | ") for row in table[2:])
  bad = subprocess.run(args[:2] + ["--figure=nope"], capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert bad.returncode != 0 and "figure" in bad.stderr


def _row(seed, policy, x, ttft, contended=5):
  return {"seed": seed, "base_policy": policy, "policy": policy, "rps": 20.0, "alpha": x, "ttft_p99_s": ttft,
          "kv_contended_steps": contended}


def test_claims_hold_only_on_every_contended_seed():
  fig = Figure("f", "", (Part("p", "", {}, x_key="alpha"),), metrics=("ttft_p99_s",),
               claims=(Claim("a halves TTFT", "p", "ttft_p99_s", {"base_policy": "a", "alpha": 1},
                             {"base_policy": "b", "alpha": 1}, "<=", 0.5),))
  good = [_row(0, "a", 1, 1.0), _row(0, "b", 1, 4.0), _row(1, "a", 1, 2.0), _row(1, "b", 1, 4.0)]
  (c,) = check_claims(fig, {"p": good})
  assert c["ratios"] == {0: 0.25, 1: 0.5} and c["holds_on"] == [0, 1] and c["holds"]
  one_fails = good[:2] + [_row(1, "a", 1, 3.0), _row(1, "b", 1, 4.0)]
  (c,) = check_claims(fig, {"p": one_fails})
  assert c["holds_on"] == [0] and not c["holds"]
  quiet = good[:3] + [_row(1, "b", 1, 4.0, contended=0)]
  (c,) = check_claims(fig, {"p": quiet})
  assert c["holds_on"] == [0, 1] and c["uncontended_seeds"] == [1] and not c["holds"]
  (c,) = check_claims(fig, {"p": good[:3]})    # seed 1 lacks its denominator
  assert c["ratios"][1] is None and not c["holds"]


def test_summarize_points_mean_min_max_and_uncontended():
  rows = [_row(0, "a", 1, 1.0), _row(1, "a", 1, 3.0, contended=0), _row(0, "a", 2, 5.0)]
  pts = summarize_points("p", "alpha", rows, ("ttft_p99_s",))
  assert [(e["x"], e["seeds"], e["uncontended_seeds"]) for e in pts] == [(1, [0, 1], [1]), (2, [0], [])]
  assert pts[0]["ttft_p99_s"] == {"mean": 2.0, "min": 1.0, "max": 3.0}
