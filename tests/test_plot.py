"""scripts/plot.py and superinfer_jax.metrics.plots produce non-empty PNGs from a fixture results dir."""
import os
import subprocess
import sys

from superinfer_jax.metrics import plots
from superinfer_jax.metrics.timeline import RequestTimeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
  out = plots.plot_request_timeline(tls, str(tmp_path / "t.png"))
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
