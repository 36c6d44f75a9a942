"""Metrics against hand-computed timelines (1-token request, a rotation gap, an unfinished request)."""
import json
import math

import numpy as np
import pytest

from superinfer_jax import metrics as M
from superinfer_jax.metrics.timeline import RequestTimeline

# Times are exact binary fractions so the <= comparisons at the SLO boundary are exact.
TTFT_SLO, TBT_SLO = 0.6, 0.125


def _hand_timelines():
  a = RequestTimeline("a", 0.0, 10, 4, [1.0, 1.125, 1.25, 1.375],
                      [(0.0, "waiting"), (0.875, "running"), (1.375, "finished")], "length")
  b = RequestTimeline("b", 0.5, 5, 1, [0.8], [(0.5, "waiting"), (0.75, "running")], "length")
  # c is rotated out after its 2nd token and parked 2 s on host: one long TBT gap.
  c = RequestTimeline("c", 1.0, 7, 4, [1.5, 1.5625, 3.5625, 3.625],
                      [(1.0, "waiting"), (1.25, "running"), (1.6, "rotary"), (3.5, "running")],
                      "length")
  d = RequestTimeline("d", 2.0, 3, 0, [], [(2.0, "waiting")], None)  # never finished
  return [a, b, c, d]


def test_per_request_values():
  a, b, c, d = _hand_timelines()
  assert a.ttft_s == 1.0 and a.e2e_s == 1.375 and a.tpot_s == 0.125
  np.testing.assert_array_equal(a.tbt_gaps_s(), [0.125, 0.125, 0.125])
  assert b.ttft_s == pytest.approx(0.3) and b.e2e_s == pytest.approx(0.3)
  assert b.tpot_s is None and b.tbt_gaps_s().size == 0  # 1 output token: TPOT undefined
  assert c.ttft_s == 0.5 and c.tpot_s == pytest.approx(2.125 / 3) and c.e2e_s == 2.625
  np.testing.assert_array_equal(c.tbt_gaps_s(), [0.0625, 2.0, 0.0625])
  assert c.num_rotations == 1 and a.num_rotations == 0
  assert not d.finished and d.ttft_s is None and d.e2e_s is None and d.tpot_s is None


def test_compute_metrics_hand_computed():
  m = M.compute_metrics(_hand_timelines(), ttft_slo_s=TTFT_SLO, tbt_slo_s=TBT_SLO)
  assert m["num_requests"] == 4 and m["num_finished"] == 3
  # TTFT over finished requests: [1.0, 0.3, 0.5]; numpy linear percentiles.
  assert m["ttft_p50_s"] == pytest.approx(0.5)
  assert m["ttft_p99_s"] == pytest.approx(0.5 + 0.98 * 0.5)
  assert m["ttft_mean_s"] == pytest.approx(1.8 / 3)
  # Pooled TBT gaps of a and c: [.125]*3 + [.0625, 2.0, .0625] (b has none).
  assert m["num_tbt_gaps"] == 6
  assert m["tbt_p50_s"] == pytest.approx(0.125)
  assert m["tbt_p99_s"] == pytest.approx(0.125 + 0.95 * 1.875)
  assert m["tbt_mean_s"] == pytest.approx((3 * 0.125 + 0.125 + 2.0) / 6)
  # TPOT excludes the 1-token request: [0.125, 2.125/3].
  assert m["tpot_p50_s"] == pytest.approx((0.125 + 2.125 / 3) / 2)
  assert m["e2e_p99_s"] == pytest.approx(np.percentile([1.375, 0.3, 2.625], 99))
  # Attainments: TTFT a fails (1.0 > .6), b and c pass, d unfinished fails -> 2/4.
  assert m["ttft_attainment"] == 0.5
  # TBT: 5 of 6 gaps <= 0.125 (a's gaps sit exactly at the SLO and pass).
  assert m["tbt_attainment"] == pytest.approx(5 / 6)
  # Per request: a's worst gap 0.125 passes, b has no gap and passes, c's 2.0 fails, d unfinished -> 2/4.
  assert m["tbt_request_attainment"] == 0.5
  # Worst gap per request with a gap: a 0.125, c 2.0 -> P99 = 0.125 + 0.99 * 1.875 (one value per request).
  assert m["tbt_worst_p50_s"] == pytest.approx((0.125 + 2.0) / 2)
  assert m["tbt_worst_p99_s"] == pytest.approx(0.125 + 0.99 * 1.875)
  assert m["tbt_worst_p99_s"] > m["tbt_p99_s"]
  # SLO: only b (1 token, judged on TTFT alone); c's TPOT 0.708 > 0.125; d unfinished.
  assert m["slo_attainment"] == 0.25
  # Throughput: 9 output tokens of finished requests over [0, 3.625] s.
  assert m["duration_s"] == 3.625
  assert m["output_throughput_tok_s"] == pytest.approx(9 / 3.625)
  assert m["request_throughput_req_s"] == pytest.approx(3 / 3.625)
  assert m["num_rotations_observed"] == 1


