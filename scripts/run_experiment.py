#!/usr/bin/env python
"""Replays a workload on the real engine for each policy × variant × RPS and writes results, timelines, plots.

  python scripts/run_experiment.py --flagfile=configs/experiments/main.flags       # the main job (make run)
  python scripts/run_experiment.py --model=smollm2-135m --dataset=sharegpt --num_requests=32 \
      --rps=2 --policies=fcfs,rotasched --num_device_blocks=48 --output_dir=runs/main
  python scripts/run_experiment.py --flagfile=configs/experiments/ablation_duplexkv_modes.flags
  python scripts/run_experiment.py --flagfile=configs/experiments/gpu.flags      # make run on a GPU machine

``--random_weights``: ``--model`` names a model config (``configs/models/<name>.json``, e.g. ``llama-3-8b``)
and the engine runs random weights of its shape in ``--dtype`` (prompts: ``real_vs_sim.FoldedTokenizer``).
``--simulate``: after the real sweep, fit the simulator to every run's own steps, replay the same requests
in it and write the real-vs-simulated table and plots (``scripts/real_vs_sim.py``; results then go under
``<output_dir>/real``).

Every flag is generated from a config field: the sweep's (``experiment.real_sweep.SweepSpec``) and the engine's
one config tree (``engine.config.EngineConfig``: scheduler, rotation and model settings), shared with
scripts/generate.py. ``--helpfull`` lists them all.
"""
import dataclasses
import os
import shlex
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from superinfer_jax import configtree  # noqa: E402
from superinfer_jax.engine.config import define_engine_flags, engine_config_from_flags  # noqa: E402
from superinfer_jax.parallel.distributed import (define_distributed_flags, initialize_from_flags,  # noqa: E402
                                                 is_primary)
from superinfer_jax.experiment.real_sweep import SweepSpec, apply_variant, finish_report, run_sweep  # noqa: E402
from superinfer_jax.sched.policies import POLICIES  # noqa: E402

configtree.define_flags(SweepSpec)
define_engine_flags()
define_distributed_flags()
flags.DEFINE_bool("random_weights", False, "--model names a model config (configs/models/); random weights of "
                  "its shape in --dtype, prompts tokenized by the simulator's stand-in tokenizer")
flags.DEFINE_bool("simulate", False, "after the real sweep (one load), fit the simulator to each run's steps, "
                  "replay the same requests in it and write real_vs_sim.table.md / .json and plots (scripts/real_vs_sim.py)")
flags.DEFINE_string("sim_profile", "auto", "with --simulate: the hardware profile the simulator starts from "
                    "(a name in configs/hardware/ or a scripts/calibrate.py JSON; auto: the packaged one of this "
                    "device); its link numbers are kept, its step cost refitted to each run")
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    multi = initialize_from_flags()
    spec = configtree.from_flags(SweepSpec)
    if multi and spec.calibrate:
      # Calibration derives the load and SLOs from this process's own step times: processes would replay
      # different workloads. Give --rps and the SLOs instead.
      raise ValueError("--calibrate is single-process only; give --rps and the SLOs in a multi-host run")
    if not is_primary():   # only process 0 writes results; the others replay the same sweep into scratch
      spec = dataclasses.replace(spec, output_dir=tempfile.mkdtemp(prefix="superinfer-process-"),
                                 progress=False)
    config = engine_config_from_flags()
    unknown = [p for p in spec.policy_names if p not in POLICIES]
    if unknown:
      raise ValueError(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    for variant in spec.variants:
      apply_variant(config, variant)
    if FLAGS.simulate and (multi or len(spec.rps_values) > 1 and not spec.calibrate):
      raise ValueError("--simulate compares one load in one process")
  except ValueError as e:
    sys.exit(f"run_experiment: {e}")
  import real_vs_sim  # pylint: disable=import-outside-toplevel (scripts/, next to this file)
  model_tuple = real_vs_sim.random_model(spec.model, config.model.dtype) if FLAGS.random_weights else None
  if FLAGS.simulate:
    profile = FLAGS.sim_profile
    if profile == "auto":
      import jax  # pylint: disable=import-outside-toplevel
      profile = real_vs_sim.auto_profile(getattr(jax.devices()[0], "device_kind", "cpu"))
    command = " ".join(["python scripts/run_experiment.py"] + [shlex.quote(a) for a in sys.argv[1:]])
    doc = real_vs_sim.real_vs_sim(spec, config, sim_profile=profile, command=command, model_tuple=model_tuple)
    print(doc["markdown"] + "\n" + "\n".join(f"plot: {p}" for p in doc["plots"]))
    return
  rows = run_sweep(spec, config, model_tuple=model_tuple, freeze_heap=True)   # one sweep (util.freeze_heap)
  if is_primary():
    print(finish_report(spec.output_dir, rows))


if __name__ == "__main__":
  app.run(main)
