"""scripts/bench_transfer.py runs on CPU in seconds, prints the JSON schema, and its modes agree on bytes moved."""
import collections
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_bench_transfer_cpu_modes_agree_on_bytes():
  cmd = [sys.executable, str(ROOT / "scripts" / "bench_transfer.py"), "--json", "--max_segment_mb=0.125",
         "--min_segment_kb=64", "--total_mb=0.5", "--reps=1", "--warmup=1", "--models=smollm2-135m",
         "--kv_blocks=2", "--naive_max_blocks=2"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  assert rows, proc.stdout
  for r in rows:
    assert {"mode", "direction", "segment_bytes", "total_bytes", "gbps"} <= set(r), r
    assert r["direction"] in ("d2h", "h2d", "duplex") and r["mode"] in ("naive", "merged", "duplex", "torch")
    assert r["total_bytes"] > 0 and r["gbps"] > 0 and r["segment_bytes"] > 0
  # Segment sweep: 64 KiB and 128 KiB, every mode; duplex counts both directions.
  seg_rows = [r for r in rows if r["case"] == "segments"]
  assert {r["segment_bytes"] for r in seg_rows} == {64 * 1024, 128 * 1024}
  assert {(r["mode"], r["direction"]) for r in seg_rows} == {
      ("naive", "d2h"), ("naive", "h2d"), ("naive", "duplex"), ("merged", "d2h"), ("merged", "h2d"),
      ("merged", "duplex"), ("duplex", "duplex")}
  # Bytes agree across modes for the same case / layout / segment size / direction.
  groups = collections.defaultdict(set)
  for r in seg_rows:
    groups[(r["segment_bytes"], r["direction"])].add(r["total_bytes"])
  kv_rows = [r for r in rows if r["case"] == "smollm2-135m"]
  assert {r["layout"] for r in kv_rows} == {"block_first", "layer_first"}
  for r in kv_rows:
    groups[(r["case"], r["layout"], r["direction"])].add(r["total_bytes"])
    assert r["engine_bytes"] == r["total_bytes"], r       # the engine's counters saw the same bytes
    assert r["segments"] * r["segment_bytes"] == r["total_bytes"]
  assert all(len(v) == 1 for v in groups.values()), groups
  block_bytes = 2 * 30 * 16 * 3 * 64 * 2
  assert {r["segment_bytes"] for r in kv_rows if r["mode"] != "naive"} == {block_bytes}
  assert {r["segment_bytes"] for r in kv_rows if r["mode"] == "naive"} == {block_bytes // 60}
