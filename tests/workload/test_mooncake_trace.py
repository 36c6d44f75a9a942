"""The Mooncake trace as a workload (issue 50 item 1): JSON-lines reading, block ids on RequestSpec, their
expansion to the engine's block size, the context rule, the reuse bound, and scripts/simulate.py --trace."""
import gzip
import json
import os
import subprocess
import sys
import textwrap

import pytest

from superinfer_jax.metrics.results import read_results
from superinfer_jax.sim.config import SimConfig
from superinfer_jax.sim.sim_sweep import read_sim_trace
from superinfer_jax.sweep import SweepSpec
from superinfer_jax.workload import RequestSpec, TraceError, Workload, read_trace, rescale_to_rps
from superinfer_jax.workload.reuse import expand_block_ids, mix64, reuse_bound
from superinfer_jax.workload.traces import PACKAGED_TRACES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "simulate.py")
ENV = dict(os.environ, JAX_PLATFORMS="cpu")

# Arrival order A (t=0), B (1.5 s), C (3 s), D (4 s). A and B share their first two 512-token blocks; C shares
# A's first; D's second id is A's second, but after a different first block (so no whole-prefix hit).
TINY = textwrap.dedent("""\
    {"timestamp": 1500, "input_length": 1100, "output_length": 10, "hash_ids": [7, 8, 10]}
    {"timestamp": 0, "input_length": 1100, "output_length": 20, "hash_ids": [7, 8, 9], "extra": 1}

    {"timestamp": 3000, "input_length": 600, "output_length": 5, "hash_ids": [7, 11]}
    {"timestamp": 4000, "input_length": 1024, "output_length": 1, "hash_ids": [12, 8]}
    """)


def _write(tmp_path, name, text):
  p = tmp_path / name
  p.write_text(text)
  return str(p)


def _splitmix64_finalizer(z: int) -> int:
  """Pure-Python reference of reuse.mix64 (no numpy)."""
  m = (1 << 64) - 1
  z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & m
  z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & m
  return z ^ (z >> 31)


def _key(h, s):
  return _splitmix64_finalizer((h << 16) | s)


def test_mix64_is_splitmix64():
  # splitmix64 seeded with 0 outputs mix(0x9e3779b97f4a7c15) = 0xe220a8397b1dcdaf first (the published value)
  assert int(mix64([0x9e3779b97f4a7c15])[0]) == 0xe220a8397b1dcdaf
  for z in (0, 1, 7 << 16, (123456 << 16) | 31, (1 << 64) - 1):
    assert int(mix64([z])[0]) == _splitmix64_finalizer(z)


def test_read_mooncake_jsonl(tmp_path):
  w, info = read_trace(_write(tmp_path, "mc.jsonl", TINY), token_ids=False)
  assert info.format == "mooncake" and info.rows == 4 and info.kept == 4 and info.skipped_zero == 0
  assert [r.arrival_s for r in w] == [0.0, 1.5, 3.0, 4.0] and info.duration_s == 4.0   # ms -> s
  assert [(r.prompt_len, r.output_len) for r in w] == [(1100, 20), (1100, 10), (600, 5), (1024, 1)]
  assert [r.block_ids for r in w] == [(7, 8, 9), (7, 8, 10), (7, 11), (12, 8)]
  assert all(r.block_ids_tokens == 512 and r.prompt_token_ids is None for r in w)
  assert w[0].source == "mooncake:mc:2" and w.name == "mc"
  # gzip, disjoint windows, rescaling keep the ids
  gz = tmp_path / "mc.jsonl.gz"
  gz.write_bytes(gzip.compress(TINY.encode()))
  w2, info2 = read_trace(str(gz), token_ids=False, start=1, num_requests=2)
  assert info2.format == "mooncake" and [r.block_ids for r in w2] == [(7, 8, 10), (7, 11)]
  assert [r.arrival_s for r in w2] == [0.0, 1.5]
  assert [r.block_ids for r in rescale_to_rps(w2, 2.0)] == [(7, 8, 10), (7, 11)]
  # token ids still come with the ids when asked for
  w3, _ = read_trace(str(gz), vocab_size=500, num_requests=1)
  assert len(w3[0].prompt_token_ids) == 1100 and w3[0].block_ids == (7, 8, 9)


