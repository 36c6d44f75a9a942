"""``scripts/device_check.sh --dry_run``: the device check's stages on the tiny model, on CPU, with the JSON keys
the GPU run writes (so the script cannot rot between lent GPUs)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_device_check_dry_run_writes_every_stage(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", OUT=str(tmp_path), PYTHON=sys.executable)
  proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "device_check.sh"), "--dry_run"], env=env,
                        capture_output=True, text=True, timeout=900, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  d = json.loads((tmp_path / "device_check.json").read_text())
  assert d["dry_run"] is True and d["platform"] == "cpu"
  for stage in ("gpu_tests", "attention", "transfer", "engine", "calibration", "experiment"):
    assert d[stage]["rc"] == 0, (stage, (tmp_path / f"{stage}.log").read_text()[-2000:])
  assert d["gpu_tests"]["passed"] > 0 and d["gpu_tests"]["failed"] == 0
  assert {r["impl"] for r in d["attention"]["results"]} >= {"pallas", "reference"}
  assert {w["key"]["mode"] for w in d["attention"]["tune_written"]} == {"decode", "mixed"}   # --tune ran
  tuned = json.loads(open(d["attention"]["tune_table"], encoding="utf-8").read())["entries"]
  assert {e["key"]["card"] for e in tuned} >= {"cpu"}
  assert all(r["tuning"]["reason"] == "exact" for r in d["attention"]["results"] if r["impl"] == "pallas")
  assert {r["mode"] for r in d["transfer"]["results"]} >= {"merged", "duplex"}
  assert [r["mode"] for r in d["transfer"]["table1"]["rows"]] == ["naive", "merged", "merged_kernel", "duplex",
                                                                   "ideal"]
  assert (tmp_path / "table1.table.md").exists()
  assert len(d["experiment"]["entries"]) == 7 and all(os.path.exists(p) for p in d["experiment"]["plots"])
  for b in ("1", "2"):
    row = d["engine"]["by_batch"][b]
    assert row["engine_tok_s"] > 0 and row["transformers_tok_s"] > 0 and row["engine_ms_per_step"] > 0
    assert row["dispatch_ms"] >= 0 and row["device_idle_ms_per_step"] >= 0 and row["speedup_vs_transformers"] > 0
  assert "weight_stream_bound_ms" in d["engine"]
  profile = d["calibration"]["profile"]
  assert profile is not None and os.path.exists(d["calibration"]["profile_path"])
  from superinfer_jax.sim.profiles import load_hardware_profile   # the simulator loads it
  load_hardware_profile(d["calibration"]["profile_path"])
