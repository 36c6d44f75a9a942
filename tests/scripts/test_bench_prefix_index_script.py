"""scripts/bench_prefix_index.py end to end (subprocess): its JSON row on a small pool, and a clear error for bad
sizes."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args):
  return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_prefix_index.py")] + args,
                        capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_bench_prefix_index_row():
  out = _run(["--pool_blocks=3000", "--churn_steps=40", "--blocks_per_step=100"])
  assert out.returncode == 0, out.stderr[-3000:]
  row = json.loads(out.stdout.strip().splitlines()[-1])
  assert row["pool_blocks"] == 3000 and row["steps"] == 40 and row["blocks_per_step"] == 100
  assert 0 < row["median_ms"] <= row["p99_ms"] <= row["max_ms"]


def test_bench_prefix_index_rejects_bad_sizes():
  out = _run(["--pool_blocks=10", "--blocks_per_step=11"])
  assert out.returncode != 0 and "blocks_per_step <= pool_blocks" in out.stderr
