#!/usr/bin/env python
"""Replays a workload on the real engine for each policy × RPS and writes results, timelines and plots.

  python scripts/run_experiment.py --model=smollm2-135m --dataset=sharegpt --num_requests=32 \
      --rps=2 --policies=fcfs,rotasched --num_device_blocks=48 --output_dir=runs/main

Engine flags (--num_device_blocks, --num_host_blocks, --block_size, --ttft_slo, --tbt_slo, --alpha, ...)
are shared with scripts/generate.py (superinfer_jax/engine/config.py). See superinfer_jax/experiment/.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from superinfer_jax.engine.config import define_engine_flags, engine_config_from_flags  # noqa: E402
from superinfer_jax.sched.policies import POLICIES  # noqa: E402
from superinfer_jax.experiment.runner import SweepSpec, finish_report, parse_float_list, run_sweep  # noqa: E402

flags.DEFINE_string("model", "smollm2-135m", "HF dir, .gguf, orbax dir, or smollm2-135m")
flags.DEFINE_string("dataset", "sharegpt", "sharegpt | synthetic | path to a ShareGPT/LMSYS/trace file")
flags.DEFINE_integer("num_requests", 32, "requests per (policy, rps) run")
flags.DEFINE_string("rps", "1", "comma list of request rates (requests/s); inf = all at once")
flags.DEFINE_string("policies", "fcfs,rotasched", "comma list of scheduling policies")
flags.DEFINE_integer("seed", 0, "seeds request selection and arrivals")
flags.DEFINE_string("output_dir", "runs/experiment", "where results, timelines and plots go")
flags.DEFINE_integer("max_prompt_len", 0, "drop requests with longer prompts (0: no limit)")
flags.DEFINE_integer("max_output_len", 0, "drop requests with longer outputs (0: no limit)")
flags.DEFINE_string("synthetic_prompt_len", "uniform:16,256", "prompt length distribution (synthetic)")
flags.DEFINE_string("synthetic_output_len", "uniform:16,128", "output length distribution (synthetic)")
flags.DEFINE_enum("arrival_process", "poisson", ["poisson", "gamma", "uniform"], "arrival process")
flags.DEFINE_float("burstiness", 1.0, "gamma burstiness (vLLM convention: shape = burstiness)")
flags.DEFINE_bool("warmup", True, "compile the step shapes before the timed runs")
flags.DEFINE_float("time_limit_s", 0, "abort a (policy, rps) run after this many seconds (0: none)")
flags.DEFINE_string("hardware", "", "hardware label in results (default: the JAX device kind)")
flags.DEFINE_bool("progress", True, "progress bars")
define_engine_flags()
FLAGS = flags.FLAGS


def main(argv):
  del argv
  try:
    spec = SweepSpec(
        model=FLAGS.model, dataset=FLAGS.dataset, num_requests=FLAGS.num_requests,
        rps=parse_float_list(FLAGS.rps),
        policies=[p.strip() for p in FLAGS.policies.split(",") if p.strip()], seed=FLAGS.seed,
        output_dir=FLAGS.output_dir, max_prompt_len=FLAGS.max_prompt_len or None,
        max_output_len=FLAGS.max_output_len or None, synthetic_prompt_len=FLAGS.synthetic_prompt_len,
        synthetic_output_len=FLAGS.synthetic_output_len, arrival_process=FLAGS.arrival_process,
        burstiness=FLAGS.burstiness, warmup=FLAGS.warmup, time_limit_s=FLAGS.time_limit_s or None,
        hardware=FLAGS.hardware or None, progress=FLAGS.progress)
    config = engine_config_from_flags()
    unknown = [p for p in spec.policies if p not in POLICIES]
    if unknown:
      raise ValueError(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
  except ValueError as e:
    sys.exit(f"run_experiment: {e}")
  rows = run_sweep(spec, config)
  print(finish_report(spec.output_dir, rows))


if __name__ == "__main__":
  app.run(main)
