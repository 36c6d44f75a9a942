"""``scripts/device_check.sh``: its deadline logic on stand-in stages (a share of what is left per stage, a stage
cut short or skipped, the JSON rewritten after every stage, at most 8 files under ``$OUT``), a real dry run
under a tiny budget, and the whole dry run on the tiny model with the JSON keys the GPU run writes (so the
script cannot rot between lent GPUs)."""
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_FILES_BACK = 8   # what one device call returns from $OUT


@pytest.fixture(scope="module")
def device_check():
  spec = importlib.util.spec_from_file_location("device_check_script", os.path.join(ROOT, "scripts",
                                                                                     "device_check.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _files_under(path) -> list:
  return [os.path.join(d, f) for d, _, files in os.walk(path) for f in files]


def test_stages_share_what_is_left_and_the_json_is_rewritten_after_each(device_check, tmp_path, monkeypatch):
  # 10 s for engine (weight 4), gpu_tests (3) and transfer (2), none under 4 s: engine's share is 4.4 s, what it
  # leaves goes 3:2 to gpu_tests (cut short at its end) and transfer, whose share is then under 4 s.
  monkeypatch.setattr(device_check, "MIN_STAGE_S", 4.0)
  out, work = tmp_path / "out", tmp_path / "work"
  out.mkdir()
  work.mkdir()
  seen = {}

  def run_stage(st):
    if st.name == "engine":
      st.run("quick", [sys.executable, "-c", "print('{\"x\": 1}')"])
      with open(st.path("figure.txt"), "w") as f:
        f.write("engine figure")
      return {"x": 1}
    if st.name == "gpu_tests":   # the JSON already holds the engine stage's figures
      seen["json"] = json.loads((out / "device_check.json").read_text())
      seen["limit"] = st.ends_at - time.monotonic()
      st.run("slow", [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"])
      return {"partial": "started" in st.outputs[-1]}
    raise AssertionError(st.name)

  names = ["engine", "gpu_tests", "transfer"]
  t = time.monotonic()
  result = device_check.run_stages(names, run_stage, 10.0, str(out), str(work), {}, dict(os.environ),
                                   log=lambda m: None)
  assert time.monotonic() - t < 10.0 + 5.0                    # the deadline held the slow stage
  assert seen["json"]["stages"]["engine"]["status"] == "finished" and seen["json"]["engine"] == {"x": 1}
  # gpu_tests' share: its weight over the weights still to run (3 of 3 + 2) of what engine left.
  assert 0.5 * 10.0 * 3 / 5 < seen["limit"] <= 10.0 * 3 / 5
  stages = result["stages"]
  assert stages["gpu_tests"]["status"] == "cut" and result["gpu_tests"] == {"partial": True}
  assert stages["transfer"]["status"] == "skipped" and "under" in stages["transfer"]["reason"]
  assert result["transfer"] is None
  assert json.loads((out / "device_check.json").read_text())["stages"] == stages
  assert len(_files_under(out)) <= MAX_FILES_BACK
  with tarfile.open(out / device_check.ARCHIVE) as tar:
    names_in = tar.getnames()
  assert "engine/figure.txt" in names_in and "engine/quick.log" in names_in and "gpu_tests/slow.log" in names_in


def test_a_stage_that_raises_is_failed_and_the_rest_still_run(device_check, tmp_path, monkeypatch):
  monkeypatch.setattr(device_check, "MIN_STAGE_S", 0.1)

  def run_stage(st):
    if st.name == "engine":
      raise RuntimeError("no device")
    return {"ran": st.name}

  result = device_check.run_stages(["engine", "gpu_tests"], run_stage, 5.0, str(tmp_path), str(tmp_path), {},
                                   dict(os.environ), log=lambda m: None)
  assert result["stages"]["engine"]["status"] == "failed" and "no device" in result["engine"]["error"]
  assert result["stages"]["gpu_tests"]["status"] == "finished" and result["gpu_tests"] == {"ran": "gpu_tests"}


def test_compile_seconds_are_read_from_jax_log_compiles(device_check):
  text = ("W1207 pxla.py:1514] Finished XLA compilation of jit(_step_fn) in 1.500000000 sec\n"
          "WARNING:jax._src.dispatch:Finished tracing + transforming f for pjit in 9.0 sec\n"
          "Finished jaxpr to MLIR module conversion jit(f) in 0.250000000 sec\n"
          "Finished tracing f for jit in 0.25 sec\n")
  assert device_check.compile_seconds(text) == (2.0, 3)
  assert device_check.compile_seconds(text, device_check.STEP_COMPILE_LOG) == (1.5, 1)


def _dry_run(out, *args, timeout):
  env = dict(os.environ, JAX_PLATFORMS="cpu", OUT=str(out), PYTHON=sys.executable)
  return subprocess.run(["bash", os.path.join(ROOT, "scripts", "device_check.sh"), "--dry_run", *args], env=env,
                        capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_dry_run_under_a_tiny_budget_holds_its_deadline(tmp_path):
  """46 s for eight stages: engine gets 4/18 (just over the 10 s minimum), and the stages after it share what it
  leaves; every stage ends by its limit (cut short if it must), and those whose share is too short are skipped."""
  proc = _dry_run(tmp_path, "--budget_s=46", timeout=120)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "[device_check] budget 46 s for 8 stages" in proc.stdout
  d = json.loads((tmp_path / "device_check.json").read_text())
  assert d["dry_run"] is True and d["budget_s"] == 46 and d["elapsed_s"] < 46 + 5
  stages = d["stages"]
  assert list(stages) == ["engine", "gpu_tests", "transfer", "attention", "experiment", "multiturn", "calibration",
                          "startup"]
  assert stages["engine"]["limit_s"] == pytest.approx(46 * 4 / 18, abs=0.5)
  for name, record in stages.items():
    assert record["seconds"] <= record["limit_s"] + 3, (name, record)
    assert record["status"] in ("finished", "cut", "skipped"), (name, record)
    assert f"[device_check] {name:<13} {record['status']}" in proc.stdout
  assert stages["gpu_tests"]["status"] == "skipped" and "under 10 s" in stages["gpu_tests"]["reason"]
  assert sorted(os.listdir(tmp_path)) == ["device_check.json", "device_check_artifacts.tar.gz"]


@pytest.mark.slow
def test_device_check_dry_run_writes_every_stage(tmp_path):
  proc = _dry_run(tmp_path, "--budget_s=1500", timeout=1800)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert len(_files_under(tmp_path)) <= MAX_FILES_BACK
  d = json.loads((tmp_path / "device_check.json").read_text())
  assert d["dry_run"] is True and d["platform"] == "cpu"
  for stage, record in d["stages"].items():
    assert record["status"] == "finished", (stage, record)
    assert record["compile_s"] is None if stage == "gpu_tests" else record["compile_s"] > 0, (stage, record)
  art = tmp_path / "artifacts"
  with tarfile.open(tmp_path / "device_check_artifacts.tar.gz") as tar:
    tar.extractall(art, filter="data")
  assert d["gpu_tests"]["passed"] > 0 and d["gpu_tests"]["failed"] == 0
  assert {r["impl"] for r in d["attention"]["results"]} >= {"pallas", "reference"}
  assert {w["key"]["mode"] for w in d["attention"]["tune_written"]} == {"decode", "mixed"}   # --tune ran
  tuned = json.loads((art / d["attention"]["tune_table"]).read_text())["entries"]
  assert {e["key"]["card"] for e in tuned} >= {"cpu"}
  assert all(r["tuning"]["reason"] == "exact" for r in d["attention"]["results"] if r["impl"] == "pallas")
  assert {r["mode"] for r in d["transfer"]["results"]} >= {"merged", "duplex"}
  assert [r["mode"] for r in d["transfer"]["table1"]["rows"]] == ["naive", "merged", "merged_kernel", "duplex",
                                                                   "ideal"]
  assert (art / d["transfer"]["table1_markdown"]).exists()
  assert len(d["experiment"]["entries"]) == 7 and all((art / p).exists() for p in d["experiment"]["plots"])
  (row,) = d["multiturn"]["rows"]   # one conversation of two turns, caching on: turn 2 reuses turn 1's prompt
  assert row["policy"] == "fcfs" and row["num_finished"] >= 1 and row["prefill_tokens_saved"] > 0
  for b in ("1", "2"):
    row = d["engine"]["by_batch"][b]
    assert row["engine_tok_s"] > 0 and row["transformers_tok_s"] > 0 and row["engine_ms_per_step"] > 0
    assert row["dispatch_ms"] >= 0 and row["device_idle_ms_per_step"] >= 0 and row["speedup_vs_transformers"] > 0
  assert "weight_stream_bound_ms" in d["engine"]
  assert d["startup"]["startup_s"] > d["startup"]["precompile_s"] > 0
  assert d["startup"]["compiled_step_shapes"] == d["startup"]["step_compiles_logged"] > 0
  assert d["calibration"]["profile"] is not None
  from superinfer_jax.sim.profiles import load_hardware_profile   # the simulator loads it
  load_hardware_profile(str(art / d["calibration"]["profile_path"]))
