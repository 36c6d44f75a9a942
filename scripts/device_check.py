#!/usr/bin/env python
"""One device check that fits one lent-GPU call: every GPU figure the project lacks, within a global deadline.

  python scripts/device_check.py --out=$OUT                  # on a lent H100 / H200: --budget_s=420 (7 minutes)
  python scripts/device_check.py --dry_run --out=/tmp/dc     # CPU: tiny model, the same stages and deadline logic

Stages, in the order of what the project most needs to know (each a subprocess, or two):
  1. ``engine``: ``scripts/bench_engine.py --random_weights`` on Llama-3-8B's shape in bf16 at batch 1 / 32 / 64
     (the zero-bubble engine and transformers side by side): per batch decode tok/s, ms/step, dispatch ms and
     device idle ms per step, the speedup, and the weight-stream bound (weight bytes / the card's memory
     bandwidth) with the engine's step time over it.
  2. ``gpu_tests``: ``pytest -m gpu`` (the GPU-marked tests); passed / failed counts and failing test ids (read
     from the verbose log, so a cut-short run still counts what finished).
  3. ``transfer``: ``scripts/bench_transfer.py --json`` (DuplexKV modes vs torch pinned copies), then its
     ``--table1`` report (the paper's Table 1 shape).
  4. ``attention``: ``scripts/bench_attention.py --tune`` (a sweep of the Pallas kernel's tunables for the decode
     and mixed shapes, within half the stage's share), then the bench with that table: Pallas vs jnp reference vs
     JAX's paged attention, GB/s, % of HBM peak.
  5. ``experiment``: ``scripts/run_experiment.py --flagfile=configs/experiments/gpu.flags`` (the contended
     experiment, real vs simulated; docs/gpu_experiment.md), each run's time limit scaled to the stage's share.
  6. ``multiturn``: ``scripts/run_experiment.py --flagfile=configs/experiments/multiturn.flags`` (prefix caching
     off / device / device+host under fcfs and rotasched on multi-turn ShareGPT, real SmolLM2;
     docs/prefix_caching.md): per arm SLO, TTFT P50 / P99, prefill tokens saved and the hit rate per tier.
  7. ``calibration``: ``scripts/calibrate.py`` writes a hardware profile the simulator loads; the JSON holds it.
  8. ``startup``: ``scripts/bench_engine.py --serve_warmup``: ``scripts/serve.py``'s start-up on the model
     (engine build, then every step shape in every sampling mode compiled).

The deadline: ``--budget_s`` (default 420 s; 240 s on a dry run) from the script's start. Each stage gets a
share of what is left (``STAGE_WEIGHTS``: its weight over the weights of the stages still to run), so time a
stage leaves unused goes to the ones after it. A stage whose share is below ``MIN_STAGE_S`` is skipped; a stage
still running at the end of its share is stopped (its process group killed) and recorded as cut, with what it
had printed by then. ``device_check.json`` is rewritten after every stage, so a call cut off from outside
still returns every finished figure. Per stage it records ``status`` (finished / failed / cut / skipped),
``limit_s``, ``seconds`` and ``compile_s``: the JAX compilation (tracing, lowering, XLA compile) the stage's
processes logged (``JAX_LOG_COMPILES``), apart from the measured time; none for ``gpu_tests``, whose tests'
compiles are theirs.

Everything else (each stage's log, the profile, the tuning table, the experiment's table, JSON and plots) goes
into one archive beside it, ``device_check_artifacts.tar.gz``, rewritten after every stage: ``--out`` holds these
two files only. Paths in the JSON name members of that archive.
"""
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Callable, Optional

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STAGE_ORDER = ("engine", "gpu_tests", "transfer", "attention", "experiment", "multiturn", "calibration",
               "startup")
# A stage's share of the time left is its weight over the weights of the stages still to run.
STAGE_WEIGHTS = {"engine": 4, "gpu_tests": 3, "transfer": 2, "attention": 2, "experiment": 3, "multiturn": 2,
                 "calibration": 1, "startup": 1}
