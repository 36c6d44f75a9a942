#!/usr/bin/env python
"""One device check: GPU tests, attention / transfer / engine benchmarks and a simulator profile, in one JSON.

  python scripts/device_check.py --out=$OUT            # on a lent H100 / H200 (about 7 minutes)
  python scripts/device_check.py --dry_run --out=/tmp/dc   # CPU: tiny model, same stages, same JSON keys

Stages, each a subprocess with its own time limit (a stage that fails or times out is recorded with its return
code and log tail, and the rest still run):
  1. ``gpu_tests``: ``pytest -m gpu`` (the GPU-marked tests); passed / failed counts and failing test ids.
  2. ``attention``: ``scripts/bench_attention.py --tune`` (a bounded sweep of the Pallas kernel's tunables for
     the decode and mixed shapes, written into ``<out>/ragged_paged_attention.json``), then the bench with that
     table: Pallas vs jnp reference vs JAX's paged attention, GB/s, % of HBM peak, traffic analysis.
  3. ``transfer``: ``scripts/bench_transfer.py --json`` (DuplexKV modes vs torch pinned copies), then its
     ``--table1`` report (the paper's Table 1 shape; ``table1.table.md`` / ``table1.json`` in ``--out``).
  4. ``engine``: ``scripts/bench_engine.py --random_weights`` on Llama-3-8B's shape in bf16 at batch 1 / 32 / 64,
     the zero-bubble engine and transformers side by side: per batch decode tok/s, ms/step, dispatch ms and
     device idle ms per step, the speedup, and the weight-stream bound (weight bytes / the card's memory
     bandwidth) with the engine's step time over it.
  5. ``calibration``: ``scripts/calibrate.py`` writes a hardware profile the simulator loads
     (``--hardware=<path>``); the JSON holds its path and contents.
  6. ``experiment``: ``scripts/run_experiment.py --flagfile=configs/experiments/gpu.flags`` (the contended GPU
     experiment, real vs simulated; docs/gpu_experiment.md) into ``<out>/gpu_experiment``.
The JSON (``device_check.json`` under ``--out``) has the same keys in both modes; ``dry_run`` says which.
"""
import json
import os
import shutil
import subprocess
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

flags.DEFINE_string("out", "out", "directory for device_check.json, the profile and each stage's log")
flags.DEFINE_bool("dry_run", False, "CPU: the tiny model and small shapes through the same stages")
flags.DEFINE_list("stages", ["gpu_tests", "attention", "transfer", "engine", "calibration", "experiment"],
                  "stages to run")
FLAGS = flags.FLAGS
# Wall-clock budget of the attention stage's --tune sweep (the bench after it adds about a stage timeout).
ATTENTION_TUNE_BUDGET_S = 120

# Memory bandwidth by card name (bytes/s): the weight-stream bound of a decode step.
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "GH200": 4.0e12}


def _settings(dry: bool) -> dict:
  """Per-stage arguments: the real check, or its tiny CPU twin."""
  if dry:
    return dict(model="tiny-llama", dtype="float32", batches="1,2", prompt_len=8, max_tokens=6, blocks=64,
                attention=["--batch_sizes=2", "--context_lens=32", "--min_time_s=0", "--max_iters=1", "--tune",
                           "--dry_run", "--tune_budget_s=60"],
                transfer=["--models=smollm2-135m", "--kv_blocks=2", "--reps=1", "--max_segment_mb=0.25",
                          "--total_mb=1", "--modes=merged,duplex", "--kv_layouts=block_first"],
                table1=["--table1_model=smollm2-135m", "--table1_tokens=64", "--reps=1", "--naive_max_blocks=2"],
                calibrate=["--decode_batches=1", "--decode_contexts=16", "--prefill_chunks=16",
                           "--transfer_blocks=1", "--naive_blocks=1", "--repeats=1", "--warmup=1",
                           "--num_device_blocks=32", "--max_num_batched_tokens=16", "--max_num_seqs=2",
                           "--token_bucket_floor=8", "--seq_bucket_floor=2"],
                experiment=["--flagfile=configs/experiments/gpu_tiny.flags"],
                pytest=["-k", "lowering"], timeout=300)
  return dict(model="llama-3-8b", dtype="bfloat16", batches="1,32,64", prompt_len=256, max_tokens=32, blocks=8192,
              attention=["--context_lens=2048,8192", "--tune", f"--tune_budget_s={ATTENTION_TUNE_BUDGET_S}",
                         "--min_time_s=0.1"], transfer=["--max_segment_mb=64", "--time_budget_s=60"],
              table1=["--reps=3", "--naive_max_blocks=16", "--time_budget_s=90"],
              calibrate=["--model=llama-3-8b", "--dtype=bfloat16"], experiment=[], pytest=[], timeout=150)


