"""CI smoke tests of scripts/bench_attention.py (tiny shapes; interpret mode on CPU)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--batch_sizes=2", "--context_lens=24", "--num_q_heads=4", "--num_kv_heads=2", "--head_dim=64",
        "--dtype=float32", "--min_time_s=0", "--max_iters=1", "--mixed_prefill_chunks=1",
        "--mixed_chunk_tokens=8", "--mixed_decode_rows=2", "--mixed_context=24"]


def _run(args, tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env.pop("PALLAS_ATTENTION_TUNING_TABLE", None)
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_attention.py")] + TINY + args
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc, json.loads((tmp_path / "bench.json").read_text())


def test_pallas_bench_attention_smoke(tmp_path):
  proc, data = _run([f"--json_out={tmp_path / 'bench.json'}"], tmp_path)
  impls = {r["impl"]: r for r in data["results"] if r["mode"] == "decode"}
  mixed = {r["impl"]: r for r in data["results"] if r["mode"] == "mixed"}
  assert set(mixed) == {"pallas", "reference"} and mixed["pallas"]["max_abs_err"] < 1e-4, mixed
  assert mixed["pallas"]["kv_bytes"] == 3 * 24 * 2 * 64 * 2 * 4
  assert mixed["pallas"]["speedup_vs_jax"] is None and "decode-only" in mixed["pallas"]["speedup_vs_jax_note"]
  assert set(impls) == {"pallas", "reference", "jax_paged"}, data["results"]
  for r in impls.values():
    assert "error" not in r, r
    assert r["ms"] > 0 and r["gbps"] > 0 and r["kv_bytes"] == 2 * 24 * 2 * 64 * 2 * 4
  assert impls["pallas"]["max_abs_err"] < 1e-4
  assert impls["jax_paged"]["max_abs_err"] < 1e-4
  # The traffic analysis is derived from the chosen config: 24 keys read as whole 64-key steps.
  t = impls["pallas"]["traffic"]
  assert t["required_kv"] == impls["pallas"]["kv_bytes"] and t["read_kv"] >= t["required_kv"]
  assert impls["pallas"]["tuning"]["reason"].startswith("default")   # CPU: no entry for card "cpu"
  assert "pallas" in proc.stdout and "GB/s" in proc.stdout and data["tune_written"] == []


def test_pallas_bench_tune_dry_run_writes_the_table_it_then_uses(tmp_path):
  table = tmp_path / "table.json"
  proc, data = _run([f"--json_out={tmp_path / 'bench.json'}", "--tune", "--dry_run", f"--tune_table={table}"],
                    tmp_path)
  entries = json.loads(table.read_text())["entries"]
  assert {e["key"]["mode"] for e in entries} == {"decode", "mixed"}
  for e in entries:
    assert e["key"]["card"] == "cpu" and e["meta"]["ms"] > 0 and "--tune" in e["meta"]["command"]
  assert len(data["tune_written"]) == 2 and any("ms" in r for r in data["tune"])
  for r in data["results"]:
    if r["impl"] == "pallas":
      assert r["tuning"]["reason"] == "exact", r["tuning"]
      assert r["tuning"]["config"]["blocks_per_iter"] == r["tuning"]["kernel_config"]["blocks_per_iter"]
      assert r["max_abs_err"] < 1e-4
  assert "best" in proc.stdout
