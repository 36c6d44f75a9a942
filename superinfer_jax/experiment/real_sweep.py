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

from superinfer_jax.metrics.prefix_cache import prefix_cache_columns
from superinfer_jax import util
from superinfer_jax.experiment import calibrate as calib
from superinfer_jax.experiment.workload_replay import StepTimer, loadavg_1m, replay_workload
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


def _run_extra(engine, config, res, *, policy, variant, repeat, run_index, ref_step, drift, cpu_share, cpu_drift,
               perturbed) -> dict[str, Any]:
  """The real run's own columns of its results row: pools, the engine's counters, compilations during the
  run, step-time percentiles and drift, CPU share, load, the settings an ablation varies, and prefix
  caching's columns (``metrics/prefix_cache.py``)."""
  st = res.engine_stats
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
           "writeback": config.scheduler.writeback,
           "enable_prefix_caching": config.scheduler.enable_prefix_caching,
           "host_prefix_cache": config.scheduler.host_prefix_cache,
           "tokens_scheduled": st["tokens_scheduled"]}
  extra.update(prefix_cache_columns(engine.scheduler_stats().prefix_cache, config.block_size))
  return extra


def _calibrate(spec: SweepSpec, engine_config, base, warm_steps):
  """(``Calibration``, engine config with its SLOs): the load and SLOs derived from the warm-up's step times
  and the real scheduler's saturated makespan on this pool (``calibrate.derive``); prints its explanation."""
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
  engine_config = engine_config.replace(ttft_slo=calibration.ttft_slo_s, tbt_slo=calibration.tbt_slo_s)
  return calibration, engine_config


def _offered_rate(request_rps: float, base, progress: bool) -> float:
  """The rate to offer for a calibrated ``request_rps`` (requests/s). A closed-loop workload (multi-turn: its
  ``rps`` is the rate CONVERSATIONS start) gets ``request_rps`` x conversations / requests, so that it offers
  about the calibrated request rate while every turn keeps up (its think times only lower the load)."""
  if not getattr(base, "closed_loop", False):
    return request_rps
  n_conv = sum(r.after_request_id is None for r in base)
  rate = float(f"{request_rps * n_conv / len(base):.4g}")
  if progress:
    print(f"[calibrate] closed loop: {n_conv} conversations, {len(base)} requests -> conversations start at "
          f"{request_rps:.4g} x {n_conv}/{len(base)} = {rate:.4g} /s", flush=True)
  return rate


def _write_config(spec: SweepSpec, engine_config, cfg, *, hardware, rps_values, calibration, warm_step_s,
                  warm_cpu_share) -> None:
  """``<output_dir>/config.json``: the sweep as parsed, the engine settings, the model config, the loads run,
  the calibration and the warm-up's step time and CPU share."""
  with open(os.path.join(spec.output_dir, "config.json"), "w") as f:
    sweep = dict(dataclasses.asdict(spec), policies=spec.policy_names, rps=spec.rps_values)  # lists, as parsed
    json.dump({"sweep": sweep, "engine": engine_config.as_flat_dict(),
               "model_config": dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else str(cfg),
               "hardware": hardware, "rps": rps_values, "variants": spec.variants,
               "calibration": calibration.as_dict() if calibration else None,
               "warmup_step_s": warm_step_s, "warmup_cpu_per_wall": warm_cpu_share}, f, indent=2, default=str)


def _print_progress(label: str, rps: float, rep_tag: str, row: dict[str, Any], drift) -> None:
  flag = ("  PERTURBED: step times or CPU share drifted from the warm-up's (another process?)"
          if row["perturbed"] else "")
  print(f"[{label} @ {rps:.3g} rps{rep_tag}] finished {row['num_finished']}/{row['num_requests']}, "
        f"SLO attainment {row['slo_attainment']:.2f}, rotations {row['num_rotations']}, step p50 "
        f"{_ms(row['step_time_p50_s'])} (x{drift or float('nan'):.2f} of warm-up){flag}", flush=True)


def _row_of(spec: SweepSpec, engine, config, res, *, label, policy, variant, rps, repeat, run_index, hardware,
            calibration, ref_step, warm_cpu_share):
  """(results row, step-time drift) of one real run: the metrics of its timelines plus ``_run_extra``'s
  columns, the variant's settings as applied and the calibration's multiples; flags a perturbed run."""
  st = res.engine_stats
  drift = calib.step_drift(res.step_times_s, ref_step) if ref_step else None
  cpu_share = res.cpu_share
  cpu_drift = cpu_share / warm_cpu_share if cpu_share is not None and warm_cpu_share else None
  perturbed = (calib.is_perturbed(drift, spec.drift_tolerance)
               or (cpu_drift is not None and cpu_drift < 1.0 / spec.cpu_share_tolerance))
  extra = _run_extra(engine, config, res, policy=policy, variant=variant, repeat=repeat,
                     run_index=run_index, ref_step=ref_step, drift=drift, cpu_share=cpu_share,
                     cpu_drift=cpu_drift, perturbed=perturbed)
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
  return row, drift


