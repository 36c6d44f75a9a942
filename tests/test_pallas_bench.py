"""CI smoke test of scripts/bench_attention.py (tiny shapes; interpret mode on CPU)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pallas_bench_attention_smoke(tmp_path):
  out = tmp_path / "bench.json"
  env = dict(os.environ, PYTHONPATH=ROOT)
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_attention.py"), "--batch_sizes=2",
         "--context_lens=24", "--num_q_heads=4", "--num_kv_heads=2", "--head_dim=64", "--dtype=float32",
         "--min_time_s=0", "--max_iters=1", "--notune", "--prefill_chunk=8", f"--json_out={out}"]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  data = json.loads(out.read_text())
  impls = {r["impl"]: r for r in data["results"] if r["mode"] == "decode"}
  mixed = {r["impl"]: r for r in data["results"] if r["mode"] == "mixed"}
  assert set(mixed) == {"pallas", "reference"} and mixed["pallas"]["max_abs_err"] < 1e-4, mixed
  assert set(impls) == {"pallas", "reference", "jax_paged"}, data["results"]
  for r in impls.values():
    assert "error" not in r, r
    assert r["ms"] > 0 and r["gbps"] > 0 and r["kv_bytes"] == 2 * 24 * 2 * 64 * 2 * 4
  assert impls["pallas"]["max_abs_err"] < 1e-4
  assert impls["jax_paged"]["max_abs_err"] < 1e-4
  assert "pallas" in proc.stdout and "GB/s" in proc.stdout
