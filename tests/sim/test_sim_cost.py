"""The simulator's cost model: step roofline (dense, MoE, TP), transfer-vs-segment curves and DuplexKV modes,
hardware profiles. Expected values are computed by hand from the model / profile numbers."""
import dataclasses
import json
import math

import pytest

from superinfer_jax.model.config import load_config
from superinfer_jax.sim import cost as C
from superinfer_jax.sim import profiles as P
from superinfer_jax.sim import transfer as X
from superinfer_jax.sched.plan import ScheduledSeq

MiB = 1 << 20


@pytest.fixture(scope="module")
def llama():
  return C.ModelProfile.from_model_config(load_config("llama-3-8b"), dtype="bfloat16", name="llama-3-8b")


@pytest.fixture(scope="module")
def h200():
  return P.load_hardware_profile("h200")


@pytest.fixture(scope="module")
def gh200():
  return P.load_hardware_profile("gh200")


def _seq(new, computed, rid="r"):
  return ScheduledSeq(rid, new, computed, [], True)


# ----------------------------------------------------------------------------------------- step roofline
def test_llama3_8b_decode_batch1_is_weight_bandwidth_bound(llama, h200):
  # Weights one decode step reads, by hand (configs/models/llama-3-8b.json, bf16): per layer q/o 4096x4096
  # each, k/v 4096x1024 each, MLP 3 x 4096x14336, two norms of 4096; 32 layers; LM head 128256x4096; final
  # norm. The input embedding is only gathered (one row), so it is not charged.
  layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
  params = 32 * layer + 128256 * 4096 + 4096
  assert params == 7_504_924_672
  weight_bytes = 2 * params
  assert h200.hbm_bandwidth_gbps == 4800
  expected = weight_bytes / (4800e9 * h200.mem_efficiency) + h200.step_overhead_s
  shape = C.batch_shape([_seq(1, 200)])
  sc = C.step_cost(shape, llama, h200)
  assert sc.bound == "memory"
  assert sc.weight_bytes == weight_bytes
  assert sc.time_s == pytest.approx(expected, rel=0.01)   # KV of 201 tokens adds ~0.2%
  assert 4e-3 < sc.time_s < 7e-3                          # ~5.4 ms: the right ballpark for an H200


def test_batch_shape_counts_causal_pairs_and_context():
  shape = C.batch_shape([_seq(4, 10, "a"), _seq(1, 99, "b")])
  assert shape.num_tokens == 5 and shape.num_seqs == 2
  assert shape.context_tokens == 14 + 100
  # prefill chunk: queries at positions 10..13 see 11..14 keys; decode token sees 100
  assert shape.attn_pairs == (11 + 12 + 13 + 14) + 100


def test_long_prefill_is_compute_bound_and_attention_grows_with_context(llama, h200):
  short = C.step_cost(C.batch_shape([_seq(4096, 0)]), llama, h200)
  assert short.bound == "compute"
  flops = 2 * 4096 * llama.active_params_per_token() + 2 * 1 * 128256 * 4096 + \
      4 * (4096 * 4097 / 2) * 32 * 128 * 32
  assert short.flops == pytest.approx(flops)
  dec_short = C.step_time(C.batch_shape([_seq(1, 100)] * 64), llama, h200)
  dec_long = C.step_time(C.batch_shape([_seq(1, 4000)] * 64), llama, h200)
  # 64 x 3900 more KV tokens x 128 KiB per token read on top
  extra = 64 * 3900 * llama.kv_bytes_per_token / (4800e9 * h200.mem_efficiency)
  assert dec_long - dec_short == pytest.approx(extra, rel=1e-6)


def test_moe_expected_experts_grow_with_batch_and_saturate():
  assert C.expected_experts(8, 2, 0) == 0.0
  assert C.expected_experts(8, 2, 1) == pytest.approx(2.0)
  assert C.expected_experts(8, 2, 2) == pytest.approx(8 * (1 - 0.75 ** 2))
  vals = [C.expected_experts(8, 2, t) for t in (1, 2, 4, 8, 16, 64, 512)]
  assert all(b > a for a, b in zip(vals, vals[1:]))
  assert vals[-1] == pytest.approx(8.0, abs=1e-9) and all(v <= 8 for v in vals)
  assert C.expected_experts(1, 1, 100) == 1.0   # dense