def _run(name: str, cmd: list, timeout: float, env: dict) -> dict:
  """Runs one stage; its log goes to ``<out>/<name>.log``. Returns rc, seconds and the output."""
  t = time.perf_counter()
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    rc, out = proc.returncode, proc.stdout + proc.stderr
  except subprocess.TimeoutExpired as e:
    rc, out = 124, (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
  with open(os.path.join(FLAGS.out, f"{name}.log"), "w", encoding="utf-8") as f:
    f.write(" ".join(cmd) + "\n" + out)
  print(f"[device_check] {name}: rc {rc} in {time.perf_counter() - t:.0f} s", flush=True)
  return {"rc": rc, "seconds": round(time.perf_counter() - t, 1), "output": out}


def stage_gpu_tests(s, env) -> dict:
  junit = os.path.join(FLAGS.out, "gpu_tests.xml")
  r = _run("gpu_tests", [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                         f"--junitxml={junit}", "tests"] + s["pytest"], 3 * s["timeout"], env)
  passed = failed = 0
  failures = []
  if os.path.exists(junit):
    import xml.etree.ElementTree as ET  # pylint: disable=import-outside-toplevel
    for case in ET.parse(junit).getroot().iter("testcase"):
      bad = case.find("failure") is not None or case.find("error") is not None
      skipped = case.find("skipped") is not None
      if bad:
        failed += 1
        failures.append(f"{case.get('classname')}::{case.get('name')}")
      elif not skipped:
        passed += 1
  return {"rc": r["rc"], "passed": passed, "failed": failed, "failures": failures}


def stage_attention(s, env) -> dict:
  """Tunes the attention kernel for the issue's shapes within ``ATTENTION_TUNE_BUDGET_S`` (into a copy of the
  repository's table under ``--out``, so the tuned table comes back with the results), then benches with it."""
  from pallas_kernels import attention_tuning  # pylint: disable=import-outside-toplevel
  path = os.path.join(FLAGS.out, "bench_attention.json")
  table = os.path.join(FLAGS.out, "ragged_paged_attention.json")
  if os.path.exists(attention_tuning.DEFAULT_TABLE_PATH):
    shutil.copyfile(attention_tuning.DEFAULT_TABLE_PATH, table)
  r = _run("attention", [sys.executable, "scripts/bench_attention.py", f"--json_out={path}",
                         f"--tune_table={table}"] + s["attention"],
           ATTENTION_TUNE_BUDGET_S + 1.2 * s["timeout"], env)
  data = json.load(open(path, encoding="utf-8")) if os.path.exists(path) else {}
  return {"rc": r["rc"], "results": data.get("results", []), "tune_written": data.get("tune_written", []),
          "tune_table": table, "jax_paged_available": data.get("jax_paged_available")}


def stage_transfer(s, env) -> dict:
  """The segment / KV-shape sweeps, then the paper's Table 1 (Qwen2.5-32B KV, every mode beside torch)."""
  r = _run("transfer", [sys.executable, "scripts/bench_transfer.py", "--json"] + s["transfer"], s["timeout"], env)
  prefix = os.path.join(FLAGS.out, "table1")
  # No preallocation: torch's copies of the same bytes need device memory beside JAX's in one process.
  t1 = _run("transfer_table1", [sys.executable, "scripts/bench_transfer.py", "--table1",
                                f"--table1_out={prefix}"] + s["table1"], s["timeout"],
            dict(env, XLA_PYTHON_CLIENT_PREALLOCATE="false"))
  table1 = json.load(open(prefix + ".json", encoding="utf-8")) if os.path.exists(prefix + ".json") else {}
  return {"rc": r["rc"] or t1["rc"], "results": _rows(r["output"]), "table1": table1}


def _rows(text: str) -> list:
  out = []
  for line in text.splitlines():
    line = line.strip()
    if line.startswith("{") and line.endswith("}"):
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return out


def _weight_bytes(model: str, dtype: str) -> int:
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from superinfer_jax.model import load_config  # pylint: disable=import-outside-toplevel
  from superinfer_jax.model.params import param_shapes  # pylint: disable=import-outside-toplevel
  shapes = jax.tree.leaves(param_shapes(load_config(model)), is_leaf=lambda x: isinstance(x, tuple))
  return int(sum(np.prod(x) for x in shapes)) * (2 if dtype in ("bfloat16", "float16") else 4)


def stage_engine(s, env, card: str) -> dict:
  cmd = [sys.executable, "scripts/bench_engine.py", f"--model={s['model']}", "--random_weights",
         f"--dtype={s['dtype']}", f"--batch_sizes={s['batches']}", f"--prompt_len={s['prompt_len']}",
         f"--max_tokens={s['max_tokens']}", f"--num_device_blocks={s['blocks']}", "--num_host_blocks=0",
         "--loops=zero_bubble", "--torch_threads=0", f"--max_num_seqs={max(int(b) for b in s['batches'].split(','))}",
         "--max_num_batched_tokens=2048"]
  r = _run("engine", cmd, 2 * s["timeout"], env)
  rows = _rows(r["output"])
  bw = next((v for k, v in HBM_BYTES_PER_S.items() if k in card), None)
  bound_ms = 1e3 * _weight_bytes(s["model"], s["dtype"]) / bw if bw else None
  by_batch = {}
  for row in rows:
    b = by_batch.setdefault(str(row["batch"]), {})
    if row["impl"] == "transformers":
      b["transformers_tok_s"], b["transformers_ms_per_step"] = row["decode_tok_s"], row["decode_step_ms"]
    else:
      b.update(engine_tok_s=row["decode_tok_s"], engine_ms_per_step=row["decode_step_ms"],
               dispatch_ms=row["decode_host_ms_per_step"]["dispatch"] if row.get("decode_host_ms_per_step") else None,
               device_idle_ms_per_step=row["device_idle_ms_per_step"],
               speedup_vs_transformers=row.get("speedup_vs_torch_decode"),
               over_weight_stream_bound=row["decode_step_ms"] / bound_ms if bound_ms else None)
  return {"rc": r["rc"], "model": s["model"], "dtype": s["dtype"], "weight_stream_bound_ms": bound_ms,
          "by_batch": by_batch, "rows": rows}


def stage_calibration(s, env) -> dict:
  path = os.path.join(FLAGS.out, "profile.json")
  r = _run("calibration", [sys.executable, "scripts/calibrate.py", f"--output={path}", "--name=device_check"]
           + s["calibrate"], 2 * s["timeout"], env)
  profile = json.load(open(path, encoding="utf-8")) if os.path.exists(path) else None
  return {"rc": r["rc"], "profile_path": path, "profile": profile}


def stage_experiment(s, env) -> dict:
  """configs/experiments/gpu.flags (the contended experiment, real vs simulated; gpu_tiny.flags on a dry run):
  its table, JSON and plots land in ``<out>/gpu_experiment``."""
  out = os.path.join(FLAGS.out, "gpu_experiment")
  r = _run("experiment", [sys.executable, "scripts/run_experiment.py", "--flagfile=configs/experiments/gpu.flags"]
           + s["experiment"] + [f"--output_dir={out}", "--noprogress"], 2 * s["timeout"], env)
  path = os.path.join(out, "real_vs_sim.json")
  doc = json.load(open(path, encoding="utf-8")) if os.path.exists(path) else {}
  return {"rc": r["rc"], "output_dir": out, "entries": doc.get("entries", []), "plots": doc.get("plots", [])}


def main(argv):
  del argv
  os.makedirs(FLAGS.out, exist_ok=True)
  s = _settings(FLAGS.dry_run)
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1",
             TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
  if FLAGS.dry_run:
    env["JAX_PLATFORMS"] = "cpu"
  import jax  # pylint: disable=import-outside-toplevel
  dev = jax.devices()[0]
  card = getattr(dev, "device_kind", dev.platform)
  result = {"dry_run": FLAGS.dry_run, "device": card, "platform": dev.platform, "jax": jax.__version__,
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
  stages = {"gpu_tests": lambda: stage_gpu_tests(s, env), "attention": lambda: stage_attention(s, env),
            "transfer": lambda: stage_transfer(s, env), "engine": lambda: stage_engine(s, env, card),
            "calibration": lambda: stage_calibration(s, env), "experiment": lambda: stage_experiment(s, env)}
  unknown = set(FLAGS.stages) - set(stages)
  if unknown:
    raise app.UsageError(f"--stages: unknown {sorted(unknown)}; choose from {sorted(stages)}")
  for name in stages:
    result[name] = stages[name]() if name in FLAGS.stages else None
  path = os.path.join(FLAGS.out, "device_check.json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)
  print(f"[device_check] wrote {path}", flush=True)
  eng = result.get("engine") or {}
  for b, row in sorted((eng.get("by_batch") or {}).items(), key=lambda kv: int(kv[0])):
    print(f"[device_check] batch {b}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()
                                                    if isinstance(v, (int, float))), flush=True)


if __name__ == "__main__":
  app.run(main)