@pytest.mark.parametrize("text, match", [
    ('{"timestamp": 0, "input_length": 10}\n', "unknown JSON-lines trace format"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [1]}\nnot json\n', r":2: not JSON"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [1, 2]}\n', r":1: 2 hash_ids but "
     r"input_length = 10 needs ceil\(10 / 512\) = 1"),
    ('{"timestamp": "x", "input_length": 10, "output_length": 3}\n', "timestamp = 'x' is not a number"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [-1]}\n', "list of ints >= 0"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 3}\n{"timestamp": 1, "input_length": 5}\n',
     r":2: no output_length"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 3, "hash_ids": []}\n', "no request left"),
])
def test_bad_mooncake_traces(tmp_path, text, match):
  with pytest.raises(TraceError, match=match):
    read_trace(_write(tmp_path, "bad.jsonl", text))


def test_request_spec_block_ids():
  r = RequestSpec("a", "", prompt_len=1100, output_len=3, block_ids=[7, 8, 9], block_ids_tokens=512)
  assert r.block_ids == (7, 8, 9)
  assert RequestSpec.from_json_dict(json.loads(json.dumps(r.to_json_dict()))) == r
  plain = RequestSpec("b", "", prompt_len=10, output_len=3)
  assert plain.block_ids is None and plain.block_ids_tokens == 0 and plain.derived_block_ids(16) is None
  assert RequestSpec.from_json_dict(plain.to_json_dict()) == plain
  with pytest.raises(ValueError, match=r"2 block_ids but prompt_len=1100 needs ceil\(1100 / 512\) = 3"):
    RequestSpec("a", "", prompt_len=1100, output_len=3, block_ids=(7, 8), block_ids_tokens=512)
  with pytest.raises(ValueError, match="block_ids_tokens must be an int >= 1"):
    RequestSpec("a", "", prompt_len=1100, output_len=3, block_ids=(7, 8, 9))
  with pytest.raises(ValueError, match="without block_ids"):
    RequestSpec("a", "", prompt_len=10, output_len=3, block_ids_tokens=512)
  assert r.derived_block_ids(256) == expand_block_ids((7, 8, 9), 512, 1100, 256)
  # a length-scaled request: shortened keeps its leading ids, lengthened keeps none
  w = Workload([r])
  assert w.scale_lengths(0.5)[0].block_ids == (7, 8) and w.scale_lengths(0.5)[0].prompt_len == 550
  assert w.scale_lengths(2.0)[0].block_ids is None and w.scale_lengths(2.0)[0].block_ids_tokens == 0


def test_expand_block_ids_hand_worked(tmp_path):
  w, _ = read_trace(_write(tmp_path, "mc.jsonl", TINY), token_ids=False)
  a, b, c, d = w
  # block size 256: each 512-token id gives 2 sub-blocks; A's last 76 tokens (1100 - 1024) need 1
  assert a.derived_block_ids(256) == (_key(7, 0), _key(7, 1), _key(8, 0), _key(8, 1), _key(9, 0))
  assert b.derived_block_ids(256) == (_key(7, 0), _key(7, 1), _key(8, 0), _key(8, 1), _key(10, 0))
  assert c.derived_block_ids(256) == (_key(7, 0), _key(7, 1), _key(11, 0))          # 600 = 512 + 88
  assert d.derived_block_ids(256) == (_key(12, 0), _key(12, 1), _key(8, 0), _key(8, 1))   # 1024: no partial
  # block size 128: 4 sub-blocks per id; ceil(1100 / 128) = 9, ceil(600 / 128) = 5
  assert a.derived_block_ids(128) == tuple(_key(h, s) for h in (7, 8) for s in range(4)) + (_key(9, 0),)
  assert c.derived_block_ids(128) == tuple(_key(7, s) for s in range(4)) + (_key(11, 0),)
  # same (id, position) -> same derived id; anything else -> different ones
  a128 = a.derived_block_ids(128)
  assert len(set(a128)) == len(a128) and a128[:8] == b.derived_block_ids(128)[:8]
  assert set(a128) & set(d.derived_block_ids(128)) == {_key(8, s) for s in range(4)}
  assert len(a.derived_block_ids(512)) == 3 and len(expand_block_ids((7, 8, 9), 512, 1100, 1)) == 1100


@pytest.mark.parametrize("block_size", [96, 1024, 0])
def test_expand_block_ids_rule(block_size):
  with pytest.raises(ValueError, match=f"{block_size}"):
    expand_block_ids((7, 8, 9), 512, 1100, block_size)