def _prepare(spec: SweepSpec, engine_config, model_tuple, freeze_heap: bool):
  """Checks every arm's settings (before any work), makes the output directory fresh, loads the model unless
  given (then freezes the heap when asked); returns (model_tuple, the longest request the engine accepts:
  the model's context, cut to the device pool when its size is set)."""
  for _, v in spec.arms:
    apply_variant(engine_config, v)  # fail before any work on a bad --vary or policy setting
  fresh_output_dir(spec.output_dir)
  if model_tuple is None:
    model_tuple = _load_model_tuple(spec, engine_config)
  if freeze_heap:
    util.freeze_heap()
  cfg = model_tuple[0]
  max_len = min(engine_config.model.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
  if engine_config.num_device_blocks:   # a request must fit the device pool on its own
    max_len = min(max_len, engine_config.num_device_blocks * engine_config.block_size)
  return model_tuple, max_len


def _warm_up_first_arm(spec: SweepSpec, engine_config, model_tuple, base):
  """(warm-up step times, its CPU share, engine config with the pool the warm-up sized) with the first arm's
  settings, when the spec warms up or calibrates; else ([], None, engine_config)."""
  if not (spec.warmup or spec.calibrate):
    return [], None, engine_config
  first_policy, first_variant = spec.arms[0]
  n, warm_steps, warm_cpu_share = _warm_up(
      model_tuple, apply_variant(engine_config.replace(policy=first_policy), first_variant), base, spec.progress)
  gc.collect()
  return warm_steps, warm_cpu_share, engine_config.replace(num_device_blocks=n)


def run_sweep(spec: SweepSpec, engine_config, *, model_tuple=None,
              on_engine: Optional[Callable[[Any, str], None]] = None, freeze_heap: bool = False) -> list[dict[str, Any]]:
  """Runs every (policy, variant, rps, repeat) of ``spec`` with ``engine_config`` (policy overridden).

  ``model_tuple`` = (cfg, params, tokenizer) skips loading ``spec.model`` (tests pass tiny models).
  ``on_engine(engine, label)`` is called with each timed run's engine (not the warm-up's), in run order,
  before it serves anything (``experiment/sim_validation.py`` records every step through it).
  ``freeze_heap``: freeze what the process holds once the model is loaded (``util.freeze_heap``; the
  engines stay collectable), for processes that run one sweep (``scripts/run_experiment.py``).
  Returns the results rows (also appended to ``<output_dir>/results.jsonl``).
  """
  from superinfer_jax.engine.engine import LLMEngine  # pylint: disable=import-outside-toplevel
  model_tuple, max_len = _prepare(spec, engine_config, model_tuple, freeze_heap)
  cfg, _, tokenizer = model_tuple
  hardware = spec.hardware or _hardware_label()
  results_path = os.path.join(spec.output_dir, "results.jsonl")

  def workload_at(rps: float):
    return spec.make_workload(tokenizer, rps, max_total_len=max_len, vocab_size=cfg.vocab_size)

  rps_values = spec.rps_values
  base = workload_at(rps_values[0])   # the same requests at every rate (arrivals differ)
  warm_steps, warm_cpu_share, engine_config = _warm_up_first_arm(spec, engine_config, model_tuple, base)
  calibration = None
  if spec.calibrate:
    calibration, engine_config = _calibrate(spec, engine_config, base, warm_steps)
    rps_values = [_offered_rate(calibration.rps, base, spec.progress)]
  ref_step = float(sorted(warm_steps)[len(warm_steps) // 2]) if warm_steps else None
  _write_config(spec, engine_config, cfg, hardware=hardware, rps_values=rps_values, calibration=calibration,
                warm_step_s=ref_step, warm_cpu_share=warm_cpu_share)
  workloads = {rps: workload_at(rps) for rps in rps_values}
  rows = []
  run_index = 0
  for rps in rps_values:
    for repeat, (policy, variant) in calib.interleaved_order(spec.arms, spec.repeats):
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
      row, drift = _row_of(spec, engine, config, res, label=label, policy=policy, variant=variant, rps=rps,
                           repeat=repeat, run_index=run_index, hardware=hardware, calibration=calibration,
                           ref_step=ref_step, warm_cpu_share=warm_cpu_share)
      append_results_row(results_path, row)
      write_timelines(os.path.join(spec.output_dir, requests_filename(
          label, rps, repeat if spec.repeats > 1 else None)), res.timelines)
      rows.append(row)
      run_index += 1
      del engine, res     # free this engine's device cache and host pool before the next one
      gc.collect()
      if spec.progress:
        _print_progress(label, rps, rep_tag, row, drift)
  return rows


def _ms(s: Optional[float]) -> str:
  return "-" if s is None else f"{1e3 * s:.0f} ms"
