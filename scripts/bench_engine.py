"""Decode throughput of the serving engine vs. transformers' generate (PyTorch), same weights, one run.

For each batch size B: B requests with the same prompt length run greedily for --max_tokens new tokens
(ignore_eos), all submitted together, once per engine step loop in --loops (default: the zero-bubble loop
and the pipelined loop it replaces, side by side) and once with transformers. Reported per (impl, B):
  * engine: decode tokens/s (steps after every request has its first token), mean decode-step ms, total
    tokens/s (prefill included), host share of step time, host ms per step by phase (schedule, issue,
    dispatch, process, exposed_host: wall time; dispatch_cpu: the host thread's CPU time in dispatch) over the
    whole run
    and over the decode steps only (decode_host_ms_per_step), and the device's idle time per decode step, measured from real
    timestamps by ``engine/idle_probe.py``: idle_k = max(0, [step k+1's dispatch returned] - [step k's
    outputs became ready, seen by a watcher thread blocked in block_until_ready, or the host's own read of
    k's ids, whichever is earlier]). Its error is one-sided (a late "ready" hides idle time); the watcher's
    wake-up latency is reported (probe_wakeup_ms) and the interpreter's switch interval is lowered to
    --switch_interval_s while the engine runs so that the watcher gets the GIL promptly;
  * torch: transformers ``generate`` (greedy, ``min_new_tokens = max_new_tokens``) on the same GGUF weights,
    total new tokens/s (prefill included) — its decode-only rate is estimated by subtracting a 1-token run;
    one row per ``--torch_threads`` value (``torch.set_num_threads``; 0: every core the process may run on, as
    many as XLA's CPU pool uses; the default ``0,1`` times both), each with ``torch_threads``.
    ``speedup_vs_torch_decode`` is the engine's decode rate over the *fastest* transformers row of that batch
    (``torch_threads_best`` says which), and ``speedup_vs_torch_by_threads`` gives it against each.
Each side runs once untimed first (compilation / warm-up); --repeats > 1 interleaves the runs (engine
loops, torch, engine loops, torch, ...) and reports, per impl, the run with the median decode rate, so a
burst of load on a shared machine hits all sides alike. Every row carries the 1-minute load average and
``machine`` (``util.machine_description()``: CPU model, L2 / L3 sizes; the ratios move with the box).
Prints one JSON line per (impl, batch).

``--random_weights``: ``--model`` names a config (``configs/models/<name>.json``, e.g. ``llama-3-8b``) and both
sides run random weights of that shape, in ``--dtype``, transformers on the GPU when there is one (weights need
not match for a speed comparison; nothing is downloaded or read from disk).

  python scripts/bench_engine.py --batch_sizes=1,16,64 --prompt_len=32 --max_tokens=64 --num_device_blocks=512
  python scripts/bench_engine.py --model=llama-3-8b --random_weights --dtype=bfloat16 --batch_sizes=1,32,64
"""
import dataclasses
import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from superinfer_jax import configtree  # noqa: E402
from superinfer_jax.sweep import SweepSpec  # noqa: E402
from superinfer_jax.engine.config import define_engine_flags, engine_config_from_flags  # noqa: E402
from superinfer_jax.model.attention import resolved_attention_name  # noqa: E402
from superinfer_jax.util import freeze_heap, machine_description  # noqa: E402

configtree.define_flags(SweepSpec, only={"model"})   # --model: the model the engine loads
flags.DEFINE_list("batch_sizes", ["1", "8", "32"], "batch sizes")
flags.DEFINE_integer("prompt_len", 32, "prompt tokens per request")
flags.DEFINE_integer("max_tokens", 64, "new tokens per request")
flags.DEFINE_list("loops", ["zero_bubble", "pipelined"], "engine step loops to run side by side: zero_bubble, "
                  "pipelined (reads step k's ids before dispatching k+1), sync (no pipeline)")
flags.DEFINE_integer("repeats", 1, "interleaved runs per (impl, batch); the median-rate run is reported")
flags.DEFINE_float("switch_interval_s", 1e-4, "sys.setswitchinterval while the engine runs (idle probe)")
flags.DEFINE_bool("serve_warmup", False, "first time scripts/serve.py's start-up on this model: the engine's build, "
                  "then its warm-up (the rotation buckets and every step shape in every sampling mode), one JSON "
                  "row with impl serve_warmup (--batch_sizes= runs nothing else)")
