"""Generate completions with the serving engine: all prompts are submitted together as one continuous batch.

Examples:
  python scripts/generate.py --model=smollm2-135m --max_tokens=48 --prompt="The capital of France is"
  python scripts/generate.py --model=/path/hf_dir --prompt_token_ids=1,2,3 --prompt_token_ids=4,5 --json

With --json: one JSON object per prompt, in input order (text prompts first, then --prompt_token_ids):
  {"prompt_token_ids": [...], "token_ids": [...], "text": "...", "finish_reason": "..."}
A prompt the engine rejects (empty, too long, can never fit, ...) gets "finish_reason": "error" and an
"error" field; the others are still served, and the exit status is 1.
Engine flags (KV pools, policy, token budget, attention, pipeline, --tensor_parallel_size, ...) are shared
with the other scripts: see superinfer_jax/engine/config.py. Multi-host: run it on every host with
--coordinator_address/--num_processes/--process_id (docs/parallel.md); only process 0 prints.
"""
import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from superinfer_jax import configtree  # noqa: E402
from superinfer_jax.sweep import SweepSpec  # noqa: E402
from superinfer_jax.engine.config import (SamplingParams, define_engine_flags,  # noqa: E402
                                          engine_config_from_flags)
from superinfer_jax.parallel.distributed import (define_distributed_flags, initialize_from_flags,  # noqa: E402
                                                 is_primary)

configtree.define_flags(SweepSpec, only={"model"})   # --model: the model the engine loads
flags.DEFINE_multi_string("prompt", [], "prompt text (repeatable)")
flags.DEFINE_multi_string("prompt_token_ids", [], "comma-separated prompt token ids (repeatable)")
flags.DEFINE_integer("max_tokens", 16, "max new tokens per prompt")
flags.DEFINE_float("temperature", 0.0, "sampling temperature (0 = greedy)")
flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass (1 = off)")
flags.DEFINE_integer("top_k", 0, "top-k sampling (0 = off)")
flags.DEFINE_integer("seed", None, "sampling seed of every request (default: derived per request)")
flags.DEFINE_bool("ignore_eos", False, "keep generating past the end-of-sequence token")
flags.DEFINE_multi_string("stop", [], "stop string (repeatable)")
flags.DEFINE_bool("json", False, "print one JSON object per prompt")
flags.DEFINE_bool("stats", False, "print engine counters to stderr at the end")
define_engine_flags()
define_distributed_flags()
FLAGS = flags.FLAGS


def _parse_ids(s: str) -> list[int]:
  s = s.strip()
  if not s:
    return []
  try:
    return [int(x) for x in s.split(",") if x.strip()]
  except ValueError:
    raise app.UsageError(f"--prompt_token_ids must be comma-separated integers, got {s!r}") from None


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  prompts = list(FLAGS.prompt) + [_parse_ids(s) for s in FLAGS.prompt_token_ids]
  if not prompts:
    raise app.UsageError("give at least one --prompt or --prompt_token_ids")
  try:
    initialize_from_flags()
    config = engine_config_from_flags()
    params = SamplingParams(max_tokens=FLAGS.max_tokens, temperature=FLAGS.temperature, top_p=FLAGS.top_p,
                            top_k=FLAGS.top_k, seed=FLAGS.seed, ignore_eos=FLAGS.ignore_eos,
                            stop=tuple(FLAGS.stop)).validate()
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  import jax  # pylint: disable=import-outside-toplevel
  from superinfer_jax.engine.engine import LLMEngine  # pylint: disable=import-outside-toplevel
  from superinfer_jax.model.api import load_model_config  # pylint: disable=import-outside-toplevel
  try:
    estimate = load_model_config(FLAGS.model).memory_estimate(config.model.dtype, config.block_size)
    print(estimate.describe(config.num_device_blocks), file=sys.stderr, flush=True)   # before the weights load
    engine = LLMEngine(FLAGS.model, config)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2

  ids, errors = [], {}
  for i, p in enumerate(prompts):
    try:
      ids.append(engine.add_request(p, params))
    except ValueError as e:
      ids.append(None)
      errors[i] = str(e)
      print(f"error: prompt {i}: {e}", file=sys.stderr)
  for _ in engine.stream():
    pass

  if engine.replica is not None:   # multi-process: every process made the same plans (checked each step)
    print(f"[distributed] process {jax.process_index()}: {engine.replica.num_plans} plans, digest "
          f"{engine.replica.digest}", file=sys.stderr, flush=True)
  if not is_primary():
    return 1 if errors else 0
  tok = engine.tokenizer
  for i, (p, rid) in enumerate(zip(prompts, ids)):
    if rid is None:
      prompt_ids = p if isinstance(p, list) else []
      if isinstance(p, str) and tok is not None:
        prompt_ids = tok.encode(p)
      rec = {"prompt_token_ids": prompt_ids, "token_ids": [], "text": "", "finish_reason": "error",
             "error": errors[i]}
    else:
      res = engine.get_request(rid)
      rec = {"prompt_token_ids": res.prompt_token_ids, "token_ids": res.token_ids, "text": res.text,
             "finish_reason": res.finish_reason}
    if FLAGS.json:
      print(json.dumps(rec), flush=True)
    else:
      shown = p if isinstance(p, str) else (tok.decode(p) if tok is not None else str(p))
      print(f"--- [{i}] finish_reason={rec['finish_reason']} tokens={len(rec['token_ids'])}")
      print(f"prompt:     {shown!r}")
      if "error" in rec:
        print(f"error:      {rec['error']}")
      else:
        print(f"completion: {rec['text'] if tok is not None else rec['token_ids']!r}")
  if FLAGS.stats:
    print(json.dumps(engine.stats.as_dict()), file=sys.stderr)
  return 1 if errors else 0


if __name__ == "__main__":
  app.run(main)
