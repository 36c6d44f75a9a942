"""experiment/sim_validation.py: which real steps count for the in-run fit (hand-worked), the refitted profile, the
comparison table, and the recorder on a real (tiny) engine."""
import json

import pytest

from superinfer_jax.sim import calibration as cal
from superinfer_jax.experiment import sim_validation as v
from superinfer_jax.sim.cost import ModelProfile, step_time
from superinfer_jax.sim.profiles import load_hardware_profile, profile_from_dict, resolve_profile_path
from superinfer_jax.model.config import load_config


def _rec(plan, done, seqs, out=0, inn=0):
  return v.StepRecord(plan_time=plan, done_time=done, seqs=tuple(seqs), blocks_out=out, blocks_in=inn)


def test_points_from_records_hand_worked():
  recs = [
      _rec(0.00, 0.10, [(32, 0)]),            # first: no previous completion -> not a point
      _rec(0.05, 0.30, [(1, 32), (16, 0)]),   # planned (lookahead) before 0.10: period 0.20, mixed
      _rec(0.29, 0.45, [(1, 33), (1, 16)]),   # planned before 0.30: period 0.15, decode
      _rec(1.45, 1.60, [(8, 0)]),             # planned 1 s after 0.45 (idle): dropped
      _rec(1.59, 1.60, []),                   # nothing ran: dropped
      _rec(1.61, 1.75, [(1, 8)]),             # planned 0.01 s after 1.60: counts, period 0.15
  ]
  pts = v.points_from_records(recs, max_gap_s=0.02)
  assert [p.kind for p in pts] == ["mixed", "decode", "decode"]
  assert [round(p.seconds, 6) for p in pts] == [0.2, 0.15, 0.15]
  first = pts[0].shape
  assert (first.num_tokens, first.num_seqs, first.context_tokens) == (17, 2, 33 + 16)
  assert first.attn_pairs == (1 * 32 + 1) + 16 * 17 // 2       # causal pairs: decode 33, prefill 136


def test_refit_profile_replaces_the_step_numbers_only():
  with open(resolve_profile_path("cpu")) as f:
    base = json.load(f)
  fit = cal.StepFit(mem_gbps=3.0, flop_tflops=0.02, overhead_s=0.05, rel_errors=(0.0,))
  d = v.refit_profile(base, fit, name="cpu-refit", source="test")
  hw = profile_from_dict(d)
  old = load_hardware_profile("cpu")
  assert hw.name == "cpu-refit" and hw.step_overhead_s == 0.05
  assert hw.hbm_bandwidth_gbps * hw.mem_efficiency == pytest.approx(3.0, rel=1e-4)
  assert hw.peak_tflops * hw.flop_efficiency == pytest.approx(0.02, rel=1e-4)
  assert hw.link == old.link and hw.copies_overlap_compute == old.copies_overlap_compute
  assert base["step_overhead_s"]["value"] == old.step_overhead_s        # the base is not modified
  # The refitted profile predicts what the fit predicts.
  mp = ModelProfile.from_model_config(load_config("smollm2-135m"), dtype="float32")
  shape = cal.prefill_shape(128)
  assert step_time(shape, mp, hw) == pytest.approx(fit.predict(shape, mp), rel=1e-3)


def test_comparison_counts_within_tolerance():
  real = dict(ttft_p50_s=1.0, ttft_p99_s=2.0, tbt_p50_s=0.1, tbt_p99_s=0.4, slo_attainment=0.5)
  sim = dict(ttft_p50_s=1.2, ttft_p99_s=1.0, tbt_p50_s=0.1, tbt_p99_s=0.5, slo_attainment=0.5)
  table, ok, n = v.comparison([("fcfs", real, sim)])
  assert (ok, n) == (3, 4)                   # +20%, -50% (miss), 0%, +25%
  assert "1000 / 1200 (+20%)" in table and "2000 / 1000 (-50% ✗)" in table and "50.0 / 50.0" in table


def test_recorder_on_a_real_engine(tiny_model_dir):
  """Every step of a real engine is recorded with its batch, in order, and the back-to-back steps of a
  saturated run become fit points whose periods add up to the run's stepping time."""
  from superinfer_jax.engine.config import EngineConfig, SamplingParams
  from superinfer_jax.engine import engine as engine_mod
  rec = v.StepRecorder()
  eng = engine_mod.LLMEngine(tiny_model_dir, EngineConfig.create(
      num_device_blocks=64, num_host_blocks=0, block_size=8, max_num_seqs=4, max_num_batched_tokens=64))
  rec.attach(eng, eng.config.scheduler.policy)
  for n in (20, 9, 5):
    eng.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=4, ignore_eos=True))
  while eng.has_unfinished():
    eng.step()
  (label, records), = rec.engines
  assert label == eng.config.scheduler.policy
  ran = [r for r in records if r.seqs]
  assert sum(n for r in ran for n, _ in r.seqs) == 20 + 9 + 5 + 3 * 3   # prompts + 3 decodes each
  assert ran[0].seqs == ((20, 0), (9, 0), (5, 0))
  assert all(b.done_time >= a.done_time for a, b in zip(records, records[1:]))
  pts = v.points_from_records(records, max_gap_s=0.5)
  assert len(pts) == len(ran) - 1 and all(p.seconds > 0 for p in pts)