def test_mixtral_weight_term_follows_the_routed_experts(h200):
  mix = C.ModelProfile.from_model_config(load_config("mixtral-8x7b"), dtype="bfloat16")
  assert mix.is_moe and mix.num_experts == 8 and mix.experts_per_token == 2
  b1 = C.step_cost(C.batch_shape([_seq(1, 10)]), mix, h200)
  b64 = C.step_cost(C.batch_shape([_seq(1, 10)] * 64), mix, h200)
  assert b1.experts_touched == pytest.approx(2.0) and b64.experts_touched == pytest.approx(8.0, abs=1e-6)
  expert_bytes = 2 * 32 * 3 * 4096 * 14336     # one expert in every layer, bf16
  assert b64.weight_bytes - b1.weight_bytes == pytest.approx(6 * expert_bytes, rel=1e-6)
  # the weights in memory hold all 8 experts (~93 GB) and the input embedding
  assert 90e9 < mix.total_weight_bytes() < 95e9


def test_tensor_parallel_halves_weights_and_adds_allreduce(llama, h200):
  shape = C.batch_shape([_seq(1, 100)] * 8)
  one = C.step_cost(shape, llama, h200, 1)
  two = C.step_cost(shape, llama, h200, 2)
  assert two.weight_bytes == pytest.approx(one.weight_bytes / 2)
  assert two.memory_s == pytest.approx(one.memory_s / 2)
  assert one.allreduce_s == 0.0
  # 2 all-reduces per layer of T x hidden x 2 bytes; ring factor 2 (p-1)/p = 1 at p = 2
  msg = 8 * 4096 * 2
  assert two.allreduce_s == pytest.approx(2 * 32 * (h200.tp_latency_s + msg / (h200.tp_bandwidth_gbps * 1e9)))
  assert two.time_s < one.time_s
  with pytest.raises(ValueError):
    C.step_cost(shape, llama, h200, 0)


