"""Decode throughput of the serving engine vs. transformers' generate (PyTorch), same weights, one run.

For each batch size B: B requests with the same prompt length run greedily for --max_tokens new tokens
(ignore_eos), all submitted together. Reported per B:
  * engine: decode tokens/s (steps after every request has its first token), mean decode-step ms, total
    tokens/s (prefill included), host share of step time (time in step() not blocked reading sampled ids);
  * torch: transformers ``generate`` (greedy, ``min_new_tokens = max_new_tokens``) on the same GGUF weights,
    total new tokens/s (prefill included) — its decode-only rate is estimated by subtracting a 1-token run.
Each side runs once untimed first (compilation / warm-up). Prints one JSON line per (impl, batch).

  python scripts/bench_engine.py --batch_sizes=1,8,32 --prompt_len=32 --max_tokens=64
"""
import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from superinfer_jax.engine.config import define_engine_flags, engine_config_from_flags  # noqa: E402

flags.DEFINE_string("model", "smollm2-135m", "built-in name or .gguf path (torch side needs a GGUF)")
flags.DEFINE_list("batch_sizes", ["1", "8", "32"], "batch sizes")
flags.DEFINE_integer("prompt_len", 32, "prompt tokens per request")
flags.DEFINE_integer("max_tokens", 64, "new tokens per request")
flags.DEFINE_bool("torch", True, "also run transformers generate on the same weights")
flags.DEFINE_integer("torch_threads", 0, "torch.set_num_threads (0: leave default)")
define_engine_flags()
FLAGS = flags.FLAGS


def _prompts(batch, prompt_len, vocab):
  import numpy as np  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  return [rng.integers(100, min(vocab, 20000), size=prompt_len).tolist() for _ in range(batch)]


def bench_engine(engine, batch, prompt_len, max_tokens):
  from superinfer_jax.engine.config import SamplingParams  # pylint: disable=import-outside-toplevel
  from superinfer_jax.engine.engine import EngineStats  # pylint: disable=import-outside-toplevel
  sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
  prompts = _prompts(batch, prompt_len, engine.model_config.vocab_size)
  engine.generate(prompts, sp)                 # warm-up: compiles every shape of this run
  engine.stats = EngineStats()
  ids = [engine.add_request(p, sp) for p in prompts]
  t0 = time.perf_counter()
  decode_t0 = None
  decode_steps = 0
  decode_tokens = 0
  while engine.has_unfinished():
    outs = engine.step()
    te = time.perf_counter()
    if decode_t0 is not None:
      decode_steps += 1
      decode_tokens += sum(len(o.token_ids) for o in outs)
    elif all(engine.get_request(i).token_ids for i in ids):
      decode_t0 = te
  total = time.perf_counter() - t0
  decode_time = time.perf_counter() - decode_t0 if decode_t0 else float("nan")
  st = engine.stats
  return {"impl": "superinfer_jax", "batch": batch, "prompt_len": prompt_len, "max_tokens": max_tokens,
          "decode_tok_s": decode_tokens / decode_time, "decode_step_ms": 1e3 * decode_time / max(decode_steps, 1),
          "total_tok_s": batch * max_tokens / total, "total_s": total,
          "host_time_share": st.host_time_share, "exposed_host_share": st.exposed_host_share,
          "host_ms_per_step": {k: 1e3 * getattr(st, f"{k}_time_s") / max(st.steps, 1)
                               for k in ("schedule", "issue", "dispatch", "process", "exposed_host")},
          "pipeline": engine.config.pipeline, "policy": engine.config.scheduler.policy,
          "attention": engine.config.model.attention}


def bench_torch(model, batch, prompt_len, max_tokens, vocab):
  import torch  # pylint: disable=import-outside-toplevel
  ids = torch.tensor(_prompts(batch, prompt_len, vocab))
  mask = torch.ones_like(ids)

  def run(n):
    with torch.no_grad():
      t = time.perf_counter()
      out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
      dt = time.perf_counter() - t
    assert out.shape[1] == prompt_len + n
    return dt

  run(2)                                        # warm-up
  t_one = run(1)
  total = run(max_tokens)
  decode = max(total - t_one, 1e-9)
  return {"impl": "transformers", "batch": batch, "prompt_len": prompt_len, "max_tokens": max_tokens,
          "decode_tok_s": batch * (max_tokens - 1) / decode,
          "decode_step_ms": 1e3 * decode / (max_tokens - 1), "total_tok_s": batch * max_tokens / total,
          "total_s": total}


def _rounded(x):
  if isinstance(x, float):
    return round(x, 4)
  if isinstance(x, dict):
    return {k: _rounded(v) for k, v in x.items()}
  return x


def main(argv):
  del argv
  from superinfer_jax.engine.engine import LLMEngine  # pylint: disable=import-outside-toplevel
  from superinfer_jax.model.api import resolve_model_path  # pylint: disable=import-outside-toplevel
  config = engine_config_from_flags()
  engine = LLMEngine(FLAGS.model, config)
  batches = [int(b) for b in FLAGS.batch_sizes]
  tmodel = None
  if FLAGS.torch:
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
    if FLAGS.torch_threads:
      torch.set_num_threads(FLAGS.torch_threads)
    path = resolve_model_path(FLAGS.model)
    tmodel = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), torch_dtype=torch.float32).eval()
  for b in batches:
    rows = [bench_engine(engine, b, FLAGS.prompt_len, FLAGS.max_tokens)]
    if tmodel is not None:
      rows.append(bench_torch(tmodel, b, FLAGS.prompt_len, FLAGS.max_tokens, engine.model_config.vocab_size))
      rows[0]["speedup_vs_torch_decode"] = rows[0]["decode_tok_s"] / rows[1]["decode_tok_s"]
    for r in rows:
      print(json.dumps(_rounded(r)), flush=True)


if __name__ == "__main__":
  app.run(main)
