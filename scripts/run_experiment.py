#!/usr/bin/env python
"""Replays a workload on the real engine for each policy × variant × RPS and writes results, timelines, plots.

  python scripts/run_experiment.py --flagfile=configs/experiments/main.flags       # the main job (make run)
  python scripts/run_experiment.py --model=smollm2-135m --dataset=sharegpt --num_requests=32 \
      --rps=2 --policies=fcfs,rotasched --num_device_blocks=48 --output_dir=runs/main
  python scripts/run_experiment.py --flagfile=configs/experiments/ablation_duplexkv_modes.flags

Every flag is generated from a config field: the sweep's (``experiment.runner.SweepSpec``) and the engine's
one config tree (``engine.config.EngineConfig``: scheduler, rotation and model settings), shared with
scripts/generate.py. ``--helpfull`` lists them all.
"""
import dataclasses
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # noqa: E402

from superinfer_jax import configtree  # noqa: E402
from superinfer_jax.engine.config import define_engine_flags, engine_config_from_flags  # noqa: E402
from superinfer_jax.parallel.distributed import (define_distributed_flags, initialize_from_flags,  # noqa: E402
                                                 is_primary)
from superinfer_jax.experiment.runner import SweepSpec, apply_variant, finish_report, run_sweep  # noqa: E402
from superinfer_jax.sched.policies import POLICIES  # noqa: E402

configtree.define_flags(SweepSpec)
define_engine_flags()
define_distributed_flags()


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
  except ValueError as e:
    sys.exit(f"run_experiment: {e}")
  rows = run_sweep(spec, config, freeze_heap=True)   # this process runs one sweep (util.freeze_heap)
  if is_primary():
    print(finish_report(spec.output_dir, rows))


if __name__ == "__main__":
  app.run(main)