def test_device_pool_blocks_from_hbm(llama, h200):
  block = load_config("llama-3-8b").kv_spec(16, "bfloat16").block_bytes
  assert block == 2 * MiB
  n = C.device_pool_blocks(llama, h200, block, memory_fraction=0.9)
  assert n == int((141e9 * 0.9 - llama.total_weight_bytes()) // block)
  assert 50_000 < n < 56_000
  assert C.device_pool_blocks(llama, h200, block, memory_fraction=0.9, tensor_parallel_size=2) > 2 * n
  mix = C.ModelProfile.from_model_config(load_config("mixtral-8x7b"), dtype="bfloat16")   # ~93 GB
  a100 = P.load_hardware_profile("a100-80gb")
  with pytest.raises(ValueError, match="do not fit"):
    C.device_pool_blocks(mix, a100, block, memory_fraction=0.9)
  assert C.device_pool_blocks(mix, a100, block, memory_fraction=0.9, tensor_parallel_size=2) > 0


# ----------------------------------------------------------------------------------------------- transfers
def test_curve_follows_the_profile_points(h200, gh200):
  pc = h200.link.d2h_curve
  assert X.curve_bandwidth(pc, 65536) == pytest.approx(4.5)
  assert X.curve_bandwidth(pc, MiB) == pytest.approx(30)
  assert X.curve_bandwidth(pc, 8 * MiB) == pytest.approx(60)
  assert X.curve_bandwidth(pc, 64 * MiB) == pytest.approx(60)        # plateau
  assert X.curve_bandwidth(pc, 2 * MiB) == pytest.approx(30 + 30 / 3)  # 1/3 of the way in log2 from 1 to 8 MB
  assert X.curve_bandwidth(pc, 32768) == pytest.approx(4.5 / 2)       # latency-bound below the first point
  c2c = gh200.link.d2h_curve
  assert X.curve_bandwidth(c2c, 4 * MiB) == pytest.approx(80.05 * 2**30 / 1e9, rel=1e-4)   # Table 1 merged
  sizes = [2 ** k for k in range(10, 27)]
  bws = [X.curve_bandwidth(pc, s) for s in sizes]
  assert all(b >= a for a, b in zip(bws, bws[1:]))


def test_merged_transfer_time_by_hand(h200):
  spec = load_config("llama-3-8b").kv_spec(16, "bfloat16")
  t = X.transfer_cost(10, 0, spec, h200.link, "merged")
  assert t.segment_bytes == 2 * MiB and t.segments_out == 10 and t.bytes_out == 20 * MiB
  assert t.time_s == pytest.approx(h200.link.launch_overhead_s + 20 * MiB / 40e9)
  both = X.transfer_cost(10, 5, spec, h200.link, "merged")
  assert both.time_s == pytest.approx(2 * h200.link.launch_overhead_s + 30 * MiB / 40e9)
  assert X.transfer_cost(0, 0, spec, h200.link, "duplex").time_s == 0.0


def test_duplex_beats_merged_beats_naive_for_in_and_out(h200, gh200):
  spec = load_config("llama-3-8b").kv_spec(16, "bfloat16")
  for hw in (h200, gh200):
    naive, merged, kernel, duplex = (X.transfer_time(200, 200, spec, hw.link, m) for m in X.MODES)
    assert duplex < kernel <= merged < naive
    assert naive > 5 * merged                               # 32 KiB copies sit on the steep end of the curve
  # h200 has no kernel rates: its batches run at the 2 MiB curve point; the duplex cap does not bind there.
  h = [X.transfer_time(200, 200, spec, h200.link, m) for m in ("merged", "merged_kernel", "duplex")]
  assert h[0] == pytest.approx(h[1]) and h[2] == pytest.approx(h[1] / 2, rel=0.02)
  # one direction only: duplex == merged (nothing to overlap)
  assert X.transfer_time(50, 0, spec, h200.link, "duplex") == pytest.approx(
      X.transfer_time(50, 0, spec, h200.link, "merged"))


def test_duplex_cap_binds_when_the_sum_exceeds_it():
  link = P.LinkProfile("test", ((1.0, 200.0),), ((1.0, 200.0),), duplex_cap_gbps=300.0, launch_overhead_s=0.0)
  spec = load_config("llama-3-8b").kv_spec(16, "bfloat16")
  t = X.transfer_time(100, 100, spec, link, "duplex")
  assert t == pytest.approx(200 * 2 * MiB / 300e9)
  assert t > X.transfer_time(100, 0, spec, link, "duplex")


def test_layer_first_same_bytes_2L_times_more_smaller_segments(h200):
  cfg = load_config("llama-3-8b")
  bf = cfg.kv_spec(16, "bfloat16", "block_first")
  lf = cfg.kv_spec(16, "bfloat16", "layer_first")
  a = X.transfer_cost(40, 40, bf, h200.link, "merged")
  b = X.transfer_cost(40, 40, lf, h200.link, "merged")
  assert a.bytes_out == b.bytes_out and a.bytes_in == b.bytes_in
  assert b.segments_out == 2 * 32 * a.segments_out and b.segments_in == 2 * 32 * a.segments_in
  assert b.segment_bytes * 2 * 32 == a.segment_bytes == 2 * MiB
  assert b.time_s > 5 * a.time_s
  # naive copies layer x K/V pieces whatever the layout
  assert X.transfer_cost(1, 0, bf, h200.link, "naive").segments_out == 64
  with pytest.raises(ValueError):
    X.transfer_cost(1, 0, bf, h200.link, "bogus")


def test_swap_bandwidth_override_scales_the_link(gh200):
  hw = gh200.with_swap_bandwidth(50.0)
  assert hw.link.plateau_gbps == pytest.approx(50.0)
  f = 50.0 / 200.0
  assert hw.link.duplex_cap_gbps == pytest.approx(gh200.link.duplex_cap_gbps * f)
  assert hw.link.kernel_h2d_gbps == pytest.approx(gh200.link.kernel_h2d_gbps * f)
  assert X.curve_bandwidth(hw.link.h2d_curve, MiB) == pytest.approx(80 * f)
  assert gh200.with_swap_bandwidth(0.0) is gh200


# ------------------------------------------------------------------------------------------------ profiles
@pytest.mark.parametrize("name", ["gh200", "h200", "a100-80gb", "cpu"])
def test_builtin_profiles_load_and_every_number_has_a_source(name):
  hw = P.load_hardware_profile(name)
  assert hw.name == name
  with open(P.resolve_profile_path(name)) as f:
    raw = json.load(f)

  def numbers(d, prefix=""):
    for k, v in d.items():
      if isinstance(v, dict) and ("value" in v or "points" in v):
        yield prefix + k, v
      elif isinstance(v, dict):
        yield from numbers(v, prefix + k + ".")
  found = dict(numbers(raw))
  assert len(found) >= 12
  for key, entry in found.items():
    assert entry["source"].strip(), key
  if name == "cpu":   # written by scripts/calibrate.py: every number cites the command and its date
    assert all("scripts/calibrate.py" in e["source"] and "placeholder" not in e["source"]
               for e in found.values())
  assert set(P.builtin_profile_names()) >= {"gh200", "h200", "a100-80gb", "cpu"}


def _base_profile():
  with open(P.resolve_profile_path("h200")) as f:
    return json.load(f)


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d["hbm_bandwidth_gbps"].pop("source"), "no 'source'"),
    (lambda d: d.pop("peak_tflops"), "missing field"),
    (lambda d: d.update(bogus=1), "unknown field"),
    (lambda d: d["mem_efficiency"].update(value=1.5), "outside"),
    (lambda d: d["hbm_capacity_gb"].update(value="big"), "finite number"),
    (lambda d: d["link"]["d2h_gbps_by_segment"].update(points=[[2, 1], [1, 2]]), "increasing"),
    (lambda d: d["link"].pop("duplex_cap_gbps"), "missing link field"),
    (lambda d: d["link"]["h2d_gbps_by_segment"].update(points=[[1, -3]]), "GB/s > 0"),
])
def test_profile_validation_names_the_problem(mutate, match, tmp_path):
  d = _base_profile()
  mutate(d)
  p = tmp_path / "bad.json"
  p.write_text(json.dumps(d))
  with pytest.raises(P.ProfileError, match=match):
    P.load_hardware_profile(str(p))