def test_slo_boundary_and_one_token_request():
  tl = RequestTimeline("x", 0.0, 4, 3, [0.5, 0.625, 0.75], [], "length")  # TTFT .5, TPOT .125
  assert M.request_meets_slo(tl, 0.5, 0.125)
  assert not M.request_meets_slo(tl, 0.4999, 0.125)
  assert not M.request_meets_slo(tl, 0.5, 0.12)
  one = RequestTimeline("y", 0.0, 4, 1, [0.25], [], "length")
  assert M.request_meets_slo(one, 0.25, 1e-9)  # no TPOT: the TBT/TPOT condition holds vacuously
  assert not M.request_meets_slo(one, 0.2, 1.0)


def test_rotation_gap_breaks_tbt_not_ttft():
  a, _, c, _ = _hand_timelines()
  m = M.compute_metrics([c], ttft_slo_s=1.0, tbt_slo_s=0.1)
  assert m["ttft_attainment"] == 1.0 and m["slo_attainment"] == 0.0
  assert m["tbt_attainment"] == pytest.approx(2 / 3)
  assert m["tbt_p99_s"] > 1.9


def test_one_stall_among_many_fast_gaps():
  """200 requests of 101 tokens, 10 ms apart; 5 of them stall once for 3 s. Pooled, the stalls are 5 gaps
  in 20,000 (P99 stays 10 ms, 99.975% of gaps attain); per request they are 5 in 200 (2.5% > 1%)."""
  tls = []
  for i in range(200):
    times = [1.0 + 0.01 * k for k in range(101)]
    if i % 40 == 7:
      times = times[:50] + [t + 3.0 for t in times[50:]]
    tls.append(RequestTimeline(f"r{i}", 0.0, 8, 101, times, [(0.0, "waiting"), (0.5, "running")], "length"))
  m = M.compute_metrics(tls, ttft_slo_s=2.0, tbt_slo_s=0.1)
  assert m["tbt_p99_s"] == pytest.approx(0.01)
  assert m["tbt_attainment"] == pytest.approx(1 - 5 / 20000)
  assert m["tbt_request_attainment"] == pytest.approx(195 / 200)
  assert m["tbt_worst_p99_s"] == pytest.approx(3.01)


def test_empty_and_no_gap_cases():
  m = M.compute_metrics([], ttft_slo_s=1.0, tbt_slo_s=0.1)
  assert m["num_requests"] == 0 and m["ttft_p99_s"] is None and m["tbt_attainment"] == 1.0
  assert m["tbt_request_attainment"] == 0.0 and m["tbt_worst_p99_s"] is None
  assert m["output_throughput_tok_s"] == 0.0
  one = RequestTimeline("y", 0.0, 4, 1, [0.25], [], "length")
  m = M.compute_metrics([one], ttft_slo_s=1.0, tbt_slo_s=0.1)
  assert m["tbt_p50_s"] is None and m["tpot_p99_s"] is None and m["slo_attainment"] == 1.0


def _row(**kw):
  args = dict(engine="real", model="m", hardware="cpu", policy="fcfs", rps=2.0, ttft_slo_s=TTFT_SLO,
              tbt_slo_s=TBT_SLO, num_rotations=3, swap_out_bytes=4096, swap_in_bytes=2048,
              num_recompute_preemptions=0)
  args.update(kw)
  return M.results_row(_hand_timelines(), **args)


def test_results_row_schema():
  row = _row(extra={"seed": 0})
  assert set(M.RESULTS_KEYS) <= set(row)
  assert row["num_rotations"] == 3 and row["swap_out_bytes"] == 4096 and row["seed"] == 0
  assert row["slo_attainment"] == 0.25 and row["num_finished"] == 3
  json.dumps(row, allow_nan=False)  # strict JSON
  # Counters default to what the timelines' state changes show.
  assert _row(num_rotations=None)["num_rotations"] == 1
  with pytest.raises(ValueError, match="override"):
    _row(extra={"policy": "x"})


@pytest.mark.parametrize("key,value", [
    ("slo_attainment", 1.5), ("num_finished", 99), ("num_rotations", -1), ("engine", ""),
    ("ttft_p99_s", float("nan")), ("num_requests", 2.0), ("rps", 0.0), ("swap_in_bytes", True),
])
def test_validate_rejects(key, value):
  row = _row()
  row[key] = value
  with pytest.raises(ValueError, match="invalid results row"):
    M.validate_results_row(row)


def test_validate_missing_key_and_null_latency():
  row = _row()
  row["tbt_p50_s"] = None  # no sample: allowed
  M.validate_results_row(row)
  del row["e2e_p99_s"]
  with pytest.raises(ValueError, match="missing e2e_p99_s"):
    M.validate_results_row(row)


def test_jsonl_roundtrip_and_inf_rps(tmp_path):
  path = str(tmp_path / "sub" / "results.jsonl")
  M.append_results_row(path, _row())
  M.append_results_row(path, _row(policy="rotasched", rps=math.inf))
  rows = M.read_results(path)
  assert [r["policy"] for r in rows] == ["fcfs", "rotasched"] and math.isinf(rows[1]["rps"])
  assert rows[0] == _row()


