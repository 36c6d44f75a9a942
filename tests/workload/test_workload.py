"""Workload loaders (fixtures in every format, a truncated ShareGPT file, the real package file),
the synthetic generator and the arrival processes."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from superinfer_jax import workload as wl

FIX = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "workload")


def _fx(name):
  return os.path.join(FIX, name)


def ws_tokenizer(text):
  """Whitespace 'tokenizer': one id per word (id = word length)."""
  return [len(w) for w in text.split()]


class _Encoding:
  def __init__(self, ids):
    self.ids = ids


class HFStyleTokenizer:
  """Like tokenizers.Tokenizer: encode returns an Encoding with .ids."""

  def encode(self, text):
    return _Encoding(ws_tokenizer(text))


def test_truncated_sharegpt_fixture():
  with pytest.raises(json.JSONDecodeError):
    with open(_fx("sharegpt_truncated.json")) as f:
      json.load(f)
  info = wl.TruncatedFileInfo()
  pairs = list(wl.sharegpt_pairs(_fx("sharegpt_truncated.json"), info=info))
  assert info.truncated and info.num_records == 5
  assert [p.pair_id for p in pairs] == ["a1", "b2", "e5"]  # c3 (no reply) and d4 (empty) skipped
  assert pairs[1].prompt == "tell me a joke" and pairs[1].reference_output == "no"
  assert pairs[2].prompt == 'what is "json", [really]? {x}'  # leading gpt turn skipped


def test_full_sharegpt_fixture_and_small_chunks():
  info = wl.TruncatedFileInfo()
  pairs = list(wl.sharegpt_pairs(_fx("sharegpt_small.json"), info=info))
  assert not info.truncated and info.num_records == 6 and len(pairs) == 4
  for name in ("sharegpt_small.json", "sharegpt_truncated.json"):
    a = list(wl.iter_json_array(_fx(name)))
    b = list(wl.iter_json_array(_fx(name), chunk_chars=7))  # records straddle many chunks
    assert a == b


def test_lmsys_and_trace_fixtures():
  lm = list(wl.lmsys_pairs(_fx("lmsys_small.jsonl")))
  assert [(p.pair_id, p.reference_output) for p in lm] == [
      ("lm1", "four"), ("lm2", "rain falls soft on the quiet roof at night")]
  tr = list(wl.trace_pairs(_fx("trace_small.jsonl")))  # last line cut mid-write: skipped
  assert [p.reference_output for p in tr] == [
      "A prince seeks revenge for his father and almost everyone dies", "yes", "red green blue"]
  assert wl.detect_format(_fx("sharegpt_small.json")) == "sharegpt"
  assert wl.detect_format(_fx("lmsys_small.jsonl")) == "lmsys"
  assert wl.detect_format(_fx("trace_small.jsonl")) == "trace"


def test_jsonl_bad_middle_line_raises(tmp_path):
  p = tmp_path / "bad.jsonl"
  p.write_text('{"prompt": "a", "generated": "b"}\n{oops\n{"prompt": "c", "generated": "d"}\n')
  with pytest.raises(ValueError, match="invalid JSON line"):
    list(wl.trace_pairs(str(p)))


def test_trace_workload_lengths_and_order():
  w = wl.load_dataset(_fx("trace_small.jsonl"), HFStyleTokenizer())
  assert [r.source for r in w] == ["0", "1", "2"]  # trace order kept
  assert [r.output_len for r in w] == [11, 1, 3]  # tokenized generated text
  assert [r.prompt_len for r in w] == [5, 2, 3]
  assert w[0].prompt_token_ids == tuple(ws_tokenizer("Summarize the plot of Hamlet"))
  assert [r.request_id for r in w] == ["0", "1", "2"] and all(r.arrival_s == 0 for r in w)


def test_build_workload_seeded_and_filtered():
  pairs = list(wl.sharegpt_pairs(_fx("sharegpt_small.json")))
  w1 = wl.build_workload(pairs, ws_tokenizer, seed=3)
  w2 = wl.build_workload(pairs, ws_tokenizer, seed=3)
  assert [r.source for r in w1] == [r.source for r in w2] and len(w1) == 4
  orders = {tuple(r.source for r in wl.build_workload(pairs, ws_tokenizer, seed=s)) for s in range(8)}
  assert len(orders) > 1
  w = wl.build_workload(pairs, ws_tokenizer, shuffle=False, max_total_len=8)
  assert [(r.source, r.prompt_len, r.output_len) for r in w] == [("a1", 3, 5), ("b2", 4, 1), ("f6", 3, 5)]
  w = wl.build_workload(pairs, ws_tokenizer, shuffle=False, min_output_len=2, num_requests=1)
  assert [r.source for r in w] == ["a1"]
  w = wl.build_workload(pairs, ws_tokenizer, shuffle=False, keep_token_ids=False)
  assert w[0].prompt_token_ids is None
  assert w.filter(max_prompt_len=3).requests[0].source == "a1"


def test_workload_arrivals_and_jsonl(tmp_path):
  w = wl.load_dataset(_fx("lmsys_small.jsonl"), ws_tokenizer, seed=0)
  w = w.with_arrivals(wl.poisson_arrivals(len(w), 2.0, seed=1))
  assert w[0].arrival_s == 0.0 and w[1].arrival_s > 0
  with pytest.raises(ValueError):
    w.with_arrivals([1.0, 0.5])
  p = str(tmp_path / "w.jsonl")
  w.save_jsonl(p)
  back = wl.Workload.load_jsonl(p)
  assert back.requests == w.requests
  with pytest.raises(ValueError):
    wl.RequestSpec("x", "p", prompt_len=2, output_len=1, prompt_token_ids=(1,))
  with pytest.raises(ValueError):
    wl.RequestSpec("x", "p", prompt_len=1, output_len=0)


def test_real_sharegpt_package_file(sharegpt_file):
  t0 = time.perf_counter()
  info = wl.TruncatedFileInfo()
  pairs = list(wl.sharegpt_pairs(sharegpt_file, info=info))
  elapsed = time.perf_counter() - t0
  assert info.truncated and info.num_records > 17000
  assert len(pairs) > 17000
  assert elapsed < 10.0, elapsed
  w = wl.build_workload(pairs, ws_tokenizer, num_requests=50, seed=0, max_total_len=2048)
  assert len(w) == 50 and all(r.total_len <= 2048 for r in w)


def test_synthetic_workload():
  a = wl.synthetic_workload(200, "uniform:4,64", "lognormal:100,0.5,1,400", seed=5, vocab_size=1000)
  b = wl.synthetic_workload(200, "uniform:4,64", "lognormal:100,0.5,1,400", seed=5, vocab_size=1000)
  assert a.requests == b.requests
  p = np.array([r.prompt_len for r in a])
  o = np.array([r.output_len for r in a])
  assert p.min() >= 4 and p.max() <= 64 and o.min() >= 1 and o.max() <= 400
  assert all(1 <= t < 1000 for r in a for t in r.prompt_token_ids)
  big = wl.LengthDist.parse("lognormal:100,0.5").sample(np.random.default_rng(0), 20000)
  assert abs(big.mean() - 100) < 3
  f = wl.synthetic_workload(5, 16, "fixed:8", seed=0)
  assert all(r.prompt_len == 16 and r.output_len == 8 for r in f)
  c = wl.synthetic_workload(50, "choice:10,20", "uniform:1,500", seed=0, max_total_len=64)
  assert all(r.total_len <= 64 and r.prompt_len in (10, 20) for r in c)
  dec = wl.synthetic_workload(2, 3, 2, tokenizer=type("T", (), {"decode": lambda s, ids: "x" * len(ids)})())
  assert dec[0].prompt == "xxx"
  with pytest.raises(ValueError):
    wl.LengthDist.parse("zipf:1")


def test_poisson_arrivals_seeded_rate():
  a = wl.poisson_arrivals(20000, 5.0, seed=42)
  assert np.array_equal(a, wl.poisson_arrivals(20000, 5.0, seed=42))
  assert not np.array_equal(a, wl.poisson_arrivals(20000, 5.0, seed=43))
  assert a[0] == 0.0 and np.all(np.diff(a) >= 0)
  rate = (len(a) - 1) / a[-1]
  assert abs(rate - 5.0) / 5.0 < 0.03
  gaps = np.diff(a)
  assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05  # exponential: CV = 1
  assert wl.poisson_arrivals(3, 5.0, seed=0, start_at_zero=False)[0] > 0
  assert np.array_equal(wl.poisson_arrivals(4, float("inf")), np.zeros(4))


@pytest.mark.parametrize("convention,b,cv2", [
    (wl.VLLM, 0.5, 2.0), (wl.VLLM, 4.0, 0.25), (wl.SUPERINFER, 2.0, 2.0), (wl.SUPERINFER, 0.25, 0.25),
    (wl.VLLM, 1.0, 1.0), (wl.SUPERINFER, 1.0, 1.0)])
def test_gamma_conventions(convention, b, cv2):
  a = wl.gamma_arrivals(40000, 8.0, b, convention, seed=7)
  assert np.array_equal(a, wl.gamma_arrivals(40000, 8.0, b, convention, seed=7))
  gaps = np.diff(a)
  assert abs(gaps.mean() - 1 / 8.0) / (1 / 8.0) < 0.03  # mean rate = rps in both conventions
  assert abs(gaps.var() / gaps.mean() ** 2 - cv2) / cv2 < 0.1


def test_gamma_shape_scale_values():
  assert wl.gamma_shape_scale(4.0, 2.0, wl.VLLM) == (2.0, 1 / 8.0)  # shape = b, scale = 1/(rps*b)
  assert wl.gamma_shape_scale(4.0, 2.0, wl.SUPERINFER) == (0.5, 0.5)  # shape = 1/b, scale = b/rps
  with pytest.raises(ValueError):
    wl.gamma_shape_scale(4.0, 1.0, "sglang")
  t = wl.arrival_times(5, 2.0, process="uniform")
  np.testing.assert_allclose(t, [0, 0.5, 1.0, 1.5, 2.0])
  g = wl.arrival_times(100, 3.0, process="gamma", burstiness=0.5, convention=wl.VLLM, seed=1)
  assert np.array_equal(g, wl.gamma_arrivals(100, 3.0, 0.5, wl.VLLM, seed=1))


def test_no_jax_import():
  code = ("import sys; sys.modules['jax'] = None\n"
          "import superinfer_jax.workload, superinfer_jax.metrics, superinfer_jax.metrics.plots\n"
          "import superinfer_jax.workload.datasets, superinfer_jax.workload.synthetic\n"
          "assert sys.modules['jax'] is None\n")
  subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_make_workload():
  a = wl.make_workload("synthetic", None, num_requests=30, rps=4.0, seed=2,
                       synthetic_prompt_len="fixed:8", synthetic_output_len="uniform:1,4")
  b = wl.make_workload("synthetic", None, num_requests=30, rps=4.0, seed=2,
                       synthetic_prompt_len="fixed:8", synthetic_output_len="uniform:1,4")
  assert a.requests == b.requests and len(a) == 30
  assert a[0].arrival_s == 0.0 and a[-1].arrival_s > 0
  t = wl.make_workload(_fx("trace_small.jsonl"), ws_tokenizer, num_requests=2, rps=float("inf"))
  assert [r.output_len for r in t] == [11, 1] and all(r.arrival_s == 0 for r in t)
  g = wl.make_workload(_fx("sharegpt_truncated.json"), ws_tokenizer, num_requests=10, rps=1.0,
                       process="gamma", burstiness=2.0, convention=wl.SUPERINFER, max_total_len=8)
  assert len(g) == 2 and all(r.total_len <= 8 for r in g)
