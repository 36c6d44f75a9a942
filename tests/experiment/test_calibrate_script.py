"""scripts/calibrate.py end to end on a tiny random model (minimal grid), and the calibration fits."""
import json
import math
import os
import subprocess
import sys

import pytest

from superinfer_jax.sim import calibration as cal
from superinfer_jax.sim.cost import ModelProfile
from superinfer_jax.sim.profiles import load_hardware_profile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "calibrate.py")
ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def _smol():
  from superinfer_jax.model.config import load_config
  return ModelProfile.from_model_config(load_config("smollm2-135m"), dtype="float32")


def test_calibrate_script_tiny_model(tiny_model_dir, tmp_path):
  out = tmp_path / "hw" / "tiny.json"
  cmd = [sys.executable, SCRIPT, f"--model={tiny_model_dir}", "--decode_batches=1,2", "--decode_contexts=16",
         "--prefill_chunks=16,32", "--transfer_blocks=1,2", "--naive_blocks=1", "--warmup=1", "--repeats=2",
         "--max_num_batched_tokens=32", "--num_device_blocks=24", "--num_host_blocks=8",
         "--blocks_bucket_floor=8", "--name=tiny-cpu", f"--output={out}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "wrote" in proc.stdout
  hw = load_hardware_profile(str(out))
  assert hw.name == "tiny-cpu"
  for v in (hw.hbm_bandwidth_gbps, hw.peak_tflops, hw.mem_efficiency, hw.flop_efficiency, hw.hbm_capacity_gb,
            hw.link.duplex_cap_gbps):
    assert math.isfinite(v) and v > 0
  assert 0 < hw.mem_efficiency <= 1 and 0 < hw.flop_efficiency <= 1
  assert hw.step_overhead_s >= 0 and hw.link.launch_overhead_s >= 0
  for curve in (hw.link.d2h_curve, hw.link.h2d_curve):
    assert len(curve) == 2 and all(s > 0 and b > 0 and math.isfinite(b) for s, b in curve)
  with open(out) as f:
    raw = json.load(f)
  src = raw["mem_efficiency"]["source"]
  assert "python scripts/calibrate.py" in src and "--decode_batches=1,2" in src and "UTC" in src
  assert all("scripts/calibrate.py" in s for s in hw.sources.values())


def test_calibrate_script_bad_flags(tmp_path):
  proc = subprocess.run([sys.executable, SCRIPT, "--prefill_chunks=512", "--max_num_batched_tokens=256",
                         f"--output={tmp_path / 'x.json'}"], capture_output=True, text=True, timeout=120,
                        env=ENV, cwd=ROOT)
  assert proc.returncode != 0 and "--prefill_chunks 512" in proc.stderr
  assert not (tmp_path / "x.json").exists()


def test_fit_step_model_recovers_a_roofline():
  model = _smol()
  mem, flop, over = 10.0, 0.04, 0.02        # GB/s, TFLOP/s, s
  pts = []
  for b in (1, 4, 8):
    for c in (32, 160):
      s = cal.decode_shape(b, c)
      bts, fl = cal._terms(s, model)
      pts.append(cal.StepPoint("decode", b, b, c, s, max(bts / (mem * 1e9), fl / (flop * 1e12)) + over))
  for n in (32, 128, 256):
    s = cal.prefill_shape(n)
    bts, fl = cal._terms(s, model)
    pts.append(cal.StepPoint("prefill", 1, n, 0, s, max(bts / (mem * 1e9), fl / (flop * 1e12)) + over))
  fit = cal.fit_step_model(pts, model)
  assert fit.mem_gbps == pytest.approx(mem, rel=0.03)
  assert fit.flop_tflops == pytest.approx(flop, rel=0.03)
  assert fit.overhead_s == pytest.approx(over, rel=0.05)
  assert max(abs(e) for e in fit.rel_errors) < 0.02


def test_fit_link_and_profile():
  bb = 1 << 20
  pts = []
  for n in (1, 4, 16):
    pts += [cal.TransferPoint("duplex", n, 0, 1e-4 + n * bb / 5e9),
            cal.TransferPoint("duplex", 0, n, 1e-4 + n * bb / 4e9),
            cal.TransferPoint("duplex", n, n, 1e-4 + 2 * n * bb / 6e9)]
  pts += [cal.TransferPoint("naive", 2, 0, 1e-4 + 2 * bb / 0.5e9),
          cal.TransferPoint("naive", 0, 2, 1e-4 + 2 * bb / 0.4e9)]
  fit = cal.fit_link(pts, bb)
  assert fit.d2h_gbps == pytest.approx(5, rel=1e-6) and fit.h2d_gbps == pytest.approx(4, rel=1e-6)
  assert fit.launch_s == pytest.approx(1e-4, rel=1e-6)
  assert fit.duplex_cap_gbps == pytest.approx(6, rel=1e-3)
  assert fit.naive_d2h_gbps == pytest.approx(0.5, rel=1e-6)
  model = _smol()
  sfit = cal.StepFit(mem_gbps=9.0, flop_tflops=0.05, overhead_s=0.01, rel_errors=(0.0,))
  pt = cal.StepPoint("decode", 1, 1, 32, cal.decode_shape(1, 32), 0.07)
  prof = cal.build_profile(name="t", description="d", command="python scripts/calibrate.py --x", date="D",
                           machine={"read_gbps": 20.0, "matmul_tflops": 0.04}, step_fit=sfit, link_fit=fit,
                           model=model, block_bytes=bb, num_layers=30, step_points=[pt], memory_gb=8)
  assert prof["mem_efficiency"]["value"] == pytest.approx(0.45)
  assert prof["peak_tflops"]["value"] == pytest.approx(0.05) and prof["flop_efficiency"]["value"] == 1.0
  assert prof["link"]["d2h_gbps_by_segment"]["points"][0][0] == bb // 60
  assert "`python scripts/calibrate.py --x` on D" in prof["step_overhead_s"]["source"]


def test_checked_in_cpu_profile_is_calibrated():
  hw = load_hardware_profile("cpu")
  assert all("scripts/calibrate.py" in s and "placeholder" not in s for s in hw.sources.values())