def test_expand_block_ids_errors():
  with pytest.raises(ValueError, match="block_size 96 does not divide block_ids_tokens 512"):
    expand_block_ids((7, 8, 9), 512, 1100, 96)
  with pytest.raises(ValueError, match=r"needs ceil\(1100 / 512\) = 3"):
    expand_block_ids((7, 8), 512, 1100, 16)
  with pytest.raises(ValueError, match=r"\[0, 2\^48\)"):
    expand_block_ids((1 << 48,), 512, 10, 16)


def test_context_rule(tmp_path):
  path = _write(tmp_path, "mc.jsonl", TINY)
  w, info = read_trace(path, token_ids=False, context_len=1000)                  # drop (the default)
  assert info.context_dropped == 3 and info.context_clipped == 0 and [r.block_ids for r in w] == [(7, 11)]
  w, info = read_trace(path, token_ids=False, context_len=1000, context_rule="clip")
  assert info.context_dropped == 0 and info.context_clipped == 3 and info.context_rule == "clip"
  assert [(r.prompt_len, r.output_len) for r in w] == [(980, 20), (990, 10), (600, 5), (999, 1)]
  assert [r.block_ids for r in w] == [(7, 8), (7, 8), (7, 11), (12, 8)]
  # the clipped prompt's engine blocks are the recorded prompt's first ones
  full, _ = read_trace(path, token_ids=False)
  assert w[0].derived_block_ids(16) == full[0].derived_block_ids(16)[:62]          # ceil(980 / 16)
  # the window is taken after dropping
  w, info = read_trace(path, token_ids=False, context_len=1100 + 10, start=1)
  assert info.context_dropped == 1 and [r.block_ids for r in w] == [(7, 11), (12, 8)]   # A dropped, B skipped
  with pytest.raises(TraceError, match="context_rule must be one of drop, clip"):
    read_trace(path, context_len=1000, context_rule="trim")


def test_reuse_bound_hand_worked(tmp_path):
  w, _ = read_trace(_write(tmp_path, "mc.jsonl", TINY), token_ids=False)
  b = reuse_bound(w, 512)
  # full blocks: A 7,8 miss; B 7,8 hit; C 7 hit; D 12 miss, 8 seen but after a miss -> miss
  assert (b["blocks"], b["hit_blocks"], b["hit_tokens"]) == (7, 3, 1536) and b["hit_rate"] == pytest.approx(3 / 7)
  assert (b["blocks_with_partial"], b["hit_blocks_with_partial"], b["prompt_tokens"]) == (10, 3, 3824)
  b = reuse_bound(w, 256)
  assert (b["blocks"], b["hit_blocks"], b["hit_tokens"]) == (4 + 4 + 2 + 4, 4 + 2, 1536)
  assert (b["blocks_with_partial"], b["hit_blocks_with_partial"]) == (17, 6)
  # arrival order decides: D first would not help it (nothing before it), A after B makes A's prefix hit
  assert reuse_bound(w[1:], 512)["hit_blocks"] == 1                              # C's 7 after B
  with pytest.raises(ValueError, match="no block_ids"):
    reuse_bound([RequestSpec("x", "", 10, 1)], 16)


def _independent_bound(records):
  """From the raw hash ids at 512, in arrival order, with an unlimited cache: whole-prefix hits. Returns
  (all blocks, hits among all blocks [the README's reading: every id, the partial last one too, looked up
  and stored], full blocks, hits among full blocks [only full blocks looked up and stored])."""
  seen_all, seen_full = set(), set()
  n_all = h_all = n_full = h_full = 0
  for r in sorted(records, key=lambda r: r["timestamp"]):
    ids, nfull = r["hash_ids"], r["input_length"] // 512
    ok_all = ok_full = True
    for i, h in enumerate(ids):
      n_all += 1
      ok_all = ok_all and h in seen_all
      h_all += ok_all
      if i < nfull:
        n_full += 1
        ok_full = ok_full and h in seen_full
        h_full += ok_full
    seen_all.update(ids)
    seen_full.update(ids[:nfull])
  return n_all, h_all, n_full, h_full


@pytest.fixture(scope="module")
def mooncake():
  w, info = read_trace("mooncake", token_ids=False)
  with gzip.open(PACKAGED_TRACES["mooncake"], "rt") as f:
    records = [json.loads(line) for line in f]
  return w, info, records