flags.DEFINE_bool("torch", True, "also run transformers generate on the same weights")
flags.DEFINE_bool("random_weights", False, "--model is a config name; both sides run random weights of its shape")
flags.DEFINE_list("torch_threads", ["0", "1"], "torch.set_num_threads for each transformers run (0: every core "
                  "this process may use, as XLA's CPU pool does); the engine's speedup is over the fastest")
define_engine_flags()
FLAGS = flags.FLAGS


def _prompts(batch, prompt_len, vocab):
  import numpy as np  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  return [rng.integers(100, min(vocab, 20000), size=prompt_len).tolist() for _ in range(batch)]


LOOPS = {"zero_bubble": dict(pipeline=True, zero_bubble=True),
         "pipelined": dict(pipeline=True, zero_bubble=False),
         "sync": dict(pipeline=False)}


def bench_engine(engine, batch, prompt_len, max_tokens, warm_up=True):
  from superinfer_jax.engine.config import SamplingParams  # pylint: disable=import-outside-toplevel
  from superinfer_jax.engine.engine import EngineStats  # pylint: disable=import-outside-toplevel
  from superinfer_jax.engine.idle_probe import DeviceIdleProbe  # pylint: disable=import-outside-toplevel
  from superinfer_jax.experiment.workload_replay import loadavg_1m  # pylint: disable=import-outside-toplevel
  sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
  prompts = _prompts(batch, prompt_len, engine.model_config.vocab_size)
  if warm_up:
    engine.generate(prompts, sp)               # compiles every shape of this run
  engine.stats = EngineStats()
  probe = engine.idle_probe = DeviceIdleProbe().start()
  switch = sys.getswitchinterval()
  sys.setswitchinterval(FLAGS.switch_interval_s)
  try:
    wakeup_ms = probe.wakeup_latency_ms()
    ids = [engine.add_request(p, sp) for p in prompts]
    t0 = time.perf_counter()
    decode_t0 = None
    decode_steps = decode_tokens = 0
    probe_k0 = 0
    at_decode = None
    while engine.has_unfinished():
      outs = engine.step()
      te = time.perf_counter()
      if decode_t0 is not None:
        decode_steps += 1
        decode_tokens += sum(len(o.token_ids) for o in outs)
      elif all(engine.get_request(i).token_ids for i in ids):
        decode_t0 = te
        probe_k0 = probe.num_dispatched
        at_decode = dataclasses.replace(engine.stats)
    total = time.perf_counter() - t0
    decode_time = time.perf_counter() - decode_t0 if decode_t0 else float("nan")
    probe.stop()
  finally:
    sys.setswitchinterval(switch)
    engine.idle_probe = None
  idle = probe.idle_ms(since=probe_k0)
  st = engine.stats
  c = engine.config
  phases = ("schedule", "issue", "dispatch", "dispatch_cpu", "process", "exposed_host")

  def per_step(a, b):   # host ms per step by phase between two stats snapshots (b None: from the start)
    n = a.steps - (b.steps if b else 0)
    return {k: 1e3 * (getattr(a, f"{k}_time_s") - (getattr(b, f"{k}_time_s") if b else 0.0)) / max(n, 1)
            for k in phases}

  return {"impl": "superinfer_jax", "batch": batch, "prompt_len": prompt_len, "max_tokens": max_tokens,
          "loop": next(k for k, v in LOOPS.items() if all(getattr(c, n) == x for n, x in v.items())),
          "zero_bubble": bool(c.pipeline and c.zero_bubble),
          "decode_tok_s": decode_tokens / decode_time, "decode_step_ms": 1e3 * decode_time / max(decode_steps, 1),
          "total_tok_s": batch * max_tokens / total, "total_s": total,
          "device_idle_ms_per_step": sum(idle) / len(idle) if idle else float("nan"),
          "device_idle_ms_p90": sorted(idle)[int(0.9 * (len(idle) - 1))] if idle else float("nan"),
          "idle_pairs": len(idle), "probe_wakeup_ms": wakeup_ms,
          "host_time_share": st.host_time_share, "exposed_host_share": st.exposed_host_share,
          "host_ms_per_step": per_step(st, None),
          "decode_host_ms_per_step": per_step(st, at_decode) if decode_t0 else None,
          "batch_rebuild_share": st.batch_rebuilds / max(st.model_steps, 1),
          "discarded_tokens": st.discarded_tokens,
          "pipeline": c.pipeline, "policy": c.scheduler.policy, "attention": c.model.attention,
          "attention_backend": resolved_attention_name(c.model.attention),
          "layer_loop": c.layer_loop, "token_bucket_floor": c.token_bucket_floor,
          "loadavg_1m": loadavg_1m()}


