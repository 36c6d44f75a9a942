"""scripts/plot.py and superinfer_jax.metrics.plots produce non-empty PNGs from a fixture results dir."""
import os
import subprocess
import sys

import numpy as np
import pytest

from superinfer_jax import metrics as M
from superinfer_jax.metrics import plot_common, plot_timelines, plots
from superinfer_jax.metrics.timeline import RequestTimeline

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "tests", "fixtures", "workload", "results_small")
EXPECTED = {"slo_attainment_vs_rps.png", "p99_latency_vs_rps.png", "latency_cdf-rps1.png",
            "latency_cdf-rps2.png", "timeline-fcfs-1.png", "timeline-fcfs-2.png",
            "timeline-rotasched-1.png", "timeline-rotasched-2.png"}


def _check_pngs(out_dir, names):
  for name in names:
    path = os.path.join(out_dir, name)
    assert os.path.getsize(path) > 1000, path
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_results_dir_library(tmp_path):
  paths = plots.plot_results_dir(RESULTS, str(tmp_path))
  assert {os.path.basename(p) for p in paths} == EXPECTED
  _check_pngs(str(tmp_path), EXPECTED)


def test_timeline_without_state_changes(tmp_path):
  tls = [RequestTimeline("0", 0.0, 3, 2, [0.5, 0.6], [], "length"),
         RequestTimeline("1", 0.2, 3, 0, [], [], None)]
  out = plot_timelines.plot_request_timeline(tls, str(tmp_path / "t.png"))
  _check_pngs(str(tmp_path), ["t.png"])
  assert out.endswith("t.png")


def test_plot_script(tmp_path):
  out = tmp_path / "plots"
  env = dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=ROOT)
  res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plot.py"),
                        f"--results_dir={RESULTS}", f"--out_dir={out}"],
                       capture_output=True, text=True, timeout=120, env=env)
  assert res.returncode == 0, res.stderr
  assert "rotasched" in res.stdout and "wrote 8 figures" in res.stdout
  _check_pngs(str(out), EXPECTED)


# --- repeats: one load with interleaved repeats per policy, or several loads -------------------------

TTFT_SLO, TBT_SLO = 0.5, 0.05


def _synthetic_timelines(rps, slow, n=12):
  """n requests at ``rps``; ``slow`` stretches TTFT and token gaps; every 3rd request is rotated once."""
  tls = []
  for i in range(n):
    a = i / rps
    first = a + 0.2 * slow
    gaps = [0.02 * slow] * 4 + ([0.3 * slow] if i % 3 == 0 else []) + [0.02 * slow] * 3
    times = list(np.cumsum([first] + gaps))
    sc = [(a, "waiting"), (first - 0.05, "running")]
    if i % 3 == 0:
      sc += [(times[4] + 0.001, "rotary"), (times[5] - 0.001, "running")]
    sc.append((times[-1], "finished"))
    tls.append(RequestTimeline(str(i), a, 8, len(times), [float(t) for t in times], sc, "length"))
  return tls


def _write_run(out, policy, rps, repeat, run_index, *, slow, perturbed=False, rot=0.1, residency=4.0,
               repeat_in_name=True):
  tls = _synthetic_timelines(rps, slow)
  row = M.results_row(
      tls, engine="sim", model="m", hardware="cpu", policy=policy, rps=rps, ttft_slo_s=TTFT_SLO,
      tbt_slo_s=TBT_SLO, num_rotations=None, swap_out_bytes=0, swap_in_bytes=0,
      extra={"repeat": repeat, "run_index": run_index, "perturbed": perturbed,
             "step_time_drift": 1.3 if perturbed else 1.01, "rotations_per_step": rot,
             "mean_residency_steps": residency})
  M.append_results_row(str(out / "results.jsonl"), row)
  M.write_timelines(str(out / M.requests_filename(policy, rps, repeat if repeat_in_name else None)), tls)
  return row


def test_single_load_repeats_write_bars_not_vs_rps(tmp_path):
  res, figs = tmp_path / "res", tmp_path / "figs"
  # interleaved order fcfs, rotasched, rotasched, fcfs; the 3rd run drifted (perturbed).
  _write_run(res, "fcfs", 4.0, 0, 0, slow=3.0, rot=0.0, residency=None)
  _write_run(res, "rotasched", 4.0, 0, 1, slow=1.0, rot=0.2, residency=5.0)
  _write_run(res, "rotasched", 4.0, 1, 2, slow=1.4, rot=0.25, residency=6.0, perturbed=True)
  _write_run(res, "fcfs", 4.0, 1, 3, slow=3.2, rot=0.0, residency=None)
  assert set(plots.find_request_files(str(res))) == {
      ("fcfs", 4.0, 0), ("fcfs", 4.0, 1), ("rotasched", 4.0, 0), ("rotasched", 4.0, 1)}
  paths = plots.plot_results_dir(str(res), str(figs))
  names = {os.path.basename(p) for p in paths}
  assert names == {"attainment_bars.png", "latency_bars.png", "rotation_bars.png", "latency_cdf-rps4.png",
                   "timeline-fcfs-4.png", "timeline-rotasched-4.png"}
  assert not [n for n in os.listdir(figs) if n.endswith("_vs_rps.png")]
  _check_pngs(str(figs), names)
  assert os.path.getsize(figs / "attainment_bars.png") > 10000


