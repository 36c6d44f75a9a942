"""workload.traces (Azure / Splitwise CSV traces) and scripts/simulate.py --trace."""
import math
import os
import subprocess
import sys
import textwrap

import pytest

from superinfer_jax.metrics.results import read_results
from superinfer_jax.workload import TraceError, load_trace, read_trace, rescale_to_rps
from superinfer_jax.workload.traces import PACKAGED_TRACES, parse_timestamp, rescale_factor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "simulate.py")
ENV = dict(os.environ, JAX_PLATFORMS="cpu")

AZURE = textwrap.dedent("""\
    TIMESTAMP,ContextTokens,GeneratedTokens
    2023-11-16 18:15:46.6805900,374,44
    2023-11-16 18:15:50.9951690,396,109
    2023-11-16 18:15:51.1000000,0,5
    2023-11-16 18:15:47.0000000,879,20
    2023-11-16 18:15:56.6805900,100,30
    """)
SPLITWISE = textwrap.dedent("""\
    arrived_at,num_prefill_tokens,num_decode_tokens,extra
    0.5,120,12,x
    0.25,64,8,y
    2.25,900,1,z
    1.0,33,40,w
    """)


def _write(tmp_path, name, text):
  p = tmp_path / name
  p.write_text(text)
  return str(p)


def test_azure_trace(tmp_path):
  w, info = read_trace(_write(tmp_path, "az.csv", AZURE), vocab_size=1000)
  assert info.format == "azure" and info.rows == 5 and info.skipped_zero == 1 and info.kept == 4
  assert [(r.prompt_len, r.output_len) for r in w] == [(374, 44), (879, 20), (396, 109), (100, 30)]
  arr = [r.arrival_s for r in w]
  assert arr[0] == 0 and arr[1] == pytest.approx(0.31941) and arr[3] == pytest.approx(10.0)
  assert info.duration_s == pytest.approx(10.0) and info.mean_rps == pytest.approx(0.3)
  for r in w:
    assert len(r.prompt_token_ids) == r.prompt_len and all(100 <= t < 1000 for t in r.prompt_token_ids)
  w2, _ = read_trace(_write(tmp_path, "az.csv", AZURE), token_ids=False, max_prompt_len=500, num_requests=2)
  assert [r.prompt_len for r in w2] == [374, 396] and w2[0].prompt_token_ids is None


def test_splitwise_trace_and_rescale(tmp_path):
  path = _write(tmp_path, "sw.csv", SPLITWISE)
  w, info = read_trace(path, token_ids=False)
  assert info.format == "splitwise" and info.kept == 4
  assert [r.arrival_s for r in w] == [0.0, 0.25, 0.75, 2.0]
  assert [r.prompt_len for r in w] == [64, 120, 33, 900]
  w3 = rescale_to_rps(w, 3.0)        # (n - 1) / last = 3 rps -> last arrival at 1 s
  assert [r.arrival_s for r in w3] == pytest.approx([0.0, 0.125, 0.375, 1.0])
  assert all(r.arrival_s == 0 for r in rescale_to_rps(w, math.inf))
  assert [r.arrival_s for r in load_trace(path, rps=3.0, token_ids=False)] == pytest.approx([0, .125, .375, 1])


def test_timestamps():
  assert parse_timestamp("12.5") == 12.5
  a = parse_timestamp("2023-11-16 18:15:46.6805900")
  assert parse_timestamp("2023-11-16T18:15:47.6805900Z") - a == pytest.approx(1.0)
  with pytest.raises(ValueError):
    parse_timestamp("yesterday")


@pytest.mark.parametrize("text, match", [
    ("", "empty trace"),
    ("a,b,c\n1,2,3\n", "unknown trace format"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no data rows"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nnoon,3,4\n", r":2: TIMESTAMP = 'noon'"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n1.0,abc,4\n", r":2: num_prefill_tokens = 'abc'"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n1.0,2.5,4\n", "whole number"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n1.0,3\n", r":2: 2 fields"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n1.0,0,4\n", "no request left"),
])
def test_bad_traces(tmp_path, text, match):
  with pytest.raises(TraceError, match=match):
    read_trace(_write(tmp_path, "bad.csv", text))


def test_missing_trace(tmp_path):
  with pytest.raises(TraceError, match="not a file"):
    read_trace(str(tmp_path / "nope.csv"))


def test_traces_import_no_jax():
  code = ("import sys; sys.modules['jax'] = None; sys.path.insert(0, %r); "
          "import superinfer_jax.workload.traces; print('ok')" % ROOT)
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
  assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


