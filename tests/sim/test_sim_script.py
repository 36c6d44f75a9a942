"""scripts/simulate.py end to end (h200 profile, Llama-3-8B shapes, tiny synthetic workload), its flags, and
the simulator's independence from JAX."""
import os
import subprocess
import sys
import textwrap

from superinfer_jax.metrics.results import RESULTS_KEYS, read_results, validate_results_row
from superinfer_jax.metrics.timeline import read_timelines, requests_filename

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "simulate.py")
ENV = dict(os.environ, JAX_PLATFORMS="cpu")

SMALL = ["--hardware=h200", "--model=llama-3-8b", "--dataset=synthetic", "--num_requests=24", "--rps=20",
         "--synthetic_prompt_len=uniform:64,256", "--synthetic_output_len=uniform:32,96",
         "--num_device_blocks=48", "--num_host_blocks=512", "--max_num_seqs=16",
         "--max_num_batched_tokens=512", "--proactive_swap_budget=16", "--ttft_slo=0.5", "--tbt_slo=0.05",
         "--beta_f=0", "--noprogress"]


def _run(args, timeout=300):
  return subprocess.run([sys.executable, SCRIPT] + args, capture_output=True, text=True, timeout=timeout,
                        env=ENV, cwd=ROOT)


def test_simulate_script_end_to_end(tmp_path):
  out = tmp_path / "sim"
  proc = _run(SMALL + ["--policies=fcfs,rotasched", f"--output_dir={out}"])
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "TTFT p99 ms" in proc.stdout and "rotasched" in proc.stdout
  rows = read_results(str(out / "results.jsonl"))
  assert [r["policy"] for r in rows] == ["fcfs", "rotasched"]
  for r in rows:
    validate_results_row(r)
    assert set(RESULTS_KEYS) <= set(r)
    assert r["engine"] == "sim" and r["hardware"] == "h200" and r["model"] == "llama-3-8b"
    assert r["num_requests"] == r["num_finished"] == 24 and r["rps"] == 20
    for k in ("rotations_per_step", "blocks_out_per_step", "blocks_in_per_step", "bytes_out_per_step",
              "bytes_in_per_step", "exposed_transfer_s", "hardware_profile", "model_profile"):
      assert k in r, k
    assert r["dtype"] == "bfloat16" and r["block_bytes"] == 2 << 20
    tls = read_timelines(str(out / requests_filename(r["policy"], 20)))
    assert len(tls) == 24 and all(tl.finished for tl in tls)
  fcfs, rota = rows
  assert fcfs["num_rotations"] == 0 and fcfs["swap_in_bytes"] == 0
  assert rota["num_rotations"] > 0 and rota["rotations_per_step"] > 0
  assert rota["swap_out_bytes"] > 0 and rota["swap_in_bytes"] == rota["blocks_in"] * (2 << 20)
  assert rota["ttft_p99_s"] < fcfs["ttft_p99_s"]     # rotation cuts head-of-line blocking
  assert (out / "config.json").is_file() and list(out.glob("*.png"))


def test_simulate_script_varies_engine_and_sim_settings(tmp_path):
  out = tmp_path / "vary"
  proc = _run(SMALL + ["--policies=rotasched", "--vary=transfer_mode:naive,duplex;swap_bandwidth_gbps:20,120",
                       "--pipeline=false", f"--output_dir={out}"])
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = {r["policy"]: r for r in read_results(str(out / "results.jsonl"))}
  assert len(rows) == 4
  naive = rows["rotasched[transfer_mode=naive,swap_bandwidth_gbps=120]"]
  duplex = rows["rotasched[transfer_mode=duplex,swap_bandwidth_gbps=120]"]
  slow = rows["rotasched[transfer_mode=duplex,swap_bandwidth_gbps=20]"]
  assert naive["transfer_mode"] == "naive" and naive["swap_bandwidth_gbps"] == 120
  assert naive["exposed_transfer_s"] > duplex["exposed_transfer_s"] > 0
  assert slow["exposed_transfer_s"] > duplex["exposed_transfer_s"]


def test_simulate_script_flags_and_errors(tmp_path):
  proc = _run(["--helpfull"])   # absl prints the help and exits 1
  for flag in ("--hardware", "--model_profile", "--swap_bandwidth_gbps", "--tensor_parallel_size",
               "--transfer_mode", "--kv_layout", "--[no]pipeline", "--rps", "--policies", "--vary", "--trace",
               "--trace_arrivals"):
    assert flag in proc.stdout, flag
  bad = _run(SMALL + ["--hardware=tpu-v9", f"--output_dir={tmp_path / 'x'}"])
  assert bad.returncode != 0 and "no hardware profile" in bad.stderr
  bad = _run(SMALL + ["--vary=no_such_setting:1,2", f"--output_dir={tmp_path / 'y'}"])
  assert bad.returncode != 0 and "unknown engine setting" in bad.stderr
  assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_sim_imports_no_jax(tmp_path):
  code = textwrap.dedent(f"""
      import sys
      sys.modules["jax"] = None          # any 'import jax' now raises ImportError
      sys.path.insert(0, {ROOT!r})
      import superinfer_jax.sim, superinfer_jax.sim.sim_sweep
      from superinfer_jax.sim.config import SimConfig
      from superinfer_jax.sim.sim_sweep import run_sim_sweep
      from superinfer_jax.experiment.real_sweep import SweepSpec
      from superinfer_jax.engine.config import EngineConfig
      spec = SweepSpec(model="llama-3-8b", dataset="synthetic", num_requests=8, rps="50",
                       policies="fcfs,rotasched", output_dir={str(tmp_path / "nojax")!r}, progress=False,
                       synthetic_prompt_len="uniform:32,128", synthetic_output_len="uniform:8,32", hardware="gh200")
      cfg = EngineConfig.create(dtype="bfloat16", num_device_blocks=24, num_host_blocks=256,
                                proactive_swap_budget=8, max_num_seqs=8)
      rows = run_sim_sweep(spec, cfg, SimConfig(), log=lambda *a: None)
      assert len(rows) == 2 and all(r["num_finished"] == 8 and r["engine"] == "sim" for r in rows), rows
      assert sys.modules["jax"] is None and "jaxlib" not in sys.modules and "flax" not in sys.modules
      print("ok")
  """)
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=ENV)
  assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