def test_unknown_profile_name_lists_the_builtins():
  with pytest.raises(P.ProfileError, match="gh200"):
    P.load_hardware_profile("tpu-v9")


def test_model_profile_kv_bytes_match_the_kv_spec(llama):
  spec = load_config("llama-3-8b").kv_spec(16, "bfloat16")
  assert llama.kv_bytes_per_token * 16 == spec.block_bytes
  assert math.isclose(llama.total_weight_bytes(), 2 * load_config("llama-3-8b").num_params())


def test_padded_shape_by_hand_and_matches_the_engines_buckets():
  """The engine's buckets (model/batch.py: powers of two over the floors): T 9 -> 16, S 3 -> 8, the widest
  block table 5 blocks -> 32; every seq attends over 32 * 16 = 512 padded keys."""
  from superinfer_jax.model.batch import bucket
  b = C.Buckets(block_size=16, token_floor=8, seq_floor=8, blocks_floor=32)
  seqs = [(1, 70), (1, 20), (7, 0)]                  # 9 tokens; widest: 71 tokens = 5 blocks
  s = C.padded_shape(seqs, b)
  assert (s.num_tokens, s.num_seqs) == (bucket(9, 8), bucket(3, 8)) == (16, 8)
  assert s.context_tokens + s.num_tokens == 8 * 512 and s.attn_pairs == 16 * 512
  assert C.padded_shape([], b) == C.BatchShape()
  assert C.padded_shape([(1, 600)], b).attn_pairs == 8 * 1024    # 38 blocks -> 64


def test_pad_to_buckets_profile_charges_the_bucket(tmp_path):
  """On the cpu profile (compute-bound, padded) a 9-token step costs what a 16-token one does, and about
  1.6x an 8-token one (2x its compute; the fixed overhead aside); the same steps unpadded cost about the same as each other."""
  from superinfer_jax.sim.event_loop import RooflineCost
  cpu = P.load_hardware_profile("cpu")
  assert cpu.pad_to_buckets and not P.load_hardware_profile("h200").pad_to_buckets
  cfg = load_config("smollm2-135m")
  mp = C.ModelProfile.from_model_config(cfg, dtype="float32")
  spec = cfg.kv_spec(16, "float32", "block_first")
  b = C.Buckets(16, 8, 8, 32)
  cost = RooflineCost(mp, cpu, spec, "duplex", buckets=b)

  def seqs(n):
    return [ScheduledSeq(f"r{i}", 1, 40, [0, 1, 2], True) for i in range(n)]
  t8, t9, t16 = cost.step_time(seqs(8)), cost.step_time(seqs(8) + [ScheduledSeq("x", 1, 5, [3], True)]), \
      cost.step_time(seqs(8) + [ScheduledSeq("y", 8, 0, [4], True)])
  assert t9 == pytest.approx(t16) and t9 > 1.5 * t8      # overhead aside, twice the work
  flat = RooflineCost(mp, dataclasses.replace(cpu, pad_to_buckets=False), spec, "duplex")
  assert flat.step_time(seqs(8) + [ScheduledSeq("x", 1, 5, [3], True)]) < 1.2 * flat.step_time(seqs(8))
  with pytest.raises(ValueError, match="buckets"):
    RooflineCost(mp, cpu, spec, "duplex")
