#!/usr/bin/env python
"""Simulates a workload on the real scheduler with a cost model: policy x variant x RPS, results, plots.

  python scripts/simulate.py --hardware=gh200 --model=llama-3-8b --dataset=sharegpt --num_requests=2400 \
      --rps=40 --policies=fcfs,rotasched --output_dir=runs/sim-gh200
  python scripts/simulate.py --hardware=h200 --model=qwen2.5-32b --rps=5,10,20 --vary=transfer_mode:naive,duplex
  python scripts/simulate.py --hardware=gh200 --model=qwen2.5-32b --vary=swap_bandwidth_gbps:50,100,150
  python scripts/simulate.py --figure=motivation --figure_workload=splitwise --seeds=5

Flags: the workload / sweep flags of scripts/run_experiment.py (``sweep.SweepSpec``), the engine's
config tree (``engine.config.EngineConfig``: pools, pipeline, --transfer_mode, --kv_layout, scheduler knobs)
and the simulator's own (``sim.config.SimConfig``: --model_profile, --swap_bandwidth_gbps,
--fixed_step_s, --trace, --trace_arrivals, --length_scale); the simulated TP degree is the engine's
--tensor_parallel_size. ``--trace PATH`` replays an Azure LLM
inference or Splitwise CSV (arrivals and lengths; format from the header) or a Mooncake JSONL (with its
prefix-reuse block ids; ``--trace=mooncake`` is the packaged one) instead of --dataset, requests over the
context handled by --trace_context_rule (drop | clip, counted). Defaults
that differ from run_experiment.py (the paper's GPU setting, docs/paper.md §2.2 / §5): --model=llama-3-8b,
--dtype=bfloat16, --num_device_blocks=0 (size the pool from the profile's HBM), --num_host_blocks=-1 with
--host_gib=400, --max_num_seqs=16384 and --max_num_batched_tokens=16384. --calibrate is ignored (nothing is
measured). ``--figure NAME`` reruns a paper experiment (motivation, bandwidth, main, budget, alpha_beta,
headline, ablation, tp; ``sim/figures.py``) on ``--figure_workload`` (sharegpt, sharegpt_long, splitwise)
over ``--seeds`` seeds (default 5) with its plot, per-point mean and min-max, contention and the paper's
claims checked on every seed, e.g. ``--figure=budget --figure_workload=splitwise``. See docs/simulator.md.
"""
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from superinfer_jax import configtree  # noqa: E402
from superinfer_jax.engine.config import EngineConfig, engine_config_from_flags  # noqa: E402
from superinfer_jax.sweep import SweepSpec  # noqa: E402
from superinfer_jax.sched.policies import POLICIES  # noqa: E402
from superinfer_jax.sim.config import SimConfig  # noqa: E402
from superinfer_jax.sim.figures import (DEFAULT_WORKLOAD, figure_names, get_figure, part_configs,  # noqa: E402
                                       run_figure, workload_names)
from superinfer_jax.sim.sim_sweep import (read_sim_trace, report, resolve_run, run_sim_sweep,  # noqa: E402
                                      validate_variants)

configtree.define_flags(SimConfig)
configtree.define_flags(SweepSpec)   # its --hardware is the profile the simulator loads
configtree.define_flags(EngineConfig)
flags.DEFINE_enum("figure", None, figure_names(),
                  "rerun a named paper experiment (sim/figures.py; docs/simulator.md 'Figures') into --output_dir "
                  "(default runs/figure-<name>) with its plot; flags given explicitly override its settings")
flags.DEFINE_bool("validate", False,
                  "run the REAL sweep of these flags (run_experiment.py's, into <output_dir>/real), fit the step "
                  "cost to each real run's own step times, simulate each run with its fit and with --hardware, and "
                  "print real vs sim P50 / P99 TTFT and TBT (experiment/sim_validation.py); needs --nocalibrate")
flags.DEFINE_bool("validate_reuse", False,
                  "with --validate: reuse the real runs and step records already in --output_dir (redo only the "
                  "fits and the simulations)")
flags.DEFINE_string("results_file", None,
                    "with --figure: also rewrite this figure's claims table (block <figure>-<workload>) in this "
                    "markdown results file, e.g. docs/results/simulator.md")
flags.DEFINE_bool("figure_timelines", False, "with --figure: also draw each run's per-request timeline (slow)")
flags.DEFINE_integer("seeds", 5, "with --figure: run every point on this many seeds (--seed, --seed + 1, ...) and "
                                 "report mean and min-max; a claim holds only if it holds on each", lower_bound=1)
flags.DEFINE_enum("figure_workload", DEFAULT_WORKLOAD, workload_names(),
                  "with --figure: the workload (sim/figures.py WORKLOADS): the ShareGPT stand-in as loaded, its "
                  "length-scaled variant, or the Splitwise trace (time-scaled; its RPS is the figure's x its "
                  "rps_scale)")

SIM_DEFAULTS = dict(model="llama-3-8b", dtype="bfloat16", num_device_blocks=0, num_host_blocks=-1,
                    host_gib=400.0, max_num_seqs=16384, max_num_batched_tokens=16384,
                    output_dir="runs/sim")
FLAGS = flags.FLAGS
for _name, _value in SIM_DEFAULTS.items():
  flags.FLAGS.set_default(_name, _value)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    sim_config = configtree.from_flags(SimConfig)
    spec = configtree.from_flags(SweepSpec)
    config = engine_config_from_flags()
    unknown = [p for p in spec.policy_names if p not in POLICIES]
    if unknown:
      raise ValueError(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    if FLAGS.figure:
      explicit = {name for name in FLAGS if FLAGS[name].present and name != "figure"}
      checks = [part_configs(p, spec, config, sim_config, explicit=explicit, workload=FLAGS.figure_workload)[:3]
                for p in get_figure(FLAGS.figure).parts]
    else:
      checks = [(spec, config, sim_config)]
    for c_spec, c_config, c_sim in checks:
      validate_variants(c_spec, c_config, c_sim)
      resolve_run(c_config, c_sim, c_spec.model, c_spec.hardware)   # profiles load, the model fits
      if c_sim.trace:
        read_sim_trace(c_spec, c_sim)               # the trace parses (TraceError names the file and line)
  except ValueError as e:   # ProfileError and ConfigError too
    sys.exit(f"simulate: {e}")
  if FLAGS.validate:
    if spec.calibrate:
      sys.exit("simulate: --validate needs --nocalibrate (give --rps, --ttft_slo, --tbt_slo)")
    from superinfer_jax.experiment import sim_validation as validation  # pylint: disable=import-outside-toplevel
    command = " ".join(["python scripts/simulate.py"] + [shlex.quote(a) for a in sys.argv[1:]])
    run = validation.compare if FLAGS.validate_reuse else validation.validate
    print(run(spec, config, sim_config, command=command).table)
    return
  if FLAGS.figure:
    res = run_figure(FLAGS.figure, spec, config, sim_config, explicit=explicit,
                     output_dir=spec.output_dir if FLAGS["output_dir"].present else None,
                     timelines=FLAGS.figure_timelines, seeds=range(spec.seed, spec.seed + FLAGS.seeds),
                     workload=FLAGS.figure_workload, results_file=FLAGS.results_file)
    print(res.report)
    return
  rows = run_sim_sweep(spec, config, sim_config)
  print(report(spec.output_dir, rows))


if __name__ == "__main__":
  app.run(main)
