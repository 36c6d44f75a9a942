"""scripts/bench_engine.py end to end on a tiny random-weight HF model dir (subprocess): the JSON rows issue 15
asks for (per batch, each engine loop and transformers side by side, with the keys the notes' tables read)."""
import json
import os
import subprocess
import sys

from superinfer_jax.model.attention import resolved_attention_name
from superinfer_jax.util import machine_description

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args, timeout=600):
  env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
  return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_engine.py")] + args,
                        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_bench_engine_rows_side_by_side(tiny_model_dir):
  out = _run([f"--model={tiny_model_dir}", "--batch_sizes=1,3", "--prompt_len=5", "--max_tokens=6",
              "--num_device_blocks=64", "--repeats=2", "--torch_threads=1,2,1"])
  assert out.returncode == 0, out.stderr[-3000:]
  rows = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
  # Per batch: the zero-bubble loop, the pipelined loop, then transformers once per distinct thread count.
  assert [(r["impl"], r["batch"], r.get("loop"), r.get("torch_threads")) for r in rows] == [
      (impl, b, loop, n) for b in (1, 3)
      for impl, loop, n in (("superinfer_jax", "zero_bubble", None), ("superinfer_jax", "pipelined", None),
                            ("transformers", None, 1), ("transformers", None, 2))]
  for i in range(0, len(rows), 4):
    zb, pipe, t1, t2 = rows[i:i + 4]
    best = max((t1, t2), key=lambda t: t["decode_tok_s"])
    assert zb["zero_bubble"] is True and pipe["zero_bubble"] is False
    for r in (zb, pipe):
      assert r["decode_tok_s"] > 0 and r["repeats"] == 2
      # The speedup is over the fastest transformers run (a fair baseline), and each is reported.
      ratio = r["decode_tok_s"] / best["decode_tok_s"]   # both rounded to 4 decimals in the output
      assert abs(r["speedup_vs_torch_decode"] - ratio) <= 1e-3 * ratio
      assert r["torch_threads_best"] == best["torch_threads"]
      assert set(r["speedup_vs_torch_by_threads"]) == {"1", "2"}
      for t in (t1, t2):
        by = r["speedup_vs_torch_by_threads"][str(t["torch_threads"])]
        assert abs(by - r["decode_tok_s"] / t["decode_tok_s"]) <= 1e-3 * by
      assert r["speedup_vs_torch_decode"] <= min(r["speedup_vs_torch_by_threads"].values()) * (1 + 1e-3)
      assert r["device_idle_ms_per_step"] >= 0 and r["idle_pairs"] > 0
      for phases in (r["host_ms_per_step"], r["decode_host_ms_per_step"]):
        assert set(phases) == {"schedule", "issue", "dispatch", "dispatch_cpu", "process", "exposed_host"}
        assert all(v >= 0 for v in phases.values())
      assert r["discarded_tokens"] == 0   # ignore_eos: every request runs to max_tokens, nothing stops early
      # "auto" is reported as the backend it resolved to: the jnp reference on a CPU.
      assert r["attention"] == "auto" and r["attention_backend"] == resolved_attention_name("auto") == "reference"
    # The zero-bubble loop reads step k's ids only after dispatching k+1: no host time exposed between steps.
    assert zb["decode_host_ms_per_step"]["exposed_host"] == 0
    assert pipe["decode_host_ms_per_step"]["exposed_host"] > 0
    for t in (t1, t2):
      assert t["decode_tok_s"] > 0 and "speedup_vs_torch_decode" not in t and t["repeats"] == 2
    assert zb["machine"] == pipe["machine"] == t1["machine"] == machine_description()   # which box


def test_bench_engine_rejects_bad_torch_threads(tiny_model_dir):
  for bad in ("two", "-1"):
    out = _run([f"--model={tiny_model_dir}", "--batch_sizes=1", f"--torch_threads={bad}"], timeout=300)
    assert out.returncode != 0 and "--torch_threads" in out.stderr


def test_bench_engine_rejects_unknown_loop(tiny_model_dir):
  out = _run([f"--model={tiny_model_dir}", "--batch_sizes=1", "--loops=zero_bubble,warp", "--notorch"], timeout=300)
  assert out.returncode != 0 and "warp" in out.stderr