MIN_STAGE_S = 10.0   # a share below this is skipped: a stage cannot start a process and report in less
ARCHIVE = "device_check_artifacts.tar.gz"
RESULT = "device_check.json"
FINISHED, FAILED, CUT, SKIPPED = "finished", "failed", "cut", "skipped"

flags.DEFINE_string("out", "out", "directory for device_check.json and the archive of everything else")
flags.DEFINE_bool("dry_run", False, "CPU: the tiny model and small shapes through the same stages and deadline")
flags.DEFINE_float("budget_s", None, "seconds the whole check may take, from its start (default 420; 240 on a "
                   "dry run)")
flags.DEFINE_list("stages", list(STAGE_ORDER), "stages to run (they run in STAGE_ORDER whatever the order here)")
FLAGS = flags.FLAGS

# Memory bandwidth by card name (bytes/s): the weight-stream bound of a decode step.
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "GH200": 4.0e12}
COMPILE_LOG = re.compile(r"Finished (?:tracing \S+ for jit|jaxpr to MLIR module conversion \S+|XLA compilation of "
                         r"\S+) in ([0-9.]+) sec")
STEP_COMPILE_LOG = re.compile(r"Finished XLA compilation of jit\(_step_fn\) in ([0-9.]+) sec")


def stage_shares(names: list, seconds_left: float) -> float:
  """The share of ``seconds_left`` the first of ``names`` (the stages still to run, in order) gets."""
  return seconds_left * STAGE_WEIGHTS[names[0]] / sum(STAGE_WEIGHTS[n] for n in names)


def compile_seconds(text: str, pattern: re.Pattern = COMPILE_LOG) -> tuple:
  """(seconds, count) of the JAX compilation events ``JAX_LOG_COMPILES`` logged in ``text``."""
  times = [float(m.group(1)) for m in pattern.finditer(text)]
  return round(sum(times), 2), len(times)


@dataclasses.dataclass
class Stage:
  """One stage's processes, each bounded by the stage's end (``ends_at``, monotonic); logs go to ``work``."""
  name: str
  work: str
  env: dict
  ends_at: float
  cut: bool = False
  rc: int = 0
  outputs: list = dataclasses.field(default_factory=list)

  def path(self, *parts) -> str:
    """``<work>/<stage>/<parts>``, its directory created: a file the archive carries as ``<stage>/<parts>``."""
    p = os.path.join(self.work, self.name, *parts)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    return p

  def run(self, label: str, cmd: list, env: Optional[dict] = None) -> str:
    """Runs ``cmd`` until it exits or the stage's time is up (then its process group is killed and the stage is
    cut); returns what it printed (stdout and stderr), also written to ``<stage>/<label>.log``."""
    left = self.ends_at - time.monotonic()
    if left <= 1:
      self.cut = True
      return ""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            env=env or self.env, cwd=ROOT, start_new_session=True)
    try:
      out, _ = proc.communicate(timeout=left)
      rc = proc.returncode
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      out, _ = proc.communicate()
      rc, self.cut = 124, True
    self.rc = self.rc or rc
    self.outputs.append(out)
    with open(self.path(f"{label}.log"), "w", encoding="utf-8") as f:
      f.write(" ".join(cmd) + "\n" + out)
    return out

  @property
  def seconds_left(self) -> float:
    return max(0.0, self.ends_at - time.monotonic())