SIM = ["--hardware=h200", "--model=llama-3-8b", "--num_device_blocks=64", "--num_host_blocks=512",
       "--max_num_seqs=16", "--max_num_batched_tokens=1024", "--ttft_slo=0.5", "--tbt_slo=0.05", "--noprogress",
       "--policies=fcfs,rotasched"]


def test_simulate_script_trace(tmp_path):
  trace = _write(tmp_path, "az.csv", AZURE)
  out = tmp_path / "rec"
  proc = subprocess.run([sys.executable, SCRIPT, f"--trace={trace}", f"--output_dir={out}"] + SIM,
                        capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "4 requests of 5 rows" in proc.stdout
  rows = read_results(str(out / "results.jsonl"))
  assert [r["policy"] for r in rows] == ["fcfs", "rotasched"]
  for r in rows:
    assert r["num_requests"] == r["num_finished"] == 4 and r["rps"] == pytest.approx(0.3)
    assert r["dataset"] == trace and r["trace_arrivals"] == "recorded"
  out2 = tmp_path / "resc"
  proc = subprocess.run([sys.executable, SCRIPT, f"--trace={trace}", "--trace_arrivals=rescale", "--rps=1,30",
                         f"--output_dir={out2}"] + SIM, capture_output=True, text=True, timeout=300, env=ENV,
                        cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert sorted({r["rps"] for r in read_results(str(out2 / "results.jsonl"))}) == [1, 30]


def test_simulate_script_bad_trace(tmp_path):
  bad = _write(tmp_path, "bad.csv", "when,prompt,out\n1,2,3\n")
  proc = subprocess.run([sys.executable, SCRIPT, f"--trace={bad}", f"--output_dir={tmp_path / 'o'}"] + SIM,
                        capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
  assert proc.returncode != 0 and "unknown trace format" in proc.stderr
  assert not (tmp_path / "o").exists()


def test_rescale_factor_is_reported_and_windows_are_disjoint(tmp_path):
  path = _write(tmp_path, "sw.csv", SPLITWISE)
  w, _ = read_trace(path, token_ids=False)
  assert rescale_factor(w, 3.0) == pytest.approx(0.5)      # last arrival 2 s -> 1 s
  assert rescale_factor(w, math.inf) == 0.0 and rescale_factor(w.take(1), 3.0) == 1.0
  first, _ = read_trace(path, token_ids=False, num_requests=2)
  second, _ = read_trace(path, token_ids=False, num_requests=2, start=2)
  assert [r.prompt_len for r in first] == [64, 120] and [r.prompt_len for r in second] == [33, 900]
  assert second[0].arrival_s == 0.0 and second[1].arrival_s == pytest.approx(1.25)
  with pytest.raises(TraceError, match="window start 4"):
    read_trace(path, token_ids=False, start=4)


def test_packaged_splitwise_trace():
  assert os.path.isfile(PACKAGED_TRACES["splitwise"])
  assert os.path.isfile(os.path.join(os.path.dirname(PACKAGED_TRACES["splitwise"]), "README.md"))
  w, info = read_trace("splitwise", token_ids=False)
  assert info.format == "splitwise" and info.rows == 19366 and info.kept == 19366
  assert info.duration_s == pytest.approx(3502, abs=1)
  s = w.stats()
  mean_p = sum(r.prompt_len for r in w) / len(w)
  mean_o = sum(r.output_len for r in w) / len(w)
  assert mean_p == pytest.approx(1155, abs=1) and mean_o == pytest.approx(211, abs=1), s


def test_scale_lengths():
  w, _ = read_trace("splitwise", token_ids=False, num_requests=3)
  w2 = w.scale_lengths(1.5)
  assert [(r.prompt_len, r.output_len) for r in w2] == [
      (round(r.prompt_len * 1.5), round(r.output_len * 1.5)) for r in w]
  assert [r.arrival_s for r in w2] == [r.arrival_s for r in w] and w.scale_lengths(1.0) is w
  clipped = w.scale_lengths(10.0, max_total_len=1000)
  assert all(r.prompt_len + r.output_len <= 1000 and r.output_len >= 1 for r in clipped)
  ids, _ = read_trace("splitwise", num_requests=1, vocab_size=500)
  r = ids.scale_lengths(2.0)[0]
  assert r.prompt_len == 2 * ids[0].prompt_len and r.prompt_token_ids == ids[0].prompt_token_ids * 2
  with pytest.raises(ValueError):
    w.scale_lengths(0.0)