def serve_warmup(engine, build_s: float) -> dict:
  """scripts/serve.py's start-up on ``engine`` (built in ``build_s`` seconds, weights included): its default
  warm-up, the rotation buckets and then every step shape in every sampling mode, timed."""
  from superinfer_jax.engine.sampling import SAMPLING_MODES  # pylint: disable=import-outside-toplevel
  t0 = time.perf_counter()
  before = engine.num_compiled_shapes()
  engine.precompile_rotation()
  engine.precompile_steps(SAMPLING_MODES)
  warmup_s = time.perf_counter() - t0
  return {"impl": "serve_warmup", "engine_build_s": build_s, "precompile_s": warmup_s,
          "startup_s": build_s + warmup_s, "compiled_step_shapes": engine.num_compiled_shapes() - before,
          "token_bucket_floor": engine.config.token_bucket_floor,
          "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens}


def torch_thread_counts(values) -> list[int]:
  """``--torch_threads`` as distinct thread counts, in order (0: the cores this process may run on)."""
  out = []
  for v in values:
    try:
      n = int(v)
    except ValueError:
      raise app.UsageError(f"--torch_threads: {v!r} is not an integer") from None
    if n < 0:
      raise app.UsageError(f"--torch_threads: {n} < 0")
    n = n or len(os.sched_getaffinity(0))
    if n not in out:
      out.append(n)
  if not out:
    raise app.UsageError("--torch_threads: give at least one thread count")
  return out


def bench_torch(model, batch, prompt_len, max_tokens, vocab, threads, warm_up=True):
  import torch  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(threads)
  ids = torch.tensor(_prompts(batch, prompt_len, vocab), device=model.device)
  mask = torch.ones_like(ids)

  def run(n):
    with torch.no_grad():
      t = time.perf_counter()
      out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
      dt = time.perf_counter() - t
    assert out.shape[1] == prompt_len + n
    return dt

  if warm_up:
    run(2)                                      # warm-up
  # Decode = the n-token run minus the 1-token run (best of 3 each); when noise makes that non-positive (a tiny
  # model), the whole run per token instead (an upper bound of the step), as ``decode_estimate`` says.
  t_one = min(run(1) for _ in range(3))
  total = min(run(max_tokens) for _ in range(3))
  decode, how = total - t_one, "subtracted"
  if decode <= 0:
    decode, how = total * (max_tokens - 1) / max_tokens, "whole_run"
  from superinfer_jax.experiment.workload_replay import loadavg_1m  # pylint: disable=import-outside-toplevel
  return {"impl": "transformers", "batch": batch, "torch_threads": threads, "prompt_len": prompt_len,
          "max_tokens": max_tokens, "decode_tok_s": batch * (max_tokens - 1) / decode,
          "decode_step_ms": 1e3 * decode / (max_tokens - 1), "total_tok_s": batch * max_tokens / total,
          "total_s": total, "decode_estimate": how, "loadavg_1m": loadavg_1m()}


def _load_torch_model(path):
  """transformers' model on the same weights: a GGUF file (de-quantized to f32) or an HF model directory."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  if os.path.isdir(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
  else:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), torch_dtype=torch.float32)
  return model.eval()


def _torch_model_like(cfg, dtype: str):
  """A random-weight transformers Llama-family model of ``cfg``'s shape in ``dtype``, built on the GPU if any."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  hf = transformers.LlamaConfig(
      vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
      rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings)
  device = "cuda" if torch.cuda.is_available() else "cpu"
  with torch.device(device):
    model = transformers.LlamaForCausalLM._from_config(hf, torch_dtype=getattr(torch, dtype))  # pylint: disable=protected-access
  return model.eval()


