"""Policy × variant × RPS sweeps on the real engine (``scripts/run_experiment.py`` is a thin flag wrapper).

Output directory layout (one schema for the real engine, the simulator and the HTTP client):
  results.jsonl                         one row per run: ``metrics.results_row`` + engine counters + the
                                        run's step times, drift flag, machine load and rotation figures
  requests-<label>-<rps>[-rep<k>].jsonl per-request timelines (``metrics.timeline`` schema); ``label`` is
                                        the policy, or ``policy[setting=value,...]`` for a variant
  config.json                           the sweep, the engine config tree (flat), the calibration
  *.png                                 ``metrics.plots.plot_results_dir``

Run order: with ``repeats > 1`` the (policy, variant) runs of each repeat go in alternating order (ABBA), so
a machine that slows down during the job weighs on every policy alike; every repeat is its own row.
With ``calibrate`` the load and the SLOs come from this machine's measured step time (``calibrate.py``).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import time
from typing import Any, Callable, Optional

from superinfer_jax import util
from superinfer_jax.experiment import calibrate as calib
from superinfer_jax.experiment.replay import StepTimer, loadavg_1m, replay_workload
from superinfer_jax.metrics.results import append_results_row, results_row
from superinfer_jax.metrics.timeline import requests_filename, write_timelines
from superinfer_jax.sweep import (SweepSpec, apply_variant, finish_report, fresh_output_dir,  # noqa: F401 (re-exported)
                                  parse_float_list, variant_label)


def _hardware_label() -> str:
  import jax  # pylint: disable=import-outside-toplevel
  d = jax.devices()[0]
  return f"{d.platform}:{getattr(d, 'device_kind', d.platform)}"


def _model_label(model: str) -> str:
  return os.path.basename(os.path.normpath(model)) if os.path.exists(model) else model


def _warm_up(model_tuple, engine_config, workload, progress: bool) -> tuple[int, list[float], float]:
  """Compiles the step shapes a run will hit and measures the step time: the job's prompts, all at t=0,
  short outputs, the same pool. Returns (device pool size in blocks, wall time of each step, this process's
  CPU seconds per wall second while stepping)."""
  from superinfer_jax.engine.config import SamplingParams  # pylint: disable=import-outside-toplevel
  from superinfer_jax.engine.engine import LLMEngine  # pylint: disable=import-outside-toplevel
  engine = LLMEngine(model_tuple, engine_config)
  engine.precompile_rotation()
  engine.precompile_steps()
  t = time.perf_counter()
  for s in workload:
    engine.add_request(s.prompt_token_ids, SamplingParams(max_tokens=min(s.output_len, 24), ignore_eos=True))
  timer = StepTimer()
  while engine.has_unfinished():
    timer.step(engine)
  steps = timer.step_times_s
  if progress:
    print(f"[warm-up] {len(workload)} requests, {len(steps)} steps, {engine.num_compiled_shapes()} compiled "
          f"step shapes, {time.perf_counter() - t:.1f} s", flush=True)
  return engine.num_device_blocks, (steps[2:] if len(steps) > 6 else steps), timer.cpu_share  # 2 fill the pipe


def _load_model_tuple(spec: SweepSpec, engine_config) -> tuple[Any, Any, Any]:
  """``(model config, params, tokenizer)`` of ``spec.model`` in ``engine_config``'s dtype; sharded once when
  ``tensor_parallel_size`` > 1 (every engine of the sweep reuses the shards). The tokenizer is None for a
  synthetic dataset whose model ships none (prompts are token ids)."""
  from superinfer_jax.model import load_model, load_tokenizer  # pylint: disable=import-outside-toplevel
  from superinfer_jax.parallel.tensor_parallel import make_tensor_parallel  # pylint: disable=import-outside-toplevel
  tp = make_tensor_parallel(engine_config.tensor_parallel_size)
  if tp is None:
    cfg, params = load_model(spec.model, dtype=engine_config.model.dtype)
  else:   # loaded in host memory and sharded once; every engine of the sweep reuses the shards
    cfg, params = tp.load_model(spec.model, dtype=engine_config.model.dtype)
    _, params = tp.prepare(cfg, params)
  try:
    tokenizer = load_tokenizer(spec.model)
  except FileNotFoundError:
    if spec.dataset != "synthetic":
      raise
    tokenizer = None  # synthetic prompts are token ids; outputs then carry no text
  return (cfg, params, tokenizer)


def run_sweep(spec: SweepSpec, engine_config, *, model_tuple=None,
              on_engine: Optional[Callable[[Any, str], None]] = None, freeze_heap: bool = False) -> list[dict[str, Any]]:
  """Runs every (policy, variant, rps, repeat) of ``spec`` with ``engine_config`` (policy overridden).

  ``model_tuple`` = (cfg, params, tokenizer) skips loading ``spec.model`` (tests pass tiny models).
  ``on_engine(engine, label)`` is called with each timed run's engine (not the warm-up's), in run order,
  before it serves anything (``sim/validation.py`` records every step through it).
  ``freeze_heap``: once the model is loaded, before the first engine, freeze what the process holds
  (``util.freeze_heap``: the cyclic collector's full passes then skip the imports, weights and tokenizer,
  ~600k objects); the sweep's engines stay collectable. For processes that run one sweep
  (``scripts/run_experiment.py``); tests leave it off.
  Returns the results rows (also appended to ``<output_dir>/results.jsonl``).
  """
  from superinfer_jax.engine.engine import LLMEngine  # pylint: disable=import-outside-toplevel
  variants = spec.variants
  for _, v in spec.arms:
    apply_variant(engine_config, v)  # fail before any work on a bad --vary or policy setting
  fresh_output_dir(spec.output_dir)
  if model_tuple is None:
    model_tuple = _load_model_tuple(spec, engine_config)
  if freeze_heap:
    util.freeze_heap()
  cfg, _, tokenizer = model_tuple
  max_len = min(engine_config.model.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
  # A request must fit the device pool on its own (the engine refuses it otherwise).
  if engine_config.num_device_blocks:
    max_len = min(max_len, engine_config.num_device_blocks * engine_config.block_size)
  hardware = spec.hardware or _hardware_label()
  results_path = os.path.join(spec.output_dir, "results.jsonl")

  def workload_at(rps: float):
    return spec.make_workload(tokenizer, rps, max_total_len=max_len, vocab_size=cfg.vocab_size)

  rps_values = spec.rps_values
  base = workload_at(rps_values[0])   # the same requests at every rate (arrivals differ)
  policies = spec.policy_names
  warm_steps: list[float] = []
  warm_cpu_share = None
  if spec.warmup or spec.calibrate:
    first_policy, first_variant = spec.arms[0]
    n, warm_steps, warm_cpu_share = _warm_up(model_tuple, apply_variant(engine_config.replace(policy=first_policy),
                                                                        first_variant),
                             base, spec.progress)
    engine_config = engine_config.replace(num_device_blocks=n)
    gc.collect()
  calibration = None
  if spec.calibrate:
    prompt_lens, output_lens = [s.prompt_len for s in base], [s.output_len for s in base]
    saturated = calib.saturated_steps(
        prompt_lens, output_lens, scheduler_config=engine_config.scheduler,
        num_device_blocks=engine_config.num_device_blocks,
        num_host_blocks=engine_config.num_host_blocks if engine_config.num_host_blocks is not None else 0,
        block_size=engine_config.block_size)
    calibration = calib.derive(
        warm_steps, prompt_lens, output_lens, num_steps_saturated=saturated,
        pool_tokens=engine_config.num_device_blocks * engine_config.block_size, load_factor=spec.load_factor,
        ttft_slo_steps=spec.ttft_slo_steps, tbt_slo_steps=spec.tbt_slo_steps, loadavg_1m=loadavg_1m())
    print(calibration.explain(), flush=True)
    rps_values = [calibration.rps]
    engine_config = engine_config.replace(ttft_slo=calibration.ttft_slo_s, tbt_slo=calibration.tbt_slo_s)
  ref_step = float(sorted(warm_steps)[len(warm_steps) // 2]) if warm_steps else None
  with open(os.path.join(spec.output_dir, "config.json"), "w") as f:
    sweep = dict(dataclasses.asdict(spec), policies=policies, rps=spec.rps_values)  # lists, as parsed
    json.dump({"sweep": sweep, "engine": engine_config.as_flat_dict(),
               "model_config": dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else str(cfg),
               "hardware": hardware, "rps": rps_values, "variants": variants,
               "calibration": calibration.as_dict() if calibration else None,
               "warmup_step_s": ref_step, "warmup_cpu_per_wall": warm_cpu_share}, f, indent=2, default=str)
  workloads = {rps: workload_at(rps) for rps in rps_values}
  rows = []
  run_index = 0
  for rps in rps_values:
    arms = spec.arms
    for repeat, (policy, variant) in calib.interleaved_order(arms, spec.repeats):
      label = variant_label(policy, variant)
      config = apply_variant(engine_config.replace(policy=policy), variant)
      engine = LLMEngine(model_tuple, config)
      if on_engine is not None:
        on_engine(engine, label)
      # A pool sized from free device memory is pinned after the first engine: later engines must not
      # size theirs from what an earlier engine's cache left free (every policy gets the same pool).
      engine_config = engine_config.replace(num_device_blocks=engine.num_device_blocks)
      if spec.warmup:
        engine.precompile_rotation()   # no-ops when the process-wide jit caches already hold them
        engine.precompile_steps()
      rep_tag = f" #{repeat + 1}" if spec.repeats > 1 else ""
      res = replay_workload(engine, workloads[rps], desc=f"{label} @ {rps:.3g} rps{rep_tag}",
                            progress=spec.progress, time_limit_s=spec.time_limit_s)
      st = res.engine_stats
      drift = calib.step_drift(res.step_times_s, ref_step) if ref_step else None
      cpu_share = res.cpu_share
      cpu_drift = cpu_share / warm_cpu_share if cpu_share is not None and warm_cpu_share else None
      perturbed = (calib.is_perturbed(drift, spec.drift_tolerance)
                   or (cpu_drift is not None and cpu_drift < 1.0 / spec.cpu_share_tolerance))
      steps_sorted = sorted(res.step_times_s)
      extra = {"num_device_blocks": engine.num_device_blocks, "num_host_blocks": engine.num_host_blocks,
               "block_size": config.block_size, "tensor_parallel_size": config.tensor_parallel_size,
               "rotations_in": st["rotations_in"],
               "blocks_out": st["blocks_out"], "blocks_writeback": st["blocks_writeback"],
               "blocks_in": st["blocks_in"], "steps": st["steps"], "round_trips": st["round_trips"],
               "contended_steps": st["contended_steps"], "rotations_per_step": st["rotations_per_step"],
               "mean_residency_steps": st["mean_residency_steps"],
               "host_time_share": st["host_time_share"], "step_compilations_during_run": res.compilations[0],
               "rotation_compilations_during_run": res.compilations[1],
               "num_rejected": len(res.rejected), "timed_out": res.timed_out,
               "base_policy": policy, "variant": variant or None, "repeat": repeat, "run_index": run_index,
               "step_time_p50_s": steps_sorted[len(steps_sorted) // 2] if steps_sorted else None,
               "step_time_p90_s": steps_sorted[int(0.9 * (len(steps_sorted) - 1))] if steps_sorted else None,
               "warmup_step_s": ref_step, "step_time_drift": drift,
               "perturbed": perturbed, "cpu_per_wall": cpu_share, "cpu_share_drift": cpu_drift,
               "loadavg_1m_start": res.loadavg_1m[0], "loadavg_1m_end": res.loadavg_1m[1],
               "pipeline": config.pipeline, "attention": config.model.attention, "dtype": config.model.dtype,
               "transfer_mode": config.rotation.transfer_mode, "min_residency": config.scheduler.min_residency,
               "proactive_swap_budget": config.scheduler.proactive_swap_budget,
               "writeback": config.scheduler.writeback}
      flat = config.as_flat_dict()
      extra.update({name: flat[name] for name in variant})   # the variant's settings as applied
      if calibration is not None:
        extra.update(calibrated=True, load_factor=calibration.load_factor,
                     ttft_slo_steps=calibration.ttft_slo_steps, tbt_slo_steps=calibration.tbt_slo_steps)
      row = results_row(
          res.timelines, engine="real", model=_model_label(spec.model), hardware=hardware, policy=label,
          rps=rps, ttft_slo_s=config.scheduler.ttft_slo, tbt_slo_s=config.scheduler.tbt_slo,
          num_rotations=st["rotations_out"], swap_out_bytes=st["bytes_out"], swap_in_bytes=st["bytes_in"],
          num_recompute_preemptions=st["recompute_preemptions"], duration_s=res.duration_s, extra=extra)
      append_results_row(results_path, row)
      write_timelines(os.path.join(spec.output_dir, requests_filename(
          label, rps, repeat if spec.repeats > 1 else None)), res.timelines)
      rows.append(row)
      run_index += 1
      del engine, res     # free this engine's device cache and host pool before the next one
      gc.collect()
      if spec.progress:
        flag = ("  PERTURBED: step times or CPU share drifted from the warm-up's (another process?)"
                if row["perturbed"] else "")
        print(f"[{label} @ {rps:.3g} rps{rep_tag}] finished {row['num_finished']}/{row['num_requests']}, "
              f"SLO attainment {row['slo_attainment']:.2f}, rotations {row['num_rotations']}, step p50 "
              f"{_ms(row['step_time_p50_s'])} (x{drift or float('nan'):.2f} of warm-up){flag}", flush=True)
  return rows


def _ms(s: Optional[float]) -> str:
  return "-" if s is None else f"{1e3 * s:.0f} ms"