def test_packaged_mooncake_trace(mooncake):
  w, info, records = mooncake
  data = os.path.dirname(PACKAGED_TRACES["mooncake"])
  assert PACKAGED_TRACES["mooncake"].startswith(os.path.join(ROOT, "superinfer_jax", "workload", "data"))
  assert os.path.isfile(os.path.join(data, "LICENSE-mooncake-APACHE-2.0.txt"))
  with open(os.path.join(data, "README.md")) as f:
    assert "mooncake_conversation.jsonl.gz" in f.read()
  assert info.format == "mooncake" and info.rows == info.kept == len(w) == len(records) == 12031
  assert sum(r.prompt_len for r in w) / len(w) == pytest.approx(12035, abs=1)
  assert sum(r.output_len for r in w) / len(w) == pytest.approx(343, abs=1)
  assert info.duration_s == pytest.approx(3537.0)
  assert all(r.block_ids is not None and len(r.block_ids) == -(-r.prompt_len // 512) for r in w)


def test_reuse_bound_matches_the_trace(mooncake):
  w, _, records = mooncake
  n_all, h_all, n_full, h_full = _independent_bound(records)
  assert round(100 * h_all / n_all, 1) == 36.6          # the README's figure, every block counted
  b = reuse_bound(w, 512)
  assert (b["blocks_with_partial"], b["hit_blocks_with_partial"]) == (n_all, h_all)
  assert (b["blocks"], b["hit_blocks"]) == (n_full, h_full)   # full blocks only: 38.2%
  assert round(100 * b["hit_rate"], 1) == 38.2
  # at block size 16, the prompts cut to their full 512-token blocks hit the same tokens (32 sub-blocks each)
  cut = Workload(RequestSpec(r.request_id, "", prompt_len=512 * (r.prompt_len // 512), output_len=1,
                             arrival_s=r.arrival_s, block_ids=r.block_ids[:r.prompt_len // 512],
                             block_ids_tokens=512) for r in w)
  b16 = reuse_bound(cut, 16)
  # Every cut prompt ends on a block boundary, so its last token's block never hits (always computed): the m
  # prompts whose last 512-token block would hit lose it at 512 and only its last 16-token sub-block at 16.
  m = h_full - reuse_bound(cut, 512)["hit_blocks"]
  assert m > 0
  assert (b16["blocks"], b16["hit_blocks"]) == (32 * n_full, 32 * h_full - m)
  assert b16["hit_tokens"] == (32 * h_full - m) * 16


def test_sim_requests_carry_block_ids(tmp_path):
  path = _write(tmp_path, "mc.jsonl", TINY)
  spec = SweepSpec(num_requests=2, seed=1)                  # window 1: requests 2 and 3 of the kept ones
  w, info = read_sim_trace(spec, SimConfig(trace=path, trace_context_rule="clip"), max_total_len=1000)
  assert info.context_clipped == 1 and [r.block_ids for r in w] == [(7, 11), (12, 8)]
  assert w[1].derived_block_ids(16) == expand_block_ids((12, 8), 512, 999, 16)
  with pytest.raises(ValueError, match="trace_context_rule"):
    SimConfig(trace=path, trace_context_rule="trim")


SIM = ["--hardware=h200", "--max_num_seqs=64", "--max_num_batched_tokens=16384", "--ttft_slo=5",
       "--tbt_slo=0.1", "--noprogress", "--policies=fcfs"]


def test_simulate_script_mooncake(tmp_path):
  out = tmp_path / "clip"
  proc = subprocess.run([sys.executable, SCRIPT, "--trace=mooncake", "--num_requests=30", "--seed=2",
                         "--model=llama-3-8b", "--trace_context_rule=clip", f"--output_dir={out}"] + SIM,
                        capture_output=True, text=True, timeout=600, env=ENV, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  w, info = read_trace("mooncake", token_ids=False, num_requests=30, start=60, context_len=8192,
                       context_rule="clip")
  assert info.context_clipped > 0
  assert f"{info.context_clipped} clipped" in proc.stdout
  (row,) = read_results(str(out / "results.jsonl"))
  assert row["num_requests"] == row["num_finished"] == 30 and row["dataset"] == "mooncake"
  assert row["trace_context_rule"] == "clip" and row["trace_context_clipped"] == info.context_clipped
  assert row["trace_context_len"] == 8192 and row["trace_context_dropped"] == 0