def _models(config):
  """``(engine model (cfg, params), transformers model or None)`` for the flags."""
  if FLAGS.random_weights:
    import jax  # pylint: disable=import-outside-toplevel
    from superinfer_jax.model import load_config  # pylint: disable=import-outside-toplevel
    from superinfer_jax.model.params import init_random_params  # pylint: disable=import-outside-toplevel
    cfg = load_config(FLAGS.model)
    model = (cfg, jax.jit(lambda k: init_random_params(cfg, k, dtype=config.model.dtype))(jax.random.key(0)))
    return model, _torch_model_like(cfg, config.model.dtype) if FLAGS.torch else None
  from superinfer_jax.model import load_model  # pylint: disable=import-outside-toplevel
  from superinfer_jax.model.api import resolve_model_path  # pylint: disable=import-outside-toplevel
  model = load_model(FLAGS.model, dtype=config.model.dtype)
  return model, _load_torch_model(resolve_model_path(FLAGS.model)) if FLAGS.torch else None


def _rounded(x):
  if isinstance(x, float):
    return round(x, 4)
  if isinstance(x, dict):
    return {k: _rounded(v) for k, v in x.items()}
  return x


def _median_run(runs):
  """The run with the median decode rate (lower median for an even count), with the repeat count."""
  run = sorted(runs, key=lambda r: r["decode_tok_s"])[(len(runs) - 1) // 2]
  return dict(run, repeats=len(runs))


def add_torch_speedups(engine_rows, torch_rows) -> None:
  """Adds to each engine row its decode-rate ratio over the fastest transformers row (``speedup_vs_torch_decode``,
  ``torch_threads_best``) and over each (``speedup_vs_torch_by_threads``, keyed by thread count as a string)."""
  if not torch_rows:
    return
  best = max(torch_rows, key=lambda t: t["decode_tok_s"])
  for r in engine_rows:
    r["speedup_vs_torch_decode"] = r["decode_tok_s"] / best["decode_tok_s"]
    r["torch_threads_best"] = best["torch_threads"]
    r["speedup_vs_torch_by_threads"] = {str(t["torch_threads"]): r["decode_tok_s"] / t["decode_tok_s"]
                                        for t in torch_rows}


def main(argv):
  del argv
  from superinfer_jax.engine.engine import LLMEngine  # pylint: disable=import-outside-toplevel
  config = engine_config_from_flags()
  unknown = [l for l in FLAGS.loops if l not in LOOPS]
  if unknown or not FLAGS.loops:
    raise app.UsageError(f"--loops: unknown {unknown}; choose from {sorted(LOOPS)}")
  if FLAGS.repeats < 1:
    raise app.UsageError("--repeats must be >= 1")
  torch_threads = torch_thread_counts(FLAGS.torch_threads) if FLAGS.torch else []
  t0 = time.perf_counter()
  model, tmodel = _models(config)     # one copy of the weights for every loop
  engines = {loop: LLMEngine(model, config.replace(**LOOPS[loop])) for loop in FLAGS.loops}
  if FLAGS.serve_warmup:
    print(json.dumps(_rounded(serve_warmup(next(iter(engines.values())), time.perf_counter() - t0))), flush=True)
  batches = [int(b) for b in FLAGS.batch_sizes]
  freeze_heap()   # weights, tokenizer, imports and engines live as long as this process (util.freeze_heap)
  vocab = model[0].vocab_size
  machine = machine_description()
  for b in batches:
    runs = {name: [] for name in list(engines) + [("transformers", n) for n in torch_threads]}
    for rep in range(FLAGS.repeats):
      for loop, engine in engines.items():
        runs[loop].append(bench_engine(engine, b, FLAGS.prompt_len, FLAGS.max_tokens, warm_up=rep == 0))
      for n in torch_threads:
        runs[("transformers", n)].append(bench_torch(tmodel, b, FLAGS.prompt_len, FLAGS.max_tokens, vocab, n,
                                                     warm_up=rep == 0))
    rows = [_median_run(runs[name]) for name in runs]
    add_torch_speedups(rows[:len(engines)], rows[len(engines):])
    for r in rows:
      r["machine"] = machine
      print(json.dumps(_rounded(r)), flush=True)


if __name__ == "__main__":
  app.run(main)