def _settings(dry: bool) -> dict:
  """Per-stage arguments: the real check, or its tiny CPU twin."""
  if dry:
    return dict(model="tiny-llama", dtype="float32", batches="1,2", prompt_len=8, max_tokens=6, blocks=64,
                attention=["--batch_sizes=2", "--context_lens=32", "--min_time_s=0", "--max_iters=1", "--tune",
                           "--dry_run"],
                transfer=["--models=smollm2-135m", "--kv_blocks=2", "--reps=1", "--max_segment_mb=0.25",
                          "--total_mb=1", "--modes=merged,duplex", "--kv_layouts=block_first"],
                table1=["--table1_model=smollm2-135m", "--table1_tokens=64", "--reps=1", "--naive_max_blocks=2"],
                calibrate=["--decode_batches=1", "--decode_contexts=16", "--prefill_chunks=16",
                           "--transfer_blocks=1", "--naive_blocks=1", "--repeats=1", "--warmup=1",
                           "--num_device_blocks=32", "--max_num_batched_tokens=16", "--max_num_seqs=2",
                           "--token_bucket_floor=8", "--seq_bucket_floor=2"],
                experiment=["--flagfile=configs/experiments/gpu_tiny.flags"],
                multiturn=["--num_requests=1", "--max_turns=2", "--max_output_len=4", "--nocalibrate", "--nowarmup",
                           "--rps=1", "--ttft_slo=60", "--tbt_slo=10", "--policies=fcfs"],
                startup=["--num_device_blocks=64", "--max_num_batched_tokens=32", "--max_num_seqs=4",
                         "--token_bucket_floor=8"],
                pytest=["-k", "lowering"])
  return dict(model="llama-3-8b", dtype="bfloat16", batches="1,32,64", prompt_len=256, max_tokens=32, blocks=8192,
              attention=["--context_lens=2048,8192", "--tune", "--min_time_s=0.1"],
              transfer=["--max_segment_mb=64"], table1=["--reps=3", "--naive_max_blocks=16"],
              calibrate=["--model=llama-3-8b", "--dtype=bfloat16"], experiment=[], multiturn=[],
              startup=["--num_device_blocks=8192"], pytest=[])


def _json_rows(text: str) -> list:
  out = []
  for line in text.splitlines():
    line = line.strip()
    if line.startswith("{") and line.endswith("}"):
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return out


def _load_json(path: str):
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError):
    return None


def _weight_bytes(model: str, dtype: str) -> int:
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from superinfer_jax.model import load_config  # pylint: disable=import-outside-toplevel
  from superinfer_jax.model.params import param_shapes  # pylint: disable=import-outside-toplevel
  shapes = jax.tree.leaves(param_shapes(load_config(model)), is_leaf=lambda x: isinstance(x, tuple))
  return int(sum(np.prod(x) for x in shapes)) * (2 if dtype in ("bfloat16", "float16") else 4)


def _engine_cmd(s: dict, *extra) -> list:
  return [sys.executable, "scripts/bench_engine.py", f"--model={s['model']}", "--random_weights",
          f"--dtype={s['dtype']}", "--loops=zero_bubble"] + list(extra)


def stage_engine(st: Stage, s: dict, card: str) -> dict:
  max_batch = max(int(b) for b in s["batches"].split(","))
  out = st.run("engine", _engine_cmd(s, f"--batch_sizes={s['batches']}", f"--prompt_len={s['prompt_len']}",
                                     f"--max_tokens={s['max_tokens']}", f"--num_device_blocks={s['blocks']}",
                                     "--num_host_blocks=0", "--torch_threads=0", f"--max_num_seqs={max_batch}", "--max_num_batched_tokens=2048"))
  rows = _json_rows(out)
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
  return {"model": s["model"], "dtype": s["dtype"], "weight_stream_bound_ms": bound_ms, "by_batch": by_batch,
          "rows": rows}