def test_comparison_table():
  rows = [_row(policy="rotasched", rps=4.0), _row(policy="fcfs", rps=4.0), _row(rps=1.0)]
  text = M.format_comparison_table(rows)
  lines = text.splitlines()
  assert "SLO%" in lines[0] and "TTFT p99 ms" in lines[0]
  assert len(lines) == 2 + 3
  assert lines[2].split()[:2] == ["1", "fcfs"] and lines[4].split()[:2] == ["4", "rotasched"]
  assert "25.0" in lines[2]  # slo_attainment in %


def test_timeline_jsonl_roundtrip(tmp_path):
  tls = _hand_timelines()
  tls[0].extra["worker"] = 7
  path = str(tmp_path / M.requests_filename("fcfs_swap", 2.5))
  assert path.endswith("requests-fcfs_swap-2.5.jsonl")
  M.write_timelines(path, tls)
  back = M.read_timelines(path)
  assert [t.to_json_dict() for t in back] == [t.to_json_dict() for t in tls]
  assert back[0].extra == {"worker": 7}
  assert M.parse_requests_filename(path) == ("fcfs_swap", 2.5)
  assert M.parse_requests_filename("requests-my-policy-10.jsonl") == ("my-policy", 10.0)
  assert M.parse_requests_filename("results.jsonl") is None


@pytest.mark.parametrize("policy", ["fcfs", "rotasched_code", "fcfs-x", "a-1", "p-rep1"])
@pytest.mark.parametrize("rps", [1.0, 2.5, 40.0, math.inf, 1e-5, 1e6])
@pytest.mark.parametrize("repeat", [None, 0, 3, 12])
def test_requests_filename_roundtrip_with_repeats(policy, rps, repeat):
  from superinfer_jax.metrics.timeline import parse_requests_filename_full
  name = M.requests_filename(policy, rps, repeat)
  if repeat is None:
    assert name == M.requests_filename(policy, rps) == f"requests-{policy}-{M.format_rps(rps)}.jsonl"
  else:
    assert name == f"requests-{policy}-{M.format_rps(rps)}-rep{repeat}.jsonl"
  assert parse_requests_filename_full("/some/dir/" + name) == (policy, rps, repeat)
  assert M.parse_requests_filename(name) == (policy, rps)


def test_requests_filename_repeat_edge_cases():
  from superinfer_jax.metrics.timeline import parse_requests_filename_full
  assert M.requests_filename("rotasched_code", 2, 1) == "requests-rotasched_code-2-rep1.jsonl"
  assert parse_requests_filename_full("requests-fcfs-x-2-rep1.jsonl") == ("fcfs-x", 2.0, 1)
  assert parse_requests_filename_full("requests-fcfs-x-2.jsonl") == ("fcfs-x", 2.0, None)
  for bad in ("results.jsonl", "requests-fcfs-rep1.jsonl", "requests-2.jsonl", "requests-fcfs-2.json",
              "requests-fcfs-two.jsonl", "requests-fcfs-2-rep.jsonl"):
    assert parse_requests_filename_full(bad) is None, bad
    assert M.parse_requests_filename(bad) is None, bad
  for bad in (-1, 1.5, True, "1"):
    with pytest.raises(ValueError, match="repeat"):
      M.requests_filename("fcfs", 2, bad)


def test_timeline_validate():
  bad = RequestTimeline("z", 1.0, 3, 2, [0.5, 1.5], [], "length")  # token before arrival
  with pytest.raises(ValueError, match="before arrival"):
    bad.validate()
  bad = RequestTimeline("z", 0.0, 3, 2, [1.5, 1.0], [], "length")
  with pytest.raises(ValueError, match="non-decreasing"):
    bad.validate()
  for tl in _hand_timelines():
    tl.validate()


def test_timeline_recorder_matches_hand_timeline():
  rec = M.TimelineRecorder()
  rec.add_request("c", 1.0, 7, target_output_len=4)
  rec.state("c", 1.25, M.RUNNING)
  rec.state("c", 1.3, M.RUNNING)  # no change: ignored
  rec.token("c", 1.5)
  rec.token("c", 1.5625)
  rec.state("c", 1.6, M.ROTARY)
  rec.state("c", 3.5, M.RUNNING)
  rec.token("c", 3.5625)
  rec.token("c", 3.625)
  rec.finish("c", 3.625, "length")
  rec.add_request("d", 2.0, 3)
  c, d = rec.timelines()
  hand = _hand_timelines()[2]
  assert c.token_times_s == hand.token_times_s and c.output_len == 4 and c.finished
  assert [s for _, s in c.state_changes] == ["waiting", "running", "rotary", "running", "finished"]
  assert c.first_scheduled_s == 1.25 and c.num_rotations == 1
  assert c.tpot_s == hand.tpot_s and not d.finished
  c.validate()
  d.validate()
  with pytest.raises(ValueError):
    rec.add_request("c", 0.0, 1)