def test_single_load_old_rows_without_rotation_keys(tmp_path):
  """Rows of older runs (no repeat / rotation keys, plain file names): bars but no rotation panel."""
  res = tmp_path / "res"
  for policy, slow in (("fcfs", 2.0), ("rotasched", 1.0)):
    _write_run(res, policy, 2.0, 0, 0, slow=slow, repeat_in_name=False)
  rows = M.read_results(str(res / "results.jsonl"))
  for r in rows:
    for k in ("repeat", "run_index", "perturbed", "step_time_drift", "rotations_per_step",
              "mean_residency_steps"):
      del r[k]
  M.write_jsonl(str(res / "results.jsonl"), rows)
  assert set(plots.find_request_files(str(res))) == {("fcfs", 2.0, 0), ("rotasched", 2.0, 0)}
  names = {os.path.basename(p) for p in plots.plot_results_dir(str(res), str(tmp_path / "f"))}
  assert names == {"attainment_bars.png", "latency_bars.png", "latency_cdf-rps2.png",
                   "timeline-fcfs-2.png", "timeline-rotasched-2.png"}


def test_two_loads_with_repeats_write_vs_rps(tmp_path):
  res, figs = tmp_path / "res", tmp_path / "figs"
  i = 0
  for rps in (2.0, 8.0):
    for rep in (0, 1):
      for policy, slow in (("fcfs", 2.0 + rep), ("rotasched", 1.0 + 0.5 * rep)):
        _write_run(res, policy, rps, rep, i, slow=slow * rps / 2.0)
        i += 1
  names = {os.path.basename(p) for p in plots.plot_results_dir(str(res), str(figs))}
  assert names == {"slo_attainment_vs_rps.png", "p99_latency_vs_rps.png", "latency_cdf-rps2.png",
                   "latency_cdf-rps8.png", "timeline-fcfs-2.png", "timeline-fcfs-8.png",
                   "timeline-rotasched-2.png", "timeline-rotasched-8.png"}
  assert not {"attainment_bars.png", "latency_bars.png", "rotation_bars.png"} & set(os.listdir(figs))
  _check_pngs(str(figs), names)


def _row(policy, rps, repeat=None, **vals):
  r = {"policy": policy, "rps": rps, **vals}
  if repeat is not None:
    r["repeat"] = repeat
  return r


def test_aggregate_repeats_mean_min_max():
  rows = [_row("fcfs", 2.0, 0, slo_attainment=0.5, ttft_p99_s=1.0, run_index=0),
          _row("rota", 2.0, 0, slo_attainment=0.9, ttft_p99_s=None, run_index=1),
          _row("rota", 2.0, 1, slo_attainment=0.7, ttft_p99_s=0.4, perturbed=True, run_index=2),
          _row("fcfs", 2.0, 1, slo_attainment=0.25, ttft_p99_s=3.0, run_index=3),
          _row("fcfs", 4.0, slo_attainment=0.1),            # old row: no repeat key -> repeat 0
          _row("fcfs", 4.0, 0, slo_attainment=0.2)]         # same (policy, rps, repeat): replaces it
  agg = plot_common.aggregate_repeats(rows)
  assert list(agg) == ["fcfs", "rota"]
  f2, f4 = agg["fcfs"]
  assert (f2["rps"], f2["num_repeats"], f4["rps"], f4["num_repeats"]) == (2.0, 2, 4.0, 1)
  assert f2["mean"]["slo_attainment"] == pytest.approx(np.mean([0.5, 0.25]))
  assert (f2["min"]["slo_attainment"], f2["max"]["slo_attainment"]) == (0.25, 0.5)
  assert f2["mean"]["ttft_p99_s"] == pytest.approx(2.0)
  assert f4["mean"]["slo_attainment"] == 0.2
  (r2,) = agg["rota"]
  assert r2["mean"]["slo_attainment"] == pytest.approx(0.8) and r2["num_perturbed"] == 1
  assert r2["mean"]["ttft_p99_s"] == 0.4                  # None repeat left out of the mean
  assert "perturbed" not in r2["mean"]                      # bools are not averaged
  assert [r["run_index"] for r in r2["rows"]] == [1, 2]
  groups = plot_common.group_repeats(rows)
  assert [plot_common.row_repeat(r) for r in groups[("fcfs", 2.0)]] == [0, 1]


def test_find_request_files_prefers_explicit_rep0(tmp_path):
  tls = _synthetic_timelines(1.0, 1.0, n=2)
  for rep in (None, 0, 2):
    M.write_timelines(str(tmp_path / M.requests_filename("fcfs-x", 1.0, rep)), tls)
  M.write_timelines(str(tmp_path / M.requests_filename("rotasched_code", 1.0)), tls)
  found = plots.find_request_files(str(tmp_path))
  assert found == {("fcfs-x", 1.0, 0): str(tmp_path / "requests-fcfs-x-1-rep0.jsonl"),
                   ("fcfs-x", 1.0, 2): str(tmp_path / "requests-fcfs-x-1-rep2.jsonl"),
                   ("rotasched_code", 1.0, 0): str(tmp_path / "requests-rotasched_code-1.jsonl")}