def stage_gpu_tests(st: Stage, s: dict, card: str) -> dict:
  del card
  out = st.run("gpu_tests", [sys.executable, "-m", "pytest", "-v", "-m", "gpu", "-p", "no:cacheprovider", "tests"]
               + s["pytest"])
  outcomes = dict(re.findall(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", out, re.M))
  failures = sorted(t for t, o in outcomes.items() if o in ("FAILED", "ERROR"))
  return {"passed": sum(o in ("PASSED", "XPASS") for o in outcomes.values()), "failed": len(failures),
          "skipped": sum(o in ("SKIPPED", "XFAIL") for o in outcomes.values()), "failures": failures}


def stage_transfer(st: Stage, s: dict, card: str) -> dict:
  """The segment / KV-shape sweeps, then the paper's Table 1 (every mode beside torch), each with a time budget
  of about half the stage's share."""
  del card
  budget = f"--time_budget_s={max(1.0, 0.4 * st.seconds_left):.0f}"
  out = st.run("transfer", [sys.executable, "scripts/bench_transfer.py", "--json", budget] + s["transfer"])
  prefix = st.path("table1")
  budget = f"--time_budget_s={max(1.0, 0.7 * st.seconds_left):.0f}"
  # No preallocation: torch's copies of the same bytes need device memory beside JAX's in one process.
  st.run("table1", [sys.executable, "scripts/bench_transfer.py", "--table1", f"--table1_out={prefix}", budget]
         + s["table1"], dict(st.env, XLA_PYTHON_CLIENT_PREALLOCATE="false"))
  return {"results": _json_rows(out), "table1": _load_json(prefix + ".json") or {},
          "table1_markdown": "transfer/table1.table.md"}


def stage_attention(st: Stage, s: dict, card: str) -> dict:
  """Tunes the attention kernel for the decode and mixed shapes within half the stage's share (into a copy of
  the repository's table, which comes back in the archive), then benches with it."""
  del card
  from pallas_kernels import attention_tuning  # pylint: disable=import-outside-toplevel
  path, table = st.path("bench_attention.json"), st.path("ragged_paged_attention.json")
  if os.path.exists(attention_tuning.DEFAULT_TABLE_PATH):
    shutil.copyfile(attention_tuning.DEFAULT_TABLE_PATH, table)
  st.run("attention", [sys.executable, "scripts/bench_attention.py", f"--json_out={path}", f"--tune_table={table}",
                       f"--tune_budget_s={max(1.0, 0.5 * st.seconds_left):.0f}"] + s["attention"])
  data = _load_json(path) or {}
  return {"results": data.get("results", []), "tune_written": data.get("tune_written", []),
          "tune_table": "attention/ragged_paged_attention.json", "jax_paged_available": data.get("jax_paged_available")}


def _experiment_runs(flagfiles: list, policies: Optional[str] = None) -> int:
  """Timed runs of the experiment the flag files describe (its policy entries; the last --policies wins, and
  ``policies``, a command-line override, over them)."""
  from superinfer_jax.sweep import SweepSpec  # pylint: disable=import-outside-toplevel
  if policies is None:
    for path in flagfiles:
      with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        policies = next((l.strip().split("=", 1)[1] for l in f if l.startswith("--policies=")), policies)
  return len(SweepSpec(policies=policies).arms) if policies else 1


def stage_experiment(st: Stage, s: dict, card: str) -> dict:
  """configs/experiments/gpu.flags (gpu_tiny.flags on a dry run) with each run's time limit at most half the
  stage's share over its runs (the rest: the warm-up, its compilation and the simulator's replays); its table,
  JSON and plots go to ``experiment/`` in the archive."""
  del card
  flagfiles = ["configs/experiments/gpu.flags"] + [a.split("=", 1)[1] for a in s["experiment"]]
  per_run = max(1.0, 0.5 * st.seconds_left / _experiment_runs(flagfiles))
  out_dir = os.path.dirname(st.path("gpu_experiment", "real_vs_sim.json"))
  st.run("experiment", [sys.executable, "scripts/run_experiment.py", "--flagfile=configs/experiments/gpu.flags"]
         + s["experiment"] + [f"--output_dir={out_dir}", "--noprogress", f"--time_limit_s={min(20.0, per_run):.0f}"])
  doc = _load_json(os.path.join(out_dir, "real_vs_sim.json")) or {}
  return {"output_dir": "experiment/gpu_experiment", "entries": doc.get("entries", []),
          "plots": [os.path.join("experiment/gpu_experiment", os.path.basename(p)) for p in doc.get("plots", [])],
          "run_time_limit_s": round(min(20.0, per_run))}


MULTITURN_COLUMNS = ("policy", "num_finished", "slo_attainment", "ttft_p50_s", "ttft_p99_s", "tokens_scheduled",
                     "prefill_tokens_saved", "prefix_device_hit_rate", "prefix_host_hit_rate", "num_rotations",
                     "step_time_p50_s")


def stage_multiturn(st: Stage, s: dict, card: str) -> dict:
  """configs/experiments/multiturn.flags (tiny on a dry run): prefix caching off / device / device+host under
  fcfs and rotasched, each run's time limit at most half the stage's share over its runs; per arm the
  ``MULTITURN_COLUMNS`` of its results row."""
  del card
  flagfile = "configs/experiments/multiturn.flags"
  override = [a for a in s["multiturn"] if a.startswith("--policies=")]
  runs = _experiment_runs([flagfile], override[-1].split("=", 1)[1] if override else None)
  per_run = max(1.0, 0.5 * st.seconds_left / runs)
  out_dir = os.path.dirname(st.path("multiturn", "results.jsonl"))
  st.run("multiturn", [sys.executable, "scripts/run_experiment.py", f"--flagfile={flagfile}"] + s["multiturn"]
         + [f"--output_dir={out_dir}", "--noprogress", f"--time_limit_s={per_run:.0f}"])
  rows = []
  path = os.path.join(out_dir, "results.jsonl")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      rows = [json.loads(line) for line in f if line.strip()]
  return {"output_dir": "multiturn/multiturn", "run_time_limit_s": round(per_run),
          "rows": [{k: r.get(k) for k in MULTITURN_COLUMNS} for r in rows]}


def stage_calibration(st: Stage, s: dict, card: str) -> dict:
  del card
  path = st.path("profile.json")
  st.run("calibration", [sys.executable, "scripts/calibrate.py", f"--output={path}", "--name=device_check"]
         + s["calibrate"])
  return {"profile_path": "calibration/profile.json", "profile": _load_json(path)}


def stage_startup(st: Stage, s: dict, card: str) -> dict:
  """scripts/serve.py's start-up on the engine stage's model with serve's default buckets: the engine's build and
  its warm-up (every step shape in every sampling mode). Cut short, the step compiles it logged still count."""
  del card
  out = st.run("startup", _engine_cmd(s, "--serve_warmup", "--batch_sizes=", "--notorch") + s["startup"])
  row = next((r for r in _json_rows(out) if r.get("impl") == "serve_warmup"), None)
  step_compile_s, step_compiles = compile_seconds(out, STEP_COMPILE_LOG)
  return {"model": s["model"], "startup_s": row and row["startup_s"], "engine_build_s": row and row["engine_build_s"],
          "precompile_s": row and row["precompile_s"], "compiled_step_shapes": row and row["compiled_step_shapes"],
          "step_compiles_logged": step_compiles, "step_compile_s_logged": step_compile_s}


STAGES: dict[str, Callable] = {"engine": stage_engine, "gpu_tests": stage_gpu_tests, "transfer": stage_transfer,
                               "attention": stage_attention, "experiment": stage_experiment,
                               "multiturn": stage_multiturn,
                               "calibration": stage_calibration, "startup": stage_startup}


def _write_results(out: str, work: str, result: dict) -> None:
  """``device_check.json`` and the archive of ``work``, each written whole beside and then moved in place (a
  reader never sees half a file)."""
  tmp = os.path.join(out, f".{RESULT}.tmp")
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)
  os.replace(tmp, os.path.join(out, RESULT))
  tmp = os.path.join(work, ARCHIVE)
  with tarfile.open(tmp, "w:gz") as tar:
    for name in sorted(os.listdir(work)):
      if name != ARCHIVE:
        tar.add(os.path.join(work, name), arcname=name)
  shutil.move(tmp, os.path.join(out, ARCHIVE))


def run_stages(names: list, run_stage: Callable, budget_s: float, out: str, work: str, result: dict, env: dict,
               log: Callable = print) -> dict:
  """Runs ``names`` (in order) under the deadline ``budget_s`` from now, each given ``stage_shares`` of what is
  left: ``run_stage(stage) -> figures`` with ``stage`` a ``Stage`` (its processes' environment ``env``) ending
  at its share. Records each stage's
  status, limit, seconds and compile seconds in ``result["stages"]`` and its figures in ``result[name]``, and
  rewrites the JSON and the archive after each. Returns ``result``."""
  start = time.monotonic()
  result.update(budget_s=budget_s, stages={})
  for i, name in enumerate(names):
    left = budget_s - (time.monotonic() - start)
    limit = stage_shares(names[i:], left)
    record = {"status": SKIPPED, "limit_s": round(limit, 1), "seconds": 0.0, "compile_s": None}
    if limit < MIN_STAGE_S:
      record["reason"] = f"its share of the {left:.0f} s left is under {MIN_STAGE_S:.0f} s"
      result[name] = None
    else:
      t = time.monotonic()
      st = Stage(name, work, dict(env), ends_at=t + limit)
      try:
        result[name] = run_stage(st)
      except Exception as e:  # pylint: disable=broad-except
        result[name], st.rc = {"error": f"{type(e).__name__}: {e}"}, st.rc or 1
      text = "\n".join(st.outputs)
      compile_s, compiles = compile_seconds(text)
      record.update(status=CUT if st.cut else FAILED if st.rc else FINISHED, rc=st.rc,
                    seconds=round(time.monotonic() - t, 1),
                    compile_s=None if name == "gpu_tests" else compile_s, compiles=compiles)
      if st.rc and not st.cut:
        record["log_tail"] = text[-1500:]
    result["stages"][name] = record
    result["elapsed_s"] = round(time.monotonic() - start, 1)
    _write_results(out, work, result)
    log(f"[device_check] {name}: {record['status']} in {record['seconds']:.1f} s (limit {record['limit_s']:.0f} s"
        + (f", compile {record['compile_s']:.1f} s" if record.get("compile_s") is not None else "") + ")")
  return result


def main(argv):
  del argv
  unknown = set(FLAGS.stages) - set(STAGES)
  if unknown:
    raise app.UsageError(f"--stages: unknown {sorted(unknown)}; choose from {list(STAGE_ORDER)}")
  budget = FLAGS.budget_s if FLAGS.budget_s is not None else (240.0 if FLAGS.dry_run else 420.0)
  os.makedirs(FLAGS.out, exist_ok=True)
  s = _settings(FLAGS.dry_run)
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1",
             TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1", JAX_LOG_COMPILES="1",
             JAX_COMPILATION_CACHE_DIR=os.path.join(tempfile.gettempdir(), "device_check_jax_cache"))
  if FLAGS.dry_run:
    env["JAX_PLATFORMS"] = "cpu"
  import jax  # pylint: disable=import-outside-toplevel
  dev = jax.devices()[0]
  card = getattr(dev, "device_kind", dev.platform)
  names = [n for n in STAGE_ORDER if n in FLAGS.stages]
  print(f"[device_check] budget {budget:.0f} s for {len(names)} stages ({', '.join(names)}) on {card}"
        f"{' (dry run)' if FLAGS.dry_run else ''}", flush=True)
  result = {"dry_run": FLAGS.dry_run, "device": card, "platform": dev.platform, "jax": jax.__version__,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "archive": ARCHIVE}
  gpu_env = {k: v for k, v in env.items() if k != "JAX_LOG_COMPILES"}   # the tests' logs stay as they expect
  with tempfile.TemporaryDirectory(prefix="device_check_") as work:

    def run_stage(st: Stage) -> dict:
      if st.name == "gpu_tests":
        st.env = gpu_env
      return STAGES[st.name](st, s, card)

    run_stages(names, run_stage, budget, FLAGS.out, work, result, env, log=lambda m: print(m, flush=True))
  print(f"[device_check] wrote {os.path.join(FLAGS.out, RESULT)} and {ARCHIVE} in {result['elapsed_s']:.0f} s of "
        f"the {budget:.0f} s budget", flush=True)
  print("[device_check] stage         status    seconds  limit  compile", flush=True)
  for name, r in result["stages"].items():
    comp = f"{r['compile_s']:7.1f}" if r.get("compile_s") is not None else "      -"
    print(f"[device_check] {name:<13} {r['status']:<9} {r['seconds']:7.1f} {r['limit_s']:6.0f}  {comp}", flush=True)
  eng = result.get("engine") or {}
  for b, row in sorted((eng.get("by_batch") or {}).items(), key=lambda kv: int(kv[0])):
    print(f"[device_check] batch {b}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()
                                                    if isinstance(v, (int, float))), flush=True)


if __name__ == "__main__":
  app.run(main)
